"""Scheduler side of the vLLM connector, free of vLLM: chunk spans in a prompt and the claim.

    spans = spans_from_params(params) or spans_from_separator(prompt, sep_id)
    claim = plan_claim(prompt, spans, store_key, store_has)   # -> Claim
    claim.num_tokens    # prompt tokens [0, claim.num_tokens) the connector fills; vLLM computes the rest

A *span* ``(start, end)`` is a block of the prompt that was prefilled alone and cached in the
chunk store (the prompt head is a block too, as in the HF path). The claim is the longest run of
spans that starts at token 0, has no gap, holds only cached chunks and ends before the prompt's
last token: the final block (the rest of the prompt, at least one token) is always vLLM's, and
attends to everything, exactly Block-Attention's layout. A span that is not cached, a gap, or a
span reaching the prompt's end stops the claim there (never a partial span).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Sequence

from ragattn.methods import registry as _registry
from ragattn.store.positions import Positions

SPANS_PARAM = "ragattn_spans"   # keys in a request's kv_transfer_params
METHOD_PARAM = "ragattn_method"
RATIO_PARAM = "ragattn_ratio"
KNOWN_PARAMS = (SPANS_PARAM, METHOD_PARAM, RATIO_PARAM)   # what a request may send
RECOMPUTED_PARAM = "ragattn_recomputed"   # in the response: the prompt positions the server recomputed
# in the response of every request that carried chunks: what it was answered with (report_params)
REPORT_PARAMS = ("ragattn_answered_by", "ragattn_reason", "ragattn_chunks_hit", "ragattn_chunks_missed",
                 "ragattn_tokens_reused", "ragattn_tokens_recomputed", "ragattn_tokens_exact",
                 "ragattn_prefix_cache_tokens")

# the methods a request may ask for (how its chunks' keys are placed, and what is recomputed):
# ragattn.methods.registry's served entries
METHODS = _registry.names(served=True)
RECOMPUTE_METHODS = _registry.names(served=True, ratio=True)
DEFAULT_RATIO = _registry.DEFAULT_RATIO


class SpanError(ValueError):
    """Chunk spans that cannot describe the prompt (unsorted, overlapping, out of range)."""


@dataclass(frozen=True)
class Claim:
    """What the connector fills for one request: the spans ``spans[i]`` (prompt token ranges)
    with the chunk store keys ``keys[i]``; ``num_tokens`` = the end of the last one (0: none)."""
    spans: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return self.spans[-1][1] if self.spans else 0


NO_CLAIM = Claim((), ())


@dataclass(frozen=True)
class MethodChoice:
    """A request's method (one of :data:`METHODS`) and, for CacheBlend and FusionRAG, the
    fraction ``ratio`` of the chunk tokens (every span but the first, the prompt head) recomputed.

    * ``block-attention``, ``turborag-reordered``: chunk keys rotated to their prompt positions
      (one computation; the methods differ in the model: Block-Attention's is fine-tuned for it);
    * ``turborag-composite``: every span's keys at ``0..n-1`` as it was prefilled, the final block
      after the longest span (served as the same relative distances: see the connector);
    * ``cacheblend``, ``fusionrag``: the reordered layout, then ``ratio`` of the chunk tokens
      recomputed through every layer by the server's model (ragattn.vllm.recompute)."""
    name: str = _registry.SERVED_DEFAULT
    ratio: float = 0.0

    @property
    def recomputes(self) -> bool:
        return self.name in RECOMPUTE_METHODS

    @property
    def entry(self) -> _registry.Method:
        """Its registry entry (what the connector does for it: ``positions``, ``fused``, ``selection``)."""
        return _registry.get(self.name)


class ParamError(ValueError):
    """A ``kv_transfer_params`` value the connector cannot use; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"ragattn.vllm: {message}")
        self.field = field


def method_from_params(params: dict | None) -> MethodChoice:
    """The method a request's ``kv_transfer_params`` asks for (default Block-Attention), checked:
    ParamError naming the field for an unknown method, a ratio outside [0, 1] or not a number, or
    a ratio given to a method that recomputes nothing."""
    params = params or {}
    name = params.get(METHOD_PARAM, _registry.SERVED_DEFAULT)
    if getattr(_registry.find(name), "name", None) not in METHODS:
        raise ParamError(f"kv_transfer_params.{METHOD_PARAM}",
                         f"kv_transfer_params.{METHOD_PARAM} must be one of {list(METHODS)}, got {name!r}")
    name = _registry.canonical(name)
    if RATIO_PARAM not in params:
        return MethodChoice(name, DEFAULT_RATIO if name in RECOMPUTE_METHODS else 0.0)
    ratio = params[RATIO_PARAM]
    field = f"kv_transfer_params.{RATIO_PARAM}"
    if name not in RECOMPUTE_METHODS:
        raise ParamError(field, f"{field} is for {' / '.join(RECOMPUTE_METHODS)}; {name} recomputes nothing")
    wrong = _registry.check_ratio(ratio)
    if wrong:
        raise ParamError(field, f"{field} {wrong}")
    return MethodChoice(name, float(ratio))


def report_params(method: MethodChoice, answered_by: str, reason: str, num_spans: int, chunks_hit: int,
                  prompt_len: int, reused_end: int, recomputed: list[int] | None, prefix_cache_tokens: int) -> dict:
    """The response's ``kv_transfer_params`` for a request that carried chunks: the method asked
    for (and its ratio), ``ragattn_answered_by`` (that method, or ``"full-attention"``) and
    ``ragattn_reason`` (why full attention, or which spans were not reused; "" when all were),
    ``ragattn_chunks_hit`` / ``_missed`` (spans reused from the store or not, the prompt head
    included), ``ragattn_tokens_reused`` (prompt tokens ``[0, reused_end)`` whose K/V came from the
    store, less the recomputed ones), ``ragattn_tokens_recomputed`` (``ragattn_recomputed``: their
    prompt positions, for the methods that recompute), ``ragattn_tokens_exact`` (the rest of the
    prompt, computed by vLLM with full attention over everything before it) and
    ``ragattn_prefix_cache_tokens`` (of the reused tokens, those found in vLLM's prefix cache,
    pages of the same computation)."""
    rows = list(recomputed or [])
    out = {METHOD_PARAM: method.name}
    if method.recomputes:
        out |= {RATIO_PARAM: method.ratio, RECOMPUTED_PARAM: rows}
    values = (answered_by, reason, chunks_hit, num_spans - chunks_hit, reused_end - len(rows), len(rows),
              prompt_len - reused_end, min(prefix_cache_tokens, reused_end))
    return out | dict(zip(REPORT_PARAMS, values))


def check_spans(spans: Sequence[Sequence[int]], prompt_len: int) -> tuple[tuple[int, int], ...]:
    """``spans`` as a tuple of int pairs, or SpanError: each ``0 <= start < end <= prompt_len``,
    in prompt order, non-overlapping (gaps are allowed: they stop the claim)."""
    out, prev = [], 0
    for i, s in enumerate(spans):
        if not isinstance(s, (list, tuple)) or len(s) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
            raise SpanError(f"ragattn.vllm: span {i} must be a [start, end) pair of ints, got {s!r}")
        a, b = s
        if not 0 <= a < b <= prompt_len:
            raise SpanError(f"ragattn.vllm: span {i} = [{a}, {b}) is empty or outside the prompt of {prompt_len} tokens")
        if a < prev:
            raise SpanError(f"ragattn.vllm: span {i} = [{a}, {b}) overlaps or precedes the previous span (ends at {prev})")
        out.append((a, b))
        prev = b
    return tuple(out)


def spans_from_params(params: dict | None, prompt_len: int, name: str = SPANS_PARAM):
    """Spans from a request's ``kv_transfer_params`` (``{name: [[start, end], ...]}``), checked;
    None when the request names none."""
    if not params or name not in params:
        return None
    spans = params[name]
    if not isinstance(spans, (list, tuple)):
        raise SpanError(f"ragattn.vllm: kv_transfer_params[{name!r}] must be a list of [start, end) pairs, "
                        f"got {type(spans).__name__}")
    return check_spans(spans, prompt_len)


def spans_from_separator(tokens: Sequence[int], separator: int) -> tuple[tuple[int, int], ...]:
    """Blocks ending *after* each ``separator`` token (the separator is the last token of its
    chunk, so chunks are stored with it); the tokens after the last separator are the final
    block and form no span."""
    spans, start = [], 0
    for i, t in enumerate(tokens):
        if t == separator:
            spans.append((start, i + 1))
            start = i + 1
    return tuple(spans)


def plan_claim(tokens: Sequence[int], spans: Sequence[tuple[int, int]], key: Callable[[Sequence[int]], str],
               has: Callable[[str], bool]) -> Claim:
    """The claim for a prompt (see the module docstring). ``key(chunk_tokens)`` -> store key,
    ``has(key)`` -> whether the store holds it (memory or directory)."""
    n = len(tokens)
    got, keys, end = [], [], 0
    for a, b in spans:
        if a != end or b > n - 1:   # a gap, or the span would leave vLLM no token
            break
        k = key(tokens[a:b])
        if not has(k):
            break
        got.append((a, b))
        keys.append(k)
        end = b
    return Claim(tuple(got), tuple(keys))


def request_salt(key: str, layout, claim: Claim, method: MethodChoice, nonce: str | None = None,
                 client_salt: str | None = None) -> str:
    """The ``cache_salt`` the server gives a request it serves from cached chunks (vLLM hashes it
    into the request's first block, so its pages are hashed apart from every request whose pages
    were made otherwise). ``key``: a secret of the server process (no client can send a salt that
    collides with a derived one); ``layout``: the request's spans (a list of pairs) or, in
    separator mode, the separator id; ``claim``: the spans served from the store (the pages of a
    prompt prefix are a function of its tokens, the claimed spans and the method, which is why
    requests with equal salts may share them); ``nonce``: set for requests whose pages must
    never be shared (selective recompute, shared chunk pages); ``client_salt``: the salt the
    client sent, kept as a tenant separator, never instead of the derived one."""
    name = method.entry.serves_as or method.name   # requests that run one computation make equal pages
    text = json.dumps([key, layout, [list(s) for s in claim.spans], name, method.ratio, nonce, client_salt])
    return f"ragattn-{hashlib.sha256(text.encode()).hexdigest()[:32]}"


def composite_positions(spans: Sequence[tuple[int, int]]) -> list[int]:
    """TurboRAG's composite layout served at prompt positions: each span's keys at ``s + 0..n-1``
    with ``s = end - max n`` (``end``: the last span's end), so that the final block, which vLLM
    computes at positions ``end, end + 1, ...``, sees every chunk at the relative distances of the
    composite layout (each chunk from 0, the final block from ``max n``); RoPE attention depends
    on those distances only."""
    return Positions("composite").token_positions([b - a for a, b in spans], final_at=spans[-1][1])


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    parts = name.split(".")
    nums = [int(p) for p in parts if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"ragattn.vllm: cannot read one layer index from layer name {name!r}")
    return nums[0]
