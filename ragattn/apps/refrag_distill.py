"""REFRAG's RAG stage (``refrag-train --stages ...,rag``): answer from compressed passages the way the
decoder answers from their tokens.

    samples = [rag_sample(rm, ex, expand) for ex in examples]   # teacher: the decoder over the tokens
    loss = rag_loss(rm, samples)                                # student: the REFRAG layout
    run_rag(rm, cfg, train_passages, held_passages)             # the stage: LoRA on the decoder, AdamW

The paper fine-tunes the whole model on RAG tasks after continual pre-training; here the task is a
distillation that needs no gold answers (the recipe of ``python -m ragattn finetune``): a RAG question
over FOLDOC passages (:func:`ragattn.apps.training_text.rag_examples`) is answered greedily by the
decoder (LoRA disabled) with every passage as tokens, in :func:`ragattn.methods.prompt.prompt_parts`'
chat layout. Its log-probabilities at the rows that predict the answer are the targets. The student
reads the same prompt with the passages cut into k-token chunks (:class:`RefragModel`'s layout, a
fraction of chunks expanded at random, in turn from ``cfg.rag_expand``), and the loss is
``KL(teacher || student)`` over those rows. The encoder (``cfg.encoder_layers``), the projector and a
LoRA of rank ``cfg.decoder_lora_rank`` on the decoder train; at the end the LoRA is merged into the
decoder and its weights are kept for :func:`ragattn.apps.refrag_ship.ship`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import Dict, List, Sequence

import torch

from ragattn.apps.block_distill import teacher_answer
from ragattn.apps.finetune import LORA_TARGETS
from ragattn.methods.generate import _eos_ids, first_row_figures, kl_rows
from ragattn.methods.prompt import prompt_parts

@dataclasses.dataclass
class RagSample:
    """A RAG question as REFRAG reads it: ``example`` (RefragExample: prefix = chat head, context =
    the passages' chunks, prompt = the question tail, target = the teacher's answer ids), ``expand``
    bool ``[L]`` (chunks read as tokens) and ``target`` float32 ``[len(answer), vocab]``: the teacher's
    log-probabilities at the rows predicting each answer token."""
    example: object
    expand: torch.Tensor
    target: torch.Tensor


def rag_sample(rm, example, expand_fraction: float, rng: random.Random, max_answer: int = 16) -> RagSample:
    """The teacher's answer and targets for ``example`` (:class:`ragattn.apps.training_text.RagExample`)
    with every passage as tokens, and the student's layout at rate ``rm.k`` with
    ``round(expand_fraction * L)`` chunks expanded at random. ``rm.decoder`` is a peft model (the
    teacher runs with its adapter disabled) or a plain one."""
    from ragattn.methods.refrag.chunking import chunk_context
    from ragattn.methods.refrag.layout import RefragExample
    from ragattn.methods.refrag.train import random_expand_masks

    head, chunks, tail = prompt_parts(rm.tokenizer, [p.render() for p in example.passages], example.question)
    prompt = head + [t for c in chunks for t in c] + tail
    dec = rm.decoder
    off = dec.disable_adapter() if hasattr(dec, "disable_adapter") else contextlib.nullcontext()
    with off:
        answer, target = teacher_answer(dec, prompt, len(prompt) - 1, max_answer, _eos_ids(dec, rm.tokenizer))
    ctx = chunk_context(chunks, rm.k, allowed_k=None)
    L = ctx.num_chunks
    expand = random_expand_masks(1, L, min(L, round(expand_fraction * L)), rng)[0]
    return RagSample(RefragExample(ctx, prompt=tail, target=answer, prefix=head), expand, target)


def _row_kl(rm, samples: Sequence[RagSample]):
    """``(KL per answer row [R], student log-probs [R, vocab], teacher [R, vocab])``, rows in sample order."""
    inputs = rm.build_inputs([s.example for s in samples], [s.expand for s in samples])
    logits = rm.logits(inputs)
    labels = inputs.padded("right")[3][:, 1:].to(logits.device)
    student = logits[:, :-1][labels != -100].log_softmax(-1)
    target = torch.cat([s.target for s in samples]).to(student.device)
    return kl_rows(target, student), student, target


def rag_loss(rm, samples: Sequence[RagSample]) -> torch.Tensor:
    """Mean over answer rows of ``KL(teacher || student)`` (differentiable)."""
    return _row_kl(rm, samples)[0].mean()


@torch.no_grad()
def rag_agreement(rm, samples: Sequence[RagSample]) -> Dict[str, float]:
    """Held-out figures: mean KL over answer rows, KL and top-1 agreement at the first answer row."""
    kl, student, target = _row_kl(rm, samples)
    starts = torch.tensor([0] + [s.target.shape[0] for s in samples[:-1]]).cumsum(0)
    return first_row_figures(kl, student, target, starts.tolist())


def _held_samples(rm, held_passages, cfg, n: int) -> Dict[float, List[RagSample]]:
    from ragattn.apps.training_text import rag_examples

    stream = rag_examples(held_passages, random.Random(cfg.seed + 7), top_k=cfg.rag_top_k)
    examples = [next(stream) for _ in range(n)]
    return {f: [rag_sample(rm, ex, f, random.Random(cfg.seed + 8), cfg.rag_answer_tokens) for ex in examples]
            for f in cfg.rag_expand}


def run_rag(rm, cfg, train_passages, held_passages, init_lora=None):
    """The stage (see the module docstring). Returns ``(StageResult, lora_state)``: ``lora_state`` is
    ``dict(config=LoraConfig, weights=state dict)`` of the decoder's LoRA (float32, peft's names), or
    None with rank 0. On return ``rm.decoder`` is a plain model again, the LoRA merged into its weights.
    ``init_lora``: the LoRA's starting weights (peft's names, e.g. a shipped folder's) instead of peft's
    initialisation."""
    from ragattn.apps.training_text import rag_examples
    from ragattn.methods.refrag.train import StageResult, _optimise, set_decoder_trainable, trainable_encoder_params

    res = StageResult("rag")
    set_decoder_trainable(rm, False)
    lora = None
    if cfg.decoder_lora_rank:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=cfg.decoder_lora_rank, lora_alpha=2 * cfg.decoder_lora_rank, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS))
        rm.decoder = get_peft_model(rm.decoder, lora)
        if init_lora is not None:
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(rm.decoder, init_lora)
            if getattr(result, "unexpected_keys", None):
                raise ValueError(f"refrag-train: the initial LoRA has tensors this decoder has no place for: "
                                 f"{result.unexpected_keys[:3]}")
    params = trainable_encoder_params(rm, cfg.encoder_layers) + [p for p in rm.decoder.parameters()
                                                                 if p.requires_grad]
    held = _held_samples(rm, held_passages, cfg, cfg.eval_examples)

    def evaluate():
        rm.encoder.eval()
        rm.decoder.eval()
        out = {}
        for f, samples in held.items():
            for key, v in rag_agreement(rm, samples).items():
                out[f"{key}_expand{f:g}"] = v
        return out

    res.heldout_before = evaluate()
    rng = random.Random(cfg.seed + 4)
    stream = rag_examples(train_passages, rng, top_k=cfg.rag_top_k)
    t0 = time.perf_counter()

    def step(i):
        f = cfg.rag_expand[i % len(cfg.rag_expand)]
        rm.encoder.eval()
        rm.decoder.eval()
        samples = [rag_sample(rm, next(stream), f, rng, cfg.rag_answer_tokens) for _ in range(cfg.batch)]
        rm.encoder.train()
        rm.decoder.train()
        return rag_loss(rm, samples), {"m": sum(s.example.context.num_chunks for s in samples) // len(samples)}

    _optimise(params, cfg.rag_lr, cfg.rag_steps, step, res, cfg.progress)
    res.seconds = time.perf_counter() - t0
    res.heldout_after = evaluate()
    state = None
    if lora is not None:
        from peft.utils import get_peft_model_state_dict

        state = dict(config=lora, weights={k: v.detach().float().cpu().clone()
                                                     for k, v in get_peft_model_state_dict(rm.decoder).items()})
        rm.decoder = rm.decoder.merge_and_unload()
    set_decoder_trainable(rm, False)
    rm.encoder.eval()
    return res, state
