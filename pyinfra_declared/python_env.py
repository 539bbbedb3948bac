"""Python environments: a venv, the distributions it holds (installed together, with uv or pip),
and an editable install of a source tree."""

from __future__ import annotations

import shlex

from pyinfra import host

from pyinfra_declared.batched_facts import (
    EditableInstall,
    PathStates,
    VenvDistributions,
    normalized_name,
    shell_glob,
)
from pyinfra_declared.decorator import fail, operation
from pyinfra_declared.snapshot import need

q = shlex.quote


@operation(found=lambda op: need(PathStates, paths=[f"{op.path}/bin/activate"]))
def python_venv(path: str, python: str, found: dict):
    """A venv made by `python -m venv` (again, in place, when bin/activate is missing: venv
    writes it last, so a venv whose creation was interrupted is completed)."""
    if found:
        host.noop(f"venv {path} present")
        return
    yield f"{q(python)} -m venv {q(path)}"


@operation(installed=lambda op: need(VenvDistributions, venv_dir=op.venv_dir),
           busy=lambda op: need(PathStates, paths=[f"{op.venv_dir}/{op.busy_marker}"])
           if op.uv else None)
def venv_packages(venv_dir: str, packages: list[str], installed: dict[str, str],
                  busy: dict | None, install_args: list[str] | None = None,
                  install: list[str] | None = None, uv: str | None = None,
                  busy_marker: str = ".installing", stale_on_change: list[str] | None = None):
    """Each requirement (`name==version` and the like) satisfied in the venv (the distributions
    its site-packages holds); the installer installs them all together when any is not, so its
    resolver sees the whole set: `install` when given (the same requirements, some as direct
    references: `name @ <wheel URL>`), else `packages`. `install_args`: the installer's own
    options (e.g. --index-url URL), each an argument.

    `uv` (a requirement, `uv==0.13.9`): install with uv, itself installed into the venv by the
    venv's pip from the same index when the venv lacks that version (so the box needs no other
    source); uv uses the box's own certificate store, as pip does. None: the venv's pip.
    uv installs a set's distributions in parallel, in no order: killed midway, it can leave the
    requirements' distributions in place without all of their own dependencies' files (seen on
    the testbed: torch present, libcusparseLt.so.0 missing). So with uv a marker
    (`<venv>/<busy_marker>`) is made before installing and removed once uv succeeded; a
    venv that has it is not converged, and the next install is `--reinstall` (every
    distribution of the set laid out again, from uv's cache). The marker is read through the
    snapshot: no extra remote command.

    `stale_on_change`: paths under the venv (`*` expands) that other steps put there for this
    set of distributions and that belong to no distribution: removed before any install, so a
    changed set never meets them (the next steps lay them out again for the new set)."""
    from packaging.requirements import InvalidRequirement, Requirement

    def parsed(spec: str) -> Requirement:
        try:
            return Requirement(spec)
        except InvalidRequirement as exc:
            fail(f"venv package {spec!r} is not a pip requirement: {exc}")

    def met(requirement: Requirement) -> str | None:
        """None when satisfied, else what the venv has."""
        version = installed.get(normalized_name(requirement.name))
        # `==2.11.0` accepts 2.11.0+cu130, as pip does: the index's local tag is not a mismatch.
        if version is None or not requirement.specifier.contains(version, prereleases=True):
            return f"{requirement.name} ({version or 'absent'})"
        return None

    unmet = [m for m in (met(parsed(spec)) for spec in packages) if m]
    args, marker = install_args or [], f"{venv_dir}/{busy_marker}"
    interrupted = uv is not None and marker in (busy or {})
    if not unmet and not interrupted:
        host.noop(f"{len(packages)} requirements met in {venv_dir}")
        return
    pip, specs = q(f"{venv_dir}/bin/pip"), [*map(q, install or packages)]
    stale = [f"rm -rf {' '.join(shell_glob(f'{venv_dir}/{path}') for path in stale_on_change)}"
             ] if stale_on_change else []
    if uv is None:
        yield " && ".join([*stale, " ".join([pip, "install", "-q", *map(q, args), *specs])])
        return
    steps = [f"touch {q(marker)}", *stale]
    if met(parsed(uv)):
        # From the same index as the rest (PyPI, or the operator's mirror of it).
        index = args[args.index("--index-url"):][:2] if "--index-url" in args else []
        steps.append(" ".join([pip, "install", "-q", *map(q, index), q(uv)]))
    steps.append(" ".join([q(f"{venv_dir}/bin/uv"), "pip", "install", "--python",
                           q(f"{venv_dir}/bin/python"), "-q", "--system-certs",
                           *(["--reinstall"] if interrupted else []), *map(q, args), *specs]))
    steps.append(f"rm -f {q(marker)}")
    yield " && ".join(steps)


def editable_install_command(venv_dir: str, source_dir: str) -> str:
    return f"{q(f'{venv_dir}/bin/pip')} install -q --no-deps -e {q(source_dir)}"


@operation(installed=lambda op: need(EditableInstall, venv_dir=op.venv_dir,
                                     source_dir=op.source_dir))
def editable_install(venv_dir: str, source_dir: str, installed: bool):
    """`pip install --no-deps -e` unless some distribution in the venv is installed editable
    from there. (A changed source is reinstalled by a step with `_if=` on the step that
    changed it: see tasks/plugin.py.)"""
    if installed:
        host.noop(f"{source_dir} is installed editable")
        return
    yield editable_install_command(venv_dir, source_dir)
