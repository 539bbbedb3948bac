"""`make` as the unit tests run it: the Makefile's own recipe for a target, with this test run's
Python as the venv's, never its venv step (a test never installs packages)."""

from __future__ import annotations

import sys
from pathlib import Path


def make(*args: str) -> list[str]:
    return ["make", "-s", "-o", "venv", "-o", "venv-test", f"BIN={Path(sys.executable).parent}",
            *args]
