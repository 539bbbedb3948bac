"""exllamav3: built on the box from the pinned git ref against the venv's torch, for this card's
arch only, and installed --no-deps; skipped when this stack's wheel is installed already."""

from pyinfra import host
from pyinfra.operations import files

from donorkit.operations import exllamav3_wheel, git_checkout

source = f"{host.data.install_root}/src/exllamav3"
script = f"{host.data.install_root}/bin/build-exllamav3.sh"

git_checkout(
    name=f"Check out exllamav3 {host.data.exllamav3_ref}",
    url=host.data.exllamav3_git_url,
    ref=host.data.exllamav3_ref,
    dest=source,
)
files.put(name="Install the exllamav3 build script", src="files/build_exllamav3.sh",
          dest=script, mode="755")
exllamav3_wheel(
    name=f"Build and install exllamav3 for arch {host.data.card['arch']}",
    script=script,
    stamp=f"{host.data.install_root}/state/exllamav3.stack",
    stack_key=host.data.exllamav3_stack_key,
    env={"SRC": source, "VENV": host.data.venv_dir, "CUDA_HOME": host.data.cuda_home,
         "ARCH": host.data.card["arch"], "GIB_PER_JOB": host.data.exllamav3_gib_per_job},
)
