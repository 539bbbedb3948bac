"""The helpers' old module paths (tests.testbed.X, tests.unit.X), kept importable while branches
written against them are merged: `import tests.testbed.hosts` gives tests.support.hosts itself
(the same module object, so state and monkeypatching are shared). Installed by
tests/testbed/__init__.py and tests/unit/conftest.py; new code imports tests.support."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

MOVED = {
    "tests.testbed": ("hosts", "common", "containers", "network", "rootfs", "hub_standin", "www",
                      "cuda_standin", "cpu_engine", "tiny_model", "rollout_watch"),
    "tests.unit": ("host_edit", "host_tools", "loopback_sshd", "make", "rendered_shape",
                   "version_server", "wheels"),
}


class Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the module at its new one."""

    def find_spec(self, name: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        package, _, leaf = name.rpartition(".")
        if leaf in MOVED.get(package, ()):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"tests.support.{spec.name.rpartition('.')[2]}")

    def exec_module(self, module: ModuleType) -> None:
        pass  # already run at its new path


def install() -> None:
    if not any(isinstance(finder, Alias) for finder in sys.meta_path):
        sys.meta_path.insert(0, Alias())
