"""FlashInfer's JIT kernels built before a unit's first start of a stack (files/prebuild_kernels.py
on the box): as the service user, with the unit's own environment (the compiler, paths and flags
ninja compares), outside the unit's cgroup and its MemoryMax, with compile jobs sized from the
box's memory (defaults.yml kernel_prebuild_*; figures: docs/benchmarks.md).

Once per stack: a stamp records the stack the kernels were built for (donorkit/box/kernel_cache.py's
key); a box given the stack's kernels by ship_kernels finds them there and builds nothing."""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import FunctionCommand

from donorkit.box.box_facts import CudaStack
from donorkit.box.kernel_cache import EngineKernels, UnitKernels, kernel_stack
from donorkit.box.serving import streamed
from donorkit.render.templates import hub_cache
from pyinfra_declared.batched_facts import VenvDistributions
from pyinfra_declared.decorator import operation
from pyinfra_declared.snapshot import need

q = shlex.quote


def prebuild_stamp(kernels: UnitKernels) -> str:
    return str(PurePosixPath(kernels.stamp).with_suffix(".prebuilt"))


def checkpoint_config(kernels: UnitKernels) -> str:
    """The checkpoint's config.json on the box, where the weights step left it."""
    if kernels.checkpoint.startswith("/"):
        return f"{kernels.checkpoint}/config.json"
    folder = f"models--{kernels.checkpoint.replace('/', '--')}"
    return f"{hub_cache(kernels.home)}/{folder}/snapshots/{kernels.revision}/config.json"


def prebuild_command(kernels: UnitKernels, script: str, environment: dict[str, str],
                     args: list[str], gib_per_job: float, reserve_gib: float) -> str:
    """The script as the service user, with exactly the unit's environment (env -i)."""
    def flag(name: str) -> str:
        return args[args.index(name) + 1] if name in args[:-1] else "auto"
    env = " ".join(q(f"{k}={v}") for k, v in {"HOME": kernels.home, **environment}.items())
    return (f"cd / && runuser -u {q(kernels.service_user)} -- env -i {env} "
            f"{q(kernels.venv_dir + '/bin/python')} {q(script)} "
            f"--config {q(checkpoint_config(kernels))} --dtype {q(flag('--dtype'))} "
            f"--kv-cache-dtype {q(flag('--kv-cache-dtype'))} --arch {q(kernels.arch)} "
            f"--gib-per-job {float(gib_per_job):g} --reserve-gib {float(reserve_gib):g}")


@operation(box=lambda op: need(EngineKernels, stamp=prebuild_stamp(op.kernels),
                               home=op.kernels.home),
           venv=lambda op: need(VenvDistributions, venv_dir=op.kernels.venv_dir),
           cuda=lambda op: need(CudaStack, cuda_home=op.kernels.cuda_home,
                                venv_dir=op.kernels.venv_dir))
def prebuild_kernels(kernels: UnitKernels, command: str, box: dict, venv: dict, cuda: dict):
    """Before the unit starts: its FlashInfer kernels built, once per stack."""
    stack = kernel_stack(kernels, box, venv, cuda)
    if box["stamp"] == stack.key:
        host.noop(f"FlashInfer kernels of {kernels.unit} (stack {stack.id}) built")
        return
    stamp = q(prebuild_stamp(kernels))
    yield FunctionCommand(streamed, (command,), {})
    yield (f"mkdir -p {q(str(PurePosixPath(prebuild_stamp(kernels)).parent))} && "
           f"printf '%s\\n' {q(stack.key)} > {stamp}.tmp && mv {stamp}.tmp {stamp}")
