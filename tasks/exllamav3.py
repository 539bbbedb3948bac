"""exllamav3: the compiled wheel for this box's card stack, built at most once per stack.

The first box of a stack (exllamav3 ref + patches, Python ABI, torch + CUDA variant, nvcc, arch,
distro) builds the wheel from the pinned git ref, for this card's arch only, and the deploy copies
it back to the wheel cache on the operator's machine (`exllamav3_wheel_cache`, git-ignored).
Every later box of that stack gets the cached wheel uploaded and installed `--no-deps`: no
compiler runs. sha256 is checked before the upload and on the box before pip sees the file.

Only a cache builder (`cache_builder: true` in the inventory; never a volunteer's box) copies its
wheel back, and only a builder's wheel is shipped (it is installed as root and imported by every
engine of the stack): other boxes build their own while the cache has no builder's wheel.
Builders of one stack deployed in the same run may each build (pyinfra runs hosts in parallel);
the first wheel copied back is kept. Deploy one builder first (`--limit`) to build once.

The build runs as root, from the operator's pinned ref in root's folders with the root-owned
venv's pip (files/build_exllamav3.sh): nothing it imports is the service user's or a cache's.
"""

from pathlib import Path

from pyinfra import host
from pyinfra.api import deploy

from donorkit.box.box_facts import host_profile
from donorkit.box.box_operations import (
    Exllamav3Build,
    build_wheel,
    copy_wheel_back,
    install_wheel,
    upload_cached_wheel,
)
from donorkit.inventory.host_data import this_box
from donorkit.inventory.paths import repo_path
from pyinfra_declared.files import config_file, directories


@deploy("exllamav3")
def apply() -> None:
    box = this_box(host)
    root = host.data.install_root
    source = f"{root}/src/exllamav3"
    script = f"{root}/bin/build-exllamav3.sh"
    arch = host.data.card.arch

    config_file(name="Install the exllamav3 build script",
                content=repo_path("files/build_exllamav3.sh").read_text(), dest=script, mode="755")
    directories(name="Create the exllamav3 patch directory", paths=[f"{source}-patches"])
    for patch in host.data.exllamav3_patches:
        config_file(name=f"Install exllamav3 patch {patch}", content=repo_path(patch).read_text(),
                    dest=f"{source}-patches/{Path(patch).name}")

    build = Exllamav3Build(
        version=host.data.exllamav3_version,
        ref=host.data.exllamav3_ref,
        patches=tuple(host.data.exllamav3_patches),
        arch=arch,
        distro=host_profile()["distro"],
        venv_dir=host.data.venv_dir,
        cuda_home=host.data.cuda_home,
        stamp=box.exllamav3_stamp,
        box_dir=f"{root}/wheels",
        cache_dir=host.data.exllamav3_wheel_cache,
        builders=tuple(box.cache_builders),
    )
    upload_cached_wheel(name="exllamav3: upload the cached wheel of this stack", build=build)
    build_wheel(name=f"exllamav3: build {build.ref} for arch {arch} (no cached wheel)", build=build,
                git_url=host.data.exllamav3_git_url, source_dir=source, script=script,
                gib_per_job=host.data.exllamav3_gib_per_job)
    install_wheel(name="exllamav3: install the wheel", build=build,
                  service_user=host.data.service_user)
    copy_wheel_back(name="exllamav3: copy the wheel built here back to the cache", build=build)
