"""The deploy file known as a module file, so that pyinfra's per-operation stack walk stops
scanning every loaded module for it.

pyinfra orders operations by the line numbers of the call stack (`get_operation_order_from_stack`,
through `inspect.stack()` and `inspect.getframeinfo`). For each frame, `inspect` asks which module
the frame's file belongs to (`inspect.getmodule`): a module's file is a dictionary hit, but the
deploy file is no module (pyinfra's CLI compiles and `exec`s it), so each lookup walks the whole
of `sys.modules` again, about 1,200 modules in an SSH run, three times per operation. In the
profile of the testbed's no-op re-run (bench/noop_rerun.py --profile, 4 hosts) that lookup was
the controller's largest single cost.

`register(state)` (once per deploy file; deploy.py calls it first) adds an empty module object
whose `__file__` is the deploy file to `sys.modules`, under a name no import uses: `inspect`'s
next scan records its file, and every lookup after it is a hit. Nothing of pyinfra is changed or
patched, and nothing reads that module: it answers "which file is this", which `inspect` then
reads from the file itself as before (the frames' line numbers, hence the operations' order, are
the same). Nothing about donor boxes.
"""

from __future__ import annotations

import os
import sys
import types

PREFIX = "_pyinfra_deploy_file:"


def register(state) -> str | None:
    """Index the file pyinfra is loading as the deploy (`state.current_deploy_filename`);
    returns the module name used, or None when pyinfra loads no deploy file (an API run)."""
    filename = getattr(state, "current_deploy_filename", None)
    if not filename:
        return None
    path = os.path.abspath(filename)
    name = PREFIX + path
    if name not in sys.modules:
        module = types.ModuleType(name, "the deploy file, as inspect.getmodule looks it up")
        module.__file__ = path
        sys.modules[name] = module
    return name
