"""Less of pyinfra's own work per operation call (each task line, for each host, at load time).

1. pyinfra orders a deploy's operations by the line numbers of the deploy code that called them
   (pyinfra.api.util.get_operation_order_from_stack). It finds them with inspect.stack() and
   inspect.getframeinfo(): for every frame on the stack, twice, these look for the source file
   on disk (a stat each) and, at the default context=1, open and scan it. The order needs only
   each frame's file name and line number, which the frame itself holds: those are read from
   the frames directly (`co_filename` is what getframeinfo reports for any frame with a .py
   source, which is every frame of a deploy), so the order is the same.
2. pyinfra.api.arguments.pop_global_arguments asks all_global_arguments() for the global
   arguments' types, which runs typing.get_type_hints over a TypedDict, evaluating every string
   annotation again, each call. The answer never changes within a process: it is kept.

Measured on the testbed (4 hosts, 27 operations each, 2 cores), controller CPU of the no-op
re-run: 1. took it from about 0.73 s to 0.56 s (issue 6); 2. is measured in bench/results.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import FrameType

import pyinfra.api.arguments as pyinfra_arguments
import pyinfra.api.util as pyinfra_util

_stock = (pyinfra_util.stack, pyinfra_util.getframeinfo, pyinfra_arguments.all_global_arguments)


def _stack_without_source(context: int = 0) -> list[inspect.FrameInfo]:
    """inspect.stack() without source: the caller's frame first, as inspect.stack gives it
    (sys._getframe(1) skips this function's own frame, as inspect.stack skips its own)."""
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno,
                                        frame.f_code.co_name, None, None))
        frame = frame.f_back
    return frames


def _frameinfo_without_source(frame: FrameType, context: int = 0) -> inspect.Traceback:
    return inspect.Traceback(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                             None, None)


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
