"""Does exllamav3 1.5.1 need the C++20 patch with this box's nvcc? Compile one real extension
source (softcap.cu: it includes ATen's CUDA headers, as every .cu of the extension does) with the
flags torch's extension builder and 1.5.1's setup.py give nvcc, once in torch's default C++17 mode
(1.5.1 as released) and once with -std=c++20 (files/exllamav3-cxx20.patch), in parallel.

Usage: python3 gpu/cxx_probe.py SOURCE_TREE CUDA_HOME ARCH     (prints one JSON line per mode)
"""

import json
import subprocess
import sys
import sysconfig
import time

import torch
from torch.utils import cpp_extension


def main() -> None:
    tree, cuda_home, arch = sys.argv[1:4]
    ext = f"{tree}/exllamav3/exllamav3_ext"
    try:
        includes = cpp_extension.include_paths(device_type="cuda")
    except TypeError:
        includes = cpp_extension.include_paths(cuda=True)
    sm = arch.replace(".", "")
    base = [f"{cuda_home}/bin/nvcc", "-c", f"{ext}/softcap.cu",
            *(f"-I{path}" for path in [ext, *includes, sysconfig.get_paths()["include"]]),
            "-DTORCH_EXTENSION_NAME=exllamav3_ext", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *cpp_extension.COMMON_NVCC_FLAGS, f"-gencode=arch=compute_{sm},code=sm_{sm}",
            "-Xcompiler", "-fPIC", "-lineinfo", "-O3", "--use_fast_math",
            "-Xcudafe", "--diag_suppress=177", "-Xcudafe", "--diag_suppress=20012"]
    runs = {}
    for std in ("c++17", "c++20"):
        command = [*base, f"-std={std}", "-o", f"/tmp/cxx-probe-{std}.o"]
        runs[std] = (time.monotonic(), subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for std, (start, proc) in runs.items():
        output = proc.communicate()[0]
        errors = [line for line in output.splitlines() if "error" in line][:3]
        print(json.dumps({"std": std, "rc": proc.returncode,
                          "seconds": round(time.monotonic() - start, 1), "errors": errors}))


if __name__ == "__main__":
    main()
