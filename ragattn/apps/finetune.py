"""Block-Attention fine-tuning ("block fine-tune"): ordinary SFT under the Block-Attention mask.

    python -m ragattn finetune [--steps N] [--batch B] [--lr LR] [--device cpu|cuda] [--top-k K]
    python scripts/finetune_block.py ...            # the same

Each training sample is a RAG prompt in blocks, tokenized block by block exactly as at inference
(``ragattn.methods.prompt.prompt_parts``, the methods' own prompt layout): the system prefix, one block per passage (the gold passage among
``top-k - 1`` random distractors, in random order), and the final block (question + answer).
Attention runs through ``ragattn.varlen_attention`` and its autograd, with

* positions: contiguous ``0..T-1`` per sample (what position re-encoding produces at inference);
* blocks: prefix and every passage attend only inside themselves (block ids 0..k), the final
  block and the answer are global (block -1) and see everything before them;
* several samples packed into one row, separated by ``cu_seqlens`` (no padding, no dense mask);
* loss: next-token cross-entropy on the answer tokens only.

The model runs with ragattn's HF attention implementation (``ragattn.hf.attention``, "ragattn"),
which reads the packing (``ragattn_cu_seqlens``) and the blocks (``ragattn_block_ids``) from keyword
arguments of the model call.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import time
from typing import List, Sequence

import torch

from ragattn.methods.block_attention import block_ids

@dataclasses.dataclass
class Sample:
    ids: List[int]
    labels: List[int]  # -100 outside the answer
    blocks: List[int]  # block id per token, -1 = global


def make_sample(prefix: Sequence[int], chunks: Sequence[Sequence[int]], question: Sequence[int],
                answer: Sequence[int]) -> Sample:
    """Token blocks -> a sample: prefix is block 0, chunk ``i`` block ``i + 1``, question+answer global."""
    ids = list(prefix) + [t for c in chunks for t in c] + list(question) + list(answer)
    blocks = block_ids([len(prefix)] + [len(c) for c in chunks], len(question) + len(answer)).tolist()
    # labels[t] is the token predicted at t (HF shifts inside the loss): only answer tokens count
    labels = [-100] * (len(ids) - len(answer)) + list(answer)
    return Sample(ids, labels, blocks)


def pack(samples: Sequence[Sample], device) -> dict:
    """Model-call kwargs for one packed row: input_ids, position_ids, labels, cu_seqlens, blocks."""
    ids, pos, labels, blocks, cu = [], [], [], [], [0]
    for s in samples:
        ids += s.ids
        pos += list(range(len(s.ids)))
        # the first label of each sample must not be predicted from the previous sample's last token
        labels += [-100] + s.labels[1:]
        blocks += s.blocks
        cu.append(cu[-1] + len(s.ids))
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    return dict(input_ids=t([ids], torch.long), position_ids=t([pos], torch.long), labels=t([labels], torch.long),
                ragattn_cu_seqlens=t(cu, torch.int32), ragattn_block_ids=t([blocks], torch.int32))


def train_step(model, optimizer, batch: dict, max_grad_norm: float = 1.0) -> float:
    """One optimizer step on a packed batch under the Block-Attention mask; returns the loss."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def eval_loss(model, batch: dict) -> float:
    model.eval()
    return float(model(**batch, use_cache=False).loss)


def use_block_attention(model) -> None:
    """Switch a loaded HF model to ragattn's attention, which applies the packed block mask."""
    import ragattn.hf.attention  # noqa: F401  (registers "ragattn")

    model.set_attn_implementation("ragattn")


def corpus_samples(tokenizer, corpus, top_k: int, rng: random.Random) -> List[Sample]:
    """One sample per question: gold passage + ``top_k - 1`` random distractors in random order."""
    from ragattn.methods.prompt import prompt_parts

    out = []
    for q in corpus.questions:
        gold = corpus.passage(q.passage_id) if q.passage_id else None
        others = [p for p in corpus.passages if p is not gold]
        chosen = rng.sample(others, top_k - (1 if gold else 0)) + ([gold] if gold else [])
        rng.shuffle(chosen)
        head, chunk_ids, tail = prompt_parts(tokenizer, [p.render() for p in chosen], q.question)
        answer = tokenizer(f"{q.answers[0]}.<|im_end|>", add_special_tokens=False)["input_ids"]
        out.append(make_sample(head, chunk_ids, tail, answer))
    return out


def main(argv=None) -> int:
    """One ``error:`` line and exit status 2 for every bad input (:func:`ragattn.apps.cli.run_command`)."""
    from ragattn.apps.cli import run_command

    try:
        return run_command(lambda: _main(argv), "python -m ragattn finetune")
    finally:
        # the process-wide flag is this command's alone: a caller (a test, a notebook) gets its
        # default back, so numpy and torch see subnormals again after a fine-tune
        torch.set_flush_denormal(False)


def _main(argv=None) -> int:
    from ragattn.apps.cli import OneLineParser, UsageError, check_positive, parse_device, save_or_keep, writable_dir

    p = OneLineParser(prog="python -m ragattn finetune", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' (default) or a local HF checkpoint folder")
    p.add_argument("--corpus", default=None, metavar="DIR", help="corpus folder (default: the shipped one)")
    p.add_argument("--steps", type=int, default=20, help="optimiser steps (default %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="samples packed per step")
    p.add_argument("--lr", type=float, default=5e-5, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--top-k", type=int, default=3, help="passages per sample (gold + distractors)")
    p.add_argument("--train", choices=("all", "attention"), default="attention",
                   help="parameters to train: all, or only the attention projections (default; less memory)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--eval-questions", type=int, default=6,
                   help="questions in the before/after evaluation (0: no evaluation)")
    p.add_argument("--seed", type=int, default=0, help="random seed (sample order, torch; default %(default)s)")
    p.add_argument("--save", default=None, metavar="DIR", help="save the fine-tuned model here")
    args = p.parse_args(argv)
    for name in ("steps", "eval_questions"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.batch < 1:
        p.error(f"--batch must be >= 1, got {args.batch}")
    if args.top_k < 1:
        p.error(f"--top-k must be >= 1, got {args.top_k}")
    check_positive(args.lr, "--lr")
    device = parse_device(args.device)                  # before any work: device, corpus, --save
    if args.save:
        writable_dir(args.save, "--save")
    torch.set_flush_denormal(True)  # tiny Adam moments must not hit the slow denormal path

    from tqdm import tqdm

    from ragattn.apps.corpus import load_corpus
    from ragattn.apps.demo import load_model

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    corpus = load_corpus(args.corpus)
    if args.top_k > len(corpus.passages):
        raise UsageError(f"--top-k {args.top_k} exceeds the corpus's {len(corpus.passages)} passages")
    model, tok = load_model(args.model, device, "finetune")
    model = model.to(dtype)
    use_block_attention(model)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    params = [pr for n, pr in model.named_parameters()
              if args.train == "all" or any(s in n for s in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    for pr in model.parameters():
        pr.requires_grad_(False)
    for pr in params:
        pr.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    # fixed held-out view of every question (its own distractors) to measure before/after
    eval_samples = corpus_samples(tok, corpus, args.top_k, random.Random(args.seed + 1))[: args.eval_questions]
    eval_batch = pack(eval_samples, device) if eval_samples else None
    before = eval_loss(model, eval_batch) if eval_batch is not None else None
    if before is not None:
        print(f"block-mask answer loss on {len(eval_samples)} held-fixed prompts before: {before:.4f}")
    t0 = time.perf_counter()
    losses = []
    bar = tqdm(range(args.steps), desc="block fine-tune", unit="step", file=sys.stderr)
    for step in bar:
        samples = corpus_samples(tok, corpus, args.top_k, rng)
        batch = pack(rng.sample(samples, min(args.batch, len(samples))), device)
        losses.append(train_step(model, optimizer, batch))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        tqdm.write(f"step {step + 1:4d}  loss {losses[-1]:.4f}", file=sys.stdout)
    summary = [f"{args.steps} steps, {time.perf_counter() - t0:.0f} s on {device}"]
    if losses:
        n = max(1, len(losses) // 5)
        summary.append(f"training loss first {n} steps {sum(losses[:n]) / n:.4f} -> last {n} {sum(losses[-n:]) / n:.4f}")
    if eval_batch is not None:
        after = eval_loss(model, eval_batch)
        summary.append(f"block-mask answer loss on {len(eval_samples)} held-fixed prompts {before:.4f} -> {after:.4f}")
    print("; ".join(summary))
    if args.save:
        model.config._attn_implementation = "sdpa"

        def save(path):
            model.save_pretrained(path)
            tok.save_pretrained(path)

        save_or_keep(save, args.save, "--save")   # a failed save keeps the trained model elsewhere
        print(f"saved {args.save}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
