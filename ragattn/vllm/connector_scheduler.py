"""The scheduler side of :class:`ragattn.vllm.connector.RagattnConnector`: claims, the cache salt
of every request served from cached chunks, the shared chunk page pool, and what each request
was answered with (returned in its output's ``kv_transfer_params``). No worker state.

    sched = ConnectorScheduler(settings)
    sched.on_new_request(request)                                # the plan and the derived cache_salt
    n, _ = sched.get_num_new_matched_tokens(request, num_computed_tokens)   # the claim
    sched.update_state_after_alloc(request, blocks, n)
    meta = sched.build_connector_meta(scheduler_output)         # RagattnConnectorMetadata
    sched.update_connector_output(output); sched.request_finished(request, block_ids)

Prefix caching. The pages a request fills from cached chunks are approximate, so the server salts
them itself (:func:`ragattn.vllm.spans.request_salt`, set as the request's ``cache_salt`` when it
arrives, before vLLM's first prefix-cache lookup): the salt covers what makes the pages (the spans,
the claimed spans, the method and ratio), so exact prompts never hit them and requests whose salts
are equal made equal pages (Block-Attention, TurboRAG: they share them). Requests whose pages follow
more than their prefix (CacheBlend's and FusionRAG's recomputed rows) or that read shared chunk pages
(whose own claimed blocks are given back unwritten) get a salt of their own and never reuse a
prefix-cache hit: one that appears (a preempted request's own earlier pages) is dropped by salting the
request anew. So a request is answered by its method, or by full attention, never by a mix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ragattn.methods.selection import fused_variant
from ragattn.ops.page_table import num_pages
from ragattn.store import chunk_file, chunk_key
from ragattn.store.fingerprint import variant_key
from ragattn.vllm.connector_config import RagattnConnectorMetadata, RagattnWorkerMetadata, RequestLoad, Settings
from ragattn.vllm.gate import read_verdict, verdict_path
from ragattn.vllm.metrics import RagattnStats
from ragattn.vllm.platform import enabled as ragattn_attention
from ragattn.vllm.shared_pages import ChunkPagePool
from ragattn.vllm.spans import (KNOWN_PARAMS, METHOD_PARAM, NO_CLAIM, RATIO_PARAM, Claim, MethodChoice, ParamError,
                                SpanError, method_from_params, plan_claim, report_params, request_salt,
                                spans_from_params, spans_from_separator)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# under vLLM's logger tree, the only one vLLM configures: its lines carry level and time (grep WARNING)
log = init_logger(f"vllm.{__name__}")

FULL_ATTENTION = "full-attention"


@dataclass
class _Plan:
    """One request's plan, made when it arrives: its ``claim`` and ``method``, every span it names
    (``spans``), the salt's ``layout`` and ``client_salt``; ``private``: its pages are never shared
    (salted with its id and ``generation``); ``reason``: why it is computed by full attention, or
    which chunks are missing; then what happened: ``hit`` (vLLM's own prefix-cache hit when it was
    scheduled), ``served`` (its claim was loaded, or found in vLLM's prefix cache), ``failed``."""
    claim: Claim
    method: MethodChoice
    spans: tuple = ()
    layout: object = None
    client_salt: str | None = None
    private: bool = False
    reason: str = ""
    generation: int = 0
    hit: int = 0
    served: bool = False
    failed: bool = False


class ConnectorScheduler:
    """The connector's scheduler-side state: ``settings`` (:class:`~ragattn.vllm.connector_config.Settings`),
    ``refused`` (method -> why: the methods the quality gate refused; their requests get full attention)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._plans: dict[str, _Plan] = {}          # every request that carries chunks, until it finishes
        self._pending: dict[str, tuple] = {}
        self._recomputed: dict[str, list[int]] = {}   # reported by the worker, returned with the answer
        self._dropped: list[str] = []                  # failed loads: every worker forgets their shared entries
        self._can_recompute = ragattn_attention()   # the recompute runs on ragattn's backend and worker
        self._pool: ChunkPagePool | None = None     # at bind_kv_cache_manager, with shared pages
        self._kv_manager = None
        self._salt_key = os.urandom(16).hex()       # derived salts cannot be guessed by a client
        self.stats = RagattnStats()                  # what the responses said, for /metrics (ragattn.vllm.metrics)
        self.refused = self._gate_verdict()          # method -> why: refused by the quality gate (full attention)
        self.stats.add("gate_refused_methods", len(self.refused))

    def _gate_verdict(self) -> dict[str, str]:
        """The methods the quality gate refused, from the verdict the worker kept (ragattn.vllm.gate:
        vLLM builds the scheduler after the workers)."""
        if self.settings.gate_mode == "off":
            return {}
        verdict = read_verdict(self.settings.dir, self.settings.fingerprint)
        if verdict is None:
            log.warning("ragattn.vllm: no quality gate verdict kept in %s: the worker could not run the gate or keep "
                        "its verdict (see its log); the scheduler claims chunks for every method",
                        verdict_path(self.settings.dir, self.settings.fingerprint))
            return {}
        return dict(verdict.refused)

    def _spans(self, request: "Request"):
        """(spans or None, the salt's layout: the spans, or the separator id)."""
        tokens = request.prompt_token_ids or []
        spans = spans_from_params(request.kv_transfer_params, len(tokens), self.settings.spans_param)
        if spans is not None:
            return spans, [list(s) for s in spans]
        sep = self.settings.sep
        if sep is not None:
            return spans_from_separator(tokens, int(sep)) or None, int(sep)
        return None, None

    def _plan(self, request: "Request") -> _Plan | None:
        """The request's plan, or None for a request that carries no chunks."""
        tokens = request.prompt_token_ids or []
        params = request.kv_transfer_params or {}
        asked = any(k in params for k in KNOWN_PARAMS) or self.settings.spans_param in params
        try:
            method = method_from_params(params)
            spans, layout = self._spans(request)
        except (SpanError, ParamError) as exc:
            return _Plan(NO_CLAIM, MethodChoice(), reason=f"{exc}".removeprefix("ragattn.vllm: ")) if asked else None
        if not spans:
            return _Plan(NO_CLAIM, method, reason="the request names no chunk spans") if asked else None
        plan = _Plan(NO_CLAIM, method, spans, layout, request.cache_salt)
        if method.name in self.refused:
            plan.reason = self.refused[method.name]
            self.stats.add("requests_gate_refused", 1)
            return plan
        window = self.settings.window
        if method.entry.positions == "composite" and window is not None and window < len(tokens):
            # composite positions overlap (every chunk from 0); a window is by position (ragattn.kv.window), vLLM's by slot
            plan.reason = (f"{method.name} on a model with a {window}-token sliding window shorter than the "
                           "prompt: the window would cut by slot, not by position")
            return plan
        if method.recomputes and not self._can_recompute:
            plan.reason = (f"{method.name} recomputes with ragattn's attention backend, which this server does not "
                           "run (RAGATTN_VLLM_ATTENTION=1)")
            return plan
        if method.recomputes and self.settings.no_recompute:
            plan.reason = f"{method.name} is not served under pipeline parallelism: {self.settings.no_recompute}"
            return plan
        fp = self.settings.fingerprint
        claim = plan_claim(tokens, spans, lambda t: chunk_key(fp, t), self._has_chunk)
        if len(claim.spans) < len(spans):
            a, b = spans[len(claim.spans)]
            why = ("it reaches the prompt's end (the final block is vLLM's)" if b > len(tokens) - 1 else
                   "a gap before it" if a != claim.num_tokens else "not in the chunk store")
            plan.reason = (f"span {len(claim.spans)} of {len(spans)} ([{a}, {b})) not reused: {why}; "
                           f"{len(spans) - len(claim.spans)} span(s) computed exactly")
        if method.entry.fused and len(claim.keys) > 1:   # each chunk's fused cache where the store has one
            variant = fused_variant(tokens[claim.spans[0][0]:claim.spans[0][1]])
            fused = [variant_key(fp, k, variant) for k in claim.keys[1:]]
            claim = Claim(claim.spans, claim.keys[:1] + tuple(f if self._has_chunk(f) else k
                                                             for f, k in zip(fused, claim.keys[1:])))
        plan.claim = claim
        plan.private = method.recomputes or (self.settings.shared and method.entry.selection != "deviation")
        return plan

    def _salt(self, request: "Request", plan: _Plan) -> None:
        """Gives a claimed request its derived cache_salt and rehashes its blocks under it."""
        if not plan.claim.spans:
            return   # computed exactly: its own salt, vLLM's own hits
        nonce = f"{request.request_id}:{plan.generation}" if plan.private else None
        salt = request_salt(self._salt_key, plan.layout, plan.claim, plan.method, nonce, plan.client_salt)
        if request.cache_salt == salt:
            return
        request.cache_salt = salt
        request.block_hashes.clear()
        request.update_block_hashes()

    def _has_chunk(self, key: str) -> bool:
        remote = self.settings.remote
        return chunk_file(self.settings.dir, key).is_file() or (remote is not None and remote.contains(key))

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kv_manager = kv_cache_manager
        if self.settings.shared:
            self._pool = ChunkPagePool(kv_cache_manager.block_pool, self.settings.block_size)

    def on_new_request(self, request: "Request") -> None:
        """Plans a request when it arrives and salts it, before vLLM's first prefix-cache lookup."""
        plan = self._plan(request)
        if plan is None:
            return
        self._plans[request.request_id] = plan
        self._salt(request, plan)
        if plan.reason:
            log.warning("request %s: %s%s", request.request_id, plan.reason,
                        "" if plan.claim.spans else "; computing it with full attention, without cached chunks")

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._pool is not None:   # idle chunk pages make room for the request's own blocks first
            need = num_pages(len(request.prompt_token_ids or ()), self.settings.block_size)
            short = need - self._pool.block_pool.get_num_free_blocks()
            if short > 0:
                self._pool.evict(short)
        plan = self._plans.get(request.request_id)
        if plan is None:   # (a vLLM that did not call on_new_request)
            salt = request.cache_salt
            self.on_new_request(request)
            plan = self._plans.get(request.request_id)
            if plan is not None and request.cache_salt != salt and num_computed_tokens > 0:
                return None, False   # that hit was looked up under another salt: look again
        if plan is None or not plan.claim.spans:
            return 0, False
        end = plan.claim.num_tokens
        if plan.private and num_computed_tokens > 0:
            # its own earlier pages (preempted): they are not this pass's to finish; salt it anew, look again
            plan.generation += 1
            self._salt(request, plan)
            return None, False
        plan.hit = num_computed_tokens
        if num_computed_tokens >= end:   # vLLM's prefix cache holds the claim: pages of the same computation
            plan.served = True
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        plan = self._plans.get(request.request_id)
        if num_external_tokens <= 0 or plan is None:
            return
        claim, local, method = plan.claim, plan.hit, plan.method
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
        plan.served, plan.failed = True, False
        self._pending[request.request_id] = (claim, local, method, prompt, chunk_blocks)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> RagattnConnectorMetadata:
        meta = RagattnConnectorMetadata(evicted=self._pool.take_evicted() if self._pool is not None else [],
                                        dropped=self._dropped)
        self._dropped = []
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
            failed = {b for ids in worker.failed.values() for b in ids}
            if failed:
                self._fail(worker.failed, failed)
            self._dropped += list(worker.failed)
            if self._pool is not None:
                for key in worker.failed_chunks:
                    self._pool.drop(key)
                for req_id, (first, block_ids) in worker.shared.items():
                    self._pool.give_back(self._kv_manager, req_id, block_ids, first)

    def _fail(self, requests: dict[str, list[int]], blocks: set[int]) -> None:
        """Loads that failed (their claimed ``blocks``, which vLLM recomputes exactly): those requests,
        and any that found those blocks in vLLM's prefix cache in the same step, are answered by
        full attention; the blocks leave the prefix cache (exact pages under an approximate salt)."""
        for req_id, plan in self._plans.items():
            if req_id in requests:
                plan.failed = True
            elif plan.served and plan.hit and self._kv_manager is not None:
                held = self._kv_manager.get_block_ids(req_id)[0][:plan.hit // self.settings.block_size]
                plan.failed = plan.failed or bool(blocks.intersection(held))
        if self._kv_manager is not None and self.settings.prefix_caching:
            self._kv_manager.evict_blocks(blocks)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Nothing is saved (the blocks are freed at once). A request that carried chunks gets in its
        output's ``kv_transfer_params`` what it was answered with (:func:`ragattn.vllm.spans.report_params`)."""
        self._pending.pop(request.request_id, None)
        if self._pool is not None:
            self._pool.release(request.request_id)
        rows = self._recomputed.pop(request.request_id, None)
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return False, None
        used = plan.served and not plan.failed
        reason = plan.reason
        if plan.failed:
            reason = ("a chunk could not be loaded (or the prefix-cache pages it found were such a load's); vLLM "
                      "recomputed the claimed tokens exactly")
        elif plan.claim.spans and not plan.served:
            reason = "vLLM took none of the claimed tokens"
        params = report_params(plan.method, plan.method.name if used else FULL_ATTENTION, reason,
                               len(plan.spans), len(plan.claim.spans) if used else 0,
                               len(request.prompt_token_ids or ()), plan.claim.num_tokens if used else 0,
                               rows if used else [], plan.hit)
        self.stats.add("requests_method" if used else "requests_full_attention", 1)
        for key in ("chunks_hit", "chunks_missed", "tokens_reused", "tokens_recomputed", "tokens_exact",
                    "prefix_cache_tokens"):
            self.stats.add(key, params[f"ragattn_{key}"])
        return False, params


def _lists(block_ids) -> tuple[list[int], ...]:
    """vLLM's per-group block ids (a tuple of lists) as plain lists."""
    return tuple(list(ids) for ids in block_ids)


__all__ = ["ConnectorScheduler"]
