"""Input checks shared by the Python-side ops. Every error names the op and the argument."""
from __future__ import annotations

import contextlib
from typing import Iterable, Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)  # positions, lengths, offsets, block tables: as engines pass them


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
    dtypes: Sequence[torch.dtype] = (torch.int32,), check_values: bool = True,
) -> int:
    """Validate an int ``[batch + 1]`` offsets tensor starting at 0 and ending at ``total``.

    Returns ``batch``. Values (ends, monotonicity) are checked on CPU tensors only (a GPU check
    would sync), and not at all with ``check_values=False`` (fake impls: no data to read).
    """
    check_tensor(op, name, cu, dtypes=dtypes, ndim=1, device=device)
    if cu.numel() < 1:
        raise ValueError(f"ragattn.{op}: {name} must have at least one entry (batch + 1)")
    if check_values and cu.device.type == "cpu":
        if int(cu[0]) != 0 or int(cu[-1]) != total:
            raise ValueError(
                f"ragattn.{op}: {name} must start at 0 and end at {total} (the packed length), "
                f"got {int(cu[0])} .. {int(cu[-1])}"
            )
        if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"ragattn.{op}: {name} must be non-decreasing")
    return cu.numel() - 1


def check_out(op: str, name: str, out: torch.Tensor, *, shape, dtype: torch.dtype, device: torch.device,
              inputs: dict) -> None:
    """A preallocated output: exact shape and dtype, the inputs' device, contiguous, and sharing no
    memory with any input (the op would read what it already wrote)."""
    check_tensor(op, name, out, dtypes=(dtype,), shape=shape, device=device, contiguous=True)
    for other, t in inputs.items():
        if t is not None and t.device == out.device and out.numel() and t.numel() and _overlap(out, t):
            raise ValueError(f"ragattn.{op}: {name} overlaps the memory of {other}; pass a separate buffer")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of two tensors' storages can intersect (conservative: extents)."""
    from torch._subclasses.fake_tensor import is_fake

    sa, sb = a.untyped_storage(), b.untyped_storage()
    same = sa._cdata == sb._cdata  # one StorageImpl: also holds for fake tensors (fake impls)
    if not same and not (is_fake(a) or is_fake(b) or a.device.type == "meta"):
        same = sa.data_ptr() == sb.data_ptr() != 0  # two storages wrapping one allocation
    if not same:
        return False

    def extent(t):
        lo = t.storage_offset()
        hi = lo + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
        return lo * t.element_size(), hi * t.element_size()

    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU the current one while in the block (no-op for CPU tensors).

    Triton launches on the current CUDA device and stream, not the tensors' device: without this
    a tensor on ``cuda:1`` while ``cuda:0`` is current would be read from the wrong device.
    """
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
