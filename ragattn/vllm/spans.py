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

SPANS_PARAM = "ragattn_spans"   # key in a request's kv_transfer_params


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


def span_salt(spans: Sequence[tuple[int, int]]) -> str:
    """The ``cache_salt`` a request whose spans come in its ``kv_transfer_params`` must carry
    when vLLM's prefix cache is on: its approximate (Block-Attention) pages are then hashed apart
    from every exact prefix and from requests that split the same tokens into other blocks."""
    digest = hashlib.sha256(json.dumps([list(s) for s in spans]).encode()).hexdigest()[:24]
    return f"ragattn-{digest}"


def separator_salt(separator: int) -> str:
    """The ``cache_salt`` of requests split by a separator token: their spans follow from their
    tokens, so equal token prefixes are equal Block-Attention computations and may share pages
    (one salt for all such requests)."""
    return f"ragattn-sep-{int(separator)}"


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    parts = name.split(".")
    nums = [int(p) for p in parts if p.isdigit()]
    if len(nums) != 1:
        raise ValueError(f"ragattn.vllm: cannot read one layer index from layer name {name!r}")
    return nums[0]
