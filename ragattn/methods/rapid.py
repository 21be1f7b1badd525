"""RAPID: retrieval-augmented speculative decoding (Chen et al., ICML 2025; notes-rapid.md).

A long-context *target* reads the whole context; a *RAG drafter* (the same model, or a separate one
sharing the tokenizer) reads only the context chunks most relevant to the question and proposes
up to ``gamma`` tokens per round; the target scores them in one forward of ``gamma + 1`` rows and
``ragattn.verify_draft`` accepts a prefix, with RAPID's retrieval-augmented target distribution
``p_hat = softmax(z / T + eta * mask * (q - p))`` (``eta = 0``: plain speculative decoding, whose
output follows the target exactly).

    from ragattn.methods import rapid
    out = rapid.generate(target, tokenizer, long_context, question, drafter=None,  # self-speculation
                         gamma=4, eta=10.0, temperature=1.0, greedy=False, max_new_tokens=64)
    out.tokens, out.text, out.stats.acceptance_rate, out.stats.tokens_per_target_step
    ans = rapid.answer(model, tokenizer, chunks, question, max_new_tokens=32)   # common Answer

Pieces (the authors' code is the reference where it and the paper differ, notes §2.5 to §2.11):

* **Retrieval** (:func:`build_retrieval_context`, in :mod:`ragattn.methods.rapid_retrieval`): the
  context is split into chunks of at most ``chunk_tokens`` tokens of the LLM's tokenizer (recursive
  separators "\\n\\n", "\\n", ". ", ..., as the authors' LangChain splitter), chunks are scored by
  MiniLM cosine similarity to the question (``ragattn.methods.retrieval``; the authors use BGE-M3),
  the best are taken up to a token budget (``max(min_tokens, L / ratio)`` as in the authors' script,
  or ``budget_tokens``), those below ``threshold`` dropped (the best one always kept), and the rest
  re-sorted by document position and joined with "\\n\\n". The drafter's prompt is the target's
  prompt (:func:`ragattn.methods.prompt.prompt_parts`) with this retrieval context as its document.
* **Caches**: one :class:`~ragattn.kv.PagedKV` per model; slot ``j`` holds absolute
  position ``j``. The target holds every committed token but the last (fed next round, as in the
  authors' code); the drafter holds the committed tokens it has seen. Rollback after a rejection
  is a length update (``lengths``): O(1), stale slots are overwritten by the next round.
* **Round** (:meth:`RapidDecoder.step`): the drafter feeds its 1 or 2 pending tokens and drafts up
  to ``g = min(gamma, tokens left - 1)`` tokens from ``q = softmax(s / T)`` (argmax when greedy),
  stopping early after a token that is EOS or whose probability is below
  ``confidence_threshold`` (the authors' ``assistant_confidence_threshold``); the target runs
  ``[last] + drafts`` (``g + 1`` rows at their absolute positions, ``paged_attention``);
  ``verify_draft`` returns the ``n`` accepted drafts and one more token. The target keeps
  ``1 + n`` new slots, the drafter ``len(pending) + min(n, g - 1)`` (its last draft was never fed);
  the new pending tokens are the emitted ones it has not seen (1 or 2).
* **Greedy** (``greedy=True``): the drafter drafts argmax, ``verify_draft`` accepts while the draft
  equals ``argmax p_hat`` and emits that argmax at the first mismatch: with ``eta = 0`` exactly the
  target's own greedy decoding, for any drafter and ``gamma``.
* **Sampling**: the emitted tokens follow the target ``p`` when ``eta = 0`` and RAPID's modified
  distribution when ``eta > 0`` (deliberately not ``p``: notes §2.6; see ``ragattn.verify_draft``).

Host synchronisation (what a GPU run would wait on): per drafted token, only when
``confidence_threshold`` is set (reading ``q(x)`` to decide to stop), plus the capacity check of
``PagedKV.append_plan`` (``int(lengths.max())``, once per forward of either model); per round, one
read of the verified tokens (``out_tokens``/``n``, needed for EOS, the token budget and the
pending tokens). Drafted tokens otherwise stay on the device: the next drafter step takes the
sampled tensor as its input. See docs/rapid.md.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ragattn import ops as _ops
from ragattn.hf.registration import use_ragattn
from ragattn.kv import PagedKV
from ragattn.methods.generate import Answer, _eos_ids, _sync
from ragattn.methods.prompt import prompt_parts
from ragattn.methods.rapid_retrieval import (  # noqa: F401  (split_text, SEPARATORS: part of rapid's API)
    SEPARATORS, RetrievalContext, _num_tokens, build_retrieval_context, split_text)

MODES = ("rapid", "lc", "rag")
_WHERE = "ragattn.methods.rapid"


# ----------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class RapidOptions:
    """Decoding options, validated on construction (ValueError/TypeError naming the option).

    ``gamma``: drafts per round, >= 1. ``eta``: RAPID's transfer strength, >= 0 (0 = plain
    speculative decoding). ``alpha``: the shift applies where ``q >= alpha * max q``, in [0, 1].
    ``temperature``: > 0, used for ``p``, ``q`` and ``p_hat`` (and nominal in greedy mode).
    ``greedy``: deterministic drafting and verification. ``confidence_threshold``: stop drafting
    after a token whose draft probability is below it (None or 0: always ``gamma``), in [0, 1).
    """
    gamma: int = 4
    eta: float = 0.0
    alpha: float = 0.1
    temperature: float = 1.0
    greedy: bool = True
    confidence_threshold: Optional[float] = None

    def __post_init__(self):
        def num(name, val, lo, hi, lo_open=False, hi_open=False):
            if not isinstance(val, (int, float)) or isinstance(val, bool):
                raise TypeError(f"{_WHERE}: {name} must be a number, got {type(val).__name__}")
            ok = math.isfinite(val) and (val > lo if lo_open else val >= lo) and \
                (val < hi if hi_open else val <= hi)
            if not ok:
                rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
                raise ValueError(f"{_WHERE}: {name} must be finite and in {rng}, got {val}")

        if not isinstance(self.gamma, int) or isinstance(self.gamma, bool):
            raise TypeError(f"{_WHERE}: gamma must be an int, got {type(self.gamma).__name__}")
        if self.gamma < 1:
            raise ValueError(f"{_WHERE}: gamma must be >= 1, got {self.gamma}")
        num("eta", self.eta, 0, math.inf, hi_open=True)
        num("alpha", self.alpha, 0, 1)
        num("temperature", self.temperature, 0, math.inf, lo_open=True, hi_open=True)
        if not isinstance(self.greedy, bool):
            raise TypeError(f"{_WHERE}: greedy must be a bool, got {type(self.greedy).__name__}")
        if self.confidence_threshold is not None:
            num("confidence_threshold", self.confidence_threshold, 0, 1, hi_open=True)


def _check_max_new_tokens(n):
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{_WHERE}: max_new_tokens must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"{_WHERE}: max_new_tokens must be >= 1, got {n}")


def check_drafter(target, drafter, tokenizer=None, drafter_tokenizer=None) -> None:
    """Raise ValueError unless ``drafter`` can draft for ``target``: the same output vocabulary
    (lm_head width) and, when ``drafter_tokenizer`` is given, the same token -> id map."""
    if drafter is None or drafter is target:
        return
    vt = target.get_output_embeddings().weight.shape[0]
    vd = drafter.get_output_embeddings().weight.shape[0]
    if vt != vd:
        raise ValueError(f"{_WHERE}: the drafter's vocabulary ({vd} logits) differs from the target's "
                         f"({vt}); RAPID needs a drafter sharing the target's tokenizer")
    if drafter_tokenizer is not None and tokenizer is not None and \
            drafter_tokenizer is not tokenizer and drafter_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"{_WHERE}: the drafter's tokenizer differs from the target's (different "
                         "token -> id maps); RAPID needs a drafter sharing the target's tokenizer")


# ----------------------------------------------------------------------------------------------
# the decoding loop


@dataclass
class RapidStats:
    """Counters and timings of one generation (decode = everything after both prefills)."""
    rounds: int = 0            # target verification forwards (= target decode steps)
    drafted: int = 0           # drafted tokens verified
    accepted: int = 0          # accepted drafts
    generated: int = 0         # tokens emitted
    drafter_steps: int = 0     # drafter forwards in the decode phase
    retrieval_s: float = 0.0
    prefill_target_s: float = 0.0
    prefill_drafter_s: float = 0.0
    decode_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens (the paper's metric)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_target_step(self) -> float:
        return self.generated / self.rounds if self.rounds else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated / self.decode_s if self.decode_s > 0 else float("nan")


def _device(model) -> torch.device:
    return next(model.parameters()).device


def new_cache(model, capacity: int, page_size: int = 16) -> PagedKV:
    """An empty batch-1 :class:`PagedKV` for ``model`` with room for ``capacity`` slots."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return PagedKV(cfg.num_hidden_layers, 1, capacity, kv_heads, head_dim, page_size,
                   next(model.parameters()).dtype, _device(model))


def sample(logits: torch.Tensor, probs: torch.Tensor, greedy: bool,
           generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token (int64 ``[1]``, on the device): ``argmax logits`` if greedy, else a draw from
    ``probs`` ``[V]`` by the exponential race ``argmax probs / E``, ``E ~ Exp(1)`` (exact, and
    unlike ``torch.multinomial`` free of host synchronisation)."""
    if greedy:
        return logits.argmax().view(1)
    e = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(1e-30)  # never 0/0
    return (probs / e).argmax().view(1)


@torch.no_grad()
def forward_rows(model, ids: torch.Tensor, cache: PagedKV, start: int, keep: int) -> torch.Tensor:
    """Append ``ids`` (int64 ``[q]``, on the model's device) to ``cache`` at slots and RoPE positions
    ``start..start+q-1`` (``start`` = ``cache.lengths[0]``, tracked by the caller on the host) through
    ``ragattn.paged_attention``; returns float32 logits ``[keep, vocab]`` of the last ``keep`` rows."""
    q = ids.shape[0]
    pos = torch.arange(start, start + q, device=ids.device)
    with use_ragattn(model):
        out = model(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                    ragattn_paged=cache, logits_to_keep=keep)
    cache.lengths.fill_(start + q)
    return out.logits[0].float()


@torch.no_grad()
def prefill(model, ids: Sequence[int], cache: PagedKV) -> None:
    """Fill an empty ``cache`` with the K/V of ``ids`` (slots and positions ``0..len(ids)-1``): one
    forward with the model's own attention (SDPA by default: on the CPU several times faster than
    the paged path for a long prompt) into a transformers cache, copied into the pages."""
    if len(ids) == 0:
        cache.lengths.fill_(0)
        return
    dev = _device(model)
    out = model(input_ids=torch.tensor([list(ids)], device=dev), use_cache=True, logits_to_keep=1)
    rows = cache.slot_rows(0, torch.arange(len(ids), device=dev))
    for layer, (kc, vc) in enumerate(zip(cache.k, cache.v)):
        lay = out.past_key_values.layers[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, rows, lay.keys[0].transpose(0, 1).to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, rows, lay.values[0].transpose(0, 1).to(vc.dtype))
    cache.lengths.fill_(len(ids))


class RapidDecoder:
    """Speculative decoding state of one request (batch 1): the two caches and the pending tokens.

    ``target_ids``/``draft_ids``: the two prompts (lists of int, at least 1 token each);
    ``drafter``: None = the target itself (self-speculation, its own short cache).
    :meth:`prefill` fills both caches, :meth:`step` runs one round; :meth:`reset` rolls both caches
    back to the prompts in O(1) (to decode again from the same prefill). ``target_cache``: a
    :class:`PagedKV` to use for the target (e.g. one already holding a shared prefix)."""

    def __init__(self, target, target_ids: Sequence[int], draft_ids: Sequence[int], *, drafter=None,
                 options: RapidOptions = RapidOptions(), max_new_tokens: int = 64, eos_ids=(),
                 generator: Optional[torch.Generator] = None, page_size: int = 16,
                 target_cache: Optional[PagedKV] = None):
        if not isinstance(options, RapidOptions):
            raise TypeError(f"{_WHERE}: options must be a RapidOptions, got {type(options).__name__}")
        _check_max_new_tokens(max_new_tokens)
        if len(target_ids) < 1 or len(draft_ids) < 1:
            raise ValueError(f"{_WHERE}: the target and drafter prompts need at least one token each")
        check_drafter(target, drafter)
        self.target, self.drafter = target, (drafter if drafter is not None else target)
        self.opt, self.max_new_tokens, self.eos = options, max_new_tokens, set(eos_ids)
        self.generator = generator
        self.t_dev, self.d_dev = _device(self.target), _device(self.drafter)
        self.target_ids, self.draft_ids = list(target_ids), list(draft_ids)
        extra = max_new_tokens + options.gamma + 2
        self.t_cache = target_cache or new_cache(self.target, len(self.target_ids) + extra, page_size)
        if self.t_cache.capacity < len(self.target_ids) + extra:
            raise ValueError(f"{_WHERE}: target_cache holds {self.t_cache.capacity} slots, "
                             f"{len(self.target_ids) + extra} needed")
        self.d_cache = new_cache(self.drafter, len(self.draft_ids) + extra, page_size)
        self.stats = RapidStats()
        self.first_logits: Optional[torch.Tensor] = None
        self.first_token_at: Optional[float] = None   # perf_counter() when the first round ended
        self.tokens: list[int] = []
        self.done = False

    # -- prefill / reset

    def prefill(self, target_cached: int = 0) -> None:
        """Prefill the target with ``target_ids[:-1]`` and the drafter with ``draft_ids[:-1]``.
        ``target_cached``: the target cache (``target_cache=`` of the constructor) already holds
        ``target_ids[:target_cached]`` (a shared prefix); only the rest is appended."""
        for model, ids, cache, dev, attr, cached in (
                (self.target, self.target_ids, self.t_cache, self.t_dev, "prefill_target_s", target_cached),
                (self.drafter, self.draft_ids, self.d_cache, self.d_dev, "prefill_drafter_s", 0)):
            t0 = time.perf_counter()
            if cached == 0:
                prefill(model, ids[:-1], cache)
            elif cached < len(ids) - 1:
                with use_ragattn(model):
                    forward_rows(model, torch.tensor(ids[cached:-1], device=dev), cache, cached, 1)
            _sync(dev)
            setattr(self.stats, attr, time.perf_counter() - t0)
        self.reset()

    def reset(self) -> None:
        """Roll both caches back to the prefilled prompts (O(1): lengths only); clears the output."""
        self.t_len, self.d_len = len(self.target_ids) - 1, len(self.draft_ids) - 1
        self.t_cache.lengths.fill_(self.t_len)
        self.d_cache.lengths.fill_(self.d_len)
        self.last = self.target_ids[-1]        # the committed token the target has not seen
        self.pending = [self.draft_ids[-1]]    # the committed tokens the drafter has not seen
        self.tokens, self.done, self.first_logits, self.first_token_at = [], False, None, None
        self.stats = RapidStats(retrieval_s=self.stats.retrieval_s,
                                prefill_target_s=self.stats.prefill_target_s,
                                prefill_drafter_s=self.stats.prefill_drafter_s)

    # -- one round

    def _draft(self, g: int):
        """Up to ``g`` drafts: (tokens int64 [g_eff] on the target device, probs float32 [g_eff, V])."""
        opt, dev = self.opt, self.d_dev
        logits = forward_rows(self.drafter, torch.tensor(self.pending, device=dev), self.d_cache,
                              self.d_len, 1)[-1]
        self.d_len += len(self.pending)
        self.stats.drafter_steps += 1
        toks, probs = [], []
        for k in range(g):
            q = torch.softmax(logits * (1.0 / opt.temperature), dim=-1)
            x = sample(logits, q, opt.greedy, self.generator)
            toks.append(x)
            probs.append(q)
            if k == g - 1:
                break
            # the drafter's own decision to stop early: one host read per drafted token, only
            # with a confidence threshold (an EOS draft is not looked for: verification ends there)
            if opt.confidence_threshold and float(q.gather(0, x)) < opt.confidence_threshold:
                break
            logits = forward_rows(self.drafter, x, self.d_cache, self.d_len, 1)[-1]
            self.d_len += 1
            self.stats.drafter_steps += 1
        return torch.cat(toks).to(self.t_dev), torch.stack(probs).to(self.t_dev)

    def step(self) -> list[int]:
        """One round: draft, verify, roll back; returns the emitted tokens (empty when done)."""
        if self.done:
            return []
        opt, dev = self.opt, self.t_dev
        g = min(opt.gamma, self.max_new_tokens - len(self.tokens) - 1)
        d_base = self.d_len
        if g > 0:
            drafts, q = self._draft(g)
        else:  # one token left: the target alone
            vocab = self.target.get_output_embeddings().weight.shape[0]
            drafts = torch.empty(0, dtype=torch.long, device=dev)
            q = torch.empty(0, vocab, device=dev)
        g = drafts.shape[0]
        rows = torch.cat([torch.tensor([self.last], device=dev), drafts])
        z = forward_rows(self.target, rows, self.t_cache, self.t_len, g + 1)    # [g + 1, V]
        if self.first_logits is None:
            self.first_logits = z[0].clone()
        u = torch.zeros(1, g + 1, device=dev) if opt.greedy else \
            torch.rand(1, g + 1, device=dev, generator=self.generator)
        out, n = _ops.verify_draft(drafts[None], q[None].contiguous(), z[None], u,
                                   temperature=float(opt.temperature), eta=float(opt.eta),
                                   alpha=float(opt.alpha), greedy=opt.greedy)
        *out, n = torch.cat([out[0], n.long()]).tolist()   # the one host read of the round
        emitted = out[:n + 1]
        # O(1) rollback: the target keeps [last] + n accepted drafts, the drafter its pending
        # tokens + the accepted drafts it has fed (all but its last draft)
        self.t_len += 1 + n
        self.t_cache.lengths.fill_(self.t_len)
        kept = min(n, g - 1) if g > 0 else 0
        self.d_len = d_base + (len(self.pending) + kept if g > 0 else 0)
        self.d_cache.lengths.fill_(self.d_len)
        self.pending = (emitted[kept:] if g > 0 else self.pending + emitted)
        self.last = emitted[-1]
        st = self.stats
        st.rounds += 1
        st.drafted += g
        st.accepted += n
        for i, t in enumerate(emitted):
            if t in self.eos:
                emitted = emitted[:i + 1]
                self.done = True
                break
        self.tokens += emitted
        st.generated += len(emitted)
        if len(self.tokens) >= self.max_new_tokens:
            self.done = True
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        return emitted

    def run(self) -> list[int]:
        """Rounds until EOS or ``max_new_tokens``; returns the generated tokens."""
        t0 = time.perf_counter()
        with use_ragattn(self.target), use_ragattn(self.drafter):
            while not self.done:
                self.step()
        _sync(self.t_dev)
        self.stats.decode_s += time.perf_counter() - t0
        return self.tokens


@torch.no_grad()
def decode_autoregressive(model, cache: PagedKV, start: int, last: int, max_new_tokens: int, *,
                          temperature: float = 1.0, greedy: bool = True, eos_ids=(),
                          generator: Optional[torch.Generator] = None):
    """Plain decoding (one token per forward) on a prefilled paged cache holding ``start`` slots,
    ``last`` the prompt's last token (not in the cache). Returns ``(tokens, first_logits,
    first_token_at)`` (``perf_counter()`` after the first token); the baseline RAPID's decode speed
    is measured against (same attention path, same cache)."""
    dev, out, first, eos, first_at = _device(model), [], None, set(eos_ids), None
    with use_ragattn(model):
        tok = torch.tensor([last], device=dev)
        while len(out) < max_new_tokens:
            z = forward_rows(model, tok, cache, start, 1)[-1]
            start += 1
            first = z.clone() if first is None else first
            tok = sample(z, torch.softmax(z * (1.0 / temperature), -1), greedy, generator)
            out.append(int(tok))
            first_at = first_at or time.perf_counter()
            if out[-1] in eos:
                break
    return out, first, first_at


# ----------------------------------------------------------------------------------------------
# API


@dataclass
class RapidOutput:
    """``tokens``/``text``: the answer; ``stats``: :class:`RapidStats`; ``retrieval``: the drafter's
    :class:`RetrievalContext`; ``first_logits``: float32 ``[V]`` target logits of the first token;
    ``target_prompt_len``/``draft_prompt_len``: prompt tokens of each model."""
    tokens: list
    text: str
    stats: RapidStats
    retrieval: RetrievalContext
    first_logits: torch.Tensor
    target_prompt_len: int
    draft_prompt_len: int
    extra: dict = field(default_factory=dict)


def prompts(tokenizer, context, question: str, retrieval: RetrievalContext):
    """``(target_ids, draft_ids)``: the chat prompt around the whole context and around the
    retrieval context (:func:`ragattn.methods.prompt.prompt_parts`)."""
    docs = [context] if isinstance(context, str) else list(context)
    head, chunks, tail = prompt_parts(tokenizer, docs, question)
    _, rchunks, _ = prompt_parts(tokenizer, [retrieval.text], question)
    return head + [t for c in chunks for t in c] + tail, head + rchunks[0] + tail


@torch.no_grad()
def generate(target, tokenizer, context, question: str, drafter=None, *, max_new_tokens: int = 64,
             gamma: int = 4, eta: float = 0.0, alpha: float = 0.1, temperature: float = 1.0,
             greedy: bool = True, confidence_threshold: Optional[float] = None, mode: str = "rapid",
             generator: Optional[torch.Generator] = None, drafter_tokenizer=None, encoder=None,
             chunk_tokens: int = 128, budget_tokens: Optional[int] = None, min_tokens: int = 4096,
             ratio: float = 24.0, threshold: float = 0.1) -> RapidOutput:
    """Answer ``question`` about ``context`` (a ``str`` or a sequence of documents) with RAPID.

    ``drafter``: None = self-speculation, else a model sharing the target's tokenizer (ValueError
    if its vocabulary differs; pass ``drafter_tokenizer`` to have the token maps compared too).
    Decoding options: see :class:`RapidOptions`. ``mode``: "rapid" (speculative; ``eta = 0`` is
    plain speculative decoding), "lc" (the target decodes alone on the whole context), "rag" (the
    target decodes alone on the retrieval context). Retrieval options: see
    :func:`build_retrieval_context`. Ends at EOS (included) or after ``max_new_tokens`` tokens."""
    opt = RapidOptions(gamma, eta, alpha, temperature, greedy, confidence_threshold)
    _check_max_new_tokens(max_new_tokens)
    if mode not in MODES:
        raise ValueError(f"{_WHERE}: mode must be one of {MODES}, got {mode!r}")
    check_drafter(target, drafter, tokenizer, drafter_tokenizer)
    t0 = time.perf_counter()
    retrieval = build_retrieval_context(tokenizer, context, question, encoder=encoder,
                                        chunk_tokens=chunk_tokens, budget_tokens=budget_tokens,
                                        min_tokens=min_tokens, ratio=ratio, threshold=threshold)
    retrieval_s = time.perf_counter() - t0
    target_ids, draft_ids = prompts(tokenizer, context, question, retrieval)
    limit = getattr(target.config, "max_position_embeddings", None)
    if limit is not None and len(target_ids) + max_new_tokens > limit:
        raise ValueError(f"{_WHERE}: prompt of {len(target_ids)} tokens + {max_new_tokens} new tokens "
                         f"exceeds the target's window ({limit})")
    eos = _eos_ids(target, tokenizer)
    if mode == "rapid":
        dec = RapidDecoder(target, target_ids, draft_ids, drafter=drafter, options=opt,
                           max_new_tokens=max_new_tokens, eos_ids=eos, generator=generator)
        dec.prefill()
        dec.stats.retrieval_s = retrieval_s
        tokens = dec.run()
        stats, first, first_at = dec.stats, dec.first_logits, dec.first_token_at
    else:
        ids = target_ids if mode == "lc" else draft_ids
        stats = RapidStats(retrieval_s=retrieval_s if mode == "rag" else 0.0)
        cache = new_cache(target, len(ids) + max_new_tokens + 1)
        t1 = time.perf_counter()
        prefill(target, ids[:-1], cache)
        _sync(_device(target))
        t2 = time.perf_counter()
        tokens, first, first_at = decode_autoregressive(
            target, cache, len(ids) - 1, ids[-1], max_new_tokens, temperature=temperature,
            greedy=greedy, eos_ids=eos, generator=generator)
        _sync(_device(target))
        stats.prefill_target_s, stats.decode_s = t2 - t1, time.perf_counter() - t2
        stats.rounds = stats.generated = len(tokens)
    return RapidOutput(tokens, tokenizer.decode(tokens, skip_special_tokens=True), stats, retrieval,
                       first, len(target_ids), len(draft_ids), {"mode": mode, "first_token_at": first_at})


def answer(model, tokenizer, chunks, question: str, *, max_new_tokens: int = 32, store=None,
           drafter=None, gamma: int = 4, eta: float = 0.0, budget_tokens: Optional[int] = None,
           **options) -> Answer:
    """RAPID in the common method signature (greedy unless ``greedy=False`` is passed): ``chunks``
    are the long context's documents in prompt order (the target reads them all, the drafter the
    retrieved part); ``store`` is ignored (RAPID caches no chunks). ``budget_tokens`` None: a third
    of the context's tokens (at least one chunk), so that the drafter reads a short context even
    when the context is far below the authors' 4096-token floor. ``ttft_s`` ends with the first
    round (retrieval and both prefills included); ``extra`` holds the :class:`RapidStats`."""
    if len(chunks) == 0:
        raise ValueError(f"{_WHERE}.answer: no chunks given (empty retrieval)")
    if budget_tokens is None:
        budget_tokens = max(1, sum(_num_tokens(tokenizer, c) if isinstance(c, str) else len(c)
                                   for c in chunks) // 3)
    docs = [c if isinstance(c, str) else tokenizer.decode(c) for c in chunks]
    options.setdefault("greedy", True)
    t0 = time.perf_counter()
    out = generate(model, tokenizer, docs, question, drafter, max_new_tokens=max_new_tokens,
                   gamma=gamma, eta=eta, budget_tokens=budget_tokens, **options)
    total = time.perf_counter() - t0
    st = out.stats
    ttft = out.extra["first_token_at"] - t0
    return Answer(out.tokens, out.text, ttft, total, out.first_logits, out.target_prompt_len, "rapid",
                  {"stats": st, "retrieval": out.retrieval, "draft_prompt_len": out.draft_prompt_len})


@torch.no_grad()
def hf_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                synced_gpus: bool = False, streamer=None, rapid_draft_ids=None, rapid_drafter=None,
                rapid_gamma: int = 4, rapid_eta: float = 0.0, rapid_alpha: float = 0.1,
                rapid_confidence_threshold: Optional[float] = None,
                rapid_generator: Optional[torch.Generator] = None, **model_kwargs):
    """RAPID as a transformers decoding method: ``model.generate()`` prepares the inputs and the
    generation config, this runs the loop (batch 1)::

        target_ids, draft_ids = rapid.prompts(tok, context, question, retrieval)
        seq = model.generate(torch.tensor([target_ids]), custom_generate=rapid.hf_generate,
                             rapid_draft_ids=draft_ids, rapid_gamma=4, rapid_eta=10.0,
                             max_new_tokens=32, do_sample=True, temperature=0.7)

    ``rapid_draft_ids``: the drafter's prompt (list of int); ``rapid_drafter``: None =
    self-speculation. From the generation config: ``max_new_tokens``/``max_length``,
    ``do_sample`` (False = greedy), ``temperature`` and ``eos_token_id``; other logits processors
    (top-k/top-p, penalties) and stopping criteria are not applied (RAPID's distributions are
    softmax(logits / T)). Returns the sequences ``[1, prompt + new]`` like ``generate()``."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"{_WHERE}.hf_generate: batch 1 only, got input_ids {tuple(input_ids.shape)}")
    if rapid_draft_ids is None:
        raise ValueError(f"{_WHERE}.hf_generate: pass rapid_draft_ids (the drafter's prompt, e.g. from rapid.prompts)")
    cfg = generation_config or model.generation_config
    max_new = cfg.max_length - input_ids.shape[1]
    if cfg.max_new_tokens is not None:
        max_new = cfg.max_new_tokens
    greedy = not cfg.do_sample
    temperature = float(cfg.temperature) if (cfg.do_sample and cfg.temperature) else 1.0
    eos = cfg.eos_token_id
    eos = [] if eos is None else (eos.tolist() if isinstance(eos, torch.Tensor) else
                                  list(eos) if isinstance(eos, (list, tuple)) else [eos])
    opt = RapidOptions(rapid_gamma, rapid_eta, rapid_alpha, temperature, greedy, rapid_confidence_threshold)
    dec = RapidDecoder(model, input_ids[0].tolist(), list(rapid_draft_ids), drafter=rapid_drafter, options=opt,
                       max_new_tokens=max_new, eos_ids=eos, generator=rapid_generator)
    dec.prefill()
    toks = dec.run()
    return torch.cat([input_ids, torch.tensor([toks], dtype=input_ids.dtype, device=input_ids.device)], 1)
