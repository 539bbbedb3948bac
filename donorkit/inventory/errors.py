"""The one error base class and the one exit-code table of the `donors` command
(donorkit/commands/cli.py).

Every operator mistake the toolkit detects is a DonorsError whose message is one line naming the
file, the host and the field (`<file>: donor '<name>': field '<f>': <what>`); the command prints
it as `donors: <message>` and exits with the table's code, never with a traceback."""

from __future__ import annotations

# The exit codes of `donors` (make turns any non-zero code into 2: run `donors` for these).
OK = 0            # done; every box checked is serving
FAILED = 1        # a check failed: a box unreachable or not ready, below baseline, a test
#                   failed, a pin refused by the hub, a rollout stopped, a deploy's operation failed
USAGE = 2         # bad input: the inventory, a join file, a --limit matching nothing, a usage
#                   mistake; refused before anything touches a box
INTERRUPTED = 130  # Ctrl-C

EXIT_CODES = f"""exit codes:
  {OK}    done (every box checked answers and serves)
  {FAILED}    a check failed: a box unreachable or not ready, a donor below baseline, a
       verification test failed, a pin the hub refused, a rollout stopped, a deploy failed
  {USAGE}    bad input, refused before any box is touched: the inventory (one line naming file,
       host and field), a --limit that matches no host, a join file, a usage mistake
  {INTERRUPTED}  interrupted (Ctrl-C)
  (make turns any failure into 2: call `donors` directly for these codes)"""


class DonorsError(Exception):
    """An operator's mistake or a refusal; str() is the one line to print (after `donors: `)."""

    exit_code = USAGE


def one_line(exc: BaseException) -> str:
    """The message of an error, its first line only (a library's may run on)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class AnswerTooLarge(OSError):
    """An answer from a box longer than its limit: refused, not read on (donorkit/commands/
    transport.py's reads, donorkit/box/wheel_cache.py's fetch)."""
