"""Service accounts and systemd units: a system user, a unit reloaded or restarted when a marker
says it is due, a unit that runs the files it depends on (restarted when their digest changed),
and a unit retired."""

from __future__ import annotations

import shlex
from pathlib import Path

from pyinfra import host

from pyinfra_declared.batched_facts import (
    UnitState,
    UserAccount,
    digest_command,
)
from pyinfra_declared.decorator import operation
from pyinfra_declared.snapshot import need

q = shlex.quote




@operation(account=lambda op: need(UserAccount, user=op.user))
def system_user(user: str, home: str, shell: str, account: dict | None):
    """A system user with this home (created, owned by the user) and login shell."""
    q_user, q_home, q_shell = q(user), q(home), q(shell)
    if account is None:
        # A group of that name left from an earlier user is reused, as useradd would refuse it.
        yield (f"useradd --system --create-home --home-dir {q_home} --shell {q_shell} "
               f"$(getent group {q_user} >/dev/null && echo --gid {q_user}) {q_user}")
        return
    changes = []
    if account["home"] != home:
        changes.append(f"--home {q_home}")
    if account["shell"] != shell:
        changes.append(f"--shell {q_shell}")
    if changes:
        yield f"usermod {' '.join(changes)} {q_user}"
    if account["home"] != home or account["home_owner"] != user:
        yield f"mkdir -p {q_home} && chown {q_user}: {q_home}"
    if not changes and account["home_owner"] == user:
        host.noop(f"user {user} is in place")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, present=op.pending_marker))
def reloaded_service(unit: str, pending_marker: str, unit_state: dict, restart: bool = False,
                     daemon_reload: bool = False):
    """Enabled and running; reloaded when a config swap left the marker behind (`restart`:
    restarted instead, after a daemon-reload: for a change to the unit itself; `daemon_reload`:
    reloaded after a daemon-reload: for a drop-in that changes only how it reloads)."""
    q_unit, q_marker = q(unit), q(pending_marker)
    if unit_state.get("UnitFileState") != "enabled":
        yield f"systemctl enable {q_unit}"
    if unit_state.get("ActiveState") != "active":
        yield f"systemctl restart {q_unit} && rm -f {q_marker}"
    elif unit_state.get("Present") == "yes" and restart:
        yield f"systemctl daemon-reload && systemctl restart {q_unit} && rm -f {q_marker}"
    elif unit_state.get("Present") == "yes":
        first = "systemctl daemon-reload && " if daemon_reload else ""
        yield f"{first}systemctl reload-or-restart {q_unit} && rm -f {q_marker}"
    else:
        host.noop(f"{unit} is running its current config")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, depends_on=op.depends_on,
                                      record=op.record))
def service_running_its_files(unit: str, depends_on: list[str], record: str, unit_state: dict):
    """Enabled, running, and running what is on disk now. The digest of `depends_on` (paths,
    `*` allowed) is recorded at each start; a mismatch means a restart is due, including one
    that a failed run left undone."""
    q_unit, q_record = q(unit), q(record)
    if unit_state.get("NeedDaemonReload") == "yes" or unit_state.get("LoadState") != "loaded":
        yield "systemctl daemon-reload"
    if unit_state.get("UnitFileState") != "enabled":
        yield f"systemctl enable -q {q_unit}"
    running = unit_state.get("ActiveState") in ("active", "activating", "reloading")
    if running and unit_state.get("Recorded") == unit_state.get("OnDisk"):
        host.noop(f"{unit} is running what is installed")
        return
    # Digest taken before the restart: a change landing during the restart stays detectable.
    yield (f"mkdir -p {q(str(Path(record).parent))} && {digest_command(depends_on)} > "
           f"{q(record + '.tmp')} && systemctl restart {q_unit} && "
           f"mv {q(record + '.tmp')} {q_record}")


@operation(unit_state=lambda op: need(UnitState, unit=op.unit, present=op.unit_path))
def retired_unit(unit: str, unit_path: str, unit_state: dict):
    """Stop, disable and remove a unit this host no longer runs."""
    if unit_state.get("Present") != "yes" and unit_state.get("LoadState") != "loaded":
        host.noop(f"{unit} is not installed")
        return
    yield (f"systemctl disable -q --now {q(unit)} || true; rm -f {q(unit_path)} && "
           "systemctl daemon-reload")
