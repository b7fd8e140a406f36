"""Optional build of the fused CUDA kernels at install time; all metadata lives in pyproject.toml.

    ASTRAI_BUILD_CUDA=1 pip install --no-build-isolation -e .

compiles cuda/ into astrai_pl._kernels (needs torch with CUDA, nvcc and ninja in the environment, hence no
build isolation). Without the variable nothing is compiled and astrai_pl.ops builds the kernels just in
time on first use on a GPU machine.
"""

import os
from pathlib import Path

from setuptools import setup


def cuda_extension() -> dict:
    if os.environ.get("ASTRAI_BUILD_CUDA") != "1":
        return {}
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    cuda = Path("cuda")
    sources = [str(cuda / "bindings.cpp"), *sorted(str(p) for p in cuda.glob("*.cu"))]
    flags = {"cxx": ["-O3", "-std=c++17"], "nvcc": ["-O3", "-std=c++17"]}
    extension = CUDAExtension(
        "astrai_pl._kernels", sources, include_dirs=[str(cuda.resolve())], extra_compile_args=flags
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildExtension}}


setup(**cuda_extension())
