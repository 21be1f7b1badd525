"""Block fine-tuning by distillation: the model under the Block-Attention mask learns to give the
next-token distributions the same model gives under full attention.

    ex = next(rag_examples(passages, rng))                       # ragattn.apps.training_text
    s = distill_sample(model, tokenizer, ex, scheme="reordered") # teacher: adapter off, full attention
    loss = distill_loss(model, [s, ...])                         # student: adapter on, block mask
    loss.backward()

A sample is a RAG prompt tokenized block by block exactly as at inference
(:func:`ragattn.methods.prompt.prompt_parts`: head, one block per passage, the final block), followed
by the teacher's own greedy answer. The targets are the teacher's log-probabilities at every row of
the final block and the answer (the rows whose predictions the methods use), computed once with the
adapter disabled and full causal attention at contiguous positions. The student runs the same tokens
packed several to a row (``cu_seqlens``) through ragattn's attention with block ids (head and each
passage attend only inside themselves, the final block and answer to everything) and positions of
the scheme the methods use at inference:

* ``reordered`` (Block-Attention, TurboRAG reordered): contiguous ``0..T-1``;
* ``composite`` (TurboRAG composite): every cached block at ``0..n_i-1``, the final block from
  ``max(n_i)`` on (``ChunkStore.assemble``'s rule).

The loss is ``KL(teacher || student)`` averaged over the target rows of every sample.
"""
from __future__ import annotations

import dataclasses
from typing import List, Sequence

import torch

from ragattn.methods.block_attention import block_ids
from ragattn.methods.generate import _eos_ids, first_row_figures, kl_rows
from ragattn.methods.prompt import prompt_parts

SCHEMES = ("reordered", "composite")


@dataclasses.dataclass
class DistillSample:
    """One prompt + teacher answer. ``ids``/``positions``/``blocks``: int lists ``[T]``;
    ``rows``: the row indices (into ``ids``) whose next-token distribution is a target;
    ``target``: float32 ``[len(rows), vocab]`` teacher log-probabilities at those rows;
    ``scheme``: the positions' scheme (:data:`SCHEMES`)."""
    ids: List[int]
    positions: List[int]
    blocks: List[int]
    rows: List[int]
    target: torch.Tensor
    scheme: str
    first: int          # index into ``rows`` of the row that predicts the first answer token


def scheme_positions(block_lens: Sequence[int], final_len: int, scheme: str) -> List[int]:
    """RoPE positions ``[sum(block_lens) + final_len]`` of a prompt in blocks under ``scheme``."""
    if scheme == "reordered":
        return list(range(sum(block_lens) + final_len))
    if scheme == "composite":
        start = max(block_lens, default=0)
        return [p for n in block_lens for p in range(n)] + list(range(start, start + final_len))
    raise ValueError(f"block_distill: scheme must be one of {SCHEMES}, got {scheme!r}")


@torch.no_grad()
def teacher_answer(base, prompt: List[int], target_from: int, max_answer: int, stop: set):
    """Greedy answer of ``base`` (full causal attention, contiguous positions) to ``prompt``, and its
    log-probabilities at rows ``target_from .. len(prompt) + len(answer) - 2``.
    Returns ``(answer ids, float32 [rows, vocab])``; the answer ends with its stop token if one came."""
    dev = base.device
    n_keep = len(prompt) - target_from
    out = base(input_ids=torch.tensor([prompt], device=dev), use_cache=True, logits_to_keep=n_keep)
    rows = [out.logits[0].float().log_softmax(-1)]
    past, answer = out.past_key_values, []
    nxt = int(rows[0][-1].argmax())
    while True:
        answer.append(nxt)
        if nxt in stop or len(answer) >= max_answer:
            break
        out = base(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=past, use_cache=True)
        past = out.past_key_values
        lp = out.logits[0, -1:].float().log_softmax(-1)
        rows.append(lp)
        nxt = int(lp[0].argmax())
    return answer, torch.cat(rows)


def distill_sample(peft_model, tokenizer, example, scheme: str, max_answer: int = 16) -> DistillSample:
    """Tokenize ``example`` (:class:`ragattn.apps.training_text.RagExample`) as the methods do and get
    the teacher's answer and targets with the adapter disabled."""
    if scheme not in SCHEMES:
        raise ValueError(f"block_distill: scheme must be one of {SCHEMES}, got {scheme!r}")
    head, chunks, tail = prompt_parts(tokenizer, [p.render() for p in example.passages], example.question)
    blocks_lens = [len(head)] + [len(c) for c in chunks]
    prompt = head + [t for c in chunks for t in c] + tail
    with peft_model.disable_adapter():
        answer, target = teacher_answer(peft_model, prompt, len(prompt) - len(tail), max_answer,
                                        _eos_ids(peft_model.get_base_model(), tokenizer))
    ids = prompt + answer
    final_len = len(tail) + len(answer)
    first = len(prompt) - len(tail)
    return DistillSample(ids=ids, positions=scheme_positions(blocks_lens, final_len, scheme),
                         blocks=block_ids(blocks_lens, final_len).tolist(),
                         rows=list(range(first, len(ids) - 1)), target=target, scheme=scheme,
                         first=len(tail) - 1)


def pack_samples(samples: Sequence[DistillSample], device) -> dict:
    """Model-call kwargs for one packed row (``input_ids``, ``position_ids`` ``[1, T]``,
    ``ragattn_cu_seqlens`` int32 ``[n + 1]``, ``ragattn_block_ids`` int32 ``[1, T]``) and the packed
    target rows ``rows`` (int64 ``[R]``)."""
    ids, pos, blocks, rows, cu = [], [], [], [], [0]
    for s in samples:
        rows += [cu[-1] + r for r in s.rows]
        ids += s.ids
        pos += s.positions
        blocks += s.blocks
        cu.append(cu[-1] + len(s.ids))
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return dict(input_ids=t([ids], torch.long), position_ids=t([pos], torch.long),
                ragattn_cu_seqlens=t(cu, torch.int32), ragattn_block_ids=t([blocks], torch.int32),
                rows=t(rows, torch.long))


def student_logprobs(peft_model, batch: dict) -> torch.Tensor:
    """float32 ``[R, vocab]``: the adapted model's log-probabilities at ``batch["rows"]`` under the
    Block-Attention mask (the model must run ragattn's attention: ``ragattn.hf.use_ragattn``).
    The LM head runs on those rows only."""
    causal_lm = peft_model.get_base_model()
    kwargs = {k: v for k, v in batch.items() if k != "rows"}
    hidden = causal_lm.model(**kwargs, use_cache=False).last_hidden_state[0, batch["rows"]]
    return causal_lm.lm_head(hidden).float().log_softmax(-1)


def _row_kl(peft_model, samples: Sequence[DistillSample]):
    """``(KL(teacher || student) per target row [R], student [R, vocab], teacher [R, vocab])`` for
    ``samples`` packed in one row."""
    dev = next(peft_model.parameters()).device
    student = student_logprobs(peft_model, pack_samples(samples, dev))
    target = torch.cat([s.target for s in samples]).to(dev)
    return kl_rows(target, student), student, target


def distill_loss(peft_model, samples: Sequence[DistillSample]) -> torch.Tensor:
    """Mean over target rows of ``KL(teacher || student)`` for ``samples`` packed in one row."""
    return _row_kl(peft_model, samples)[0].mean()


@torch.no_grad()
def agreement(peft_model, samples: Sequence[DistillSample]) -> dict:
    """Held-out figures without gradients: mean KL over target rows, mean KL and top-1 agreement at
    the first answer row (the row the methods' first token comes from)."""
    kl, student, target = _row_kl(peft_model, samples)
    first_rows, at = [], 0
    for s in samples:
        first_rows.append(at + s.first)
        at += len(s.rows)
    return first_row_figures(kl, student, target, first_rows)
