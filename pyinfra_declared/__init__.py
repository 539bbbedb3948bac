"""pyinfra_declared: pyinfra operations that declare the facts they need (inputs, not reads),
so that a host's facts are read in one round trip while the run has changed nothing there;
generic operations built that way; SSH sockets with low-latency options. Nothing here is about
this project's boxes: donorkit builds on it.

- decorator.py      `@operation(fact=lambda op: need(Fact, ...))`: args + facts -> commands;
                    `fail` (a refusal that stops its own host)
- snapshot.py       the declared facts of a host, read in one command; `need`
- batched_facts.py  facts that read several things in one command, some batched
- apt.py            Debian packages (through apt_get.sh: apt-get once apt's locks are free)
- files.py          files, directories, absent paths
- python_env.py     venvs, their distributions, editable installs
- sources.py        git checkouts and shipped source trees
- services.py       system users and systemd units
- ssh_socket.py     TCP_NODELAY and TCP_QUICKACK through pyinfra's ssh_paramiko_connect_kwargs
- json_cases.py     the JSON test cases' runner (arguments and facts in, commands out)

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
        f"pyinfra_declared was written for pyinfra {', '.join(SUPPORTED_PYINFRA)}.x, but pyinfra "
        f"{found or '(not installed)'} is installed. It relies on pyinfra's operation results "
        "(OperationMeta), its State's stages and per-host operation data, FactBase and the "
        "ssh_paramiko_connect_kwargs hook: install a supported pyinfra (pyproject.toml pins "
        "one), or run pyinfra_declared/tests against the new version and add it to "
        "SUPPORTED_PYINFRA.")


def _installed_pyinfra() -> str | None:
    try:
        return version("pyinfra")
    except PackageNotFoundError:
        return None


check_pyinfra(_installed_pyinfra())
