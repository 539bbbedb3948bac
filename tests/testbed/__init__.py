"""`make testbed`: the deploy against local test hosts (tests/testbed/README.md). The scenarios
of one converged fleet are in fleet/; the helpers are the package tests.support."""

from tests.support import old_paths

old_paths.install()
