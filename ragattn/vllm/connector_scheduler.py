"""The scheduler side of :class:`ragattn.vllm.connector.RagattnConnector`: claims, the shared
chunk page pool, the rows each request recomputed (returned with its answer). No worker state.

    sched = ConnectorScheduler(settings)
    n, _ = sched.get_num_new_matched_tokens(request, num_computed_tokens)   # the claim
    sched.update_state_after_alloc(request, blocks, n)
    meta = sched.build_connector_meta(scheduler_output)         # RagattnConnectorMetadata
    sched.update_connector_output(output); sched.request_finished(request, block_ids)
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ragattn.methods.selection import fused_variant
from ragattn.ops.page_table import num_pages
from ragattn.store import chunk_file, chunk_key
from ragattn.store.fingerprint import variant_key
from ragattn.vllm.connector_config import RagattnConnectorMetadata, RagattnWorkerMetadata, RequestLoad, Settings
from ragattn.vllm.platform import enabled as ragattn_attention
from ragattn.vllm.shared_pages import ChunkPagePool
from ragattn.vllm.spans import (METHOD_PARAM, NO_CLAIM, RATIO_PARAM, RECOMPUTED_PARAM, Claim, MethodChoice,
                                ParamError, SpanError, method_from_params, plan_claim, separator_salt, span_salt,
                                spans_from_params, spans_from_separator)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("ragattn.vllm.connector")


class ConnectorScheduler:
    """The connector's scheduler-side state: ``settings`` (:class:`~ragattn.vllm.connector_config.Settings`)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._claims: dict[str, tuple[Claim, int, MethodChoice]] = {}   # claim, vLLM's own hit, method
        self._pending: dict[str, tuple] = {}
        self._recomputed: dict[str, list[int]] = {}   # reported by the worker, returned with the answer
        self._can_recompute = ragattn_attention()   # the recompute runs on ragattn's backend and worker
        self._pool: ChunkPagePool | None = None     # at bind_kv_cache_manager, with shared pages
        self._kv_manager = None

    def _spans(self, request: "Request", method: MethodChoice):
        """(spans or None, the cache_salt they need under prefix caching)."""
        tokens = request.prompt_token_ids or []
        spans = spans_from_params(request.kv_transfer_params, len(tokens), self.settings.spans_param)
        if spans is not None:
            return spans, span_salt(spans, method, tokens)
        sep = self.settings.sep
        if sep is not None:
            return spans_from_separator(tokens, int(sep)), separator_salt(int(sep), method, tokens)
        return None, None

    def _claim(self, request: "Request", num_computed_tokens: int) -> tuple[Claim, MethodChoice]:
        tokens = request.prompt_token_ids or []
        try:
            method = method_from_params(request.kv_transfer_params)
            spans, salt = self._spans(request, method)
        except (SpanError, ParamError) as exc:
            log.warning("request %s: %s; computing it without cached chunks", request.request_id, exc)
            return NO_CLAIM, MethodChoice()
        if not spans:
            return NO_CLAIM, method
        window = self.settings.window
        if method.entry.positions == "composite" and window is not None and window < len(tokens):
            # composite positions overlap (every chunk from 0); a window is by position (ragattn.kv.window), vLLM's by slot
            log.warning("request %s: %s on a model with a %d-token sliding window shorter than the prompt: the "
                        "window would cut by slot, not by position; computing it without cached chunks",
                        request.request_id, method.name, window)
            return NO_CLAIM, method
        if method.recomputes and not self._can_recompute:
            log.warning("request %s: %s recomputes with ragattn's attention backend, which this server does not "
                        "run (RAGATTN_VLLM_ATTENTION=1): computing it without cached chunks",
                        request.request_id, method.name)
            return NO_CLAIM, method
        if self.settings.prefix_caching and request.cache_salt != salt:
            log.warning("request %s: vLLM's prefix cache is on and the request's cache_salt is not %r "
                        "(docs/vllm.md): computing it without cached chunks (its approximate pages would "
                        "otherwise be served as an exact prefix)", request.request_id, salt)
            return NO_CLAIM, method
        fp = self.settings.fingerprint
        claim = plan_claim(tokens, spans, lambda t: chunk_key(fp, t), self._has_chunk)
        if method.recomputes and 0 < num_computed_tokens < claim.num_tokens:
            # vLLM's own hit ends inside the chunks: its pages are shared, the recompute would write them
            log.warning("request %s: vLLM's prefix cache holds %d of its %d claimed tokens; %s recomputes "
                        "rows of the whole claim, so the rest is computed without cached chunks",
                        request.request_id, num_computed_tokens, claim.num_tokens, method.name)
            return NO_CLAIM, method
        if method.entry.fused and len(claim.keys) > 1:   # each chunk's fused cache where the store has one
            variant = fused_variant(tokens[claim.spans[0][0]:claim.spans[0][1]])
            fused = [variant_key(fp, k, variant) for k in claim.keys[1:]]
            claim = Claim(claim.spans, claim.keys[:1] + tuple(f if self._has_chunk(f) else k
                                                             for f, k in zip(fused, claim.keys[1:])))
        return claim, method

    def _has_chunk(self, key: str) -> bool:
        remote = self.settings.remote
        return chunk_file(self.settings.dir, key).is_file() or (remote is not None and remote.contains(key))

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        if self.settings.shared:
            self._kv_manager = kv_cache_manager
            self._pool = ChunkPagePool(kv_cache_manager.block_pool, self.settings.block_size)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._pool is not None:   # idle chunk pages make room for the request's own blocks first
            need = num_pages(len(request.prompt_token_ids or ()), self.settings.block_size)
            short = need - self._pool.block_pool.get_num_free_blocks()
            if short > 0:
                self._pool.evict(short)
        claim, method = self._claim(request, num_computed_tokens)
        self._claims[request.request_id] = (claim, num_computed_tokens, method)
        return max(0, claim.num_tokens - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            self._claims.pop(request.request_id, None)
            return
        claim, local, method = self._claims.pop(request.request_id)
        if local + num_external_tokens != claim.num_tokens:
            # vLLM trimmed the claim (only DeepSeek's sliding-window replay does): the pages of
            # exactly [local, local + num_external_tokens) would have to be written
            raise RuntimeError(f"ragattn.vllm: request {request.request_id}: vLLM took {num_external_tokens} of "
                               f"the {claim.num_tokens - local} claimed tokens; partial claims are not supported")
        prompt = tuple(request.prompt_token_ids or ()) if method.recomputes else ()
        chunk_blocks = None
        # (a selection by deviation recomputes every chunk row in its first layers: no page to share)
        if self._pool is not None and method.entry.selection != "deviation" and local == 0:
            chunk_blocks = self._pool.acquire(request.request_id, claim.keys, [e - s for s, e in claim.spans])
        self._pending[request.request_id] = (claim, local, method, prompt, chunk_blocks)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> RagattnConnectorMetadata:
        meta = RagattnConnectorMetadata(evicted=self._pool.take_evicted() if self._pool is not None else [])
        for req in scheduler_output.scheduled_new_reqs:
            if req.req_id in self._pending:
                claim, skip, method, prompt, chunks = self._pending.pop(req.req_id)
                meta.loads.append(RequestLoad(req.req_id, claim.keys, claim.spans, _lists(req.block_ids), skip,
                                              method, prompt, chunks))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                claim, skip, method, prompt, chunks = self._pending.pop(req_id)
                meta.loads.append(RequestLoad(req_id, claim.keys, claim.spans, _lists(cached.new_block_ids[i]), skip,
                                              method, prompt, chunks))
        return meta

    def update_connector_output(self, connector_output) -> None:
        worker = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(worker, RagattnWorkerMetadata):
            self._recomputed.update(worker.recomputed)
            if self._pool is not None:
                for key in worker.failed_chunks:
                    self._pool.drop(key)
                for req_id, (first, block_ids) in worker.shared.items():
                    self._pool.give_back(self._kv_manager, req_id, block_ids, first)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is saved (the blocks are freed at once); a request the worker recomputed rows
        of gets them in its output's ``kv_transfer_params`` (``ragattn_recomputed``: prompt positions)."""
        self._claims.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        if self._pool is not None:
            self._pool.release(request.request_id)
        rows = self._recomputed.pop(request.request_id, None)
        if rows is None:
            return False, None
        params = request.kv_transfer_params or {}
        return False, {METHOD_PARAM: params.get(METHOD_PARAM), RATIO_PARAM: method_from_params(params).ratio,
                       RECOMPUTED_PARAM: rows}


def _lists(block_ids) -> tuple[list[int], ...]:
    """vLLM's per-group block ids (a tuple of lists) as plain lists."""
    return tuple(list(ids) for ids in block_ids)


__all__ = ["ConnectorScheduler"]
