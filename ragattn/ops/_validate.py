"""Input checks shared by the Python-side ops. Every error names the op and the argument."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)  # positions, lengths, offsets, page tables: as engines pass them


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Raise TypeError/ValueError unless ``t`` is a tensor of the given dtype, rank, shape, device.

    ``shape`` entries of ``None`` match any size. Returns ``t`` for chaining.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"ragattn.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"ragattn.{op}: {name} must be {_fmt_dtypes(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"ragattn.{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if shape is not None:
        want = tuple(shape)
        if t.dim() != len(want) or any(w is not None and w != s for w, s in zip(want, t.shape)):
            pretty = tuple("*" if w is None else w for w in want)
            raise ValueError(f"ragattn.{op}: {name} must have shape {pretty}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"ragattn.{op}: {name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"ragattn.{op}: {name} must be contiguous")
    return t


def check_same_device(op: str, **tensors: Optional[torch.Tensor]) -> torch.device:
    """Raise ValueError unless every non-None tensor is on one device; return that device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    dev = items[0][1].device
    for n, t in items[1:]:
        if t.device != dev:
            raise ValueError(
                f"ragattn.{op}: all tensors must be on one device; {items[0][0]} is on {dev}, {n} is on {t.device}"
            )
    return dev


def check_cu_seqlens(
    op: str, name: str, cu: torch.Tensor, total: int, device: torch.device, *,
    dtypes: Sequence[torch.dtype] = (torch.int32,), read_values: bool = True,
) -> int:
    """Validate an int ``[batch + 1]`` offsets tensor starting at 0 and ending at ``total``.

    Returns ``batch``. Values (start, end, monotonicity) are checked on CPU tensors only (a GPU
    check would sync), and not at all with ``read_values=False`` (fake/meta tensors).
    """
    check_tensor(op, name, cu, dtypes=dtypes, ndim=1, device=device)
    if cu.numel() < 1:
        raise ValueError(f"ragattn.{op}: {name} must have at least one entry (batch + 1)")
    if cu.device.type == "cpu" and read_values:
        vals = cu.tolist()  # one host read (B is small): cheaper than three tensor reductions
        if vals[0] != 0 or vals[-1] != total:
            raise ValueError(
                f"ragattn.{op}: {name} must start at 0 and end at {total} (the packed length), "
                f"got {vals[0]} .. {vals[-1]}"
            )
        if any(b < a for a, b in zip(vals, vals[1:])):
            raise ValueError(f"ragattn.{op}: {name} must be non-decreasing")
    return cu.numel() - 1


def cpu_qk_well_formed(q, k, cu_seqlens_q, cu_seqlens_k, dtypes) -> bool:
    """A fast sufficient condition for the metadata checks that the attention-score ops share:
    ``q`` ``[*, H, D]`` and ``k`` ``[*, Hkv, D]`` CPU tensors of one of ``dtypes`` with ``H % Hkv
    == 0`` and ``D > 0``, and 1-D CPU offsets of an index dtype, equally many, at least one. False
    only means "run the named checks" (``check_tensor`` and friends raise with the argument)."""
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k, T) and isinstance(cu_seqlens_q, T) and isinstance(cu_seqlens_k, T)):
        return False
    if q.dtype not in dtypes or k.dtype != q.dtype or q.dim() != 3 or k.dim() != 3:
        return False
    if not (q.is_cpu and k.is_cpu and cu_seqlens_q.is_cpu and cu_seqlens_k.is_cpu):
        return False
    heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    if dim == 0 or k.shape[2] != dim or kv_heads == 0 or heads % kv_heads:
        return False
    return not (cu_seqlens_q.dtype not in INDEX_DTYPES or cu_seqlens_k.dtype not in INDEX_DTYPES
                or cu_seqlens_q.dim() != 1 or cu_seqlens_k.dim() != 1 or cu_seqlens_q.numel() < 1
                or cu_seqlens_q.numel() != cu_seqlens_k.numel())


def _byte_span(t: torch.Tensor):
    """[first, last] byte of ``t`` in its storage (None for an empty tensor); needs no data pointer."""
    if t.numel() == 0:
        return None
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    first = t.storage_offset() * t.element_size()
    return first, first + (last + 1) * t.element_size() - 1


def overlaps_itself(t: torch.Tensor) -> bool:
    """True unless every element of ``t`` is its own memory, by strides alone (fake/meta tensors too).

    The sufficient rule: with the dims of size > 1 sorted by stride, each stride exceeds the largest
    offset the smaller dims reach. An expanded (stride-0) view fails it, and so does any layout
    where two indices could meet; a few exotic non-overlapping interleavings fail it too, and are
    refused as well (an output buffer is never one in practice)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    reach = 0
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def check_no_overlap(op: str, outputs: dict, inputs: dict) -> None:
    """Raise ValueError if an output tensor overlaps itself (e.g. an ``expand``ed view, which a
    kernel would write several times and read back wrong) or shares memory with an input or
    another output.

    Compares strides, storages and byte spans (conservative for interleaved strided views), so it
    works on fake and meta tensors too. ``outputs``/``inputs`` map argument names to tensors (None
    skipped). Empty outputs are never refused (nothing is written).
    """
    outs = [(n, t) for n, t in outputs.items() if t is not None]
    others = outs + [(n, t) for n, t in inputs.items() if t is not None]
    for i, (name, o) in enumerate(outs):
        span_o = _byte_span(o)
        if span_o is None:
            continue
        if overlaps_itself(o):
            raise ValueError(f"ragattn.{op}: {name} overlaps itself in memory (an expanded or stride-0 view?): "
                             f"shape {tuple(o.shape)}, strides {tuple(o.stride())}; give it its own memory per element")
        for other, t in others[i + 1 :]:
            if t.device != o.device or t.untyped_storage()._cdata != o.untyped_storage()._cdata:
                continue
            span_t = _byte_span(t)
            if span_t is not None and span_o[0] <= span_t[1] and span_t[0] <= span_o[1]:
                raise ValueError(f"ragattn.{op}: {name} must not share memory with {other}")


def values_readable(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values: on the CPU always, on a GPU only under
    ``RAGATTN_DEBUG=1`` (the read syncs); never for meta tensors."""
    return t.device.type == "cpu" or (t.device.type != "meta" and os.environ.get("RAGATTN_DEBUG", "0") == "1")


def check_fp8_scale_values(op: str, name: str, scale: Optional[torch.Tensor]) -> None:
    """An fp8 cache's per-tensor scale must be finite and > 0 (a stored ``x`` means ``x * scale``:
    0 would store +-inf or NaN, read every key as 0). The values are read only where
    :func:`values_readable` (no device sync); elsewhere a precondition, and the kernels read and
    write NaN with such a scale, never a finite value. Call it from real impls, not fake ones."""
    if scale is None or not values_readable(scale):
        return
    v = scale.detach().reshape(-1).to("cpu", torch.float32)
    bad = ~torch.isfinite(v) | (v <= 0)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"ragattn.{op}: {name} must be finite and > 0 (a stored x means x * scale), got "
                         f"{float(v[i])} at index {i}")


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU the current one while in the block (no-op for CPU tensors).

    Triton launches on the current CUDA device and stream, not the tensors' device: without this
    a tensor on ``cuda:1`` while ``cuda:0`` is current would be read from the wrong device.
    """
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def check_soft_cap(op: str, logits_soft_cap) -> None:
    """``logits_soft_cap``: a finite float >= 0 (0 = off; FlashInfer's name and meaning)."""
    if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
        raise TypeError(f"ragattn.{op}: logits_soft_cap must be a float, got {type(logits_soft_cap).__name__}")
    if not (math.isfinite(logits_soft_cap) and logits_soft_cap >= 0):
        raise ValueError(f"ragattn.{op}: logits_soft_cap must be finite and >= 0 (0 = off), got {logits_soft_cap}")
