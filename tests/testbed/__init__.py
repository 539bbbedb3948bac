"""Local test hosts for `make testbed`: systemd-nspawn containers on their own network namespaces.

Entry point: `python -m tests.testbed.hosts up|down|status`, or `hosts.testbed([...])` from a test.
"""
