"""systemd: one vLLM unit per model identity this box serves, restarted only when what it runs
changed (unit, venv distributions, plugin, exllamav3), including a restart a failed run left due."""

from pyinfra import host

from donorkit.render import UNIT_DIR, VERIFY_UNIT, render_unit
from pyinfra_snapshot.operations import config_file, retired_unit, service_running_its_files

install_root = host.data.install_root
site_packages = f"{host.data.venv_dir}/lib/python3*/site-packages"
shared_dependencies = [
    f"{site_packages}/*.dist-info",
    f"{host.data.vllm_exl3_plugin_dir}/.uncloseai-tree",
    f"{host.data.vllm_exl3_plugin_dir}/.git/HEAD",
    f"{install_root}/state/exllamav3.stack",
]

for model in host.data.models.values():
    unit_path = f"{UNIT_DIR}/{model['unit']}"
    # A unit systemd would refuse (or warn about: a line it ignores) never replaces a working one.
    config_file(name=f"Install {model['unit']}", content=render_unit(host.data.dict(), model),
                dest=unit_path, validate=VERIFY_UNIT)
    service_running_its_files(
        name=f"Run {model['unit']} (port {model['port']}, {model['checkpoint']})",
        unit=model["unit"],
        depends_on=[unit_path, *shared_dependencies],
        record=f"{install_root}/state/{model['unit']}.started",
    )

for unit in host.data.retired_units:
    retired_unit(name=f"Remove {unit} (model not served here)", unit=unit,
                 unit_path=f"{UNIT_DIR}/{unit}")
