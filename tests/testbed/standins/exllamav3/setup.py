"""STAND-IN for exllamav3 1.5.1 (testbed only): same name, version and extension module name.

Like the real one, `pip wheel --no-build-isolation .` in a venv with torch compiles a CUDA
extension (exllamav3_ext) through torch's CUDAExtension with the venv's torch and CUDA_HOME's nvcc,
for the architectures in TORCH_CUDA_ARCH_LIST (and MAX_JOBS parallel jobs). One tiny kernel only.
"""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(
    name="exllamav3",
    version="1.5.1",
    packages=["exllamav3"],
    ext_modules=[
        CUDAExtension(
            "exllamav3_ext",
            ["exllamav3_ext/bindings.cpp", "exllamav3_ext/add_one.cu"],
            extra_compile_args={"cxx": ["-O2"], "nvcc": ["-O2", "-lineinfo"]},
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
