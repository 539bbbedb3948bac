"""The GPU machine set up as a donor box would be, for gpu/engine_run.py: the units' venv (the
image's torch plus the carried wheels), CUDA 13.3 from NVIDIA's wheels, the service user and its
Hugging Face cache, and the engine's JIT caches (emptied, kept, shipped as the deploy ships them
to another box of the stack: donorkit/box/kernel_cache.py)."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

ROOT = Path("/root/engine")
STAGE = ROOT / "stage"
CACHE_COPY = ROOT / "qwen-caches.tar"


def install(venv: Path) -> dict:
    started = time.monotonic()
    image_site = subprocess.run(
        ["python3", "-c", "import os, torch; print(os.path.dirname(os.path.dirname("
         "torch.__file__)))"], capture_output=True, text=True, check=True).stdout.strip()
    if not (venv / "bin/python").exists():
        subprocess.run(["python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([venv / "bin/python", "-c", "import sysconfig; print(sysconfig."
                           "get_paths()['purelib'])"], capture_output=True, text=True,
                          check=True).stdout.strip()
    Path(site, "image-site.pth").write_text(image_site + "\n")
    table = json.loads((STAGE / "requirements.json").read_text())["carried"]
    need = json.loads(subprocess.run([venv / "bin/python", Path(__file__).with_name(
        "carried_set.py"), STAGE / "requirements.json"], capture_output=True, text=True,
        check=True).stdout)
    wheels = [str(STAGE / "wheels" / table[name]["wheel"]) for name, _ in need]
    # --ignore-installed: ninja and vllm go into the venv even where the image has them.
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--ignore-installed", "--no-compile", "--disable-pip-version-check", *wheels],
                   check=True)
    os.chmod(venv, 0o755)
    probe = subprocess.run([venv / "bin/python", "-c", "import vllm, vllm.entrypoints.openai."
                            "api_server; print(vllm.__version__)"], capture_output=True, text=True)
    return {"import": (probe.stdout + probe.stderr).strip()[-600:],
            "installed": {n: [h, table[n]["version"]] for n, h in need},
            "seconds": round(time.monotonic() - started, 1), "image_site": image_site}


def driver_library() -> str:
    """A donor's driver puts libcuda in the loader's path; this image mounts it elsewhere and
    finds it through its own LD_LIBRARY_PATH, which a unit's LD_LIBRARY_PATH replaces. Register
    its folder with ld.so, as a driver install does (the units stay as rendered)."""
    if "libcuda.so.1" in subprocess.run(["ldconfig", "-p"], capture_output=True,
                                        text=True).stdout:
        return "libcuda.so.1 already in ld.so's cache"
    found = [d for d in (os.environ.get("LD_LIBRARY_PATH", "").split(":") +
                         ["/usr/local/nvidia/lib64", "/usr/local/nvidia/lib"])
             if d and Path(d, "libcuda.so.1").exists()]
    if not found:
        return "libcuda.so.1 not found"
    Path("/etc/ld.so.conf.d/zz-nvidia-driver.conf").write_text(found[0] + "\n")
    subprocess.run(["ldconfig"], check=True)
    return f"registered {found[0]} with ld.so"


def toolkit(prefix: Path) -> dict:
    # The daemon runs `python3 -m gpu.engine_run` in its copy of the tree: tests/ imports.
    from tests.support.cuda_standin import finish_layout, unpack_wheel

    started = time.monotonic()
    if not (prefix / "bin/nvcc").exists():
        for wheel in sorted((STAGE / "cuda-13.3").glob("*.whl")):
            unpack_wheel(wheel, prefix)
        finish_layout(prefix, prefix.name.removeprefix("cuda-"))
    nvcc = subprocess.run([prefix / "bin/nvcc", "--version"], capture_output=True, text=True)
    return {"nvcc": nvcc.stdout.strip().splitlines()[-1] if nvcc.returncode == 0 else nvcc.stderr,
            "cicc": (prefix / "nvvm/bin/cicc").exists(),
            "seconds": round(time.monotonic() - started, 1)}


def service_user(name: str, venv: Path) -> dict:
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/usr/sbin/nologin", name],
                       check=True)
    probe = subprocess.run(["runuser", "-u", name, "--", str(venv / "bin/python"), "-c",
                            "import torch, vllm; print(torch.cuda.is_available())"],
                           capture_output=True, text=True)
    usable = probe.returncode == 0 and probe.stdout.strip() == "True"
    return {"user": name, "usable": usable, "probe": (probe.stdout + probe.stderr)[-400:]}


def hub_cache(home: Path, checkpoint: str, folder: Path, owner: str) -> str:
    """The checkpoint as the weights step leaves it: snapshots/<commit>/ and refs/main."""
    files = sorted(p for p in folder.iterdir() if p.is_file())
    commit = hashlib.sha1(b"".join(hashlib.sha256(p.read_bytes()).digest()
                                   for p in files)).hexdigest()
    repo = home / ".cache/huggingface/hub" / f"models--{checkpoint.replace('/', '--')}"
    shutil.rmtree(repo, ignore_errors=True)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(commit)
    for path in files:
        shutil.copy(path, repo / "snapshots" / commit / path.name)
    subprocess.run(["chown", "-R", f"{owner}:{owner}", str(home / ".cache")], check=True)
    return commit


def jit_caches(home: Path) -> list[Path]:
    """The JIT caches (FlashInfer's, vLLM's torch.compile, Triton's, CUDA's): not the weights."""
    return [p for p in [*(home / ".cache").glob("*"), home / ".triton", home / ".nv"]
            if p.name != "huggingface" and p.exists()]


def wipe_caches(home: Path, keep_flashinfer: bool = False) -> None:
    for path in jit_caches(home):
        if not (keep_flashinfer and path.name == "flashinfer"):
            shutil.rmtree(path, ignore_errors=True)


def jit_modules(home: Path) -> dict[str, int]:
    """FlashInfer's JIT kernels in the home (cached_ops/NAME/NAME.so), each with its library's
    mtime: a module the engine rebuilds in place keeps its name (the sixth run's lesson: the
    fifth counted names only and missed the engine rebuilding every prebuilt module)."""
    return {p.parent.name: p.stat().st_mtime_ns for p in sorted(
        (home / ".cache/flashinfer").glob("*/*/cached_ops/*/*.so"))}


def prebuild(venv: Path, home: Path, user: str, env: dict[str, str], argv: list[str],
             commit: str, gib_per_job: str = "4", arch: str = "9.0") -> dict:
    """files/prebuild_kernels.py as the deploy runs it before the unit starts: the service user,
    the unit's environment, outside any cgroup of the engine; its time and peak host memory."""
    from gpu.engine_checks import Monitor

    script = venv.parent / "bin/prebuild_kernels.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).resolve().parent.parent / "files/prebuild_kernels.py", script)
    script.chmod(0o755)
    config = (home / ".cache/huggingface/hub" / f"models--{argv[2].replace('/', '--')}"
              / "snapshots" / commit / "config.json")

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1] if name in argv else "auto"
    cmd = [str(venv / "bin/python"), str(script), "--config", str(config), "--dtype",
           flag("--dtype"), "--kv-cache-dtype", flag("--kv-cache-dtype"), "--arch", arch,
           "--gib-per-job", gib_per_job]
    entry = pwd.getpwnam(user)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, env={**env, "HOME": str(home), "USER": user, "LOGNAME": user,
                                      "LANG": "C.UTF-8"}, cwd=home, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, user=entry.pw_uid,
                            group=entry.pw_gid, start_new_session=True)
    monitor = Monitor(proc.pid)
    monitor.start()
    out, err = proc.communicate(timeout=1500)
    monitor.stop = True
    monitor.join(5)
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - started, 1),
            "peak_host_gib": round(monitor.rss / 2**30, 2), "command": cmd,
            "report": out.strip()[-1500:], "stderr": err.strip()[-1500:],
            "modules_in_home": sorted(jit_modules(home))}


def keep_caches(home: Path) -> dict:
    """A copy of the caches a cold start left, as an operator's machine would fetch them."""
    with tarfile.open(CACHE_COPY, "w") as tar:
        for path in jit_caches(home):
            tar.add(path, arcname=str(path.relative_to(home)))
    return {"bytes": CACHE_COPY.stat().st_size}


def flashinfer_package(venv: Path) -> Path:
    found = subprocess.run([venv / "bin/python", "-c", "import importlib.util as u; "
                            "print(u.find_spec('flashinfer').submodule_search_locations[0])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    return Path(found)


def shipped_kernels_box(venv: Path, home: Path, owner: str, home_caches: bool) -> dict:
    """Another box of the stack, as the deploy ships it the stack's kernels before its unit
    starts: vLLM and FlashInfer installed afresh (new file times), every JIT cache emptied, the
    cold box's FlashInfer kernels in FlashInfer's precompiled-kernel folder of the venv; with
    `home_caches`, also vLLM's torch.compile and Triton caches in the service user's home (what
    the deploy does not ship: the remainder they would save)."""
    started = time.monotonic()
    table = json.loads((STAGE / "requirements.json").read_text())["carried"]
    wheels = [str(STAGE / "wheels" / table[n]["wheel"]) for n in ("vllm", "flashinfer-python")]
    subprocess.run([venv / "bin/python", "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--force-reinstall", "--no-compile", "--disable-pip-version-check", *wheels],
                   check=True)
    wipe_caches(home)
    aot = flashinfer_package(venv) / "data" / "aot"
    shipped, other = 0, []
    with tarfile.open(CACHE_COPY) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if parts[:2] == (".cache", "flashinfer"):
                # .cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so
                if member.isfile() and len(parts) == 7 and parts[4] == "cached_ops" \
                        and parts[6] == f"{parts[5]}.so":
                    target = aot / parts[5] / parts[6]
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    target.chmod(0o644)
                    shipped += 1
            elif home_caches:
                other.append(member)
        tar.extractall(home, members=other, filter="tar")
    subprocess.run(["chown", "-R", f"{owner}:{owner}", str(home)], check=True)
    return {"seconds": round(time.monotonic() - started, 1), "kernels": shipped,
            "kernel_bytes": sum(f.stat().st_size for f in aot.rglob("*.so")),
            "home_caches": sorted({Path(m.name).parts[0] + "/" + Path(m.name).parts[1]
                                   for m in other if len(Path(m.name).parts) > 1})}
