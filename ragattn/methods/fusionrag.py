"""FusionRAG (Wang et al., SIGMOD 2026), CacheBlend (Yao et al., EuroSys 2025) and Full Reuse:
chunk KV reuse with selective recompute, one recompute path for all three.

    from ragattn.methods import fusionrag
    res = fusionrag.answer(model, tokenizer, chunks, question, ratio=0.15, store=store)
    res = fusionrag.cacheblend(model, tokenizer, chunks, question, ratio=0.15, store=store)
    res = fusionrag.full_reuse(model, tokenizer, chunks, question, store=store)
    res.first_logits, res.ttft_s, res.extra["recomputed_slots"], res.extra["select_s"]  # see Answer

Every method starts from the Full Reuse request: the prompt head and each chunk's KV come from the
:class:`~ragattn.store.ChunkStore` (chunk keys re-rotated to consecutive positions by
``ChunkStore.assemble``), so chunks have not attended to each other. FusionRAG uses each chunk's
*fused* cache where the store has one (offline, :func:`fuse_chunks` / ``python -m ragattn
build-store``: the chunk prefilled after the prompt head and the cached KV of its ``n`` most similar
chunks (MiniLM cosine, default 10, most similar first), stored re-rotated to the chunk's own
positions as a variant of the chunk). Then:

* **Full Reuse** (the ratio-0 case): only the final block (question + assistant header) is computed.
* **FusionRAG**, query-guided selection (paper §3.2): the final block runs once against the reused
  context to get its last-layer queries (``question="context"``; ``"standalone"``: the final block
  alone at its true positions, the authors' code; the pass stops at the last layer's query, whose
  attention and MLP nothing reads); ``ragattn.key_attention_scores`` gives each chunk
  token the attention mass those queries put on its cached last-layer key (softmax per chunk by
  default, as in the paper, or over all chunk tokens); the top ``ratio`` of the chunk tokens are
  recomputed.
* **CacheBlend**, gradual filtering (CacheBlend §4.3): every chunk token is recomputed through the
  first layers; after each check layer (default 1, 2, 3: layer 0's K/V equal the cached ones) the
  chunk tokens whose fresh K/V deviate most from the cached K/V (sum of squared differences over
  heads and dims, K and V) are kept, a shrinking fraction (``2r .. r``), and only those go on.

Recompute (:func:`recompute`): the selected chunk tokens and the final block go through every
layer together, each at its true position: per layer, their Q/K/V are computed, their K/V overwrite
their slots of the request's paged cache (``ragattn_slots`` of the HF patch), and they attend
through ``ragattn.paged_attention`` to the slots at or before their own position (fresh K/V of
earlier recomputed tokens, cached K/V of the others; never a later slot). The last row's logits
give the first token (``Answer.first_logits``); :func:`~ragattn.methods.generate.generate_paged`
decodes the rest (greedy). The selection ratio counts chunk tokens only (the head is a true prefix, its cache is
exact; the final block is always computed). At ``ratio=1`` every method computes full attention.

Tensor parallelism: with the heads split across ranks, pass ``group`` (a ``torch.distributed``
process group); scores and deviations are all-reduced before the top-k so that every rank selects
the same tokens (:func:`top_rows`).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from ragattn import ops as _ops
from ragattn.hf.layer_walk import HFLayerWalk, decoder
from ragattn.hf.registration import use_ragattn
from ragattn.methods.generate import Answer, _eos_ids, _sync, generate_paged
from ragattn.methods import registry
from ragattn.methods.prompt import prompt_parts
from ragattn.methods.selection import (CACHEBLEND_CHECK_LAYERS, budget, cacheblend_schedule, check_ratio,
                                       fused_variant, query_guided_scores, top_rows, walk_layers)

QUESTION_MODES = ("context", "standalone")


# ----------------------------------------------------------------------------------------------
# the shared recompute path


@torch.no_grad()
def recompute(model, cache, ids: torch.Tensor, slots: torch.Tensor, *, positions=None,
              check_layers: dict | None = None, num_candidates: int = 0, capture_query: list | None = None,
              group=None, logits: bool = False, query_only: bool = False):
    """Run the tokens ``ids`` (int64 ``[n]``) through every layer, each writing its K/V at its slot
    ``slots`` (int ``[n]``, distinct, ``< cache.lengths[0]``) of the paged request ``cache`` and
    attending causally by slot (a row never sees a later slot). RoPE positions are ``positions``
    (default: the slots). The model must run with the "ragattn" attention (``use_ragattn``).

    ``check_layers`` ``{layer: keep}`` (CacheBlend's gradual filtering): after such a layer, of the
    first ``num_candidates`` rows still running (the chunk tokens; the rows after them are always
    kept), the ``keep`` whose K/V deviate most from the cache's previous K/V at their slots go on,
    the others stop (their K/V written so far stay). ``capture_query``: a list that receives the
    last layer's query ``[1, Hq, rows, D]``; with ``query_only`` the pass stops once it has that
    query (the last layer's attention, K/V write and MLP are never run: its K/V at ``slots`` stay as
    they were), for a caller that needs the query alone (the selection pass). Returns (the slots
    that ran through the last layer, float32 logits ``[vocab]`` of the last row if ``logits`` else
    None). The loop is :func:`ragattn.methods.selection.walk_layers` over
    :class:`ragattn.hf.layer_walk.HFLayerWalk`."""
    if query_only and (capture_query is None or logits):
        raise ValueError("ragattn.methods.fusionrag.recompute: query_only needs capture_query and no logits")
    walk = HFLayerWalk(model, cache, ids, slots, positions=positions, capture_query=capture_query,
                       query_only=query_only)
    if not walk_layers(walk, checks=check_layers, num_candidates=num_candidates, group=group):
        return walk.slots, None
    return walk.slots, walk.logits() if logits else None


# ----------------------------------------------------------------------------------------------
# offline fusion (paper §3.1, Eq. 10)


def neighbours(embeddings: torch.Tensor, n: int = 10) -> list[list[int]]:
    """For each row of ``embeddings`` (float ``[N, E]``, unit rows), the indices of its ``min(n, N-1)``
    most similar other rows (cosine), most similar first; ties to the lower index. Deterministic."""
    if n < 0:
        raise ValueError(f"ragattn.methods.fusionrag.neighbours: n must be >= 0, got {n}")
    sim = embeddings.double() @ embeddings.double().T
    sim.fill_diagonal_(float("-inf"))
    k = min(n, embeddings.shape[0] - 1)
    order = torch.sort(sim, dim=1, descending=True, stable=True).indices[:, :k]
    return order.tolist()


@torch.no_grad()
def fuse_chunks(model, store, head: Sequence[int], chunks: Sequence[Sequence[int]],
                neighbour_lists: Sequence[Sequence[int]], which: Sequence[int] | None = None,
                batch: int = 8, progress=None) -> tuple[int, int]:
    """Build the fused caches of ``chunks[i]`` for ``i`` in ``which`` (default all) into ``store``.

    Chunk ``i`` is prefilled after the prompt head and the cached (raw, independent) KV of its
    neighbours ``chunks[j]``, ``j in neighbour_lists[i]`` in that order, re-rotated to consecutive
    positions; its K/V are then re-rotated back to the chunk's local positions and stored as the
    variant :func:`fused_variant` of the chunk (``ChunkStore.put``, on disk if the store has a
    directory). ``batch`` chunks run per forward (one paged request row each). Chunks whose fused
    cache is already in the store (or, read whole and verified, in its directory) are skipped:
    resumable (a truncated or corrupt file is built again). ``progress(n)`` is
    called after each batch. Returns (built, skipped)."""
    from ragattn.kv import PagedKV

    if batch < 1:
        raise ValueError(f"ragattn.methods.fusionrag.fuse_chunks: batch must be >= 1, got {batch}")
    keys = store.add([list(head)] + [list(c) for c in chunks])
    head_key, keys = keys[0], keys[1:]
    variant = fused_variant(head)
    which = range(len(chunks)) if which is None else which
    todo = [i for i in which if not store.verify(store.variant_key(keys[i], variant))]  # checked, not trusted
    todo.sort(key=lambda i: -len(chunks[i]))  # similar lengths per batch: little padding
    base, rope, dev = decoder(model), store.rope, store.device
    for b0 in range(0, len(todo), batch):
        rows = todo[b0:b0 + batch]
        reqs = [store.assemble([head_key] + [keys[j] for j in neighbour_lists[i]]) for i in rows]
        lens = [len(chunks[i]) for i in rows]
        past = [r.num_slots for r in reqs]
        width = max(lens)
        cache = PagedKV(store.num_layers, len(rows), max(past) + width, store.num_kv_heads,
                        store.head_dim, store.page_size, store.dtype, dev)
        for b, r in enumerate(reqs):
            n = torch.arange(past[b], device=dev)
            _ops.copy_kv_(cache.k, cache.v, r.cache.k, r.cache.v, r.cache.slot_rows(0, n),
                          cache.slot_rows(b, n))
        cache.lengths.copy_(torch.tensor(past, dtype=torch.int32, device=dev))
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)  # padding after each chunk
        for b, i in enumerate(rows):
            ids[b, :lens[b]] = torch.as_tensor(list(chunks[i]), device=dev)
        pos = torch.tensor(past, device=dev)[:, None] + torch.arange(width, device=dev)
        with use_ragattn(model):
            base(input_ids=ids, position_ids=pos, use_cache=False, ragattn_paged=cache)
        for b, i in enumerate(rows):
            n = lens[b]
            shape = (n, store.num_kv_heads, store.head_dim)
            k_out = [torch.empty(shape, dtype=store.dtype, device=dev) for _ in range(store.num_layers)]
            v_out = [torch.empty_like(t) for t in k_out]
            _ops.copy_kv_(k_out, v_out, cache.k, cache.v,
                          cache.slot_rows(b, past[b] + torch.arange(n, device=dev)),
                          torch.arange(n, device=dev),
                          torch.full((n,), -past[b], dtype=torch.int32, device=dev),
                          rope.inv_freq.to(dev), rope.rotary_dim, rope.interleaved)
            store.put(keys[i], variant, k_out, v_out)
        if progress is not None:
            progress(len(rows))
    return len(todo), len(which) - len(todo)


# ----------------------------------------------------------------------------------------------
# answering


def _check_store(model, store, where):
    from ragattn.store import ChunkStore

    if store is None:
        return ChunkStore(model)
    store.check_model(model, f"ragattn.methods.fusionrag.{where}")   # follows its own model's weights
    return store


def _select_query_guided(model, req, head_len, tail, k, *, question, score_norm, group):
    """Slots (int64, sorted) of the ``k`` chunk tokens FusionRAG recomputes."""
    dev = req.cache.lengths.device
    ctx = req.num_slots
    tail_ids = torch.tensor(tail, device=dev)
    tail_pos = ctx + torch.arange(len(tail), device=dev)
    cap: list = []
    if question == "context":  # the final block against the reused context (Eq. 6)
        req.cache.lengths[0] = ctx + len(tail)
        recompute(model, req.cache, tail_ids, tail_pos, capture_query=cap, query_only=True)
        req.cache.lengths[0] = ctx
    else:  # the final block alone (own small cache), at its true positions
        from ragattn.kv import PagedKV

        c = req.cache
        k0 = c.read_kv(0, torch.zeros(1, dtype=torch.long, device=dev))[0]
        small = PagedKV(c.num_layers, 1, len(tail), k0.shape[1], k0.shape[2], c.page_size, k0.dtype, dev)
        small.lengths[0] = len(tail)
        recompute(model, small, tail_ids, torch.arange(len(tail), device=dev), positions=tail_pos,
                  capture_query=cap, query_only=True)
    q_last = cap[0][0].transpose(0, 1)                                   # [T, Hq, D]
    chunk_slots = torch.arange(head_len, ctx, device=dev)
    k_last = req.cache.read_kv(req.cache.num_layers - 1, chunk_slots)[0]   # [N, Hkv, D], rotated
    attn = decoder(model).layers[-1].self_attn
    scores = query_guided_scores(q_last, k_last, req.chunk_lens[1:], score_norm,
                                 getattr(attn, "scaling", None))
    return chunk_slots[top_rows(scores, k, group)]


def _answer(model, tokenizer, chunks, question, *, method, ratio, max_new_tokens, store, fused=None,
            question_mode="context", score_norm="per_chunk", check_layers=CACHEBLEND_CHECK_LAYERS,
            group=None, zero_copy: bool = True) -> Answer:
    where = {"fusionrag": "answer", "cacheblend": "cacheblend", "full_reuse": "full_reuse"}[method]
    ratio = check_ratio(ratio, where)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"ragattn.methods.fusionrag.{where}: max_new_tokens must be an integer >= 1, "
                         f"got {max_new_tokens!r}")
    if question_mode not in QUESTION_MODES:
        raise ValueError(f"ragattn.methods.fusionrag.{where}: question must be one of "
                         f"{QUESTION_MODES}, got {question_mode!r}")
    if len(chunks) == 0:
        raise ValueError(f"ragattn.methods.fusionrag.{where}: no chunks given (empty retrieval)")
    store = _check_store(model, store, where)
    head, chunk_ids, tail = prompt_parts(tokenizer, chunks, question)
    dev = store.device
    with use_ragattn(model):  # switched outside the timed region
        t0 = time.perf_counter()
        keys = store.add([head] + chunk_ids)
        n_fused = 0
        if fused is not False:
            variant = fused_variant(head)
            fkeys = store.variant_keys(keys[1:], variant)
            have = store.lookup(fkeys)   # one check of the model's weights, not one per chunk
            if fused and not all(have):
                from ragattn.store import ChunkStoreError

                raise ChunkStoreError(
                    f"ragattn.methods.fusionrag.{where}: {have.count(False)} of {len(have)} chunks have "
                    "no fused cache in the store (build them with `python -m ragattn build-store` "
                    "or fusionrag.fuse_chunks)")
            keys = keys[:1] + [f if h else k for f, h, k in zip(fkeys, have, keys[1:])]
            n_fused = sum(have)
        if zero_copy:   # the store's own pages; the recomputed ones copied on write
            req = store.request(keys, positions="reordered", extra_slots=len(tail) + max_new_tokens)
        else:
            req = store.assemble(keys, positions="reordered", extra_slots=len(tail) + max_new_tokens)
        try:
            return _answer_request(model, tokenizer, store, req, head, chunk_ids, tail, t0, method=method,
                                   ratio=ratio, max_new_tokens=max_new_tokens, question_mode=question_mode,
                                   score_norm=score_norm, check_layers=check_layers, group=group,
                                   n_fused=n_fused)
        finally:
            if zero_copy:
                req.release()


def _answer_request(model, tokenizer, store, req, head, chunk_ids, tail, t0, *, method, ratio, max_new_tokens,
                    question_mode, score_norm, check_layers, group, n_fused) -> Answer:
    dev = store.device
    ctx, head_len = req.num_slots, len(head)
    n_chunk = ctx - head_len
    k = budget(ratio, n_chunk)
    _sync(dev)
    t_sel = time.perf_counter()
    checks = None
    if method == "fusionrag" and k == n_chunk:
        chosen = torch.arange(head_len, ctx, device=dev)  # everything: nothing to score
    elif method == "fusionrag" and k > 0:
        chosen = _select_query_guided(model, req, head_len, tail, k, question=question_mode,
                                      score_norm=score_norm, group=group)
    elif method == "cacheblend":
        chosen = torch.arange(head_len, ctx, device=dev)
        checks = cacheblend_schedule(ratio, n_chunk, check_layers)
    else:
        chosen = torch.empty(0, dtype=torch.long, device=dev)
    _sync(dev)
    t_rec = time.perf_counter()
    # the selected chunk tokens and the whole final block: its last row gives the first token
    slots = torch.cat([chosen, ctx + torch.arange(len(tail), device=dev)])
    ids = torch.tensor(store_tokens(head, chunk_ids) + tail, device=dev)[slots]
    req.cache.lengths[0] = ctx + len(tail)
    kept, first = recompute(model, req.cache, ids, slots, check_layers=checks,
                            num_candidates=chosen.numel(), group=group, logits=True)
    tok = int(first.argmax())
    _sync(dev)
    ttft = time.perf_counter() - t0
    tokens = [tok]
    if max_new_tokens > 1 and tok not in _eos_ids(model, tokenizer):  # greedy decode
        tokens += generate_paged(model, tokenizer, req.cache, [tok], ctx + len(tail),
                                 max_new_tokens - 1, t0, method, ctx + len(tail)).tokens
    _sync(dev)
    recomputed = kept[kept < ctx]
    extra = dict(ratio=ratio, recomputed_slots=recomputed.tolist(), context_tokens=n_chunk,
                 assemble_s=t_sel - t0, select_s=t_rec - t_sel, recompute_s=t0 + ttft - t_rec,
                 fused_chunks=n_fused)
    if hasattr(req, "private_bytes"):   # zero-copy: what this request held on its own
        extra.update(private_bytes=req.private_bytes, cow_pages=req.cache.cow_pages)
    return Answer(tokens, tokenizer.decode(tokens, skip_special_tokens=True), ttft,
                  time.perf_counter() - t0, first, ctx + len(tail), method, extra)


def store_tokens(head, chunk_ids) -> list[int]:
    """Token ids of the context slots in request order (head, then chunk after chunk)."""
    return list(head) + [t for c in chunk_ids for t in c]


def answer(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
           ratio: float = registry.DEFAULT_RATIO, fused: bool | None = None, question_mode: str = "context",
           score_norm: str = "per_chunk", group=None, zero_copy: bool = True) -> Answer:
    """FusionRAG: query-guided selection of ``ratio`` of the chunk tokens, recomputed through every
    layer (see the module docstring). ``fused``: use the chunks' fused caches (built offline by
    :func:`fuse_chunks` / ``python -m ragattn build-store``): None (default) where the store has
    one, True: all chunks (ChunkStoreError if one is missing), False: the raw caches only.
    ``zero_copy`` (default): the request reads the store's pages in place (recomputed pages are
    copied on write); False: the chunks are copied into a request cache first (``assemble``)."""
    return _answer(model, tokenizer, chunks, question, method="fusionrag", ratio=ratio,
                   max_new_tokens=max_new_tokens, store=store, fused=fused,
                   question_mode=question_mode, score_norm=score_norm, group=group, zero_copy=zero_copy)


def cacheblend(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
               ratio: float = registry.DEFAULT_RATIO, check_layers: Sequence[int] = CACHEBLEND_CHECK_LAYERS,
               group=None, zero_copy: bool = True) -> Answer:
    """CacheBlend: K/V-deviation selection with gradual filtering over ``check_layers``, then the
    same recompute (see the module docstring; ``zero_copy`` as in :func:`answer`)."""
    if not check_layers or min(check_layers) < 1 or list(check_layers) != sorted(set(check_layers)):
        raise ValueError(f"ragattn.methods.fusionrag.cacheblend: check_layers must be increasing "
                         f"layer indices >= 1, got {check_layers!r}")
    depth = len(decoder(model).layers)
    if max(check_layers) >= depth:   # a check that never runs would leave every candidate recomputed
        raise ValueError(f"ragattn.methods.fusionrag.cacheblend: check_layers {tuple(check_layers)} must be "
                         f"layers of the model, in [1, {depth - 1}] (it has {depth} layers)")
    return _answer(model, tokenizer, chunks, question, method="cacheblend", ratio=ratio,
                   max_new_tokens=max_new_tokens, store=store, fused=False, check_layers=tuple(check_layers),
                   group=group, zero_copy=zero_copy)


def full_reuse(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
               ratio: float = 0.0, zero_copy: bool = True) -> Answer:
    """Full Reuse: the cached chunks re-rotated, nothing recomputed (``ratio`` must be 0; it is
    accepted so that all three methods share one signature; ``zero_copy`` as in :func:`answer`)."""
    if check_ratio(ratio, "full_reuse") != 0.0:
        raise ValueError(f"ragattn.methods.fusionrag.full_reuse: Full Reuse recomputes nothing; "
                         f"ratio must be 0, got {ratio!r}")
    return _answer(model, tokenizer, chunks, question, method="full_reuse", ratio=0.0,
                   max_new_tokens=max_new_tokens, store=store, fused=False, zero_copy=zero_copy)

