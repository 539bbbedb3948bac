"""The vllm-exl3 plugin, from the operator's machine or a git ref, installed editable --no-deps."""

from pyinfra import host

from donorkit.fleet import plugin_local_path
from donorkit.operations import editable_install, git_checkout, source_tree

plugin = host.data.vllm_exl3_plugin
dest = host.data.vllm_exl3_plugin_dir

if "path" in plugin:
    fetched = source_tree(name="Ship the vllm-exl3 plugin source",
                          local_dir=str(plugin_local_path(plugin)), dest=dest)
else:
    fetched = git_checkout(name=f"Check out vllm-exl3 {plugin['ref']}",
                           url=plugin["git_url"], ref=plugin["ref"], dest=dest)
editable_install(name="Install the vllm-exl3 plugin (editable)", venv_dir=host.data.venv_dir,
                 source_dir=dest, reinstall=[fetched])
