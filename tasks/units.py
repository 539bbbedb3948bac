"""systemd: one vLLM unit per model identity this box serves, restarted only when what it runs
changed (unit, venv distributions, plugin, exllamav3), including a restart a failed run left due.
Units of identities no longer served go first (one model per card: a swap frees the GPU before
the new model loads; its weights are already here, tasks/weights.py). After a (re)start, or
whenever its model is not listed, the readiness gate waits until /v1/models on the unit's
loopback port lists the checkpoint, or fails the box with the unit's journal."""

from pyinfra import host
from pyinfra.api import deploy

from donorkit.host_data import this_box
from donorkit.paths import repo_path
from donorkit.render import PLUGIN_TREE_STAMP, UNIT_DIR, VERIFY_UNIT, render_unit
from donorkit.serving import ready_gate
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
    for unit in host.data.retired_units:
        retired_unit(name=f"Remove {unit} (model not served here)", unit=unit,
                     unit_path=f"{UNIT_DIR}/{unit}")

    # The gate and every unit in one operation; a unit systemd would refuse (or warn about: a
    # line it ignores) never replaces a working one.
    models = list(host.data.models.values())
    config_files(
        name=f"Install the readiness gate and {', '.join(m.unit for m in models)}",
        files=[ConfigFile(content=repo_path("files/wait_ready.py").read_text(), dest=gate,
                          mode="755"),
               *(ConfigFile(content=render_unit(box, model),
                            dest=f"{UNIT_DIR}/{model.unit}", validate=VERIFY_UNIT)
                 for model in models)])

    for model in models:
        unit_path = f"{UNIT_DIR}/{model.unit}"
        service_running_its_files(
            name=f"Run {model.unit} (port {model.port}, {model.checkpoint})",
            unit=model.unit,
            depends_on=[unit_path, *shared_dependencies],
            record=f"{install_root}/state/{model.unit}.started",
        )
        ready_gate(
            name=f"Ready: {model.unit} lists {model.checkpoint}",
            unit=model.unit, port=model.port, checkpoint=model.checkpoint,
            python=f"{host.data.venv_dir}/bin/python", script=gate,
            timeout=host.data.ready_timeout, journal_lines=host.data.ready_journal_lines,
        )
