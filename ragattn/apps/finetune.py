"""Block fine-tuning: a LoRA adapter that makes the model answer under the Block-Attention mask
the way it answers under full attention (Block-Attention, TurboRAG reordered and composite).

    python -m ragattn finetune --out runs/block-lora --steps 300          # CPU; resumes from --out
    python -m ragattn finetune --out runs/block-lora --steps 2000 --batch 8 --device cuda
    python -m ragattn finetune --out runs/block-lora2 --init ragattn/weights/block-attention-lora --steps 300

Training text: FOLDOC entries from Debian's ``dict-foldoc`` as passages, with templated questions
(:mod:`ragattn.apps.training_text`); nothing any test or eval of this repository uses. Objective:
distillation from the same model with the adapter off, under full attention
(:mod:`ragattn.apps.block_distill`); each sample's positions follow one of ``--schemes`` (by turns),
so one adapter serves the reordered and the composite schemes.

``--out`` receives ``checkpoint/`` every ``--checkpoint-every`` steps (adapter, optimiser, data
stream and history; a rerun with the same ``--out`` resumes from it), ``history.jsonl`` (one line
per step), ``loss.png`` (the curve), and at the end ``adapter/`` (``adapter_model.safetensors``,
``adapter_config.json``) with ``manifest.json`` (command, commit, data, hashes, figures).
``ragattn.hf.adapters`` loads such a folder. ``--init`` starts from such a folder (the shipped adapter,
or an earlier run's) instead of a fresh LoRA: training continues across runs, and the manifest records
the chain (``init``) with the steps and seconds of every run in it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_rank(config: dict) -> int:
    """The rank of a peft LoRA config (``adapter_config.json``'s fields) after checking it is one the
    training commands make: every :data:`LORA_TARGETS` projection, ``lora_alpha`` twice the rank;
    ValueError naming what differs."""
    rank = int(config.get("r", 0))
    if sorted(config.get("target_modules") or []) != sorted(LORA_TARGETS):
        raise ValueError(f"the adapter targets {config.get('target_modules')}, this command trains "
                         f"{list(LORA_TARGETS)}")
    if float(config.get("lora_alpha", 0)) != 2 * rank:
        raise ValueError(f"lora_alpha {config.get('lora_alpha')} is not twice the rank {rank}, as this command "
                         "trains")
    return rank


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def plot_history(history: list, path: Path) -> None:
    """The loss curve: training KL per step (and its running mean) and the held-out KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history if "loss" in h]
    loss = [h["loss"] for h in history if "loss" in h]
    held = [(h["step"], h["held_kl"], h["held_first_kl"]) for h in history if "held_kl" in h]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.6, alpha=0.4, label="training KL (per step)")
    if loss:
        w = max(1, len(loss) // 20)
        run = [sum(loss[max(0, i - w + 1): i + 1]) / len(loss[max(0, i - w + 1): i + 1]) for i in range(len(loss))]
        ax.plot(steps, run, lw=1.5, label=f"training KL (mean of {w})")
    if held:
        ax.plot([h[0] for h in held], [h[1] for h in held], "o-", label="held-out KL, all target rows")
        ax.plot([h[0] for h in held], [h[2] for h in held], "s--", label="held-out KL, first answer token")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(full attention || block attention), nats")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Block fine-tuning (distillation)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """One ``error:`` line and exit status 2 for every bad input (:func:`ragattn.apps.cli.run_command`)."""
    from ragattn.apps.cli import run_command

    try:
        return run_command(lambda: _main(argv), "python -m ragattn finetune")
    finally:
        torch.set_flush_denormal(False)    # the process-wide flag is this command's alone


def _parser():
    from ragattn.apps.cli import OneLineParser

    p = OneLineParser(prog="python -m ragattn finetune", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="run folder (checkpoints, curve, adapter)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default) or a local HF checkpoint folder")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="dictd file of the training passages (default: Debian dict-foldoc's "
                        "/usr/share/dictd/foldoc.dict.dz)")
    p.add_argument("--steps", type=int, default=300, help="optimiser steps in all (default %(default)s)")
    p.add_argument("--batch", type=int, default=2, help="samples packed per step (default %(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW peak learning rate (default %(default)s)")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank (default 16, or --init's)")
    p.add_argument("--init", default=None, metavar="DIR",
                   help="start from this adapter folder (adapter_config.json, adapter_model.safetensors, "
                        "manifest.json), e.g. the shipped ragattn/weights/block-attention-lora")
    p.add_argument("--schemes", default="reordered,composite",
                   help="position schemes, used by turns; a scheme named twice gets twice the samples "
                        "(default %(default)s)")
    p.add_argument("--top-k", default="3,17", metavar="LO,HI",
                   help="passages per prompt drawn from [LO, HI) (default %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=16, help="teacher answer length cap (default %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps between checkpoints (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=40, help="steps between held-out checks (default %(default)s)")
    p.add_argument("--held", type=int, default=8, help="held-out prompts per scheme (default %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default %(default)s)")
    return p


def _main(argv=None) -> int:
    from ragattn.apps.cli import UsageError, check_at_least, check_positive, parse_device, writable_dir

    args = _parser().parse_args(argv)
    for flag in ("steps", "batch", "rank", "answer_tokens", "checkpoint_every", "eval_every", "held"):
        if getattr(args, flag) is not None:
            check_at_least(getattr(args, flag), 1, "--" + flag.replace("_", "-"))
    args.init_manifest = _init_manifest(args) if args.init else None
    if args.rank is None:
        args.rank = args.init_manifest["rank"] if args.init else 16
    check_positive(args.lr, "--lr")
    from ragattn.apps.block_distill import SCHEMES

    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    if not schemes or any(s not in SCHEMES for s in schemes):
        raise UsageError(f"--schemes: each must be one of {', '.join(SCHEMES)}, got {args.schemes!r}")
    try:
        top_k = tuple(int(x) for x in args.top_k.split(","))
    except ValueError:
        top_k = ()
    if len(top_k) != 2 or not 1 <= top_k[0] < top_k[1]:
        raise UsageError(f"--top-k must be LO,HI with 1 <= LO < HI, got {args.top_k!r}")
    device = parse_device(args.device)
    out = writable_dir(args.out, "--out")
    torch.set_flush_denormal(True)     # tiny Adam moments must not hit the slow denormal path
    command = "python -m ragattn finetune " + shlex.join(sys.argv[1:] if argv is None else argv)
    return train(args, schemes, top_k, device, out, command)


def _init_manifest(args) -> dict:
    """The manifest of ``--init``'s adapter after checking its files against their hashes; a
    UsageError names what is missing, damaged or at odds with ``--rank``."""
    from ragattn.apps.cli import UsageError
    from ragattn.hf.adapters import AdapterError, check_adapter_files

    folder = Path(args.init)
    try:
        manifest = check_adapter_files(folder)
        lora = json.loads((folder / "adapter_config.json").read_text())
    except (AdapterError, OSError, ValueError) as e:
        raise UsageError(f"--init {folder}: {e}") from None
    if not (folder / "adapter_model.safetensors").is_file():
        raise UsageError(f"--init {folder}: adapter_model.safetensors is missing")
    try:
        manifest["rank"] = lora_rank(lora)
    except ValueError as e:
        raise UsageError(f"--init {folder}: {e}") from None
    if args.rank is not None and args.rank != manifest["rank"]:
        raise UsageError(f"--rank {args.rank}: --init's adapter has rank {manifest['rank']}")
    return manifest


def train(args, schemes, top_k, device, out: Path, command: str) -> int:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from peft.utils import get_peft_model_state_dict
    from tqdm import tqdm

    from ragattn.apps import block_distill as bd
    from ragattn.apps import training_text as tt
    from ragattn.apps.demo import load_model
    from ragattn.hf.registration import use_ragattn

    text_file = Path(args.text) if args.text else tt.FOLDOC
    passages = tt.load_foldoc(text_file)
    train_p, held_p = tt.split_passages(passages)
    if min(len(train_p), len(held_p)) < top_k[1] - 1:
        from ragattn.apps.cli import UsageError

        raise UsageError(f"--top-k {top_k[0]},{top_k[1]} needs {top_k[1] - 1} passages in the training and in the "
                         f"held-out split; {text_file} gives {len(train_p)} and {len(held_p)}")
    model, tok = load_model(args.model, device, "finetune")
    model = model.float()
    from ragattn.hf.adapters import architecture
    from ragattn.store.fingerprint import model_fingerprint

    base = dict(base_model=args.model, architecture=architecture(model),
                base_fingerprint=model_fingerprint(model, cached=False))   # before the LoRA layers go in
    torch.manual_seed(args.seed)
    cfg = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS))
    pm = get_peft_model(model, cfg)
    init = None
    if args.init:
        from safetensors.torch import load_file

        from ragattn.apps.cli import UsageError

        m = args.init_manifest
        if m.get("base_fingerprint") and m["base_fingerprint"] != base["base_fingerprint"]:
            raise UsageError(f"--init {args.init}: the adapter was trained on other weights than --model {args.model}")
        weights = Path(args.init) / "adapter_model.safetensors"
        loaded = {k: v.float() for k, v in load_file(weights).items()}
        result = set_peft_model_state_dict(pm, loaded)
        if getattr(result, "unexpected_keys", None):
            raise UsageError(f"--init {args.init}: tensors this model has no place for: {result.unexpected_keys[:3]}")
        init = dict(folder=str(args.init), sha256=tt.file_digest(weights), command=m.get("command"),
                    commit=m.get("commit"), steps=m.get("steps", 0), train_seconds=m.get("train_seconds", 0),
                    init=m.get("init"))
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    warmup = max(1, min(20, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))
    rng = random.Random(args.seed)
    step, history, elapsed, commit = 0, [], 0.0, _commit()
    ckpt = out / "checkpoint"
    if (ckpt / "state.pt").is_file():
        state = torch.load(ckpt / "state.pt", weights_only=False)
        set_peft_model_state_dict(pm, state["adapter"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        step, history, elapsed = state["step"], state["history"], state["elapsed_s"]
        commit = state.get("commit", commit)      # the code that started the run
        print(f"resumed from {ckpt} at step {step}", file=sys.stderr)
        # a run stopped after its last checkpoint logged steps that are about to run again
        (out / "history.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history if h["step"] > 0))
    stream = tt.rag_examples(train_p, rng, top_k=top_k)
    held_rng = random.Random(args.seed + 1)
    held_stream = tt.rag_examples(held_p, held_rng, top_k=top_k)
    held_schemes = list(dict.fromkeys(schemes))     # a repeated scheme weights training, not the check
    held = [bd.distill_sample(pm, tok, next(held_stream), s, args.answer_tokens)
            for s in held_schemes for _ in range(args.held)]

    def held_check():
        with use_ragattn(pm.get_base_model()):
            per = {s: bd.agreement(pm, [h for h in held if h.scheme == s]) for s in held_schemes}
        return dict(held_kl=sum(v["kl"] for v in per.values()) / len(per),
                    held_first_kl=sum(v["first_kl"] for v in per.values()) / len(per),
                    held_first_agree=sum(v["first_agree"] for v in per.values()) / len(per),
                    per_scheme=per)

    def save_checkpoint():
        tmp = ckpt.with_name("checkpoint.tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(dict(adapter=get_peft_model_state_dict(pm), optimizer=opt.state_dict(),
                        scheduler=sched.state_dict(), rng=rng.getstate(), torch_rng=torch.get_rng_state(),
                        step=step, history=history, elapsed_s=elapsed, commit=commit), tmp / "state.pt")
        if ckpt.exists():
            (ckpt / "state.pt").unlink()
            ckpt.rmdir()
        tmp.rename(ckpt)
        plot_history(history, out / "loss.png")

    if step == 0:
        history.append(dict(step=0, **held_check()))
        print(f"held-out before training: {json.dumps(history[-1])}", file=sys.stderr)
    with open(out / "history.jsonl", "a") as log:
        bar = tqdm(total=args.steps, initial=step, desc="block fine-tune", unit="step", file=sys.stderr)
        while step < args.steps:
            t0 = time.perf_counter()
            samples = [bd.distill_sample(pm, tok, next(stream), schemes[(step * args.batch + i) % len(schemes)],
                                         args.answer_tokens) for i in range(args.batch)]
            pm.train()
            with use_ragattn(pm.get_base_model()):
                loss = bd.distill_loss(pm, samples)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            pm.eval()
            step += 1
            elapsed += time.perf_counter() - t0
            rec = dict(step=step, loss=float(loss.detach()), lr=sched.get_last_lr()[0], elapsed_s=round(elapsed, 1),
                       tokens=sum(len(s.ids) for s in samples))
            if step % args.eval_every == 0 or step == args.steps:
                rec.update(held_check())
            history.append(rec)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(kl=f"{rec['loss']:.3f}")
            if step % args.checkpoint_every == 0 or step == args.steps:
                save_checkpoint()
        bar.close()
    adapter_dir = out / "adapter"
    pm.save_pretrained(adapter_dir)
    (adapter_dir / "README.md").unlink(missing_ok=True)     # peft's empty model card
    weights = adapter_dir / "adapter_model.safetensors"
    _to_bfloat16(weights)
    final = next(h for h in reversed(history) if "held_kl" in h)
    manifest = dict(
        kind="block-attention LoRA (distilled from full attention)",
        command=command,
        commit=commit, **base, schemes=schemes, steps=step + (init["steps"] if init else 0), run_steps=step,
        batch=args.batch, lr=args.lr, rank=args.rank, top_k=list(top_k), answer_tokens=args.answer_tokens,
        seed=args.seed, device=str(device), train_seconds=round(elapsed) + (init["train_seconds"] if init else 0),
        init=init,
        data=dict(package=tt.FOLDOC_PACKAGE if text_file == tt.FOLDOC else None, file=str(text_file),
                  sha256=tt.file_digest(text_file), licence=tt.FOLDOC_LICENCE if text_file == tt.FOLDOC else None,
                  passages=len(passages), train_passages=len(train_p), held_passages=len(held_p)),
        held_out_before=history[0].get("per_scheme"), held_out_after=final.get("per_scheme"),
        files={weights.name: tt.file_digest(weights)})
    (adapter_dir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    plot_history(history, out / "loss.png")
    print(f"{step} steps, {elapsed / 60:.1f} min on {device}; held-out KL {history[0]['held_kl']:.4f} -> "
          f"{final['held_kl']:.4f} (first answer token {history[0]['held_first_kl']:.4f} -> "
          f"{final['held_first_kl']:.4f}); adapter: {adapter_dir}")
    return 0


def _to_bfloat16(path: Path) -> None:
    """Rewrite a safetensors file's float tensors in bfloat16 (what ships: half the bytes; the
    adapter is merged into the model's own dtype on load)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


if __name__ == "__main__":
    sys.exit(main())
