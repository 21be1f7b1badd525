"""verify_draft's shared per-element math (csrc/speculative/verify_draft_math.h: the CUDA kernel's and its
CPU twin's) against float64, through a small C++ harness (tests/ops/cpp/verify_draft_probs.cpp, built with
the host compiler around the twin's own statistics): the base-2 exponential ``vexp2`` ulp by ulp, and
p = softmax(z / T) and RAPID's p_hat by FlashAttention's rule (the error against float64 at most twice that
of the same computation in the logits' dtype: the reference's own code run in that dtype)."""
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from ragattn.reference import speculative as ref

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "ops" / "cpp" / "verify_draft_probs.cpp"
LOG2E = 1.4426950408889634


def _build(out: Path, *flags: str) -> Path:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    subprocess.run([cxx, "-O2", "-std=c++17", *flags, f"-I{ROOT / 'csrc'}", "-o", str(out), str(SOURCE)], check=True)
    return out


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("verify_draft") / "probs")


def _vexp2(exe: Path, t: np.ndarray) -> np.ndarray:
    t = np.ascontiguousarray(t, dtype=np.float32)
    out = subprocess.run([str(exe), "exp2"], input=np.int32(t.size).tobytes() + t.tobytes(), capture_output=True,
                         check=True).stdout
    return np.frombuffer(out, dtype=np.float32)


def _probs(exe: Path, z: torch.Tensor, q: torch.Tensor, temperature: float, eta: float, alpha: float):
    """(p, p_hat) [rows, V] float32 from the twin's statistics (logits [rows, V] float32 / float16 / bfloat16),
    with the scales in base2_scales' units (one rounding each)."""
    rows, vocab = z.shape
    scale = np.float32(min(LOG2E / temperature, np.finfo(np.float32).max))
    eta2 = np.float32(eta * LOG2E) if np.float32(eta) > 0 else np.float32(0)
    kind = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[z.dtype]  # LogitsKind: the kernel's raw bits
    raw = z.contiguous().view(torch.int16 if kind else torch.int32).numpy().tobytes()
    stdin = (np.array([rows, vocab, kind], dtype=np.int32).tobytes()
             + np.array([scale, eta2, alpha], dtype=np.float32).tobytes() + raw + q.float().numpy().tobytes())
    out = np.frombuffer(subprocess.run([str(exe)], input=stdin, capture_output=True, check=True).stdout, np.float32)
    n = rows * vocab
    return torch.from_numpy(out[:n].reshape(rows, vocab).copy()), torch.from_numpy(out[n:].reshape(rows, vocab).copy())


def test_vexp2_within_two_ulp(harness):
    gen = np.random.default_rng(11)
    t = np.concatenate([np.linspace(-126.0, 0.0, 400_003), -126.0 * gen.random(100_001), -gen.random(100_003),
                        np.array([-0.5, -1.5, -125.5, -126.0, 0.0])]).astype(np.float32)
    got = _vexp2(harness, t).astype(np.float64)
    exact = np.exp2(t.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    err = np.abs(got - exact) / ulp
    assert err.max() <= 2.0, (err.max(), t[err.argmax()])
    assert _vexp2(harness, np.zeros(3, np.float32)).tolist() == [1.0, 1.0, 1.0]  # rescale by 2^0 is exact


def test_vexp2_edges(harness):
    """NaN, -inf and arguments below -126.5 give exactly 0 (no subnormals); -126.49 still a power of two."""
    t = np.array([np.nan, -np.inf, -126.51, -127.0, -1e30, -126.49], np.float32)
    got = _vexp2(harness, t)
    assert got[:5].tolist() == [0.0] * 5
    assert got[5] == pytest.approx(2.0 ** -126.49, rel=1e-6)


def _cases():
    # (logits dtype, T, eta): fp32 and the 16-bit formats the kernel widens; T = 1 and not
    return [(torch.float32, 1.0, 0.0), (torch.bfloat16, 1.0, 10.0), (torch.float16, 0.7, 10.0),
            (torch.float32, 1.3, 10.0), (torch.bfloat16, 0.37, 0.0)]


@pytest.mark.parametrize("dtype,temperature,eta", _cases())
def test_probs_follow_flash_attention_rule(harness, dtype, temperature, eta):
    """max |p - p64| <= 2 max |p_in - p64| (p64: the float64 reference; p_in: the same code in the logits'
    dtype, as FlashAttention's tests judge), for p and p_hat, at a vocabulary of 13 slices and a ragged tail,
    logits from peaked to flat rows; and every token of p >= 1e-6 within 32 fp32 ulps of relative error."""
    gen = torch.Generator().manual_seed(int(temperature * 100) + int(eta))
    vocab, alpha = 50021, 0.3
    widths = torch.tensor([[0.5], [3.0], [8.0]])
    z = (torch.randn(3, vocab, generator=gen, dtype=torch.float64) * widths + 1.25).to(dtype)
    z[1, 4097] = 30.0  # one dominant token in the second slice
    q = torch.softmax(torch.randn(3, vocab, generator=gen) * 4.0, dim=-1)
    p, p_hat = _probs(harness, z, q, temperature, eta, alpha)
    assert torch.isfinite(p).all() and torch.isfinite(p_hat).all()
    z64 = z.double()
    p64 = ref.target_probs(z64, temperature, torch.float64)
    p_in = ref.target_probs(z, temperature, dtype).double()
    err, err_in = (p.double() - p64).abs().max().item(), (p_in - p64).abs().max().item()
    assert err <= 2 * err_in, (err, err_in)
    h64 = ref.modified_target_probs(z64, q.double(), temperature, eta, alpha, torch.float64)
    h_in = ref.modified_target_probs(z, q.to(dtype), temperature, eta, alpha, dtype).double()
    err_h, err_in_h = (p_hat.double() - h64).abs().max().item(), (h_in - h64).abs().max().item()
    assert err_h <= 2 * err_in_h, (err_h, err_in_h)
    # a token's own relative error: the rounding of its base-2 exponent t (|t| ulps of t, ~|t| / 2^24 of p)
    # plus vexp2's and the normaliser's (measured: under 1e-6, i.e. 17 ulps, at every case here)
    big = p64 >= 1e-6
    rel = ((p.double() - p64).abs() / p64)[big].max().item()
    assert rel <= 32 * 2.0 ** -24, rel


def test_host_bits_do_not_depend_on_fma(harness, tmp_path):
    """The twin's bits must not change with the host ISA: a build for x86-64-v3 (FMA contraction
    available) gives the same p and p_hat, bit for bit."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    fma = _build(tmp_path / "probs_v3", "-march=x86-64-v3", "-ffp-contract=fast")
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, 9001, generator=gen) * 4.0
    q = torch.softmax(torch.randn(2, 9001, generator=gen) * 3.0, dim=-1)
    a = _probs(harness, z, q, 0.8, 10.0, 0.2)
    b = _probs(fma, z, q, 0.8, 10.0, 0.2)
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
