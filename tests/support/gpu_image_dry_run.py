"""Every step of gpu/engine_run.py (receive, launch, daemon, follow, table) run here with only what
the lent GPU machine's image has: run as `python -I tests/support/gpu_image_dry_run.py WORK`
(tests/unit/test_gpu_harness.py does), it refuses to import any module that is neither the
standard library's nor this repository's (the image has no pydantic, no pyinfra, no yaml, no
jinja2: the toolkit step once stopped there), then runs the steps against WORK (the stage
archive's chunks, made by the test).

TEST DOUBLES for the machine itself, which cannot exist here: the subprocess layer (nvidia-smi,
ldconfig, the venv's python and pip, runuser, chown, the engine and the prebuild, which exit at
once; the prebuild leaves one FlashInfer module, which the engine rebuilds in place), the
service user (this process's ids, its home under WORK), and its paths (/opt/uncloseai and
/usr/local/cuda-13.3 are moved under WORK). Everything else is the harness's own code.
"""

from __future__ import annotations

import os
import pwd
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the image has beside the standard library that the harness may import (psutil: the
# engine's memory monitor; the image's python has it).
IMAGE = {"psutil"}
OURS = {"gpu", "tests", "donorkit"}


class NotInTheImage:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top in OURS:
            return None
        if top in IMAGE:
            return None
        raise ModuleNotFoundError(f"No module named {name!r} in the GPU image (blocked)",
                                  name=name)


sys.meta_path.insert(0, NotInTheImage())
sys.path.insert(0, str(REPO))


class Done:
    def __init__(self, stdout: str = "", returncode: int = 0) -> None:
        self.stdout, self.stderr, self.returncode = stdout, "", returncode


class Exited:
    """A process that has run: the prebuild (exit 0), an engine (exit 1 at once)."""

    def __init__(self, returncode: int, stdout: str) -> None:
        self.pid, self.returncode, self.stdout = 2**22 - 1, returncode, stdout

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def communicate(self, timeout=None):
        return self.stdout, ""


class Machine:
    """TEST DOUBLE of the GPU machine's processes: canned answers, every call recorded."""

    def __init__(self, work: Path) -> None:
        self.work, self.calls = work, []

    def run(self, cmd, **kw):
        words = [str(c) for c in cmd]
        self.calls.append(words)
        if words[0] == "nvidia-smi":
            return Done("1024" if "memory.used" in words[1] else "NVIDIA H200, 9.0, 580.159.04")
        if words[0] == "ldconfig":
            return Done("libcuda.so.1 (libc6,x86-64) => /usr/lib/libcuda.so.1")
        if words[:2] == ["python3", "-c"]:
            return Done(str(self.work / "image-site"))
        if words[:3] == ["python3", "-m", "venv"]:
            Path(words[-1], "bin").mkdir(parents=True, exist_ok=True)
            Path(words[-1], "bin/python").write_text("")
            return Done()
        if words[0].endswith("/bin/python") and words[1] == "-c" and "sysconfig" in words[2]:
            site = self.work / "venv-site"
            site.mkdir(exist_ok=True)
            return Done(str(site))
        if words[0].endswith("/bin/python") and words[1].endswith("/carried_set.py"):
            return Done("[]")
        if words[0].endswith("/bin/nvcc"):
            return Done("Cuda compilation tools, release 13.3")
        if words[0] == "runuser":
            return Done("True")
        return Done()

    def popen(self, cmd, **kw):
        words = [str(c) for c in cmd]
        self.calls.append(words)
        # One FlashInfer module: the prebuild builds it; the engine, started after it, rebuilds
        # it in place (what the H200 showed on 2026-12-03), which the daemon must report.
        module = self.work / "home/.cache/flashinfer/0.6.14/90a/cached_ops/sampling/sampling.so"
        if words[1].endswith("/bin/prebuild_kernels.py"):
            module.parent.mkdir(parents=True, exist_ok=True)
            module.write_bytes(b"built by the prebuild")
            os.utime(module, ns=(10**18, 10**18))
            return Exited(0, '{"jobs": 1, "modules": {"sampling": "built"}}')
        if "serve" in words and module.exists() and module.read_bytes().endswith(b"prebuild"):
            module.write_bytes(b"built again by the engine")  # once: its state is there then
        return Exited(1, '{"jobs": 1}')


def main(work: Path) -> None:
    from gpu import engine_box, engine_checks, engine_run

    machine = Machine(work)
    fake = types.SimpleNamespace(run=machine.run, Popen=machine.popen, PIPE=-1, STDOUT=-2,
                                 DEVNULL=-3, TimeoutExpired=TimeoutError)
    for module in (engine_run, engine_box, engine_checks):
        module.subprocess = fake
    me = pwd.getpwuid(os.getuid())
    # The service user: this process's own ids, but a home under WORK. The daemon empties the
    # home's JIT caches (everything in ~/.cache but huggingface): with this process's own home
    # each `make test` emptied the developer's ~/.cache (pip's, uv's) until 2026-12-03.
    home = work / "home"
    home.mkdir(exist_ok=True)
    user = types.SimpleNamespace(pw_name=me.pw_name, pw_uid=me.pw_uid, pw_gid=me.pw_gid,
                                 pw_dir=str(home), pw_shell=me.pw_shell)
    engine_run.pwd = engine_box.pwd = types.SimpleNamespace(getpwnam=lambda name: user)
    engine_run.os = types.SimpleNamespace(**{**vars(os), "killpg": lambda *a: None,
                                             "getgrouplist": lambda *a: [me.pw_gid]})
    engine_run.time = types.SimpleNamespace(monotonic=engine_run.time.monotonic,
                                            strftime=engine_run.time.strftime,
                                            sleep=lambda s: None)
    root = work / "engine"
    engine_box.ROOT, engine_box.STAGE = root, root / "stage"
    engine_box.CACHE_COPY = root / "qwen-caches.tar"
    engine_run.ROOT, engine_run.STAGE = root, root / "stage"
    engine_run.CHUNKS, engine_run.RESULTS = root / "chunks", root / "results"
    engine_run.REPO, engine_run.PROGRESS = root / "repo", root / "results/progress.log"
    engine_run.CARRY = work / "carry"
    moved = {"/opt/uncloseai": str(work / "opt"), "/usr/local/cuda-13.3": str(work / "cuda")}
    read_unit = engine_run.read_unit

    def read_moved(path):
        user, env, argv = read_unit(path)
        swap = lambda text: [text := text.replace(a, b) for a, b in moved.items()][-1]  # noqa
        return user, {k: swap(v) for k, v in env.items()}, [swap(w) for w in argv]
    engine_run.read_unit = read_moved

    engine_run.receive()
    launched = []
    engine_run.subprocess = types.SimpleNamespace(
        **{**vars(fake), "Popen": lambda cmd, **kw: launched.append(cmd)})
    engine_run.launch(engine_run.DEFAULT_RUNS)
    assert launched and launched[0][1:4] == ["-m", "gpu.engine_run", "daemon"], launched
    engine_run.subprocess = fake
    engine_run.daemon(engine_run.DEFAULT_RUNS)
    os.environ["OUT"] = str(work / "out")
    engine_run.follow(1)
    engine_run.table(engine_run.RESULTS)
    print("STEPS DONE", flush=True)
    for call in machine.calls:
        print("CALL", " ".join(call)[:300])


if __name__ == "__main__":
    if sys.argv[1] == "--import":  # one module, under the same blocker
        __import__(sys.argv[2])
        print("imported", sys.argv[2])
    else:
        main(Path(sys.argv[1]))
