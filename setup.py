"""Build of ragattn's C++/CUDA extension ``ragattn._C``.

CPU-only torch (or no nvcc): a ``CppExtension`` with the CPU twins of every C++ op.
CUDA torch with nvcc: a ``CUDAExtension`` for sm_90a that adds the CUDA kernels.

File roles under ``csrc/`` (see docs/design notes in README):
  *_kernels.cu   framework-free CUDA kernels + raw-pointer launchers (no torch headers;
                 CI compile-checks them with nvcc alone)
  *_cuda.cu      ATen launchers that validate tensors and call the raw-pointer launchers
  *.cpp          CPU twins and the single torch_bindings.cpp
"""
import glob
import os

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _with_cuda():
    if os.environ.get("RAGATTN_FORCE_CPU", "0") == "1":
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def _extension():
    cpp = _sources("csrc/**/*.cpp")
    cxx_flags = ["-O3", "-std=c++17"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if _with_cuda():
        cu = _sources("csrc/**/*.cu")
        arch = os.environ.get("RAGATTN_CUDA_ARCH", "-gencode=arch=compute_90a,code=sm_90a").split()
        return cpp_extension.CUDAExtension(
            "ragattn._C",
            cpp + cu,
            include_dirs=include_dirs,
            define_macros=[("RAGATTN_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-lineinfo", *arch],
            },
        )
    return cpp_extension.CppExtension(
        "ragattn._C", cpp, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags}
    )


setup(
    name="ragattn",
    version="0.1.0",
    description="Attention and KV-cache operators for retrieval-augmented generation inference",
    # triton_kernels/ and bench/ live at the top of the repository (the layout of design.md) but
    # install inside the package: a top-level ``triton_kernels`` would shadow OpenAI's, which
    # vLLM and SGLang import.
    packages=find_packages(include=["ragattn", "ragattn.*"]) + ["ragattn.triton_kernels", "ragattn.bench"],
    package_dir={"ragattn.triton_kernels": "triton_kernels", "ragattn.bench": "bench"},
    package_data={"ragattn": ["data/*.json", "data/**/*"]},
    python_requires=">=3.10",
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
