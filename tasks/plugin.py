"""The vllm-exl3 plugin, from the operator's machine or a git ref, installed editable --no-deps;
installed again when its source changed in this run. As root, with the root-owned venv's pip,
from root's folder (`vllm_exl3_plugin_dir`): the operator's source, never a box's."""

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import server

from donorkit.inventory.fleet import plugin_local_path
from donorkit.inventory.schema import PluginPath
from donorkit.render.templates import PLUGIN_TREE_STAMP
from pyinfra_declared.python_env import editable_install, editable_install_command
from pyinfra_declared.sources import git_checkout, source_tree


@deploy("vllm-exl3 plugin")
def apply() -> None:
    plugin = host.data.vllm_exl3_plugin
    dest = host.data.vllm_exl3_plugin_dir
    venv = host.data.venv_dir

    if isinstance(plugin, PluginPath):
        fetched = source_tree(name="Ship the vllm-exl3 plugin source",
                              local_dir=str(plugin_local_path(plugin)), dest=dest,
                              stamp_name=PLUGIN_TREE_STAMP)
    else:
        fetched = git_checkout(name=f"Check out vllm-exl3 {plugin.ref}",
                               url=plugin.git_url, ref=plugin.ref, dest=dest)
    editable_install(name="Install the vllm-exl3 plugin (editable)", venv_dir=venv, source_dir=dest,
                     _if=fetched.did_not_change)
    # Change detection lists this one under "Conditional Change": it runs if the source changes.
    server.shell(name="Install the vllm-exl3 plugin again (its source changed)",
                 commands=[editable_install_command(venv, dest)], _if=fetched.did_change)
