"""The Debian 12 base root filesystem every test host boots from (built once, cached)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .common import STANDINS, WORK, log, remove_tree, run, sha256_of, unmount_under

BASE = WORK / "rootfs-base"
RECIPE_FILE = BASE / ".testbed-recipe"
MIRROR = "http://deb.debian.org/debian"
SUITE = "bookworm"
# What a fresh Debian 12 donor box has (or its operator installs by hand) before the deploy runs.
# python3-pip beside python3-venv: the hand checks run `pip download` on the host itself.
PACKAGES = ["systemd", "systemd-sysv", "dbus", "openssh-server", "python3", "python3-venv",
            "python3-pip", "ca-certificates", "sudo", "iproute2", "curl", "procps"]
DEBOOTSTRAP = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE]
SOURCES = f"""deb {MIRROR} {SUITE} main
deb {MIRROR} {SUITE}-updates main
deb http://deb.debian.org/debian-security {SUITE}-security main
"""
SSHD_CONF = "PermitRootLogin prohibit-password\nPasswordAuthentication no\nUseDNS no\n"
EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")


def recipe() -> str:
    """Hash of what the debootstrap stage depends on: change the recipe and the base is rebuilt."""
    return sha256_of(" ".join(DEBOOTSTRAP), MIRROR, SOURCES)


def ensure_base() -> bool:
    """Build the base if missing or stale, then refresh its cheap per-run files. True if built."""
    built = False
    if not (RECIPE_FILE.exists() and RECIPE_FILE.read_text() == recipe()):
        _debootstrap()
        built = True
    _customize(BASE)
    return built


def _debootstrap() -> None:
    tmp = WORK / "rootfs-base.new"
    remove_tree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap {SUITE} into {tmp} (about a minute)")
    try:
        run([*DEBOOTSTRAP, tmp, MIRROR])
    finally:
        unmount_under(tmp)
    (tmp / "etc/apt/sources.list").write_text(SOURCES)
    # Host keys are made per host at each start; the base must not carry any.
    for key in (tmp / "etc/ssh").glob("ssh_host_*"):
        key.unlink()
    run(["chroot", tmp, "apt-get", "clean"])
    (tmp / ".testbed-recipe").write_text(recipe())
    remove_tree(BASE)
    tmp.rename(BASE)


def _customize(root: Path) -> None:
    """Per-run files of the base: cheap, so they follow this machine without a rebuild."""
    _copy_resolv_conf(root)
    _install_extra_cas(root)
    conf = root / "etc/ssh/sshd_config.d/testbed.conf"
    conf.write_text(SSHD_CONF)
    wants = root / "etc/systemd/system/multi-user.target.wants/ssh.service"
    if not wants.is_symlink():
        wants.parent.mkdir(parents=True, exist_ok=True)
        wants.symlink_to("/lib/systemd/system/ssh.service")
    # Stand-ins (test doubles): vllm's server, and nvidia-smi answering from a per-host file.
    for name in ("vllm-standin", "nvidia-smi"):
        standin = root / "usr/local/bin" / name
        shutil.copyfile(STANDINS / name, standin)
        standin.chmod(0o755)
    (root / "root/.cache/pip").mkdir(parents=True, exist_ok=True)
    (root / "root/.cache/uv").mkdir(parents=True, exist_ok=True)


def _copy_resolv_conf(root: Path) -> None:
    dest = root / "etc/resolv.conf"
    if dest.is_symlink() or dest.exists():
        dest.unlink()
    shutil.copyfile("/etc/resolv.conf", dest)


def _install_extra_cas(root: Path) -> None:
    """This machine's extra CAs (TLS-inspecting egress): without them a host's pip fails on PyPI."""
    dest = root / "usr/local/share/ca-certificates"
    dest.mkdir(parents=True, exist_ok=True)
    wanted = {c.name for c in EXTRA_CA_DIR.glob("*.crt")} if EXTRA_CA_DIR.is_dir() else set()
    current = {c.name for c in dest.glob("*.crt")}
    same = wanted == current and all(
        (dest / n).read_bytes() == (EXTRA_CA_DIR / n).read_bytes() for n in wanted)
    if same:
        return
    for old in dest.glob("*.crt"):
        old.unlink()
    for name in wanted:
        shutil.copyfile(EXTRA_CA_DIR / name, dest / name)
    run(["chroot", root, "update-ca-certificates", "--fresh"], env={**os.environ, "PATH": _PATH})


_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
