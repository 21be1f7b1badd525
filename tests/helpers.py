"""Shared test utilities: precision-aware comparison, poisoning, awkward random inputs."""
from __future__ import annotations

import torch

# FlashAttention's rule: the kernel's error against a float64 reference may be at most
# FACTOR times the error of the same computation done in the input dtype (plus a floor for
# the case where the low-precision computation happens to be exact).
FACTOR = 2.0


def poison_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like ``t`` full of NaN (floats) or a sentinel (ints): outputs must overwrite it."""
    out = torch.empty_like(t)
    if out.is_floating_point():
        out.fill_(float("nan"))
    else:
        out.fill_(-12345)
    return out


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max |a - b| in float64, treating matching infinities as equal and any NaN as infinite error."""
    a64, b64 = a.double(), b.double()
    if torch.isnan(a64).any() or torch.isnan(b64).any():
        return float("inf")
    same_inf = torch.isinf(a64) & torch.isinf(b64) & (torch.sign(a64) == torch.sign(b64))
    diff = (a64 - b64).abs().masked_fill(same_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def assert_precision(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *, atol_floor: float | None = None, what: str = "out"):
    """Assert ``err(out, ref64) <= FACTOR * err(ref_lowp, ref64) + floor``.

    ``ref_lowp`` is the reference computed in the kernel's input dtype; ``floor`` defaults to a
    few units of that dtype's rounding at the reference's magnitude.
    """
    kernel_err = max_abs_err(out, ref64)
    base_err = max_abs_err(ref_lowp, ref64)
    if atol_floor is None:
        finite = ref64[torch.isfinite(ref64)]
        scale = float(finite.abs().max()) if finite.numel() else 1.0
        atol_floor = 4 * torch.finfo(out.dtype).eps * max(scale, 1e-6) if out.is_floating_point() else 0.0
    bound = FACTOR * base_err + atol_floor
    assert kernel_err <= bound, (
        f"{what}: error vs float64 reference {kernel_err:.3e} exceeds {FACTOR} x low-precision "
        f"reference error {base_err:.3e} (+ floor {atol_floor:.1e})"
    )


def randn_nonzero(*shape, dtype=torch.float32, device="cpu", generator=None) -> torch.Tensor:
    """Standard-normal data shifted away from zero (tests never use zeros as data)."""
    x = torch.randn(*shape, dtype=torch.float32, generator=generator)
    x = torch.where(x.abs() < 1e-3, torch.full_like(x, 1e-3), x)
    return x.to(device=device, dtype=dtype)
