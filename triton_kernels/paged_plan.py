"""The host planner of ``paged_attention``'s Triton kernel: the tile map (which query rows each
program owns), the launch configuration from ``configs/paged_attention.json`` fitted to the
shared-memory budget, and the split-KV factor. Plain torch on the inputs' device; reads the
batch's maxima back to the host unless they are given (then nothing is read and the plan can be
captured in a CUDA graph).

    plan = plan_paged_attention(cu_seqlens_q, kv_lens, num_heads=H, num_kv_heads=Hk, head_dim=D,
                                dtype=q.dtype, max_q_len=None, max_kv_len=None)   # a PagedPlan
    plan.launch(); PagedPlan.from_launch(tile_seq, tile_row0, launch)   # the custom op's int[]
    kernel_config(m_tile, block_d, elt), shape_key(...), smem_bytes(...), splits_for_sms(...)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton


def page_mode(page_size: int, block_n: int, split_len: int) -> int:
    """The kernel's PAGE_MODE: 2 when a key tile lies inside one page, 1 when it covers whole pages,
    0 (a table read per slot) for page sizes that are not powers of two or tiles that straddle pages."""
    if page_size & (page_size - 1) or split_len % block_n:
        return 0
    return 2 if page_size % block_n == 0 else 1


def split_whole_tiles(m_tile: int) -> bool:
    """The kernel's SPLIT_WHOLE_TILES for query tiles of ``m_tile`` stacked rows: decode and verify
    tiles (<= 64 rows) run whole key tiles in a loop of their own; prefill's (128) would spill."""
    return m_tile <= 64


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


SMEM_BUDGET = 160 * 1024  # of ``smem_bytes``: fits sm_90 (227 KB a CTA) and sm_80 (163 KB)


def kv_buffers(m_tile: int, num_stages: int) -> int:
    """Shared-memory copies of each of K and V that Triton's software pipeliner (3.x, sm_90) allocates
    for a loop of ``num_stages`` stages, as the compiled kernels show (``bench.sm90``): tiles of
    at least 64 stacked rows (warpgroup MMAs) take ``max(2, stages - 2)``, smaller ones (decode)
    ``max(1, stages - 3)``: a 16-row decode tile keeps one K and one V tile in flight up to 4
    stages and double-buffers them at 5."""
    return max(2, num_stages - 2) if m_tile >= 64 else max(1, num_stages - 3)


def smem_bytes(m_tile: int, block_n: int, block_d: int, elt: int, num_stages: int) -> int:
    """Shared memory of the kernel for one config, modelled on what the compiler reports for sm_90
    (checked against it by tests/tooling/test_sm90_report.py): the pipelined K and V buffers of the busiest
    loop (the loops reuse one another's), the Q tile, an fp32 P tile of layout scratch and 1 KB of
    small buffers (page ids)."""
    return (2 * kv_buffers(m_tile, num_stages) * block_n * block_d * elt + m_tile * block_d * elt
            + 4 * m_tile * block_n + 1024)


def shape_key(m_tile: int, block_d: int, elt: int) -> str:
    """The config table's shape class: ``<kind>/<dtype class>/d<BLOCK_D>`` with kind "decode" (query
    tiles of at most 16 stacked rows: one decode row x a GQA group), "verify" (up to 64: speculative
    tails) or "prefill"."""
    kind = "decode" if m_tile <= 16 else "verify" if m_tile <= 64 else "prefill"
    return f"{kind}/{'fp32' if elt == 4 else '16bit'}/d{block_d}"


def table_key(m_tile: int, block_d: int, elt: int, window: bool, device_name: Optional[str]) -> str:
    """The key ``kernel_config`` reads: ``shape_key``, or under a sliding window its ``/window``
    variant where the device's entry has one (a window decode's loops differ: its own tiles and
    stages), else the plain class."""
    from .gpu_configs import has_own_config

    key = shape_key(m_tile, block_d, elt)
    if window and has_own_config("paged_attention", device_name, key + "/window"):
        return key + "/window"
    return key


def kernel_config(m_tile: int, block_d: int, elt: int, *, interp: bool = False,
                  device_name: Optional[str] = None, window: bool = False) -> dict:
    """The launch configuration: ``m_tile`` (stacked query rows), ``BLOCK_N`` (keys a loop step),
    ``num_warps``, ``num_stages`` and ``waves`` (split-KV fills ``waves`` x the SM count with programs).

    From ``configs/paged_attention.json``: the GPU's entry (``device_name``; keys as ``shape_key``,
    measured by ``python -m ragattn.bench.tune paged_attention``), else its "default" heuristic, or
    the "interpreter" entry (``window``: the class's ``/window`` variant where the entry has one,
    ``table_key``). ``m_tile`` is capped at the entry's ``BLOCK_M``; then the tiles are
    shrunk until ``smem_bytes`` (the compiler's shared memory, modelled) fits ``SMEM_BUDGET``
    (stages first, then the key tile, then the query tile).
    """
    from .gpu_configs import DEFAULT, get_config

    dev = None if interp else (device_name or DEFAULT)
    cfg = get_config("paged_attention", dev, table_key(m_tile, block_d, elt, window, dev))
    cfg["m_tile"] = min(m_tile, cfg.pop("BLOCK_M", m_tile))
    cfg.setdefault("waves", 4.0)
    if interp:
        return cfg

    while smem_bytes(cfg["m_tile"], cfg["BLOCK_N"], block_d, elt, cfg["num_stages"]) > SMEM_BUDGET:
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["BLOCK_N"] > 32:
            cfg["BLOCK_N"] //= 2
        elif cfg["m_tile"] > 16:
            cfg["m_tile"] //= 2
        else:
            break
    return cfg


def choose_num_splits(num_programs: int, max_kv_len: int, block_n: int, device: torch.device,
                      waves: float = 4.0) -> int:
    """Split the key range when the grid would leave the GPU under-filled (decode, few rows)."""
    if device.type != "cuda" or num_programs == 0:
        return 1
    from .gpu_configs import sm_count

    return splits_for_sms(num_programs, max_kv_len, block_n, sm_count(device), waves)


def splits_for_sms(num_programs: int, max_kv_len: int, block_n: int, sms: int, waves: float = 4.0,
                   min_tiles: int = 4) -> int:
    """``choose_num_splits`` for a GPU of ``sms`` SMs (pure: the static sm_90 report asks it too):
    as many splits as keep the grid within ``waves`` x ``sms`` programs (never a straggling partial
    wave), each split at least ``min_tiles`` key tiles long (a split costs a partial state per row
    and a merge), at most 64.

    Programs past the last whole wave run as a wave of their own and cost as much as a full one
    (docs/perf/): rounding down to ``waves`` x ``sms`` keeps every grid whole."""
    if num_programs == 0:
        return 1
    key_tiles = triton.cdiv(max(max_kv_len, 1), block_n)
    want = int(waves * sms // num_programs)
    return max(1, min(want, key_tiles // min_tiles, 64))


@dataclass(frozen=True)
class PagedPlan:
    """Everything the launch needs that depends on the batch's shape, not on tensor contents.

    Built by ``plan_paged_attention`` (reads ``cu_seqlens_q`` / ``kv_lens`` back to the host
    unless ``max_q_len`` / ``max_kv_len`` are given); ``run_paged_attention`` then launches without
    any host sync or CPU tensor, so a plan built once per decode step (or once for a captured batch
    shape, from maxima) makes the run CUDA-graph safe.

    ``tile_seq``/``tile_row0`` int32 ``[num_tiles]`` on the device: the sequence of each query
    tile and its first query row *counted from the sequence's start* (the kernel adds
    ``cu_seqlens_q[seq]``, read at run time; a tile past its sequence's rows has nothing to do). ``split_len``
    slots per split-KV partition (``num_splits`` of them, counted from each tile's first visible
    slot; the last one runs to the end of the visible range, whatever its length).
    """

    tile_seq: torch.Tensor
    tile_row0: torch.Tensor
    num_tiles: int
    block_m: int
    block_n: int
    block_d: int
    group: int
    group_pad: int
    num_splits: int
    split_len: int
    num_stages: int
    num_warps: int
    pipeline_v: int = 0  # the config's ``pipeline_v`` (0/1): prefill tiles' V load pipelined
    edge_loop: int = 0  # the config's ``edge_loop`` (0/1): a window split's edge tiles in one masked loop

    def launch(self) -> list:
        """The host integers of the plan, in ``from_launch``'s order (the custom op's ``int[]``)."""
        return [self.block_m, self.block_n, self.block_d, self.group, self.group_pad, self.num_splits,
                self.split_len, self.num_stages, self.num_warps, self.pipeline_v, self.edge_loop]

    @classmethod
    def from_launch(cls, tile_seq: torch.Tensor, tile_row0: torch.Tensor, launch) -> "PagedPlan":
        """The plan back from its device tensors and ``launch()`` list (no tensor data read)."""
        return cls(tile_seq, tile_row0, tile_seq.shape[0], *(int(x) for x in launch))


LAUNCH_FIELDS = 11  # len(PagedPlan.launch())


def plan_paged_attention(
    cu_seqlens_q: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    window_left: int = -1,
    num_splits: Optional[int] = None,
    max_q_len: Optional[int] = None,
    max_kv_len: Optional[int] = None,
) -> PagedPlan:
    """Tile map and launch configuration for a batch (``cu_seqlens_q`` int32/int64 ``[B + 1]``,
    ``kv_lens`` int32/int64 ``[B]``).

    ``max_q_len`` (query rows of the longest sequence) and ``max_kv_len`` (its cached slots) are
    read from the tensors when not given: one host sync on CUDA. Given both, nothing is read: the
    tile map (``ceil(max_q_len / block_m)`` tiles per sequence) is built on the device, so the plan
    itself can be captured in a CUDA graph. A sequence may never have more than ``max_q_len`` rows
    (its rows past the last tile would not be computed: checked on CPU and with RAGATTN_DEBUG=1);
    contexts longer than ``max_kv_len`` stay exact (the last split runs to the end) but slower.
    ``num_splits`` forces the split-KV factor (None: ``choose_num_splits``).
    """
    device = cu_seqlens_q.device
    batch = kv_lens.shape[0]
    group = num_heads // num_kv_heads
    host = None
    if max_q_len is None or max_kv_len is None:
        host = torch.cat([cu_seqlens_q.long(), kv_lens.long()]).cpu()
    exact_tiles = max_q_len is None  # the tile map from the host copy of cu_seqlens_q
    if max_q_len is None:
        rows = host[1: batch + 1] - host[:batch]
        max_q_len = int(rows.max()) if batch else 0
    if max_kv_len is None:
        lens = host[batch + 1:]
        max_kv_len = int(lens.max()) if batch else 0

    # tile shape: rows x group stacked to M = BLOCK_M * GROUP_PAD in [16, 128] (tl.dot needs M >= 16)
    group_pad = triton.next_power_of_2(group)
    m_tile = min(128, max(16, triton.next_power_of_2(max(max_q_len, 1) * group_pad)))
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    elt = torch.empty((), dtype=dtype).element_size()
    from .gpu_configs import device_name as table_device

    interp = interpreting()
    cfg = kernel_config(m_tile, block_d, elt, interp=interp, window=window_left >= 0,
                        device_name=table_device(device) if (device.type == "cuda" and not interp) else None)
    m_tile, block_n, num_stages, num_warps = cfg["m_tile"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"]
    block_m = max(1, m_tile // group_pad)

    if exact_tiles:
        # one tile per block_m rows actually present
        cu = host[: batch + 1]
        tiles_per_seq = (cu[1:] - cu[:-1] + block_m - 1) // block_m
        tile_seq = torch.repeat_interleave(torch.arange(batch, dtype=torch.int64), tiles_per_seq)
        first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
        tile_idx = torch.arange(tile_seq.numel(), dtype=torch.int64) - first_tile[tile_seq]
        tile_row0 = tile_idx * block_m
        tile_seq = tile_seq.to(torch.int32).to(device, non_blocking=True)
        tile_row0 = tile_row0.to(torch.int32).to(device, non_blocking=True)
    else:
        # planned for a maximum, on the device: every sequence gets ceil(max_q_len / block_m) tiles
        tps = triton.cdiv(max(max_q_len, 1), block_m) if max_q_len > 0 else 0
        t = torch.arange(batch * tps, dtype=torch.int64, device=device)
        tile_seq = torch.div(t, max(tps, 1), rounding_mode="floor")
        tile_row0 = ((t - tile_seq * tps) * block_m).to(torch.int32)
        tile_seq = tile_seq.to(torch.int32)
    num_tiles = tile_seq.shape[0]

    # the key span one tile can see: a tile holding one query row (decode) under a window sees at
    # most window_left + 1 slots (+ the slots left of the window in its first, aligned key tile)
    one_row = min(block_m, max_q_len) <= 1
    span = max_kv_len if (window_left < 0 or not one_row) else min(max_kv_len, window_left + block_n)
    if num_splits is None:
        num_splits = choose_num_splits(num_tiles * num_kv_heads, span, block_n, device, cfg["waves"])
    split_len = triton.cdiv(triton.cdiv(max(span, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(span, 1), split_len))
    return PagedPlan(
        tile_seq=tile_seq, tile_row0=tile_row0,
        num_tiles=num_tiles, block_m=block_m, block_n=block_n, block_d=block_d, group=group,
        group_pad=group_pad, num_splits=num_splits, split_len=split_len, num_stages=num_stages,
        num_warps=num_warps, pipeline_v=int(bool(cfg.get("pipeline_v", False))),
        edge_loop=int(bool(cfg.get("edge_loop", False))),
    )
