"""KV-cache ops: in-place RoPE re-rotation of cached keys and K/V row copies between caches.

Both are CUDA C++ kernels (csrc/kv_cache/) with CPU C++ twins sharing the per-element math;
``RAGATTN_CPU_BACKEND=reference`` routes CPU calls to the plain-torch reference instead.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ragattn.ops import backend
from ragattn.ops._validate import FLOAT_DTYPES, check_fp8_scale_values, check_tensor
from ragattn.reference import kv_cache as _ref


CACHE_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)
_FP8 = torch.float8_e4m3fn


def _check_layers(op: str, name: str, layers) -> Optional[_ref.RowLayout]:
    """The Python twin of check_layers (csrc/kv_cache/kv_cache_checks.cpp): returns the list's
    row layout (None for no layers). See ``ragattn.reference.kv_cache.row_layout`` for the rule."""
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"ragattn.{op}: {name} must be a list of tensors (one per layer), got {type(layers).__name__}")
    first = None
    for i, t in enumerate(layers):
        check_tensor(op, f"{name}[{i}]", t, dtypes=CACHE_DTYPES)
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
        if t.stride() != first.stride():
            raise ValueError(f"ragattn.{op}: every layer of {name} must have one layout (strides); {name}[0] has {first.stride()}, {name}[{i}] has {t.stride()}")
    if first is None:
        return None
    try:
        return _ref.row_layout(first)
    except ValueError as exc:
        raise ValueError(f"ragattn.{op}: {name}[0] {exc}") from None


def _check_writes_disjoint(op: str, written) -> None:
    """Every written layer is its own memory (twin of check_writes_disjoint)."""
    flat = [(name, i, t, g) for name, layers, g in written if g is not None for i, t in enumerate(layers)]
    for a in range(len(flat)):
        for b in range(a + 1, len(flat)):
            na, ia, ta, ga = flat[a]
            nb, ib, tb, gb = flat[b]
            if _ref.layers_overlap(ta, ga, tb, gb):
                raise ValueError(
                    f"ragattn.{op}: {nb}[{ib}] shares memory with {na}[{ia}]; every written layer must be its own "
                    "memory (a row written or rotated twice would depend on the order)"
                )


def _check_rope(op: str, inv_freq, rotary_dim: int, head_dim: Optional[int], device) -> None:
    if rotary_dim < 2 or rotary_dim % 2 or (head_dim is not None and rotary_dim > head_dim):
        raise ValueError(f"ragattn.{op}: rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
    check_tensor(op, "inv_freq", inv_freq, dtypes=(torch.float32,), shape=(rotary_dim // 2,), device=device)


def _check_scale(op: str, name: str, scale, cache_name: str, cache_dtype, num_layers: int, device) -> None:
    """Twin of check_scale: float8_e4m3fn caches need a float32 scale of shape [], [1] or [L] on the
    caches' device; other caches take none."""
    if cache_dtype != _FP8:
        if scale is not None:
            raise ValueError(f"ragattn.{op}: {name} is given but {cache_name} is {str(cache_dtype).replace('torch.', '')}; "
                             "scales belong to float8_e4m3fn caches only")
        return
    if scale is None:
        raise ValueError(f"ragattn.{op}: {name} is required: {cache_name} is float8_e4m3fn (stored value x means "
                         "x * scale; pass torch.ones(1) for unscaled)")
    check_tensor(op, name, scale, dtypes=(torch.float32,))
    if not ((scale.numel() == 1 and scale.dim() <= 1) or (scale.dim() == 1 and scale.shape[0] == num_layers)):
        raise ValueError(f"ragattn.{op}: {name} must have shape [], [1] or [num_layers] = [{num_layers}], got {list(scale.shape)}")
    check_tensor(op, name, scale, device=device)


def _check_num_kv_heads(op: str, num_kv_heads, name: str, layers, g) -> None:
    """Twin of check_num_kv_heads: a head-major page read as token-major has page_size as H."""
    if num_kv_heads is None or g is None:
        return
    if g.heads != num_kv_heads:
        raise ValueError(
            f"ragattn.{op}: {name}[0] of shape {list(layers[0].shape)} has {g.heads} heads in its [..., num_kv_heads, "
            f"head_dim] rows, but num_kv_heads={num_kv_heads} (a head-major (HND) cache [pages, H, page_size, D] is "
            "not token-major: pass one [pages, page_size, 1, D] view per head, cache[:, h:h+1].transpose(1, 2))"
        )


def _on_reference_path(op: str, t) -> bool:
    """The op's Python reference path (CPU tensors, ``RAGATTN_CPU_BACKEND=reference``), where the
    C++ op would run otherwise."""
    return (isinstance(t, torch.Tensor) and t.device.type == "cpu"
            and backend.choose(op, "cpu") == backend.REFERENCE)


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
_ROW_DTYPES = (torch.int32, torch.int64)


def _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads=None, k_scale=None):
    """The Python twin of csrc/kv_cache/kv_cache_checks.cpp (the reference path and the fake
    impl do not reach the C++ checks); returns the layers' row layout (None for no layers)."""
    g = _check_layers(_RR, "k_layers", k_layers)
    first = k_layers[0] if g is not None else None
    dev = first.device if first is not None else rows.device
    check_tensor(_RR, "rows", rows, dtypes=_ROW_DTYPES, ndim=1, device=dev)
    check_tensor(_RR, "delta", delta, dtypes=_ROW_DTYPES, shape=(rows.shape[0],), device=dev)
    _check_rope(_RR, inv_freq, int(rotary_dim), first.shape[-1] if first is not None else None, dev)
    _check_num_kv_heads(_RR, num_kv_heads, "k_layers", k_layers, g)
    if first is not None:
        _check_scale(_RR, "k_scale", k_scale, "k_layers", first.dtype, len(k_layers), dev)
    elif k_scale is not None:
        check_tensor(_RR, "k_scale", k_scale, dtypes=(torch.float32,))
    _check_writes_disjoint(_RR, [("k_layers", k_layers, g)])
    return g


def _validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim, num_kv_heads=None,
                   src_k_scale=None, src_v_scale=None, dst_k_scale=None, dst_v_scale=None):
    """The Python twin of the C++ checks of copy_kv_; returns the row layouts (dst_k, src_k)."""
    L = len(dst_k) if isinstance(dst_k, (list, tuple)) else None
    gk = _check_layers(_CP, "dst_k", dst_k)
    gsk = _check_layers(_CP, "src_k", src_k)
    if len(src_k) != L:
        raise ValueError(f"ragattn.{_CP}: src_k must have one tensor per layer of dst_k ({L}), got {len(src_k)}")
    if not isinstance(dst_v, (list, tuple)) or not isinstance(src_v, (list, tuple)):
        raise TypeError(f"ragattn.{_CP}: dst_v and src_v must be lists of tensors (one per layer)")
    if len(dst_v) != len(src_v) or len(dst_v) not in (0, L):
        raise ValueError(f"ragattn.{_CP}: dst_v and src_v must both be empty or have {L} layers, got {len(dst_v)} and {len(src_v)}")
    gv = gsv = None
    fk = dst_k[0] if L else None
    dev = fk.device if fk is not None else dst_rows.device
    if fk is not None:
        sk0 = src_k[0]
        if sk0.dtype != fk.dtype and _FP8 not in (sk0.dtype, fk.dtype):
            raise TypeError(f"ragattn.{_CP}: src_k must have dst_k's dtype {fk.dtype} (or one side float8_e4m3fn), got {sk0.dtype}")
        if len(dst_v):
            gv = _check_layers(_CP, "dst_v", dst_v)
            gsv = _check_layers(_CP, "src_v", src_v)
        for name, layers, ref, want in (("src_k", src_k, fk, sk0.dtype), ("dst_v", dst_v, fk, fk.dtype),
                                        ("src_v", src_v, dst_v[0] if len(dst_v) else None, sk0.dtype)):
            if not len(layers):
                continue
            t = layers[0]
            if t.dtype != want:
                side = "dst_k" if name == "dst_v" else "src_k"
                raise TypeError(f"ragattn.{_CP}: {name} must have {side}'s dtype {want}, got {t.dtype}")
            if t.device != dev:
                raise ValueError(f"ragattn.{_CP}: {name} must be on {dev} (dst_k's device), got {t.device}")
            if name != "dst_v" and t.shape[-2:] != ref.shape[-2:]:
                raise ValueError(f"ragattn.{_CP}: {name} rows must be {tuple(ref.shape[-2:])}, got shape {tuple(t.shape)}")
        if gv is not None and (gv.num_rows != gk.num_rows or gsv.num_rows != gsk.num_rows):
            raise ValueError(f"ragattn.{_CP}: dst_v/src_v must have as many rows as dst_k/src_k")
    check_tensor(_CP, "src_rows", src_rows, dtypes=_ROW_DTYPES, ndim=1, device=dev)
    check_tensor(_CP, "dst_rows", dst_rows, dtypes=_ROW_DTYPES, shape=(src_rows.shape[0],), device=dev)
    if delta is not None:
        check_tensor(_CP, "delta", delta, dtypes=_ROW_DTYPES, shape=(src_rows.shape[0],), device=dev)
        if inv_freq is None:
            raise ValueError(f"ragattn.{_CP}: inv_freq is required when delta is given")
        _check_rope(_CP, inv_freq, int(rotary_dim), fk.shape[-1] if fk is not None else None, dev)
    if fk is not None:
        _check_num_kv_heads(_CP, num_kv_heads, "dst_k", dst_k, gk)
        _check_num_kv_heads(_CP, num_kv_heads, "src_k", src_k, gsk)
        _check_num_kv_heads(_CP, num_kv_heads, "dst_v", dst_v, gv)
        _check_num_kv_heads(_CP, num_kv_heads, "src_v", src_v, gsv)
        _check_scale(_CP, "dst_k_scale", dst_k_scale, "dst_k", fk.dtype, L, dev)
        _check_scale(_CP, "src_k_scale", src_k_scale, "src_k", src_k[0].dtype, L, dev)
        if len(dst_v):
            _check_scale(_CP, "dst_v_scale", dst_v_scale, "dst_v", dst_v[0].dtype, L, dev)
            _check_scale(_CP, "src_v_scale", src_v_scale, "src_v", src_v[0].dtype, L, dev)
        elif dst_v_scale is not None or src_v_scale is not None:
            raise ValueError(f"ragattn.{_CP}: dst_v_scale/src_v_scale are given but no V layers are copied")
        _check_writes_disjoint(_CP, [("dst_k", dst_k, gk), ("dst_v", dst_v, gv)])
    return gk, gsk


def rerotate_keys_(
    k_layers: Sequence[torch.Tensor],
    rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    interleaved: bool = False,
    num_kv_heads: Optional[int] = None,
    k_scale: Optional[torch.Tensor] = None,
) -> None:
    """Rotate cached key rows by ``delta`` positions, in place, all layers in one launch.

    Args:
        k_layers: list of L key caches, one per layer, each fp16/bf16/fp32/float8_e4m3fn, one shape and one
            layout for all layers, addressed as ``[num_rows, num_kv_heads, head_dim]``: contiguous
            ``[num_rows, H, D]`` or paged ``[num_pages, page_size, H, D]``, or a strided view such
            as vLLM's ``kv_cache[0]`` of ``[2, blocks, block_size, H, D]`` or FlashInfer's
            ``cache[:, 0]`` of ``[pages, 2, page_size, H, D]``. The rule: ``[H, D]`` contiguous,
            leading dims collapsing to at most two row strides, rows never overlapping
            (:func:`ragattn.reference.kv_cache.row_layout`); anything else is a ValueError. A
            head-major (HND) page ``[pages, H, page_size, D]`` is not token-major: pass one
            ``cache[:, h:h+1].transpose(1, 2)`` view (``[pages, page_size, 1, D]``) per head.
            Layers must not share memory with each other (ValueError: a shared row would be
            rotated twice). Modified in place.
        rows: int32 or int64 ``[N]``, distinct row indices in ``[0, num_rows)`` (checked on CPU; a
            precondition on CUDA, checked when ``RAGATTN_DEBUG=1``).
        delta: int32 or int64 ``[N]`` (vLLM's positions are int64), signed position shift of each
            row (``new_pos - old_pos``); int64 values are used as they are (no wrap to int32).
        inv_freq: float32 ``[rotary_dim // 2]``, the model's RoPE frequencies (any HF scaling
            variant already folded in).
        rotary_dim: even, ``<= head_dim``; dims ``>= rotary_dim`` are left untouched.
        interleaved: False = NeoX / HF ``rotate_half`` (pairs ``(i, i + rotary_dim/2)``),
            True = GPT-J ``rotate_every_two`` (pairs ``(2i, 2i + 1)``).
        num_kv_heads: optional; when given, the ``H`` of the layers' ``[..., H, D]`` rows must equal
            it (ValueError otherwise: catches a head-major page read with page_size as H).
        k_scale: float32 ``[]``, ``[1]`` (every layer) or ``[L]`` (per layer): required for, and only
            for, float8_e4m3fn layers (vLLM's ``kv_cache_dtype="fp8"``, its layers' ``_k_scale``). A
            stored ``x`` means ``x * k_scale``; rotated rows are dequantised, rotated in fp32 and
            stored as ``clamp(y / k_scale, -448, 448)`` rounded to nearest even, in one pass.
            Finite and > 0 (ValueError on CPU; on CUDA a precondition, checked when
            ``RAGATTN_DEBUG=1``, the kernel writing NaN for another).

    Rotation is exact composition of RoPE: a key rotated at position p becomes the key at
    p + delta (no attention scaling factor is applied). Angles ``delta * inv_freq`` are reduced
    mod 2pi in float64, so deltas up to 2^20 stay within fp32 rounding of the exact rotation.
    Returns None.
    """
    if _on_reference_path("rerotate_keys_", rows):
        g = _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads, k_scale)
        # (the C++ ops check row ranges themselves; the reference path needs it here)
        if g is not None:
            _check_rows_cpu(_RR, "rows", rows, g.num_rows, distinct=True)
            check_fp8_scale_values(_RR, "k_scale", k_scale)
        _ref.rerotate_keys_(list(k_layers), rows, delta, inv_freq, int(rotary_dim), bool(interleaved),
                            compute_dtype=torch.float32, k_scale=k_scale)
        return None
    # The C++ op validates everything (before any write); meta tensors reach the fake, which does too.
    torch.ops.ragattn.rerotate_keys_(list(k_layers), rows, delta, inv_freq, int(rotary_dim), bool(interleaved),
                                     num_kv_heads, k_scale)
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
    num_kv_heads: Optional[int] = None,
    src_k_scale: Optional[torch.Tensor] = None,
    src_v_scale: Optional[torch.Tensor] = None,
    dst_k_scale: Optional[torch.Tensor] = None,
    dst_v_scale: Optional[torch.Tensor] = None,
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
            ``[..., Hk, Dk]`` / ``[..., Hv, Dv]`` addressed as ``[num_dst_rows, H, D]`` by the layout
            rule of :func:`rerotate_keys_` (contiguous, paged, vLLM's ``kv_cache[0]``/``kv_cache[1]``,
            FlashInfer's ``cache[:, 0]``/``cache[:, 1]``). ``dst_v`` and ``src_v`` may both be
            empty to copy K only. No two destination layers may share memory (ValueError).
        src_k, src_v: lists of L source caches, rows ``[Hk, Dk]`` / ``[Hv, Dv]`` like the
            destinations', any number of rows ``num_src_rows``, any layout the rule allows.
            All caches: one device, one dtype (fp16/bf16/fp32/float8_e4m3fn), except that the
            sources and the destinations may differ when one side is float8_e4m3fn (fp8 chunk
            store -> bf16 pages, or bf16 rows -> vLLM's fp8 cache). Sources may share memory with
            destinations (an in-place move): every source row is read before any destination
            row is written (the aliased case stages the rows through a temporary; on the CPU,
            for the same layers as source and destination, only when the row sets meet).
        src_rows: int32 or int64 ``[N]`` rows read, in ``[0, num_src_rows)`` (may repeat).
        dst_rows: int32 or int64 ``[N]`` rows written, in ``[0, num_dst_rows)``, distinct.
            Ranges/uniqueness are checked on CPU, a precondition on CUDA (checked when
            ``RAGATTN_DEBUG=1``).
        delta: optional int32 or int64 ``[N]``: rotate each copied K row by ``delta[n]`` positions.
        inv_freq: float32 ``[rotary_dim // 2]``; required with ``delta``.
        rotary_dim, interleaved: as in :func:`rerotate_keys_` (ignored without ``delta``).
        num_kv_heads: optional; when given, every list's row ``H`` must equal it (see
            :func:`rerotate_keys_`).
        src_k_scale, src_v_scale, dst_k_scale, dst_v_scale: float32 ``[]``, ``[1]`` or ``[L]``
            per-tensor scales, required for, and only for, the float8_e4m3fn lists they name. An
            fp8 element ``x`` means ``x * scale``; values are written as ``clamp(v / scale, -448,
            448)`` rounded to nearest even. K is dequantised, rotated in fp32 and requantised in
            one pass; without rotation (or for V) an fp8 -> fp8 copy with equal scales is a plain
            copy of the bytes (requantising with the same scale is the identity). Finite and > 0,
            as ``rerotate_keys_``'s ``k_scale``.

    Returns None.
    """
    args = (list(dst_k), list(dst_v), list(src_k), list(src_v), src_rows, dst_rows, delta, inv_freq, int(rotary_dim), bool(interleaved))
    scales = dict(src_k_scale=src_k_scale, src_v_scale=src_v_scale, dst_k_scale=dst_k_scale, dst_v_scale=dst_v_scale)
    if _on_reference_path("copy_kv_", dst_rows):
        gk, gsk = _validate_copy(*args[:-1], num_kv_heads, **scales)
        # (the C++ ops check row ranges themselves; the reference path needs it here)
        if gk is not None:
            _check_rows_cpu(_CP, "src_rows", src_rows, gsk.num_rows, distinct=False)
            _check_rows_cpu(_CP, "dst_rows", dst_rows, gk.num_rows, distinct=True)
            for name, s in scales.items():
                check_fp8_scale_values(_CP, name, s)
        _ref.copy_kv_(*args, compute_dtype=torch.float32, **scales)
        return None
    # The C++ op validates everything (before any write); meta tensors reach the fake, which does too.
    torch.ops.ragattn.copy_kv_(*args, num_kv_heads, src_k_scale, src_v_scale, dst_k_scale, dst_v_scale)
    return None


@torch.library.register_fake("ragattn::rerotate_keys_")
def _rerotate_keys_fake(k_layers, rows, delta, inv_freq, rotary_dim, interleaved, num_kv_heads=None, k_scale=None):
    _validate_rerotate(k_layers, rows, delta, inv_freq, rotary_dim, num_kv_heads, k_scale)
    return None


@torch.library.register_fake("ragattn::copy_kv_")
def _copy_kv_fake(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta=None, inv_freq=None, rotary_dim=0, interleaved=False,
                  num_kv_heads=None, src_k_scale=None, src_v_scale=None, dst_k_scale=None, dst_v_scale=None):
    _validate_copy(dst_k, dst_v, src_k, src_v, src_rows, dst_rows, delta, inv_freq, rotary_dim, num_kv_heads,
                   src_k_scale, src_v_scale, dst_k_scale, dst_v_scale)
    return None


__all__ = ["rerotate_keys_", "copy_kv_"]
