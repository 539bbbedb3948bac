"""exllamav3: the compiled wheel for this box's card stack, built at most once per stack.

The first box of a stack builds the wheel from the pinned git ref, for this card's arch only, as
root from root's folders (files/build_exllamav3.sh), and a cache builder (`cache_builder: true`,
never a volunteer's box) copies it back to the operator's wheel cache; every later box of that
stack gets a builder's wheel uploaded, sha256-checked on both ends, and installed `--no-deps`.
Builders of one stack in one run may each build: deploy one first (`--limit`) to build once
(docs/rerun.md "The exllamav3 wheel cache").
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
