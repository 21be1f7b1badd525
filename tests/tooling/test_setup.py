"""Set-up off this machine: the extension's build decision in setup.py, the CUDA
impls that stand in for the C++ ops' CUDA kernels when the build had no nvcc, and
scripts/setup.sh's choice of torch build. Nothing here downloads or builds anything."""
import ast
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import ragattn
from ragattn import _extension
from ragattn.ops import _cuda_fallback

ROOT = Path(__file__).resolve().parents[2]


def _build_kind():
    """setup.py's ``build_kind``, executed alone (importing setup.py would run setup())."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_kind")
    ns = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "setup.py", "exec"), ns)
    return ns["build_kind"]


def test_build_kind_cuda_torch_without_nvcc_builds_the_cpu_kernels_with_a_warning():
    build_kind = _build_kind()
    kind, warning = build_kind("13.0", None, {})
    assert kind == "cpu"
    for word in ("nvcc", "rerotate_keys_", "copy_kv_", "verify_draft", "reference"):
        assert word in warning
    assert build_kind("13.0", "/usr/local/cuda", {}) == ("cuda", None)
    assert build_kind(None, None, {}) == ("cpu", None)                       # CPU torch
    assert build_kind(None, "/usr/local/cuda", {}) == ("cpu", None)
    assert build_kind("13.0", "/usr/local/cuda", {"RAGATTN_FORCE_CPU": "1"}) == ("cpu", None)
    assert build_kind("13.0", None, {"RAGATTN_FORCE_CPU": "1"}) == ("cpu", None)
    # a GPU image asks for the kernels: a missing toolkit is then an error
    with pytest.raises(SystemExit, match="nvcc"):
        build_kind("13.0", None, {"RAGATTN_REQUIRE_CUDA": "1"})
    with pytest.raises(SystemExit, match="no CUDA"):
        build_kind(None, None, {"RAGATTN_REQUIRE_CUDA": "1"})
    assert build_kind("13.0", "/usr/local/cuda", {"RAGATTN_REQUIRE_CUDA": "1"}) == ("cuda", None)


# ----- the C++ ops on CUDA tensors without their CUDA kernels -----------------------------------
_CUDA = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
needs_cpu_only_build = pytest.mark.skipif(
    bool(_extension.NATIVE_CUDA_OPS), reason="this ragattn._C has its CUDA kernels (no fallback registered)")


@needs_cpu_only_build
def test_every_cpp_op_has_a_cuda_impl():
    assert _extension.NATIVE_CUDA_OPS == ()
    for op in _extension.CUDA_CPP_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"ragattn::{op}", "CUDA"), op
    assert _cuda_fallback.register() == ()   # idempotent


def _as_cuda(op, *args):
    """Call ``op``'s CUDA kernel (the dispatcher's CUDA entry) on these (CPU) tensors."""
    return getattr(torch.ops.ragattn, op).default.redispatch(_CUDA, *args)


@needs_cpu_only_build
def test_cuda_fallback_runs_the_reference_and_warns_once(monkeypatch):
    monkeypatch.setattr(_cuda_fallback, "_warned", False)
    g = torch.Generator().manual_seed(0)
    rows_total, hk, d, rd = 13, 3, 24, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    layers = [torch.randn(rows_total, hk, d, generator=g) for _ in range(2)]
    rows = torch.tensor([0, 7, 12, 3])
    delta = torch.tensor([5, -9, 1000, 1], dtype=torch.int32)
    expect = [t.clone() for t in layers]
    torch.ops.ragattn.rerotate_keys_(expect, rows, delta, inv_freq, rd, True)    # the C++ CPU op
    got = [t.clone() for t in layers]
    with pytest.warns(RuntimeWarning, match="built without its CUDA kernels"):
        _as_cuda("rerotate_keys_", got, rows, delta, inv_freq, rd, True)
    for a, b, before in zip(got, expect, layers):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert not torch.equal(a, before)

    # copy_kv_ with rotation into poisoned destinations: the same rows written, the rest untouched
    dst_k = [torch.full((9, 2, 5, hk, d), float("nan")) for _ in range(2)]
    dst_v = [torch.full_like(t, float("nan")) for t in dst_k]
    src_k = [torch.randn(rows_total, hk, d, generator=g) for _ in range(2)]
    src_v = [torch.randn(rows_total, hk, d, generator=g) for _ in range(2)]
    src_rows, dst_rows = torch.tensor([4, 4, 11], dtype=torch.int32), torch.tensor([89, 0, 17])
    d3 = torch.tensor([-3, 7, 0], dtype=torch.int32)
    ek, ev = [t.clone() for t in dst_k], [t.clone() for t in dst_v]
    torch.ops.ragattn.copy_kv_(ek, ev, src_k, src_v, src_rows, dst_rows, d3, inv_freq, rd, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # warned once already: silent now
        _as_cuda("copy_kv_", dst_k, dst_v, src_k, src_v, src_rows, dst_rows, d3, inv_freq, rd, False)
        for a, b in zip(dst_k + dst_v, ek + ev):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
        assert not torch.isnan(dst_k[0].view(-1, hk, d)[89]).any()

        # verify_draft: the float64 reference's tokens
        bsz, gamma, vocab = 3, 4, 37
        target = torch.randn(bsz, gamma + 1, vocab, generator=g) * 3
        q = torch.softmax(torch.randn(bsz, gamma, vocab, generator=g), -1)
        drafts = torch.multinomial(q.view(-1, vocab), 1, generator=g).view(bsz, gamma)
        u = torch.rand(bsz, gamma + 1, generator=g)
        monkeypatch.setenv("RAGATTN_CPU_BACKEND", "reference")
        expect = ragattn.verify_draft(drafts, q, target, u, 0.8, 0.5, 0.1, False)
        got = _as_cuda("verify_draft", drafts, q, target, u, 0.8, 0.5, 0.1, False, None, None)
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


@needs_cpu_only_build
def test_cuda_fallback_validates_like_the_kernels(monkeypatch):
    monkeypatch.setattr(_cuda_fallback, "_warned", True)
    layers = [torch.randn(4, 2, 8)]
    with pytest.raises(ValueError, match="rotary_dim"):
        _as_cuda("rerotate_keys_", layers, torch.tensor([1]), torch.tensor([1], dtype=torch.int32),
                 torch.ones(8), 16, False)
    with pytest.raises(TypeError, match="delta"):
        _as_cuda("rerotate_keys_", layers, torch.tensor([1]), torch.tensor([1.0]), torch.ones(4), 8, False)


# ----- scripts/setup.sh's torch choice ------------------------------------------------------------
_FAKE_PY = r'''#!/usr/bin/env bash
# a venv python: logs its calls (RAGATTN_REUSE_EXT=... first); `import torch` fails; pip's dry run reports TORCH_VERSION
echo "REUSE=${RAGATTN_REUSE_EXT:-} $*" >> "$LOG"
if [ "$1" = "-c" ]; then
  case "$2" in "import torch") exit 1 ;; esac
  exit 0
fi
if [ "$1 $2" = "-m pip" ]; then
  prev=""
  for a in "$@"; do
    if [ "$prev" = "--report" ]; then
      printf '{"install": [{"metadata": {"name": "torch", "version": "%s"}}]}\n' "$TORCH_VERSION" > "$a"
    fi
    prev=$a
  done
fi
exit 0
'''


def _run_setup(tmp_path, torch_version, **env):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(_FAKE_PY)
    fake.chmod(0o755)
    log = tmp_path / "log"
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    full_env = {k: v for k, v in os.environ.items() if k != "RAGATTN_TORCH_INDEX"}
    full_env.update(VENV=str(venv), LOG=str(log), TORCH_VERSION=torch_version, PATH=path, **env)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--no-demo"], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return log.read_text().splitlines()


def _torch_installs(calls):
    return [c for c in calls if "install" in c and "torch==" in c and "--dry-run" not in c]


def test_setup_sh_keeps_a_local_cpu_wheel(tmp_path):
    calls = _run_setup(tmp_path, "2.13.0+cpu")
    assert any("--dry-run" in c for c in calls)
    assert _torch_installs(calls) == []            # requirements.txt installs pip's (local) CPU wheel
    assert any("-r requirements.txt" in c for c in calls)


def test_setup_sh_takes_the_cpu_index_instead_of_pypis_cuda_torch(tmp_path):
    calls = _run_setup(tmp_path, "2.13.0")         # PyPI's Linux wheel: a CUDA build
    (install,) = _torch_installs(calls)
    assert "--index-url https://download.pytorch.org/whl/cpu" in install and "torch==2.13.0" in install
    assert calls.index(install) < next(i for i, c in enumerate(calls) if "-r requirements.txt" in c)


def test_setup_sh_index_override(tmp_path):
    calls = _run_setup(tmp_path, "2.13.0", RAGATTN_TORCH_INDEX="pypi")
    assert _torch_installs(calls) == [] and not any("--dry-run" in c for c in calls)
    calls = _run_setup(tmp_path / "b", "2.13.0", RAGATTN_TORCH_INDEX="https://example.invalid/cu130")
    assert "--index-url https://example.invalid/cu130" in _torch_installs(calls)[0]


def test_setup_sh_prints_the_time_of_each_phase(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(_FAKE_PY)
    (venv / "bin" / "python").chmod(0o755)
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    env = {k: v for k, v in os.environ.items() if k != "RAGATTN_TORCH_INDEX"}
    env.update(VENV=str(venv), LOG=str(tmp_path / "log"), TORCH_VERSION="2.13.0+cpu", PATH=path)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--no-demo"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("setup.sh: done in ") and ": installs " in last and ", extension build " in last, last


def test_setup_sh_builds_the_extension_once_for_the_wheel_too(tmp_path):
    """The extension is compiled in the tree (objects kept in build/, so scripts/wheel_check.sh's
    wheel build only links), then installed editable without compiling again."""
    calls = _run_setup(tmp_path, "2.13.0+cpu")
    build = next(i for i, c in enumerate(calls) if "setup.py -q build_ext --inplace" in c)
    install = next(i for i, c in enumerate(calls) if "install" in c and "-e ." in c)
    assert build < install and calls[install].startswith("REUSE=1 "), calls
