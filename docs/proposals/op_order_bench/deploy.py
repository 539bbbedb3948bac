"""200 operations with no fact reads (server.shell), included from a task file as our deploy's
are: loading this deploy is pyinfra's own per-operation work, the stack walk among it."""

from pyinfra import local

local.include("task.py")
