"""ragattn's kernels as a vLLM attention backend (vLLM's ``CUSTOM`` slot).

Prefill and decode of every decoder layer run on ragattn's public ops: the metadata builder
makes one :class:`ragattn.ops.PagedAttentionStep` per scheduler step (a ``PageTable`` over vLLM's
block table, ``plan_paged_attention`` once per step where the kernel plans: CUDA), and each
layer's ``forward`` runs it (``run_paged_attention``) on the layer's cache. Chunked prefill,
continuous batching and preemption are vLLM's: a step is any mix of new and continued rows.

KV layout. vLLM 0.32 gives each layer a logical ``[num_blocks, Hkv, block_size, 2 * D]`` cache
(RFC 42082) whose memory order the backend picks (``supported_kv_cache_layouts``). This backend
asks for ``LBNHC``: in memory ``[num_blocks, block_size, Hkv, 2 * D]``, a token's heads side by
side and each head's ``[K | V]`` in one run (the connector's ``"channel"`` split). K and V are
then ``[num_pages, page_size, Hkv, D]`` strided views with a unit last stride, the page shape
ragattn's kernels read (no copy, no transpose per step). Keys are stored rotated, as vLLM's
model applies RoPE before attention.

Selected with ``RAGATTN_VLLM_ATTENTION=1`` (see :mod:`ragattn.vllm.platform` and docs/vllm.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.v1.kv_cache_layout import KVCacheLayout

from ragattn import ops as _ops
from ragattn.kv import PassStep, entry_tables
from ragattn.ops import PagedAttentionStep, PageTable
from ragattn.ops.page_table import page_index, page_offset
from ragattn.vllm.connector_config import FP8_CACHE_DTYPES
from ragattn.vllm.pages import FP8, FP8_STORAGE, head_views
from ragattn.vllm.worker_state import WorkerState, worker_state

KV_SPLIT = "channel"   # where K and V sit in a block (ragattn.vllm.pages): each (token, head)'s C = [K | V]


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k, v)`` of one layer's cache (logical ``[num_blocks, Hkv, block_size, 2 * D]``, any
    strides with a unit last stride): each ``[num_blocks, block_size, Hkv, D]``, views."""
    return kv_cache[..., :head_size].transpose(1, 2), kv_cache[..., head_size:].transpose(1, 2)


def query_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int32 ``[num_tokens]``: each query row's position in its sequence (a request's ``q`` new
    rows are its last ``q`` tokens: ``seq_len - q .. seq_len - 1``)."""
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    req = torch.repeat_interleave(torch.arange(q_lens.numel(), device=q_lens.device), q_lens,
                                  output_size=num_tokens)
    row = torch.arange(num_tokens, device=q_lens.device)
    return (row - query_start_loc[req] + (seq_lens - q_lens)[req]).to(torch.int32)


@dataclass
class RagattnAttentionMetadata:
    """One scheduler step: ``num_actual_tokens`` real query rows (the rest padding), ``step``
    (the ``PagedAttentionStep`` every layer runs), ``q_pos`` int32 ``[num_actual_tokens]``;
    ``capture_query``: a list that receives the layer's query ``[num_actual_tokens, Hq, D]``
    (ragattn.vllm.recompute's FusionRAG selection), None in vLLM's steps; ``lse``: float32
    ``[num_actual_tokens, Hq]``, the step's one LSE buffer (made by the first layer, written by
    every layer: vLLM reads no LSE)."""
    num_actual_tokens: int
    step: PagedAttentionStep
    q_pos: torch.Tensor
    capture_query: list | None = None
    lse: torch.Tensor | None = None
    shared: "SharedStep | None" = None


class SharedStep:
    """A step's passes when a request reads shared chunk pages (:mod:`ragattn.vllm.shared_pages`):
    decided at the first layer's call, because vLLM builds the metadata before the connector's
    ``start_load_kv`` registers the step's requests in the worker's ``state``. ``steps()``: None,
    or the step's :class:`ragattn.kv.PassStep` (private pages by position, chunk pages as entries)."""

    def __init__(self, state: WorkerState | None, num_rows, block_table, seq_lens, block_size, cu, max_q_len):
        self._state, self._num_rows = state, num_rows
        self._args = (block_table, seq_lens, block_size)
        self._cu, self._max_q_len = cu, max_q_len
        self._steps = False

    @classmethod
    def of_tables(cls, tables, cu, max_q_len, rope) -> "SharedStep":
        """A step whose ``(private, shared)`` tables are made already (ragattn.vllm.recompute's
        passes over one request)."""
        step = cls(None, 0, None, None, 0, cu, max_q_len)
        step._steps = PassStep(tables, cu, max_q_len, rope)
        return step

    def steps(self) -> PassStep | None:
        if self._steps is False:
            found = self._state.batch_entries(self._num_rows)
            self._steps = None if found is None else PassStep(entry_tables(found, *self._args), self._cu,
                                                              self._max_q_len, self._state.rope)
        return self._steps


class RagattnAttentionMetadataBuilder(AttentionMetadataBuilder[RagattnAttentionMetadata]):
    """Builds one step's ``PageTable`` and ``PagedAttentionStep`` from vLLM's block table."""

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # the worker's ragattn state (its connector's), found at the first build that has one
        self.worker_state: WorkerState | None = None

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RagattnAttentionMetadata:
        m = common_attn_metadata
        if not (m.causal is True):
            raise NotImplementedError("ragattn attention backend: only causal decoder attention is supported")
        n = m.num_actual_tokens
        b = m.num_reqs
        cu = m.query_start_loc[:b + 1]
        kv_lens = m.seq_lens[:b]
        table = PageTable.from_block_table(m.block_table_tensor[:b], kv_lens)
        step = PagedAttentionStep(cu, table, max_q_len=m.max_query_len, max_kv_len=m.max_seq_len)
        if n == b and m.max_query_len == 1:   # a decode step: one row per request, at its last position
            q_pos = (kv_lens - 1).to(torch.int32)
        else:
            q_pos = query_positions(cu, kv_lens, n)
        if self.worker_state is None:
            self.worker_state = worker_state()
        shared = None
        if self.worker_state is not None and self.worker_state.serves_shared_pages():
            shared = SharedStep(self.worker_state, b, m.block_table_tensor[:b], kv_lens, self.kv_cache_spec.block_size,
                                cu, m.max_query_len)
        return RagattnAttentionMetadata(num_actual_tokens=n, step=step, q_pos=q_pos, shared=shared)


class RagattnAttentionImpl(AttentionImpl):
    """Writes the step's K/V into the layer's pages (``do_kv_cache_update``) and attends with
    ``PagedAttentionStep.run``; refuses what the kernels do not do (ALiBi, sinks, encoder
    attention) at construction, naming it. fp8 caches (``kv_cache_dtype`` ``fp8``/``fp8_e4m3``:
    float8_e4m3fn with the layer's per-tensor ``_k_scale``/``_v_scale``) are written quantised by
    ``copy_kv_`` (the rule of the connector's writer) and read dequantised by the kernel; shared
    chunk pages and the selective recompute need unquantised caches (refused, naming it)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None, kv_cache_dtype: str,
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks: torch.Tensor | None = None) -> None:
        for what, bad in (("alibi_slopes", alibi_slopes is not None), ("sinks", sinks is not None),
                          (f"kv_cache_dtype={kv_cache_dtype!r}", kv_cache_dtype not in ("auto",) + FP8_CACHE_DTYPES),
                          (f"attn_type={attn_type!r}", attn_type != AttentionType.DECODER)):
            if bad:
                raise NotImplementedError(f"ragattn attention backend: {what} is not supported")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = float(scale)
        self.window_left = -1 if sliding_window is None else sliding_window - 1   # the window holds the row itself
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self._cache_views: tuple | None = None   # (kv_cache, k, v, k rows, v rows) of the layer's cache
        self._fp8_heads: tuple | None = None     # (kv_cache, per-head K views, per-head V views): fp8 writes

    def _views(self, kv_cache: torch.Tensor) -> tuple:
        """``(kv_cache, k, v, k_rows, v_rows)``: ``kv_views`` of the layer's cache and, where slots
        are evenly strided (the LBNHC memory this backend asks for), its ``[num_blocks * block_size,
        Hkv, D]`` row views (else None); made once per cache tensor, not per layer call."""
        views = self._cache_views
        if views is None or views[0] is not kv_cache:
            k, v = kv_views(kv_cache.view(FP8) if kv_cache.dtype in FP8_STORAGE else kv_cache, self.head_size)
            rows = k.stride(0) == k.shape[1] * k.stride(1)
            views = self._cache_views = (kv_cache, k, v, k.flatten(0, 1) if rows else None,
                                         v.flatten(0, 1) if rows else None)
        return views

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[n, Hkv, D]`` at vLLM's slots ``slot_mapping`` int64 ``[n]``
        (``block * block_size + offset``; negative: padding, not written)."""
        _, k, v, k_rows, v_rows = self._views(kv_cache)
        n = _step_rows(layer)
        if n is not None:    # a step's real rows (vLLM pads the rest with slot -1): no filter, no device read
            slots, key, value = slot_mapping[:n].long(), key[:n], value[:n]
        else:                # outside a step (no metadata to say): drop the negative slots
            n = slot_mapping.shape[0]
            slots = slot_mapping.long()
            if key.shape[0] != n:
                key, value = key[:n], value[:n]
            if n and int(slots.min()) < 0:
                keep = slots >= 0
                slots, key, value = slots[keep], key[keep], value[keep]
        if self.fp8:   # quantised on the way: clamp(x / scale, -448, 448), rounded to nearest even
            k_scale, v_scale = _scales(layer, "write to")
            if self._fp8_heads is None or self._fp8_heads[0] is not kv_cache:
                self._fp8_heads = (kv_cache, *head_views(kv_cache.view(FP8), self.num_kv_heads, self.head_size,
                                                         k.shape[1], KV_SPLIT))
            hs = range(self.num_kv_heads)
            _ops.copy_kv_(self._fp8_heads[1], self._fp8_heads[2], [key[:, h:h + 1] for h in hs],
                          [value[:, h:h + 1] for h in hs], torch.arange(slots.shape[0], device=slots.device), slots,
                          num_kv_heads=1, dst_k_scale=k_scale, dst_v_scale=v_scale)
            return
        if key.dtype != k.dtype:
            key, value = key.to(k.dtype), value.to(v.dtype)
        if k_rows is not None:
            # one row per slot, written by index_copy_ (no div/mod)
            k_rows.index_copy_(0, slots, key)
            v_rows.index_copy_(0, slots, value)
            return
        blk, off = page_index(slots, k.shape[1]), page_offset(slots, k.shape[1])
        k[blk, off] = key
        v[blk, off] = value

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: RagattnAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` (rotated) against the pages of ``kv_cache`` (this step's K/V
        already written): ``output`` ``[T, Hq * D]`` (or ``[T, Hq, D]``), its first
        ``num_actual_tokens`` rows written."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("ragattn attention backend: fused output quantization is not supported")
        if attn_metadata is None:      # vLLM's warm-up / profile run
            return output
        n = attn_metadata.num_actual_tokens
        q = query if query.shape[0] == n else query[:n]
        if attn_metadata.capture_query is not None:
            attn_metadata.capture_query.append(q.clone())
        _, k, v, _, _ = self._views(kv_cache)
        rows = output if output.shape[0] == n else output[:n]
        lse = attn_metadata.lse
        if lse is None or lse.shape != (n, self.num_heads):
            lse = attn_metadata.lse = q.new_empty((n, self.num_heads), dtype=torch.float32)
        if rows.is_contiguous() and rows.dtype == q.dtype:   # the kernel writes vLLM's output rows in place
            out = rows.view(n, self.num_heads, self.head_size)
        else:
            out = None
        steps = attn_metadata.shared.steps() if attn_metadata.shared is not None else None
        scales = {}
        if self.fp8:
            if steps is not None or attn_metadata.capture_query is not None:
                raise NotImplementedError("ragattn attention backend: shared chunk pages and the selective recompute "
                                          "need unquantised KV caches, not kv_cache_dtype="
                                          f"{self.kv_cache_dtype!r}")
            scales = dict(zip(("k_scale", "v_scale"), _scales(layer, "read")))
        # one pass over the step's pages, or its own pages (keys rotated) and chunk pages (keys rotated
        # in the kernel) merged exactly
        step = attn_metadata.step if steps is None else steps
        o, _ = step.run(q, attn_metadata.q_pos, k, v, self.scale, window_left=self.window_left,
                        logits_soft_cap=self.logits_soft_cap, out=out, lse_out=lse, **scales)
        if out is None:
            rows.copy_(o.reshape(rows.shape))
        return output


def _scales(layer, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's fp8 scales (``_k_scale``, ``_v_scale``: float32 ``[1]``, read at every call, so a
    scale vLLM updates in place is honoured), or ValueError naming what needs them."""
    if not (hasattr(layer, "_k_scale") and hasattr(layer, "_v_scale")):
        raise ValueError(f"ragattn attention backend: to {what} an fp8 KV cache needs the layer's _k_scale and "
                         "_v_scale")
    return layer._k_scale, layer._v_scale


def _step_rows(layer) -> int | None:
    """The real (unpadded) rows of the step ``layer`` runs in: its metadata's ``num_actual_tokens``
    (computed once per step by the builder), or None outside a step with ragattn's metadata."""
    if layer is None or not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if isinstance(meta, list):
        meta = meta[0]
    if isinstance(meta, dict):
        meta = meta.get(getattr(layer, "layer_name", None))
    return meta.num_actual_tokens if isinstance(meta, RagattnAttentionMetadata) else None


class RagattnAttentionBackend(AttentionBackend):
    """vLLM attention backend on ragattn's paged attention (registered as ``CUSTOM``)."""
    forward_includes_kv_cache_update: bool = False
    kv_split: ClassVar[str] = KV_SPLIT     # read by the connector's page writer (ragattn.vllm.pages)
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", *FP8_CACHE_DTYPES]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [32, 64, 80, 96, 112, 128, 256]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[RagattnAttentionImpl]:
        return RagattnAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[RagattnAttentionMetadataBuilder]:
        return RagattnAttentionMetadataBuilder
