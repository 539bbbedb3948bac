"""Less of pyinfra's own work per operation call (each task line, for each host, at load time).

1. pyinfra orders a deploy's operations by the line numbers of the deploy code that called them
   (pyinfra.api.util.get_operation_order_from_stack). It finds them with inspect.stack() and
   inspect.getframeinfo(), whose default context=1 also opens and scans the source file of every
   frame on the stack. Line numbers need no source: with context=0 the order is the same.
2. pyinfra.api.arguments.pop_global_arguments asks all_global_arguments() for the global
   arguments' types, which runs typing.get_type_hints over a TypedDict, evaluating every string
   annotation again, each call. The answer never changes within a process: it is kept.

Measured on the testbed (4 hosts, 27 operations each, 2 cores), controller CPU of the no-op
re-run: 1. took it from about 0.73 s to 0.56 s (issue 6); 2. is measured in bench/results.
"""

from __future__ import annotations

import functools
import inspect

import pyinfra.api.arguments as pyinfra_arguments
import pyinfra.api.util as pyinfra_util

_stock = (pyinfra_util.stack, pyinfra_util.getframeinfo, pyinfra_arguments.all_global_arguments)
# partial, not a def: a Python wrapper would add its own frame to the walk and so to the order.
_stack_without_source = functools.partial(inspect.stack, context=0)
_frameinfo_without_source = functools.partial(inspect.getframeinfo, context=0)
_global_arguments_once = functools.cache(pyinfra_arguments.all_global_arguments)


def enable() -> None:
    """Idempotent: from now on pyinfra's stack walks skip source files and the global
    arguments' types are evaluated once."""
    pyinfra_util.stack = _stack_without_source
    pyinfra_util.getframeinfo = _frameinfo_without_source
    pyinfra_arguments.all_global_arguments = _global_arguments_once


def disable() -> None:
    """pyinfra's stock behaviour (for the benchmark's comparison)."""
    (pyinfra_util.stack, pyinfra_util.getframeinfo,
     pyinfra_arguments.all_global_arguments) = _stock
