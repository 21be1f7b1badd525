"""Decoding after the prompt: the :class:`Answer` every method returns, a forward against a paged
request cache (:func:`paged_forward`), and ``model.generate()`` over one (:func:`generate_paged`),
timed to the first token."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from ragattn.hf.registration import use_ragattn

@dataclass
class Answer:
    """Result of one answered question.

    ``tokens``: generated ids (greedy, stops after EOS or ``max_new_tokens``); ``text``: decoded;
    ``ttft_s``: seconds from the call to the first generated token (chunk lookup, assembly and
    final-block prefill included); ``total_s``: whole call; ``first_logits``: float32 ``[vocab]``
    logits of the first generated token; ``prompt_len``: prompt tokens."""
    tokens: list[int]
    text: str
    ttft_s: float
    total_s: float
    first_logits: torch.Tensor
    prompt_len: int
    method: str = ""
    extra: dict = field(default_factory=dict)


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(p || q) in nats between the softmax distributions of two logit vectors (``[vocab]``, any
    float dtype; computed in float64): how far a method's first-token distribution ``q`` is from
    full attention's ``p`` (``Answer.first_logits``)."""
    lp = torch.log_softmax(p_logits.detach().double().cpu(), -1)
    lq = torch.log_softmax(q_logits.detach().double().cpu(), -1)
    return float((lp.exp() * (lp - lq)).sum().clamp_min(0.0))


def kl_rows(target: torch.Tensor, student: torch.Tensor) -> torch.Tensor:
    """``KL(target || student)`` per row ``[R]`` of two log-probability matrices ``[R, vocab]``
    (differentiable in ``student``): the distillation loss of the training stages."""
    return (target.exp() * (target - student)).sum(-1)


def first_row_figures(kl: torch.Tensor, student: torch.Tensor, target: torch.Tensor, first_rows) -> dict:
    """Held-out figures of a distillation: mean ``kl`` ``[R]`` over all rows, and the mean KL and
    top-1 agreement of ``student`` with ``target`` (``[R, vocab]``) at ``first_rows`` (each answer's
    first row: the row a method's first token comes from)."""
    first = list(first_rows)
    agree = (student[first].argmax(-1) == target[first].argmax(-1)).float().mean()
    return dict(kl=float(kl.mean()), first_kl=float(kl[first].mean()), first_agree=float(agree))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _eos_ids(model, tokenizer):
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return eos


@torch.no_grad()
def paged_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache, logits_to_keep: int = 0) -> torch.Tensor:
    """Run ``ids`` ``[1, q]`` at RoPE ``positions`` ``[q]`` against a paged request cache (appending
    them) through ``ragattn.paged_attention``; returns float32 logits ``[q, vocab]``, or of the
    last ``logits_to_keep`` tokens only (``[logits_to_keep, vocab]``; 0 = all): the first token
    needs one row, and the LM head over all ``q`` rows costs a quarter of a 20-token prefill."""
    with use_ragattn(model):
        out = model(input_ids=ids, position_ids=positions[None].long(), use_cache=False,
                    ragattn_paged=cache, logits_to_keep=logits_to_keep)
    cache.lengths += ids.shape[1]
    return out.logits[0].float()


class _FirstStepClock(LogitsProcessor):
    """Notes the time when generate() has the first step's logits (the first token follows)."""

    def __init__(self, device):
        self.device, self.t = device, None

    def __call__(self, input_ids, scores):
        if self.t is None:
            _sync(self.device)
            self.t = time.perf_counter()
        return scores


def _generate(model, tokenizer, t0: float, method: str, prompt_len: int, new_from: int,
              max_new_tokens: int, generate_kwargs: dict, **inputs) -> Answer:
    """``model.generate(**inputs)`` (greedy unless ``generate_kwargs`` say otherwise; stops at the
    model's and tokenizer's EOS), timed from ``t0``; the Answer of row 0."""
    dev = next(model.parameters()).device
    clock = _FirstStepClock(dev)
    eos = sorted(_eos_ids(model, tokenizer))
    kw = dict(do_sample=False, eos_token_id=eos or None)
    if model.generation_config.pad_token_id is None:
        pad = getattr(tokenizer, "pad_token_id", None)
        kw["pad_token_id"] = pad if pad is not None else (eos[0] if eos else 0)
    kw.update(generate_kwargs)
    if not kw["do_sample"]:
        kw.update(temperature=None, top_p=None, top_k=None)   # silence sampling-flag warnings
    if "stop_strings" in kw:
        kw.setdefault("tokenizer", tokenizer)
    kw["logits_processor"] = LogitsProcessorList([clock, *kw.get("logits_processor", [])])
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, return_dict_in_generate=True,
                         output_logits=True, **kw)
    _sync(dev)
    total = time.perf_counter() - t0
    tokens = out.sequences[0, new_from:].tolist()
    eos = set(kw["eos_token_id"] or [])
    for i, t in enumerate(tokens):   # drop the padding after an early EOS
        if t in eos:
            tokens = tokens[: i + 1]
            break
    return Answer(tokens, tokenizer.decode(tokens, skip_special_tokens=True), clock.t - t0, total,
                  out.logits[0][0].float(), prompt_len, method)


@torch.no_grad()
def generate_paged(model, tokenizer, cache, final_ids, start_pos: int, max_new_tokens: int, t0: float,
                   method: str, prompt_len: int, cached_ids=None, cached_positions=None,
                   **generate_kwargs) -> Answer:
    """Prefill the final block ``final_ids`` at RoPE positions ``start_pos..`` against the paged
    request ``cache`` (a batch-1 :class:`~ragattn.kv.PagedKV` holding ``lengths[0]``
    slots), then generate with ``model.generate()`` over a :class:`~ragattn.hf.cache.PagedCache`
    (greedy by default; ``generate_kwargs`` go to ``generate()``: sampling, logits processors,
    ``stop_strings``...). ``cached_ids`` / ``cached_positions``: the tokens and positions the
    cache holds (logits processors such as a repetition penalty read them; placeholders if absent).
    Builds the Answer (``ttft_s`` from ``t0`` to the first step's logits)."""
    from ragattn.hf.cache import PagedCache

    dev = next(model.parameters()).device
    seen = int(cache.lengths[0])
    if cached_ids is None:
        cached_ids = [getattr(tokenizer, "pad_token_id", None) or 0] * seen
    if cached_positions is None:
        cached_positions = torch.arange(seen)
    ids = torch.tensor([list(cached_ids) + list(final_ids)], device=dev)
    pos = torch.cat([torch.as_tensor(cached_positions, device=dev).long(),
                     start_pos + torch.arange(len(final_ids), device=dev)])[None]
    with use_ragattn(model):
        return _generate(model, tokenizer, t0, method, prompt_len, ids.shape[1], max_new_tokens,
                         generate_kwargs, input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=pos, past_key_values=PagedCache(cache, seen=seen), use_cache=True)
