"""KV-cache ops: in-place RoPE re-rotation of cached keys and K/V row copies between caches.

Both are CUDA C++ kernels (csrc/kv_cache/) with CPU C++ twins sharing the per-element math;
``RAGATTN_CPU_BACKEND=reference`` routes CPU calls to the plain-torch reference instead.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ragattn import _extension
from ragattn.ops._validate import FLOAT_DTYPES, check_tensor
from ragattn.reference import kv_cache as _ref


def _check_layers(op: str, name: str, layers) -> Optional[torch.Tensor]:
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"ragattn.{op}: {name} must be a list of tensors (one per layer), got {type(layers).__name__}")
    first = None
    for i, t in enumerate(layers):
        check_tensor(op, f"{name}[{i}]", t, dtypes=FLOAT_DTYPES)
        if t.dim() < 3:
            raise ValueError(f"ragattn.{op}: {name}[{i}] must have at least 3 dims [..., num_kv_heads, head_dim], got shape {tuple(t.shape)}")
        if first is None:
            first = t
            continue
        if t.dtype != first.dtype:
            raise TypeError(f"ragattn.{op}: every layer of {name} must have one dtype; {name}[0] is {first.dtype}, {name}[{i}] is {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"ragattn.{op}: every layer of {name} must be on one device; {name}[0] is on {first.device}, {name}[{i}] is on {t.device}")
        if t.shape != first.shape:
            raise ValueError(f"ragattn.{op}: every layer of {name} must have one shape; {name}[0] is {tuple(first.shape)}, {name}[{i}] is {tuple(t.shape)}")
    for i, t in enumerate(layers):
        if not t.is_contiguous():
            raise ValueError(f"ragattn.{op}: {name}[{i}] must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    return first


def _check_rope(op: str, inv_freq, rotary_dim: int, head_dim: Optional[int], device) -> None:
    if rotary_dim < 2 or rotary_dim % 2 or (head_dim is not None and rotary_dim > head_dim):
        raise ValueError(f"ragattn.{op}: rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), shape=(rotary_dim // 2,), device=device)


def _on_reference_path(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and _extension.cpu_backend() == "reference"


def _num_rows(t: torch.Tensor) -> int:
    return t.numel() // max(1, t.shape[-2] * t.shape[-1])


def _check_rows_cpu(op: str, name: str, rows: torch.Tensor, num_rows: int, distinct: bool) -> None:
    if rows.device.type != "cpu" or rows.numel() == 0:
        return
    bad = (rows < 0) | (rows >= num_rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"ragattn.{op}: {name}[{i}] = {int(rows[i])} is out of range for caches of {num_rows} rows")
    if distinct and torch.unique(rows).numel() != rows.numel():
        raise ValueError(f"ragattn.{op}: {name} may not repeat a row")


_RR, _CP = "rerotate_keys_", "copy_kv_"


def _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim) -> Optional[torch.Tensor]:
    """The Python twin of csrc/kv_cache/kv_cache_checks.cpp (the reference path and the fake
    impl do not reach the C++ checks); returns the first layer (None for no layers)."""
    first = _check_layers(_RR, "k_layers", k_layers)
    dev = first.device if first is not None else rows.device
    check_tensor(_RR, "rows", rows, dtypes=(torch.int64,), ndim=1, device=dev)
    check_tensor(_RR, "delta", delta, dtypes=(torch.int32,), shape=(rows.shape[0],), device=dev)
    _check_rope(_RR, inv_freq, int(rotary_dim), first.shape[-1] if first is not None else None, dev)
    return first


def _validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim):
    """The Python twin of the C++ checks of copy_kv_; returns (first dst_k layer, first src_k layer)."""
    fk = _check_layers(_CP, "dst_k", dst_k)
    sk = _check_layers(_CP, "src_k", src_k)
    fv = _check_layers(_CP, "dst_v", dst_v)
    sv = _check_layers(_CP, "src_v", src_v)
    L = len(dst_k)
    if len(src_k) != L:
        raise ValueError(f"ragattn.{_CP}: src_k must have one tensor per layer of dst_k ({L}), got {len(src_k)}")
    if len(dst_v) != len(src_v) or len(dst_v) not in (0, L):
        raise ValueError(f"ragattn.{_CP}: dst_v and src_v must both be empty or have {L} layers, got {len(dst_v)} and {len(src_v)}")
    dev = fk.device if fk is not None else dst_rows.device
    if fk is not None:
        for name, t, ref in (("src_k", sk, fk), ("dst_v", fv, fk), ("src_v", sv, fv)):
            if t is None:
                continue
            if t.dtype != fk.dtype:
                raise TypeError(f"ragattn.{_CP}: {name} must have dst_k's dtype {fk.dtype}, got {t.dtype}")
            if t.device != dev:
                raise ValueError(f"ragattn.{_CP}: {name} must be on {dev} (dst_k's device), got {t.device}")
            if name != "dst_v" and t.shape[-2:] != ref.shape[-2:]:
                raise ValueError(f"ragattn.{_CP}: {name} rows must be {tuple(ref.shape[-2:])}, got shape {tuple(t.shape)}")
        if fv is not None and (_num_rows(fv) != _num_rows(fk) or _num_rows(sv) != _num_rows(sk)):
            raise ValueError(f"ragattn.{_CP}: dst_v/src_v must have as many rows as dst_k/src_k")
    check_tensor(_CP, "src_rows", src_rows, dtypes=(torch.int64,), ndim=1, device=dev)
    check_tensor(_CP, "dst_rows", dst_rows, dtypes=(torch.int64,), shape=(src_rows.shape[0],), device=dev)
    if delta is not None:
        check_tensor(_CP, "delta", delta, dtypes=(torch.int32,), shape=(src_rows.shape[0],), device=dev)
        if inv_freq is None:
            raise ValueError(f"ragattn.{_CP}: inv_freq is required when delta is given")
        _check_rope(_CP, inv_freq, int(rotary_dim), fk.shape[-1] if fk is not None else None, dev)
    return fk, sk


def rerotate_keys_(
    k_layers: Sequence[torch.Tensor],
    rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
) -> None:
    """Rotate cached key rows by ``delta`` positions, in place, all layers in one launch.

    Args:
        k_layers: list of L key caches, one per layer, each fp16/bf16/fp32, contiguous, one
            shape for all layers: ``[num_rows, num_kv_heads, head_dim]`` or paged
            ``[num_pages, page_size, num_kv_heads, head_dim]`` (viewed as
            ``[num_pages * page_size, num_kv_heads, head_dim]``). Modified in place.
        rows: int64 ``[N]``, distinct row indices in ``[0, num_rows)`` (checked on CPU; a
            precondition on CUDA, checked when ``RAGATTN_DEBUG=1``).
        delta: int32 ``[N]``, signed position shift of each row (``new_pos - old_pos``).
        inv_freq: float32 ``[rotary_dim // 2]``, the model's RoPE frequencies (any HF scaling
            variant already folded in).
        rotary_dim: even, ``<= head_dim``; dims ``>= rotary_dim`` are left untouched.
        interleaved: False = NeoX / HF ``rotate_half`` (pairs ``(i, i + rotary_dim/2)``),
            True = GPT-J ``rotate_every_two`` (pairs ``(2i, 2i + 1)``).

    Rotation is exact composition of RoPE: a key rotated at position p becomes the key at
    p + delta (no attention scaling factor is applied). Angles ``delta * inv_freq`` are reduced
    mod 2pi in float64, so deltas up to 2^20 stay within fp32 rounding of the exact rotation.
    Returns None.
    """
    if _on_reference_path(rows):
        first = _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim)
        # (the C++ ops check row ranges themselves; the reference path needs it here)
        if first is not None:
            _check_rows_cpu(_RR, "rows", rows, _num_rows(first), distinct=True)
        _ref.rerotate_keys_(list(k_layers), rows, delta, inv_freq, int(rotary_dim), bool(interleaved), compute_dtype=torch.float32)
        return None
    # The C++ op validates everything (before any write); meta tensors reach the fake, which does too.
    torch.ops.ragattn.rerotate_keys_(list(k_layers), rows, delta, inv_freq, int(rotary_dim), bool(interleaved))
    return None


def copy_kv_(
    dst_k: Sequence[torch.Tensor],
    dst_v: Sequence[torch.Tensor],
    src_k: Sequence[torch.Tensor],
    src_v: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: Optional[torch.Tensor] = None,
    inv_freq: Optional[torch.Tensor] = None,
    rotary_dim: int = 0,
    interleaved: bool = False,
) -> None:
    """Gather / scatter / append K/V rows between caches, all layers in one launch, optionally
    re-rotating K by ``delta`` in the same pass (V is never rotated)::

        src_k[l] (chunk store)                 dst_k[l] (request pages)
        row 0  [k0] --.                         row 0  [..]
        row 1  [k1]   |   src_rows = [0, 2]     row 1  [..]
        row 2  [k2] --+-> dst_rows = [5, 6] ->  ...
                      |   delta    = [d, d]     row 5  [R(d) k0]
                      '-------------------->    row 6  [R(d) k2]
        (same for V, without rotation)

    Args:
        dst_k, dst_v: lists of L destination caches (modified in place); each layer
            ``[..., Hk, Dk]`` / ``[..., Hv, Dv]`` viewed as ``[num_dst_rows, H, D]``. ``dst_v`` and
            ``src_v`` may both be empty to copy K only.
        src_k, src_v: lists of L source caches, rows ``[Hk, Dk]`` / ``[Hv, Dv]`` like the
            destinations', any number of rows ``num_src_rows``. All caches: one dtype
            (fp16/bf16/fp32), contiguous, one device.
        src_rows: int64 ``[N]`` rows read, in ``[0, num_src_rows)`` (may repeat).
        dst_rows: int64 ``[N]`` rows written, in ``[0, num_dst_rows)``, distinct. When a source
            and a destination are the same cache, no row may be both read and written.
            Ranges/uniqueness are checked on CPU, a precondition on CUDA (checked when
            ``RAGATTN_DEBUG=1``).
        delta: optional int32 ``[N]``: rotate each copied K row by ``delta[n]`` positions.
        inv_freq: float32 ``[rotary_dim // 2]``; required with ``delta``.
        rotary_dim, interleaved: as in :func:`rerotate_keys_` (ignored without ``delta``).

    Returns None.
    """
    args = (list(dst_k), list(dst_v), list(src_k), list(src_v), src_rows, dst_rows, delta, inv_freq, int(rotary_dim), bool(interleaved))
    if _on_reference_path(dst_rows):
        fk, sk = _validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim)
        # (the C++ ops check row ranges themselves; the reference path needs it here)
        if fk is not None:
            _check_rows_cpu(_CP, "src_rows", src_rows, _num_rows(sk), distinct=False)
            _check_rows_cpu(_CP, "dst_rows", dst_rows, _num_rows(fk), distinct=True)
        _ref.copy_kv_(*args, compute_dtype=torch.float32)
        return None
    # The C++ op validates everything (before any write); meta tensors reach the fake, which does too.
    torch.ops.ragattn.copy_kv_(*args)
    return None


@torch.library.register_fake("ragattn::rerotate_keys_")
def _rerotate_keys_fake(k_layers, rows, delta, inv_freq, rotary_dim, interleaved):
    _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim)
    return None


@torch.library.register_fake("ragattn::copy_kv_")
def _copy_kv_fake(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta=None, inv_freq=None, rotary_dim=0, interleaved=False):
    _validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim)
    return None


__all__ = ["rerotate_keys_", "copy_kv_"]
