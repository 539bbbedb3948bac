"""The exllamav3 wheel cache: checksums at both ends, entries created whole or not at all, the
stack key, the box fact (in a real shell), and the build script's all-or-nothing behaviour."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import Config, FactBase, Inventory, State
from pyinfra.api.host import Host

from donorkit.box import box_operations, wheel_cache
from donorkit.box.box_facts import CudaStack
from donorkit.box.wheel_cache import Exllamav3Stack, WheelCacheError
from donorkit.inventory.paths import REPO_ROOT
from tests.support import wheels
from tests.support.wheels import DIST_INFO, good_files, make_wheel

WHEEL = "exllamav3-1.5.1-cp312-cp312-linux_x86_64.whl"
# The inventory's cache builders in these tests, and a content check that passes anything: the
# entry mechanics below do not depend on the content (check_wheel has its own tests).
BUILDERS = ("box-a", "box-b", "box-c", "box-d", "box-0", "box-1", "box-2", "box-3")


def NO_CHECK(path: Path, name: str) -> None:
    return None


def commit(host: Host, entry: Path, key: str, check=NO_CHECK) -> bool:
    """What copy_wheel_back's last step does for `host` (a cache builder here)."""
    return wheel_cache.commit_entry(None, host, str(entry), WHEEL, key, BUILDERS, check)
BOX = {"python": "3.12", "abi": "cp312", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
       "nvcc": "13.0", "distro": "ubuntu2404", "machine": "x86_64", "installed": None}


def put_entry(entry: Path, data: bytes, sidecar_data: bytes | None = None,
              built_by: str | None = "box-a") -> Path:
    entry.mkdir(parents=True, exist_ok=True)
    if built_by:
        (entry / "built-by").write_text(built_by + "\n")
    (entry / WHEEL).write_bytes(data)
    digest = hashlib.sha256(data if sidecar_data is None else sidecar_data).hexdigest()
    (entry / f"{WHEEL}.sha256").write_text(f"{digest}  {WHEEL}\n")
    return entry / WHEEL


def test_verified_wheel_is_returned_with_its_digest(tmp_path: Path) -> None:
    path = put_entry(tmp_path / "e", b"wheel")
    assert wheel_cache.cached_wheel(tmp_path / "e", WHEEL) == (
        path, hashlib.sha256(b"wheel").hexdigest())


def test_absent_or_incomplete_entry_is_a_miss(tmp_path: Path) -> None:
    assert wheel_cache.cached_wheel(tmp_path / "none", WHEEL) is None
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / WHEEL).write_bytes(b"no sidecar yet")
    assert wheel_cache.cached_wheel(tmp_path / "e", WHEEL) is None


def test_corrupt_cached_wheel_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = put_entry(tmp_path / "e", b"wheel, then a flipped bit", sidecar_data=b"wheel")
    with pytest.raises(WheelCacheError, match=f"cached {path} is corrupt"):
        wheel_cache.cached_wheel(tmp_path / "e", WHEEL)


def test_sidecar_for_another_file_is_refused(tmp_path: Path) -> None:
    put_entry(tmp_path / "e", b"wheel")
    (tmp_path / "e" / f"{WHEEL}.sha256").write_text(f"{'0' * 64}  other.whl\n")
    with pytest.raises(WheelCacheError, match="not a sha256sum line for"):
        wheel_cache.cached_wheel(tmp_path / "e", WHEEL)


def download(entry: Path, data: bytes, sidecar_data: bytes | None = None,
             box: str = "box-a") -> None:
    """What copy_wheel_back's downloads leave for `box`, under that box's temporary names."""
    entry.mkdir(parents=True, exist_ok=True)
    tmp_wheel, tmp_sidecar = wheel_cache.download_names(WHEEL, box)
    (entry / tmp_wheel).write_bytes(data)
    digest = hashlib.sha256(data if sidecar_data is None else sidecar_data).hexdigest()
    (entry / tmp_sidecar).write_text(f"{digest}  {WHEEL}\n")


@pytest.fixture
def boxes() -> dict[str, Host]:
    """Real pyinfra hosts (with a State, as in a run), for the FunctionCommands' `host`."""
    inventory = Inventory((["box-a", "box-b", "box-c", "box-d"], {}))
    State(inventory, Config())
    return {name: inventory.get_host(name) for name in ("box-a", "box-b", "box-c", "box-d")}


def test_verified_download_becomes_an_entry(tmp_path: Path, boxes: dict[str, Host]) -> None:
    entry = tmp_path / "exllamav3" / "id"
    download(entry, b"built wheel")
    assert commit(boxes["box-a"], entry, "the key") is True
    assert wheel_cache.cached_wheel(entry, WHEEL)[0].read_bytes() == b"built wheel"
    assert (entry / "stack.txt").read_text() == "the key\n"
    assert sorted(p.name for p in entry.iterdir()) == \
        ["built-by", WHEEL, f"{WHEEL}.sha256", "stack.txt"]


def test_each_box_downloads_under_its_own_names() -> None:
    names = {box: wheel_cache.download_names(WHEEL, box) for box in ("box-a", "box-b")}
    assert len({n for pair in names.values() for n in pair}) == 4
    assert all(n.startswith(f".{WHEEL}.") and n.endswith(".download")
               for pair in names.values() for n in pair)


def test_partial_download_fails_that_box_with_one_line(
        tmp_path: Path, boxes: dict[str, Host], caplog: pytest.LogCaptureFixture) -> None:
    """A bad download is this host's failure (False: pyinfra fails the operation on that host
    only), said in one line, no exception; another box's downloads in the same entry are not
    touched and still commit."""
    entry = tmp_path / "exllamav3" / "id"
    download(entry, b"built wh", sidecar_data=b"built wheel", box="box-a")
    download(entry, b"box b's wheel", box="box-b")
    assert commit(boxes["box-a"], entry, "k") is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert "box-a" in errors[0] and f"downloaded {WHEEL} has sha256" in errors[0]
    assert errors[0].endswith(": not cached")
    assert not any(r.exc_info for r in caplog.records)
    assert wheel_cache.cached_wheel(entry, WHEEL) is None  # nothing entered the cache
    assert commit(boxes["box-b"], entry, "k") is True
    assert (entry / WHEEL).read_bytes() == b"box b's wheel"
    assert sorted(p.name for p in entry.iterdir()) == \
        ["built-by", WHEEL, f"{WHEEL}.sha256", "stack.txt"]


def test_a_missing_download_fails_that_box_with_one_line(
        tmp_path: Path, boxes: dict[str, Host], caplog: pytest.LogCaptureFixture) -> None:
    """What the shared temporary name used to cause (another box had moved the file away):
    now an OSError is one line for this host, not a traceback."""
    entry = tmp_path / "exllamav3" / "id"
    entry.mkdir(parents=True)
    assert commit(boxes["box-c"], entry, "k") is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "No such file or directory" in errors[0], errors


def test_an_entry_directory_that_cannot_be_made_fails_that_box(
        tmp_path: Path, boxes: dict[str, Host], caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_text("not a directory")
    assert wheel_cache.prepare_entry(None, boxes["box-a"], str(tmp_path / "file/id")) is False
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"][0].endswith(
        f"cannot create {tmp_path / 'file/id'}: Not a directory")
    assert wheel_cache.prepare_entry(None, boxes["box-a"], str(tmp_path / "ok/id")) is True


def test_second_build_of_a_stack_keeps_the_first_entry(tmp_path: Path,
                                                       boxes: dict[str, Host]) -> None:
    entry = tmp_path / "exllamav3" / "id"
    put_entry(entry, b"first box's wheel")
    download(entry, b"second box's wheel", box="box-b")
    assert commit(boxes["box-b"], entry, "k") is True
    assert (entry / WHEEL).read_bytes() == b"first box's wheel"
    assert sorted(p.name for p in entry.iterdir()) == ["built-by", WHEEL, f"{WHEEL}.sha256"]


def _commit_in_a_process(entry: str, box: str) -> bool:
    return wheel_cache.commit_download(entry, WHEEL, "k", box, BUILDERS, NO_CHECK)


def test_boxes_committing_at_once_leave_one_whole_entry(tmp_path: Path) -> None:
    """Four boxes of one stack, each with its own (different, all valid) wheel, commit from
    separate processes at once: exactly one becomes the entry, whole (its sidecar matches it),
    and no temporary file is left."""
    entry = tmp_path / "exllamav3" / "id"
    wheels = {f"box-{i}": os.urandom(4 << 20) for i in range(4)}
    for box, data in wheels.items():
        download(entry, data, box=box)
    with multiprocessing.get_context("fork").Pool(4) as pool:
        won = pool.starmap(_commit_in_a_process, [(str(entry), box) for box in wheels])
    assert won.count(True) == 1
    path, _ = wheel_cache.cached_wheel(entry, WHEEL)
    assert path.read_bytes() == wheels[list(wheels)[won.index(True)]]
    assert sorted(p.name for p in entry.iterdir()) == \
        ["built-by", WHEEL, f"{WHEEL}.sha256", "stack.txt"]


def test_every_part_of_the_stack_changes_the_key() -> None:
    base = wheel_cache.stack_key("1.5.1", "v1.5.1", "none", "8.9", BOX)
    variants = [wheel_cache.stack_key("1.5.2", "v1.5.1", "none", "8.9", BOX),
                wheel_cache.stack_key("1.5.1", "abc123", "none", "8.9", BOX),
                wheel_cache.stack_key("1.5.1", "v1.5.1", "3a35ae3c7327", "8.9", BOX),
                wheel_cache.stack_key("1.5.1", "v1.5.1", "none", "8.6", BOX)]
    for field, value in [("abi", "cp311"), ("torch", "2.11.0+cu128"), ("torch_cuda", "12.8"),
                         ("nvcc", "13.3"), ("distro", "debian12"), ("machine", "aarch64")]:
        variants.append(wheel_cache.stack_key("1.5.1", "v1.5.1", "none", "8.9",
                                              dict(BOX, **{field: value})))
    ids = {wheel_cache.stack_id(key) for key in [base, *variants]}
    assert len(ids) == len(variants) + 1


def test_patch_comment_is_not_part_of_the_key(tmp_path: Path) -> None:
    one, two = tmp_path / "one.patch", tmp_path / "two.patch"
    one.write_text("why: one reason\n\ndiff --git a/x b/x\n+y\n")
    two.write_text("why: better words\n\ndiff --git a/x b/x\n+y\n")
    assert wheel_cache.patches_digest([str(one)]) == wheel_cache.patches_digest([str(two)])
    assert wheel_cache.patches_digest([]) == "none"


def test_stack_fact_reads_the_box_in_a_real_shell(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run([str(venv / "bin/python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    fake = Path(site) / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('the fact must not import torch')\n")
    (fake / "version.py").write_text("__version__ = '2.11.0+cu130'\n"
                                     "cuda: Optional[str] = '13.0'\n")
    cuda = tmp_path / "cuda-13.0" / "bin"
    cuda.mkdir(parents=True)
    (cuda / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (cuda / "nvcc").chmod(0o755)
    stamp = tmp_path / "exllamav3.stack"
    stamp.write_text("the installed key\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def read(fact: FactBase, **kwargs: str) -> dict:
        output = subprocess.run(["sh", "-c", fact.command(**kwargs)], check=True,
                                capture_output=True, text=True, env=env).stdout
        return fact.process(output.splitlines())

    box_dir = tmp_path / "wheels"
    for stack, name in (("s1", "w.whl"), ("s2", "partial.whl")):
        (box_dir / stack).mkdir(parents=True)
        (box_dir / stack / name).write_text("wheel")
    (box_dir / "s1/w.whl.sha256").write_text("sidecar")  # s2's has none: not a verified wheel
    # As the exllamav3 steps read the box: nvcc and torch's CUDA come from CudaStack.
    facts = {**read(Exllamav3Stack(), venv_dir=str(venv), stamp=str(stamp),
                    box_dir=str(box_dir)),
             **read(CudaStack(), cuda_home=str(cuda.parent), venv_dir=str(venv))}
    assert facts["abi"] == f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert (facts["torch"], facts["torch_cuda"], facts["nvcc"]) == ("2.11.0+cu130", "13.0", "13.0")
    assert facts["machine"] == os.uname().machine
    assert facts["installed"] == "the installed key"
    assert facts["wheels"] == ["s1/w.whl"]


def test_stack_fact_on_a_box_without_venv(tmp_path: Path) -> None:
    fact = Exllamav3Stack()
    command = fact.command(venv_dir=str(tmp_path / "no-venv"), stamp=str(tmp_path / "no-stamp"),
                           box_dir=str(tmp_path / "no-wheels"))
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True,
                            check=True).stdout  # status 0: an answer, not a failed fact
    facts = fact.process(output.splitlines())
    assert [facts[k] for k in ("abi", "torch", "installed")] == [None] * 3
    assert facts["wheels"] == []


def build_env(tmp_path: Path, pip_body: str) -> dict:
    """A source repo tagged v1.5.1, a fake venv whose pip runs `pip_body`, and the script's env."""
    src = tmp_path / "upstream"
    src.mkdir()
    (src / "setup.py").write_text("# stand-in\n")
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "s"], ["tag", "v1.5.1"]):
        subprocess.run([*git, *args], check=True)
    (tmp_path / "venv/bin").mkdir(parents=True)
    pip = tmp_path / "venv/bin/pip"
    pip.write_text(f"#!/bin/sh\n{pip_body}\n")
    pip.chmod(0o755)
    return dict(os.environ, GIT_URL=str(src), REF="v1.5.1", SRC=str(tmp_path / "box/src"),
                VENV=str(tmp_path / "venv"), CUDA_HOME=str(tmp_path / "cuda"), ARCH="8.9",
                GIB_PER_JOB="1.5", OUT_DIR=str(tmp_path / "box/wheels/id"), WHEEL=WHEEL,
                PATCHES="")


SCRIPT = str(REPO_ROOT / "files/build_exllamav3.sh")
# The fake pip: `pip wheel ... --wheel-dir DIR .` writes a wheel into DIR (counting its runs).
FAKE_BUILD = ('while [ "$1" != "--wheel-dir" ]; do shift; done; echo x >> "$(dirname "$0")/runs"; '
              f'echo wheel > "$2/{WHEEL}"')


def test_build_leaves_a_verified_wheel_and_is_not_repeated(tmp_path: Path) -> None:
    env = build_env(tmp_path, FAKE_BUILD)
    subprocess.run(["sh", SCRIPT], env=env, check=True, capture_output=True)
    out = Path(env["OUT_DIR"])
    assert wheel_cache.cached_wheel(out, WHEEL) is not None
    again = subprocess.run(["sh", SCRIPT], env=env, check=True, capture_output=True, text=True)
    assert "already built" in again.stdout
    assert (tmp_path / "venv/bin/runs").read_text().count("x") == 1


def test_failed_build_leaves_nothing_and_the_next_run_retries(tmp_path: Path) -> None:
    env = build_env(tmp_path, "echo 'nvcc died' >&2; exit 1")
    failed = subprocess.run(["sh", SCRIPT], env=env, capture_output=True)
    assert failed.returncode != 0
    assert list(Path(env["OUT_DIR"]).iterdir()) == []
    (tmp_path / "venv/bin/pip").write_text(f"#!/bin/sh\n{FAKE_BUILD}\n")
    subprocess.run(["sh", SCRIPT], env=env, check=True, capture_output=True)
    assert wheel_cache.cached_wheel(Path(env["OUT_DIR"]), WHEEL) is not None


def test_the_cxx20_patch_is_a_git_diff_with_its_reason() -> None:
    text = (REPO_ROOT / "files/exllamav3-cxx20.patch").read_text()
    reason, diff = text.split("diff --git", 1)
    assert "PR #360" in reason and "C++17" in reason
    assert '+    "-std=c++20",' in diff and "a/setup.py" in diff


# Issue 32: a wheel copied back runs as root on every box of its stack. Only a cache builder's
# enters the cache; it holds exllamav3 and nothing else (checked here before it is stored, with
# one line naming the file); pip on the box installs just that file and refuses a .pth.

def put_download(entry: Path, wheel: Path, box: str) -> None:
    data = wheel.read_bytes()
    entry.mkdir(parents=True, exist_ok=True)
    tmp_wheel, tmp_sidecar = wheel_cache.download_names(WHEEL, box)
    (entry / tmp_wheel).write_bytes(data)
    (entry / tmp_sidecar).write_text(f"{hashlib.sha256(data).hexdigest()}  {WHEEL}\n")


HOSTILE_WHEELS = {
    # name: (files, RECORD's view of them or None, modes or None, the refusal)
    "a .pth beside the package": (
        {**good_files(), "exllamav3-init.pth": b"import os; os.system('id > /tmp/owned')\n"},
        None, None, "exllamav3-init.pth: a .pth file"),
    "a .pth inside the package": (
        {**good_files(), "exllamav3/x.pth": b"import os\n"}, None, None, "a .pth file"),
    "a module outside the package": (
        {**good_files(), "sitecustomize.py": b"import os\n"}, None, None,
        "sitecustomize.py: outside the exllamav3 package"),
    "a script in the wheel's data": (
        {**good_files(), "exllamav3-1.5.1.data/scripts/ninja": b"#!/bin/sh\nid\n"}, None, None,
        "outside the exllamav3 package"),
    "entry points": (
        {**good_files(), f"{DIST_INFO}/entry_points.txt": b"[console_scripts]\nnvcc = x:y\n"},
        None, None, "entry_points.txt: entry points"),
    "a RECORD that does not match": (
        good_files(), {**good_files(), "exllamav3/__init__.py": b"what was built"}, None,
        "exllamav3/__init__.py does not match its RECORD hash"),
    "a file RECORD does not list": (
        {**good_files(), "exllamav3/extra.py": b"x = 1\n"}, good_files(), None,
        "RECORD does not list exactly its files (exllamav3/extra.py)"),
    "a path out of the venv": (
        {**good_files(), "exllamav3/../../../../etc/cron.d/x": b"* * * * * root id\n"}, None,
        None, "not a plain relative path"),
    "a name that clears the terminal": (
        {**good_files(), "\x1b[2J\x1b]0;owned\x07": b""}, None, None,
        "'\\x1b[2J\\x1b]0;owned\\x07': outside the exllamav3 package"),
    "a setuid file": (
        good_files(), None, {"exllamav3/__init__.py": 0o104755}, "setuid/setgid/sticky"),
    "a symbolic link": (
        good_files(), None, {"exllamav3/__init__.py": 0o120777}, "a link"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_WHEELS))
def test_a_hostile_wheel_is_refused_before_it_is_stored(
        case: str, tmp_path: Path, boxes: dict[str, Host],
        caplog: pytest.LogCaptureFixture) -> None:
    files, record, modes, refusal = HOSTILE_WHEELS[case]
    wheel = make_wheel(tmp_path / WHEEL, files, record, modes)
    with pytest.raises(WheelCacheError, match=re.escape(refusal)):
        wheel_cache.check_wheel(wheel, "1.5.1")
    entry = tmp_path / "cache/exllamav3/id"
    put_download(entry, wheel, "box-a")
    assert commit(boxes["box-a"], entry, "k", check=wheel_cache.WheelCheck("1.5.1")) is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "\n" not in errors[0] and refusal in errors[0], errors
    assert errors[0].endswith(": refused: not cached") and WHEEL in errors[0]
    assert not any(r.exc_info for r in caplog.records)
    assert list(entry.iterdir()) == []  # nothing stored, the downloads removed


def test_a_good_wheel_is_stored_with_its_builder(tmp_path: Path,
                                                 boxes: dict[str, Host]) -> None:
    wheel = make_wheel(tmp_path / WHEEL, good_files())
    wheel_cache.check_wheel(wheel, "1.5.1")
    entry = tmp_path / "cache/exllamav3/id"
    put_download(entry, wheel, "box-b")
    assert commit(boxes["box-b"], entry, "k", check=wheel_cache.WheelCheck("1.5.1")) is True
    assert (entry / "built-by").read_text() == "box-b\n"
    assert wheel_cache.cached_wheel(entry, WHEEL)[0].read_bytes() == wheel.read_bytes()
    assert wheel_cache.trusted_entry(entry, WHEEL, ["box-b"])
    assert not wheel_cache.trusted_entry(entry, WHEEL, ["box-a"])  # no longer a builder


def test_a_wheel_from_a_box_that_is_not_a_builder_is_not_stored(
        tmp_path: Path, boxes: dict[str, Host], caplog: pytest.LogCaptureFixture) -> None:
    """Whatever reaches commit from a box that is not a cache builder (copy_wheel_back does not
    even download it: tests/unit/operations/exllamav3/not_a_builder.json)."""
    entry = tmp_path / "cache/exllamav3/id"
    put_download(entry, make_wheel(tmp_path / WHEEL, good_files()), "box-z")
    box_z = Inventory((["box-z"], {}))
    State(box_z, Config())
    assert wheel_cache.commit_entry(None, box_z.get_host("box-z"), str(entry), WHEEL, "k",
                                    BUILDERS, wheel_cache.WheelCheck("1.5.1")) is False
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "box-z is not a cache builder" in errors[0], errors
    assert list(entry.iterdir()) == []


def test_an_entry_of_an_older_run_or_a_former_builder_is_replaced_by_a_builders(
        tmp_path: Path, boxes: dict[str, Host]) -> None:
    entry = tmp_path / "cache/exllamav3/id"
    put_entry(entry, b"from before cache builders", built_by=None)
    assert "no record of the box that built it" in wheel_cache.distrusted(entry, BUILDERS)
    put_download(entry, make_wheel(tmp_path / WHEEL, good_files()), "box-c")
    assert commit(boxes["box-c"], entry, "k", check=wheel_cache.WheelCheck("1.5.1")) is True
    assert wheel_cache.distrusted(entry, BUILDERS) is None
    assert (entry / WHEEL).read_bytes() == (tmp_path / WHEEL).read_bytes()
    assert wheel_cache.distrusted(entry, ["box-a"]) == (
        "was built by 'box-c', which is not a cache builder (cache_builder: true)")


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real venv (this machine's Python, its bundled pip): the box's venv for pip."""
    path = tmp_path_factory.mktemp("box") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    return path


def test_pip_on_the_box_installs_the_wheel_and_refuses_a_pth(venv: Path,
                                                             tmp_path: Path) -> None:
    """The install step's pip command (box_operations.pip_install_wheel) with the real pip: a
    good wheel is laid out; a wheel carrying a .pth (had one got past the cache's check) is
    refused, in one line, after pip installed it."""
    site = next(venv.glob("lib/python3*/site-packages"))
    # Named for this machine's Python, as the box's is for its own (pip checks the name's tags).
    here = wheel_cache.wheel_name("1.5.1", f"cp{sys.version_info.major}{sys.version_info.minor}",
                                  os.uname().machine)
    command = box_operations.pip_install_wheel(str(venv), "1.5.1", here)
    make_wheel(tmp_path / here, good_files())
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (site / "exllamav3/__init__.py").is_file() and (site / wheels.EXT).is_file()
    assert [p.name for p in site.glob("*.pth") if p.name != "distutils-precedence.pth"] == []
    make_wheel(tmp_path / here, {**good_files(), "exllamav3-init.pth": b"import os\n"})
    done = subprocess.run(["sh", "-c", command], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr.strip() == f"{here} installed a .pth file: refused"
