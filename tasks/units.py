"""systemd: one vLLM unit per model identity this box serves, restarted only when what it runs
changed (unit, venv distributions, plugin, exllamav3), including a restart a failed run left due.
Units of identities no longer served go first (one model per card: a swap frees the GPU first).
After a (re)start, or whenever its model is not listed, the readiness gate waits until its
loopback port lists the checkpoint, or fails the box with the unit's journal. On a CUDA box the
stack's engine kernels (donorkit/box/kernel_cache.py) are shipped before the unit starts, and a
cache builder's first start copies them back.
"""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_facts import host_profile
from donorkit.box.kernel_cache import UnitKernels, keep_kernels, ship_kernels
from donorkit.box.prebuild import prebuild_command, prebuild_kernels
from donorkit.box.serving import ready_gate
from donorkit.inventory.host_data import this_box
from donorkit.inventory.paths import repo_path
from donorkit.render.templates import (
    PLUGIN_TREE_STAMP,
    UNIT_DIR,
    VERIFY_UNIT,
    render_unit,
    unit_environment,
)
from pyinfra_declared.files import ConfigFile, config_files
from pyinfra_declared.services import retired_unit, service_running_its_files


@deploy("vLLM units")
def apply() -> None:
    box = this_box(host)
    install_root = host.data.install_root
    site_packages = f"{host.data.venv_dir}/lib/python3*/site-packages"
    shared_dependencies = [f"{site_packages}/*.dist-info"]
    if box.cuda_engine:  # a cpu engine has no plugin and no exllamav3
        shared_dependencies += [
            f"{host.data.vllm_exl3_plugin_dir}/{PLUGIN_TREE_STAMP}",
            f"{host.data.vllm_exl3_plugin_dir}/.git/HEAD",
            box.exllamav3_stamp,
        ]

    gate = f"{install_root}/bin/wait_ready.py"
    prebuild = f"{install_root}/bin/prebuild_kernels.py"
    prebuild_on = box.cuda_engine and host.data.kernel_prebuild
    for unit in host.data.retired_units:
        retired_unit(name=f"Remove {unit} (model not served here)", unit=unit,
                     unit_path=f"{UNIT_DIR}/{unit}")

    # The gate and every unit in one operation; a unit systemd would refuse (or warn about: a
    # line it ignores) never replaces a working one.
    models = list(host.data.models.values())
    rendered = {model.unit: render_unit(box, model) for model in models}
    config_files(
        name=f"Install the readiness gate and {', '.join(m.unit for m in models)}",
        files=[ConfigFile(content=repo_path("files/wait_ready.py").read_text(), dest=gate,
                          mode="755"),
               *([ConfigFile(content=repo_path("files/prebuild_kernels.py").read_text(),
                             dest=prebuild, mode="755")] if prebuild_on else []),
               *(ConfigFile(content=rendered[model.unit],
                            dest=f"{UNIT_DIR}/{model.unit}", validate=VERIFY_UNIT)
                 for model in models)])

    for model in models:
        unit_path = f"{UNIT_DIR}/{model.unit}"
        kernels = None
        if box.cuda_engine:
            kernels = UnitKernels(
                unit=model.unit, unit_text=rendered[model.unit], checkpoint=model.checkpoint,
                revision=model.revision, arch=box.card.arch, distro=host_profile()["distro"],
                venv_dir=box.venv_dir, cuda_home=box.cuda_home, home=box.service_home,
                service_user=box.service_user,
                stamp=f"{install_root}/state/{model.unit}.kernels",
                box_dir=f"{install_root}/kernels", cache_dir=box.engine_kernel_cache,
                builders=tuple(box.cache_builders))
            ship_kernels(name=f"Kernels for {model.unit}: from an earlier box of its stack",
                         kernels=kernels)
        if kernels and prebuild_on:
            # What the stack still lacks, built outside the unit's cgroup
            # (donorkit/box/prebuild.py).
            prebuild_kernels(
                name=f"Kernels for {model.unit}: FlashInfer's, built before it starts",
                kernels=kernels, command=prebuild_command(
                    kernels, prebuild, unit_environment(box, model), model.args,
                    host.data.kernel_prebuild_gib_per_job, host.data.kernel_prebuild_reserve_gib))
        service_running_its_files(
            name=f"Run {model.unit} (port {model.port}, {model.checkpoint})",
            unit=model.unit,
            depends_on=[unit_path, *shared_dependencies],
            record=f"{install_root}/state/{model.unit}.started",
        )
        ready_gate(
            name=f"Ready: {model.unit} lists {model.checkpoint}",
            unit=model.unit, port=model.port, checkpoint=model.checkpoint,
            # As root (it reads the unit's journal): the system's Python, isolated, no site
            # (the gate is the standard library's only), never the venv's.
            python=host.data.venv_python, script=gate,
            timeout=host.data.ready_timeout, journal_lines=host.data.ready_journal_lines,
        )
        if kernels:
            keep_kernels(name=f"Kernels for {model.unit}: copy what its first start built "
                              "back to the cache", kernels=kernels)
