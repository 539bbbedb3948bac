"""pyinfra_snapshot: pyinfra operations whose facts are inputs, read in one round trip while
the run has changed nothing on a host; generic operations built that way; SSH sockets with
low-latency options. Not about donor boxes: donorkit builds on it.

- operation.py  `@operation(fact=lambda op: need(Fact, ...))`: args + facts -> commands
- snapshot.py   the declared facts of a host, read in one command; `need`
- facts.py      facts that read several things in one command, some batched
- operations.py packages, files, directories, users, venvs, git, units
- ssh_socket.py TCP_NODELAY and TCP_QUICKACK through pyinfra's ssh_paramiko_connect_kwargs

It uses pyinfra's public API only, except where pyinfra has none (snapshot.host_changed); each
such use is tested against the pyinfra installed. It was written for the versions below: another
one stops the import with the reason, before any deploy code runs.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

SUPPORTED_PYINFRA = ("3.10",)


class UnsupportedPyinfra(ImportError):
    """The installed pyinfra is not a version this package was written for."""


def check_pyinfra(found: str | None) -> None:
    """Refuse a pyinfra this package was not written for, naming both versions."""
    if found is not None and any(found == v or found.startswith(f"{v}.")
                                 for v in SUPPORTED_PYINFRA):
        return
    raise UnsupportedPyinfra(
        f"pyinfra_snapshot was written for pyinfra {', '.join(SUPPORTED_PYINFRA)}.x, but pyinfra "
        f"{found or '(not installed)'} is installed. It relies on pyinfra's operation results "
        "(OperationMeta), its State's stages and per-host operation data, FactBase and the "
        "ssh_paramiko_connect_kwargs hook: install a supported pyinfra (pyproject.toml pins "
        "one), or run pyinfra_snapshot/tests against the new version and add it to "
        "SUPPORTED_PYINFRA.")


def _installed_pyinfra() -> str | None:
    try:
        return version("pyinfra")
    except PackageNotFoundError:
        return None


check_pyinfra(_installed_pyinfra())
