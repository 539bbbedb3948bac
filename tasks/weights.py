"""Weights: each served model's checkpoint at its pinned revision, complete in the service user's
Hugging Face cache before any unit is (re)started (tasks/units.py comes next), so a first start,
an upgrade or a model swap never downloads inside the unit's start (the new model's weights are
here while the old model still serves). files/fetch_weights.py does it on the box, as the service
user, with the venv's huggingface_hub; its progress shows in the run. A box whose model has no
pinned revision stops here, with the line saying which."""

from pyinfra import host

from donorkit.paths import repo_path
from donorkit.serving import hub_cache, manifest_dir, model_weights
from pyinfra_snapshot.operations import config_file, directories

root = host.data.install_root
user, home = host.data.service_user, host.data.service_home
fetcher = f"{root}/bin/fetch_weights.py"
config_file(name="Install the weights fetcher", content=repo_path(
    "files/fetch_weights.py").read_text(), dest=fetcher, mode="755")

token_file = token_error = None
if host.data.hf_token_file:
    token_dir = f"{home}/.config/uncloseai"
    token_file = f"{token_dir}/hf-token"
    try:
        token = repo_path(host.data.hf_token_file).read_text()
    except OSError as e:
        token_error = f"hf_token_file {host.data.hf_token_file}: {e.strerror}"
    else:
        directories(name="Create the service user's token directory",
                    paths=[f"{home}/.config", token_dir], user=user, group=user, mode="700")
        config_file(name="Install the Hugging Face token (0600, the service user's)",
                    content=token, dest=token_file, mode="600", user=user, group=user,
                    secret=True)

for model in host.data.models.values():
    revision = model.get("revision")
    model_weights(
        name=f"Weights of {model['checkpoint']} @ {(revision or 'no revision')[:12]}",
        model=model["name"], repo=model["checkpoint"], revision=revision,
        python=f"{host.data.venv_dir}/bin/python", script=fetcher, service_user=user,
        home=home, cache_dir=hub_cache(home), manifests=manifest_dir(home),
        endpoint=host.data.hf_endpoint, token_file=token_file, token_error=token_error)
