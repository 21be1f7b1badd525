"""Build of ragattn's C++/CUDA extension ``ragattn._C`` (the metadata lives in pyproject.toml).

CPU-only torch: a ``CppExtension`` with the CPU twins of every C++ op.
CUDA torch: a ``CUDAExtension`` that adds the CUDA kernels, for the architectures in
``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0a``: A100 and H100). CUDA torch without a CUDA toolkit
(no nvcc: PyPI's default Linux torch on a stock machine) builds the CPU twins only, with a warning:
the three CUDA C++ ops (rerotate_keys_, copy_kv_, verify_draft) then run their torch reference on
CUDA tensors (ragattn/ops/_cuda_fallback.py), the Triton ops are unaffected. ``RAGATTN_FORCE_CPU=1``
asks for the CPU-only build; ``RAGATTN_REQUIRE_CUDA=1`` makes a missing toolkit an error (GPU images).

File roles under ``csrc/``:
  *_kernels.cu   framework-free CUDA kernels + raw-pointer launchers (no torch headers;
                 CI compile-checks them with nvcc alone)
  *_cuda.cu      ATen launchers that validate tensors and call the raw-pointer launchers
  *.cpp          CPU twins and the single torch_bindings.cpp
"""
import glob
import os
import subprocess
import sys
import tempfile

import torch
from setuptools import find_namespace_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CUDA_ARCHS = "8.0;9.0a"


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def build_kind(torch_cuda, cuda_home, env):
    """``("cuda" | "cpu", warning or None)``: which extension to build for a torch whose
    ``torch.version.cuda`` is ``torch_cuda``, a CUDA toolkit at ``cuda_home`` (None: no nvcc), and
    the environment ``env``. Raises SystemExit where ``RAGATTN_REQUIRE_CUDA=1`` cannot be met."""
    if env.get("RAGATTN_FORCE_CPU", "0") == "1":
        return "cpu", None
    if torch_cuda is None:
        if env.get("RAGATTN_REQUIRE_CUDA", "0") == "1":
            raise SystemExit("ragattn: RAGATTN_REQUIRE_CUDA=1 but this torch has no CUDA")
        return "cpu", None
    if cuda_home is None:
        if env.get("RAGATTN_REQUIRE_CUDA", "0") == "1":
            raise SystemExit(
                f"ragattn: RAGATTN_REQUIRE_CUDA=1 but no CUDA toolkit (nvcc) was found for torch's CUDA "
                f"{torch_cuda}: install the toolkit or set CUDA_HOME")
        return "cpu", (
            f"ragattn: torch has CUDA {torch_cuda} but no CUDA toolkit (nvcc) was found: building the CPU "
            "kernels only. On CUDA tensors rerotate_keys_, copy_kv_ and verify_draft will run their "
            "plain-torch reference (with a warning); the Triton ops are unaffected. Install the CUDA "
            "toolkit (or set CUDA_HOME) and rebuild for the CUDA kernels.")
    return "cuda", None


def _with_cuda():
    kind, warning = build_kind(torch.version.cuda, cpp_extension.CUDA_HOME, os.environ)
    if warning:
        print(warning, file=sys.stderr)
    return kind == "cuda"


def _openmp_flags():
    """``-fopenmp`` (compile and link) where it joins the OpenMP runtime torch already runs, else [].

    ATen's ``at::parallel_for`` is an inline OpenMP region: without ``-fopenmp`` every C++ CPU
    kernel runs on one thread. The flag is only safe when it links the same runtime: GCC links
    ``libgomp.so.1``, the SONAME of the ``libgomp`` torch ships and loads first, so the loader
    reuses torch's (tests/tooling/test_cpu_threads.py checks one runtime in the process). Elsewhere
    (clang/macOS with LLVM's libomp, a torch on another runtime, ``RAGATTN_OPENMP=0``) the build
    stays serial rather than load a second runtime.
    """
    if os.environ.get("RAGATTN_OPENMP", "1") == "0" or not sys.platform.startswith("linux"):
        return []
    if not torch.backends.openmp.is_available():
        return []
    with open("/proc/self/maps") as maps:  # torch is imported: the runtime it loaded
        if "libgomp" not in maps.read():
            return []
    probe = ("#if !defined(_OPENMP) || !defined(__GNUC__) || defined(__clang__)\n#error not GNU OpenMP\n#endif\n"
             "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [os.environ.get("CXX", "c++"), "-fopenmp", "-x", "c++", "-", "-o", os.path.join(tmp, "probe")]
        try:
            ok = subprocess.run(cmd, input=probe.encode(), capture_output=True).returncode == 0
        except OSError:
            ok = False
    return ["-fopenmp"] if ok else []


def _extension():
    cpp = _sources("csrc/**/*.cpp")
    openmp = _openmp_flags()
    # -g0: no debug info (Python's own CFLAGS carry -g). It does not change the generated code, and
    # it cuts the host compile by about 40 % (merge_attention_states_cpu.cpp: 28 s -> 16 s on 2 idle
    # cores); RAGATTN_DEBUG_INFO=1 keeps -g for a debugger.
    debug = [] if os.environ.get("RAGATTN_DEBUG_INFO") == "1" else ["-g0"]
    # No -std: torch's BuildExtension adds the standard its own headers are built for (C++20 for
    # torch 2.13, where our C++17 made every file warn about c10's C++20 bit-field initializers).
    # -Wno-psabi: GCC's note that 8-float vector arguments changed ABI in GCC 4.6
    # (csrc/common/vec8.h's helpers are always inlined; no ABI boundary is crossed).
    cxx_flags = ["-O3", "-Wno-psabi"] + debug + openmp
    include_dirs = [os.path.join(ROOT, "csrc")]
    if _with_cuda():
        # torch's BuildExtension turns TORCH_CUDA_ARCH_LIST into -gencode flags
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
        return cpp_extension.CUDAExtension(
            "ragattn._C",
            cpp + _sources("csrc/**/*.cu"),
            include_dirs=include_dirs,
            define_macros=[("RAGATTN_WITH_CUDA", "1")],
            extra_link_args=openmp,
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"],
            },
        )
    return cpp_extension.CppExtension(
        "ragattn._C", cpp, include_dirs=include_dirs, extra_compile_args={"cxx": cxx_flags}, extra_link_args=openmp
    )


def project_urls(env=os.environ):
    """Project-URLs for the wheel's METADATA: from ``RAGATTN_REPO_URL`` or the checkout's git remote
    ``origin`` (an https or git@host:owner/name address); none without either (pyproject.toml's
    ``dynamic = ["urls"]``)."""
    url = env.get("RAGATTN_REPO_URL", "").strip()
    if not url:
        try:
            url = subprocess.run(["git", "remote", "get-url", "origin"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            url = ""
    if url.startswith("git@") and ":" in url:
        host, path = url[len("git@"):].split(":", 1)
        url = f"https://{host}/{path}"
    url = url.removesuffix(".git").rstrip("/")
    if not url.startswith("https://"):
        return {}
    return {"Homepage": url, "Source": url, "Issues": f"{url}/issues",
            "Documentation": f"{url}/blob/main/docs/ops.md", "Changelog": f"{url}/commits/main"}


_MOVED_IN = ("triton_kernels", "bench")   # top-level folders installed as ragattn.<name>

setup(
    # triton_kernels/ and bench/ live at the top of the repository (the layout of design.md) but
    # install inside the package: a top-level ``triton_kernels`` would shadow OpenAI's, which
    # vLLM and SGLang import.
    # Their sub-folders too (bench/sm90, triton_kernels/configs: the GPU config tables, listed so
    # that setuptools neither warns nor drops them).
    packages=find_namespace_packages(include=["ragattn", "ragattn.*"], exclude=[
        "*.__pycache__", *(f"ragattn.{top}{tail}" for top in _MOVED_IN for tail in ("", ".*"))])   # (links of a checkout)
    + [f"ragattn.{top}" + (f".{sub}" if sub else "") for top in _MOVED_IN
       for sub in [""] + find_namespace_packages(where=top, exclude=["*__pycache__*"])],
    package_dir={f"ragattn.{top}": top for top in _MOVED_IN},
    # py.typed: PEP 561 (inline types); weights/: the trained adapters with their manifests
    package_data={"ragattn": ["data/*.json", "data/**/*", "weights/**/*", "py.typed"],
                  "ragattn.triton_kernels.configs": ["*.json"]},
    project_urls=project_urls(),
    # RAGATTN_REUSE_EXT=1: install without building, keeping the ragattn/_C*.so already in the tree
    # (scripts/setup_vllm.sh, for a second environment with the very same torch build)
    ext_modules=[] if os.environ.get("RAGATTN_REUSE_EXT") == "1" else [_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
