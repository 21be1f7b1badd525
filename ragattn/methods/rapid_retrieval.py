"""RAPID's retrieval context, the RAG drafter's input (:mod:`ragattn.methods.rapid`): the long
context split into chunks of at most ``chunk_tokens`` tokens of the LLM's tokenizer (recursive
separators, as the authors' LangChain splitter), scored by MiniLM similarity to the question, the
best taken up to a token budget and re-sorted by document position."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional

SEPARATORS = ("\n\n", "\n", ". ", "! ", "? ", "; ", ", ", " ")
_WHERE = "ragattn.methods.rapid"


def _num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _split_spans(tokenizer, text: str, start: int, end: int, limit: int, seps) -> list:
    """``[(start, end, tokens)]`` covering ``text[start:end]``, each at most ``limit`` tokens
    (measured alone): split at the first separator present (kept at the end of its piece), pieces
    still too long at the next separators, and at the character middle as the last resort."""
    n = _num_tokens(tokenizer, text[start:end])
    if n <= limit or end - start <= 1:
        return [(start, end, n)]
    for i, sep in enumerate(seps):
        piece = text[start:end]
        if sep not in piece:
            continue
        out, a = [], start
        while a < end:
            j = text.find(sep, a, end)
            b = end if j < 0 else j + len(sep)
            out += _split_spans(tokenizer, text, a, b, limit, seps[i + 1:])
            a = b
        return out
    mid = (start + end) // 2
    return (_split_spans(tokenizer, text, start, mid, limit, ()) +
            _split_spans(tokenizer, text, mid, end, limit, ()))


def split_text(tokenizer, text: str, chunk_tokens: int = 128) -> list[tuple[int, int, int]]:
    """Chunks of ``text`` as ``[(start, end, tokens)]`` character spans in order, covering it:
    separator-aware pieces (:data:`SEPARATORS`) greedily merged while the sum of their token counts
    stays within ``chunk_tokens`` (the authors' RecursiveCharacterTextSplitter with the LLM's
    tokenizer, no overlap; a merged chunk's count is the sum of its pieces' counts)."""
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"{_WHERE}.split_text: chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    chunks: list[list[int]] = []
    for a, b, n in _split_spans(tokenizer, text, 0, len(text), chunk_tokens, SEPARATORS):
        if chunks and chunks[-1][2] + n <= chunk_tokens:
            chunks[-1][1], chunks[-1][2] = b, chunks[-1][2] + n
        else:
            chunks.append([a, b, n])
    return [tuple(c) for c in chunks if text[c[0]:c[1]].strip()]


@functools.lru_cache(maxsize=1)
def default_encoder():
    """The MiniLM sentence encoder, loaded once per process."""
    from ragattn.methods.retrieval import SentenceEncoder

    return SentenceEncoder()


@dataclass
class RetrievalContext:
    """The RAG drafter's context. ``text``: the selected chunks in document order joined by
    "\\n\\n"; ``chunks``: every chunk's text; ``spans``: ``(doc, start, end)`` per chunk;
    ``scores``: cosine similarity of every chunk to the query; ``selected``: chosen chunk indices in
    document order; ``tokens``: their token count; ``context_tokens``: the whole context's;
    ``budget``: the token budget used."""
    text: str
    chunks: list
    spans: list
    scores: list
    selected: list
    tokens: int
    context_tokens: int
    budget: int


def build_retrieval_context(tokenizer, context, query: str, *, encoder=None, chunk_tokens: int = 128,
                            budget_tokens: Optional[int] = None, min_tokens: int = 4096,
                            ratio: float = 24.0, threshold: float = 0.1) -> RetrievalContext:
    """Select the chunks of ``context`` (a ``str`` or a sequence of documents) most relevant to
    ``query`` up to a token budget (see the module docstring).

    ``budget_tokens``: the budget; None: ``max(min_tokens, context tokens / ratio)`` (the authors'
    script; at short contexts that is the whole context). ``threshold``: chunks whose cosine is
    below it are dropped, the best chunk always kept (the authors' script default 0.1; the paper's
    0.3 is for BGE-M3). ``encoder``: a :class:`~ragattn.methods.retrieval.SentenceEncoder`
    (default: MiniLM, loaded once)."""
    docs = [context] if isinstance(context, str) else list(context)
    if not docs or not any(isinstance(d, str) and d.strip() for d in docs):
        raise ValueError(f"{_WHERE}: the context is empty")
    if any(not isinstance(d, str) for d in docs):
        raise TypeError(f"{_WHERE}: the context must be a str or a sequence of str")
    if budget_tokens is not None and (not isinstance(budget_tokens, int) or budget_tokens < 1):
        raise ValueError(f"{_WHERE}: budget_tokens must be an int >= 1 or None, got {budget_tokens!r}")
    if not (isinstance(ratio, (int, float)) and ratio > 0):
        raise ValueError(f"{_WHERE}: ratio must be > 0, got {ratio!r}")
    spans, chunks, counts = [], [], []
    for d, text in enumerate(docs):
        for a, b, n in split_text(tokenizer, text, chunk_tokens):
            spans.append((d, a, b))
            chunks.append(text[a:b])
            counts.append(n)
    total = sum(counts)
    budget = budget_tokens if budget_tokens is not None else max(min_tokens, math.ceil(total / ratio))
    enc = encoder or default_encoder()
    emb = enc.encode(chunks)                                  # [N, dim], unit rows
    scores = (emb @ enc.encode([query])[0]).tolist()
    order = sorted(range(len(chunks)), key=lambda i: -scores[i])
    chosen, used = [], 0
    for i in order:
        if chosen and scores[i] < threshold:
            break
        if used + counts[i] <= budget or not chosen:  # the best chunk always, even over budget
            chosen.append(i)
            used += counts[i]
    chosen.sort(key=lambda i: spans[i])
    return RetrievalContext("\n\n".join(chunks[i].strip() for i in chosen), chunks, spans, scores,
                            chosen, used, total, budget)
