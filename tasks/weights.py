"""Weights: each served model's checkpoint at its pinned revision, complete in the service user's
Hugging Face cache before any unit is (re)started (tasks/units.py comes next), so a first start,
an upgrade or a model swap never downloads inside the unit's start (the new model's weights are
here while the old model still serves). files/fetch_weights.py does it on the box, as the service
user, with the venv's huggingface_hub (a gated model's token, root's, on its stdin: operator
boxes only, a volunteer's box fetches without one); its progress shows in the run. A box whose
model has no pinned revision stops here, with the line saying which."""

from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.serving import (
    hf_token_path,
    home_token_path,
    manifest_dir,
    model_weights,
)
from donorkit.inventory.paths import operator_path, repo_path
from donorkit.render.templates import hub_cache
from pyinfra_declared.files import absent_path, config_file, directories


@deploy("Weights")
def apply() -> None:
    root = host.data.install_root
    user, home = host.data.service_user, host.data.service_home
    fetcher = f"{root}/bin/fetch_weights.py"
    config_file(name="Install the weights fetcher", content=repo_path(
        "files/fetch_weights.py").read_text(), dest=fetcher, mode="755")

    # The token is root's (0600 in a 0700 folder of root's): the vLLM units run as the service user
    # and never need it; the weights step's root shell opens it and hands it to the fetch on stdin
    # (donorkit/box/serving.py). Earlier deploys kept it in the service user's home: removed there.
    absent_path(name="No Hugging Face token in the service user's home",
                path=home_token_path(home))
    token_file = token_error = None
    # A volunteer's box (owner: volunteer) has no hf_token_file in its host data
    # (donorkit/inventory/fleet.py): a token an earlier deploy left there is removed too.
    if not host.data.hf_token_file:
        absent_path(name="No Hugging Face token (none in the inventory, or a volunteer's box)",
                    path=hf_token_path(root))
    else:
        token_file = hf_token_path(root)
        token_dir = str(PurePosixPath(token_file).parent)
        try:
            token = operator_path(host.data.hf_token_file).read_text()
        except OSError as e:
            token_error = f"hf_token_file {host.data.hf_token_file}: {e.strerror}"
        else:
            directories(name="Create root's secrets directory (0700)", paths=[token_dir],
                        mode="700")
            config_file(name="Install the Hugging Face token (0600, root's)", content=token,
                        dest=token_file, mode="600", secret=True)

    for model in host.data.models.values():
        model_weights(
            name=f"Weights of {model.checkpoint} @ {(model.revision or 'no revision')[:12]}",
            model=model.name, repo=model.checkpoint, revision=model.revision,
            python=f"{host.data.venv_dir}/bin/python", script=fetcher, service_user=user,
            home=home, cache_dir=hub_cache(home), manifests=manifest_dir(home),
            endpoint=host.data.hf_endpoint, token_file=token_file, token_error=token_error)
