"""``python -m ragattn refrag-train``: the REFRAG training recipe's run (docs/refrag.md, "Training").

The stages themselves (reconstruction, continual pre-training, the GRPO policy) and the checkpoint
paths are :mod:`ragattn.methods.refrag.train`'s; this module holds the data (FOLDOC entries as
documents), the run driver (:func:`train`: stages in order, checkpoints written without ever replacing a
trained one, resume), the loss curves and the command line.
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ragattn.methods.refrag.train import (
    TrainConfig, TrainError, Window, checkpoint_path_for_run, policy_checkpoint_path, read_checkpoint_file,
    run_cpt, run_reconstruction, run_rl, sample_windows, split_documents)


def foldoc_documents(tokenizer, text_file: Optional[Path] = None, min_words: int = 120) -> List[torch.Tensor]:
    """Whole FOLDOC entries (:mod:`ragattn.apps.training_text`: Debian's ``dict-foldoc``, text no test
    or eval uses) of at least ``min_words`` words as token streams, ``"{title}\n{text}"`` each, in
    title order. A window's continuation is the rest of the same entry. Returns int64 ``[n_i]`` per
    document (decoder tokens, no special tokens)."""
    from ragattn.apps import training_text as tt

    passages = tt.load_foldoc(Path(text_file) if text_file else tt.FOLDOC, min_words=min_words, max_words=10**9)
    return [torch.tensor(tokenizer(f"{p.title}\n{p.text}", add_special_tokens=False)["input_ids"], dtype=torch.long)
            for p in passages]


def _eval_windows(docs, cfg: TrainConfig, n_chunks: int, n_target: int, salt: int) -> List[Window]:
    return sample_windows(docs, cfg.eval_examples, n_chunks * cfg.k, n_target, random.Random(cfg.seed * 1000 + salt))


def init_manifest(folder: Path, cfg: TrainConfig) -> Dict:
    """The manifest of ``--init``'s folder (what ``--ship`` wrote, e.g. ``ragattn/weights/refrag-k16``)
    after checking its files against their sha256; TrainError when one is missing or damaged, when
    ``cfg`` has no rag stage to continue, or when the folder holds another ``k``, other encoder layers
    or another decoder LoRA (rank, alpha, modules) than ``cfg`` trains."""
    from ragattn.apps.finetune import lora_rank
    from ragattn.hf.adapters import AdapterError, check_adapter_files

    folder = Path(folder)
    try:
        m = check_adapter_files(folder)
        has_lora = "adapter_model.safetensors" in m.get("files", {})
        rank = lora_rank(json.loads((folder / "adapter_config.json").read_text())) if has_lora else 0
    except (AdapterError, OSError, ValueError) as e:
        raise TrainError(f"refrag-train: --init {folder}: {e}") from None
    if "chunk_encoder.safetensors" not in m.get("files", {}):
        raise TrainError(f"refrag-train: --init {folder}: no chunk_encoder.safetensors (not a --ship folder)")
    if "rag" not in cfg.stages:
        raise TrainError("refrag-train: --init continues the rag stage's training; --stages must include rag")
    wrong = [f"{flag} {mine} (--init's: {theirs})" for flag, mine, theirs in (
        ("--k", cfg.k, m.get("k")), ("--encoder-layers", cfg.encoder_layers, m.get("encoder_layers")),
        ("--decoder-lora-rank", cfg.decoder_lora_rank, rank)) if mine != theirs]
    if wrong:
        raise TrainError(f"refrag-train: --init {folder} was trained otherwise: {'; '.join(wrong)}")
    return m


def _load_init(rm, folder: Path, manifest: Dict, record: Dict) -> Optional[Dict[str, torch.Tensor]]:
    """Load ``--init``'s projector and encoder layers into ``rm`` and return its decoder LoRA's weights
    (float32, peft's names; None without one); ``record["init"]`` says what the run started from."""
    from safetensors.torch import load_file

    if manifest.get("base_fingerprint") and manifest["base_fingerprint"] != record.get("base_fingerprint"):
        raise TrainError(f"refrag-train: --init {folder} was trained on other decoder weights than this run's")
    rm.load_chunk_encoder(folder)
    lora_file = folder / "adapter_model.safetensors"
    weights = {k: v.float() for k, v in load_file(lora_file).items()} if lora_file.is_file() else None
    record["init"] = {key: manifest.get(key) for key in ("command", "commit", "steps", "files", "init")}
    record["init"]["folder"] = str(folder)
    return weights


def train(cfg: TrainConfig, rm=None, ckpt: Optional[Path] = None, resume: bool = False,
          out_dir: Optional[Path] = None, command: str = "", overwrite: bool = False,
          ship_dir: Optional[Path] = None, init: Optional[Path] = None) -> Dict:
    """Run ``cfg.stages`` in order; returns the run record (config, per-stage curves and held-out
    losses) and writes ``curves.json`` / ``curves.png`` to ``out_dir`` when given.

    rm: a ``RefragModel`` (default: SmolLM2 + MiniLM at ``cfg.k`` on ``cfg.device``, untrained);
    ckpt: where the encoder/projector checkpoint goes after recon and cpt (default
    ``default_checkpoint_path(k)``) and the policy beside it; ``resume``: start from that
    checkpoint (and policy) if present, e.g. to run ``--stages rl`` alone after ``recon,cpt``.
    An existing checkpoint is never overwritten unless ``overwrite``: the run writes beside it
    (:func:`checkpoint_path_for_run`; ``record["checkpoint"]`` says where). A write that fails
    keeps the checkpoint in a temporary folder (:func:`ragattn.apps.cli.save_or_keep`). ``ship_dir``:
    after the ``rag`` stage, the compact bfloat16 weights that ship (:func:`ragattn.apps.refrag_ship.ship`).
    ``init``: a shipped folder (:func:`init_manifest`) whose projector, encoder layers and decoder LoRA
    the run starts from, to train them further (not with ``resume``).
    """
    from ragattn.apps.cli import save_or_keep
    from ragattn.methods.refrag.expansion import load_policy, save_policy
    from ragattn.methods.refrag.model import RefragModel, default_checkpoint_path

    cfg.validate()
    if init is not None and resume:
        raise TrainError("refrag-train: --init and --resume each name where the run starts; give one")
    manifest = init_manifest(Path(init), cfg) if init is not None else None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    if rm is None:
        rm = RefragModel.from_smollm2(k=cfg.k, checkpoint=None, device=cfg.device)
    if rm.k != cfg.k:
        raise TrainError(f"refrag-train: the model's k={rm.k} differs from the config's k={cfg.k}")
    ckpt = Path(ckpt) if ckpt is not None else default_checkpoint_path(cfg.k)
    out = checkpoint_path_for_run(ckpt, overwrite)
    if out != ckpt:
        print(f"refrag-train: {ckpt} exists; this run writes {out} (pass --overwrite to replace it)",
              file=sys.stderr)
    net = None
    if resume and ckpt.is_file():
        try:
            rm.load_checkpoint(ckpt)
            if policy_checkpoint_path(ckpt).is_file() and "rl" in cfg.stages:
                net = load_policy(policy_checkpoint_path(ckpt), device=rm.device)
        except Exception as exc:   # noqa: BLE001 (a corrupt or foreign checkpoint)
            raise TrainError(f"refrag-train: --resume from {ckpt}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    docs = foldoc_documents(rm.tokenizer, cfg.text)
    train_docs, held_docs = split_documents(docs, cfg.heldout_frac, cfg.seed)
    record = {"command": command, "config": dataclasses.asdict(cfg), "checkpoint": str(out),
              "resumed_from": str(ckpt) if resume and ckpt.is_file() else None,
              "documents": {"train": len(train_docs), "heldout": len(held_docs),
                            "train_tokens": int(sum(d.numel() for d in train_docs)),
                            "heldout_tokens": int(sum(d.numel() for d in held_docs))},
              "stages": {}}
    if "rag" in cfg.stages:     # what a shipped decoder LoRA was trained on (hf.adapters checks it)
        from ragattn.store.fingerprint import model_fingerprint

        record["base_fingerprint"] = model_fingerprint(rm.decoder, cached=False)
    init_lora = _load_init(rm, Path(init), manifest, record) if init is not None else None
    for stage in cfg.stages:
        if stage == "recon":
            res = run_reconstruction(rm, cfg, train_docs, _eval_windows(held_docs, cfg, cfg.max_chunks, 0, 1))
        elif stage == "cpt":
            res = run_cpt(rm, cfg, train_docs, _eval_windows(held_docs, cfg, cfg.max_chunks, cfg.target_tokens, 2))
        elif stage == "rag":
            from ragattn.apps import training_text as tt
            from ragattn.apps.refrag_distill import run_rag

            train_p, held_p = tt.split_passages(tt.load_foldoc(Path(cfg.text) if cfg.text else tt.FOLDOC))
            res, lora_state = run_rag(rm, cfg, train_p, held_p, init_lora)
        else:
            res, net = run_rl(rm, cfg, train_docs,
                              _eval_windows(held_docs, cfg, cfg.rl_chunks, cfg.target_tokens, 3), net)
        record["stages"][stage] = dataclasses.asdict(res)
        if stage == "rl":
            if not out.exists():    # the policy's model beside it (a resumed run writing a new path)
                save_or_keep(lambda p: rm.save_checkpoint(p, extra={"stage": "resumed"}), out, "--checkpoint")
            save_or_keep(lambda p: save_policy(net, p, extra={"k": cfg.k, "rl_expand": cfg.rl_expand,
                                                             "rl_chunks": cfg.rl_chunks}),
                         policy_checkpoint_path(out), "--checkpoint")
        else:
            with_decoder = (cfg.train_decoder and stage == "cpt") or (stage == "rag" and cfg.decoder_lora_rank > 0)
            save_or_keep(lambda p: rm.save_checkpoint(p, include_decoder=with_decoder,
                                                      extra={"stage": stage, "heldout_after": res.heldout_after}),
                         out, "--checkpoint")
        if out_dir is not None:
            save_or_keep(lambda d: write_curves(record, d), Path(out_dir), "--out")
        if stage == "rag" and ship_dir is not None:
            from ragattn.apps.refrag_ship import ship

            ship(rm, cfg, lora_state, record, Path(ship_dir))
    return record


def write_curves(record: Dict, out_dir: Path) -> None:
    """``curves.json`` (the whole run record) and ``curves.png`` (one panel per stage)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "curves.json").write_text(json.dumps(record, indent=1) + "\n")
    stages = record["stages"]
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 3.8), squeeze=False)
    titles = {"recon": "reconstruction (decoder frozen)", "cpt": "next-paragraph CPT", "rag": "RAG distillation",
              "rl": "GRPO policy"}
    for ax, (name, st) in zip(axes[0], stages.items()):
        if name == "rl":
            ax.plot(st["steps"], st["extra"]["reward"], color="C2", label="mean reward (-NLL) of samples")
            ax.set_ylabel("reward")
        else:
            ax.plot(st["steps"], st["loss"], color="C0", alpha=0.45, label="train loss (target NLL; rag: KL)")
            run = [sum(st["loss"][max(0, i - 3):i + 1]) / len(st["loss"][max(0, i - 3):i + 1])
                   for i in range(len(st["loss"]))]
            ax.plot(st["steps"], run, color="C0", label="running mean (4 steps)")
            ax2 = ax.twinx()
            ax2.step(st["steps"], st["chunks"], color="C1", alpha=0.4, where="mid")
            ax2.set_ylabel("chunks per example (curriculum)", color="C1")
            ax.set_ylabel("NLL (nats/token)")
        for key, before in st["heldout_before"].items():
            after = st["heldout_after"].get(key)
            if after is not None and key in ("recon_nll", "nll_compressed", "nll_learned", "kl_expand0"):
                ax.axhline(before if name != "rl" else -before, color="grey", ls=":", lw=1)
                sign = "" if name != "rl" else "-"
                ax.axhline(after if name != "rl" else -after, color="k", ls="--", lw=1,
                           label=f"held-out {sign}{key}: {sign}{before:.2f} -> {sign}{after:.2f} (dotted -> dashed)")
        ax.set_title(titles.get(name, name))
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=110)
    plt.close(fig)


def _numbers(text: str, kind, flag: str) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise TrainError(f"refrag-train: {flag} takes comma-separated numbers, got {text!r}") from None


def main(argv=None) -> int:
    """One ``error:`` line and exit status 2 for every bad input (:func:`ragattn.apps.cli.run_command`)."""
    from ragattn.apps.cli import run_command

    return run_command(lambda: _main(argv), "python -m ragattn refrag-train")


def _main(argv=None) -> int:
    from ragattn.apps.cli import OneLineParser, parse_device, writable_dir, writable_file
    from ragattn.methods.refrag.model import default_checkpoint_path

    d = TrainConfig()
    p = OneLineParser(prog="python -m ragattn refrag-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", default=",".join(d.stages), help="comma list of recon,cpt,rag,rl (run in that order)")
    p.add_argument("--k", type=int, default=d.k,
                   help="tokens per chunk: each k-token chunk becomes one embedding (the compression rate; default %(default)s)")
    p.add_argument("--device", default=d.device,
                   help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="random seed (default %(default)s)")
    p.add_argument("--batch", type=int, default=d.batch,
                   help="examples per optimiser step, every stage (default %(default)s)")
    p.add_argument("--max-chunks", type=int, default=d.max_chunks,
                   help="chunks of context at the end of the curriculum and in the held-out evaluation (default %(default)s)")
    p.add_argument("--target-tokens", type=int, default=d.target_tokens,
                   help="next-paragraph tokens predicted in cpt and rl (default %(default)s)")
    p.add_argument("--curriculum-stages", type=int, default=d.curriculum_stages,
                   help="steps of the chunk-count curriculum up to --max-chunks (1 = no curriculum; default %(default)s)")
    p.add_argument("--eval-examples", type=int, default=d.eval_examples,
                   help="held-out examples for the before/after losses (default %(default)s)")
    p.add_argument("--recon-steps", type=int, default=d.recon_steps,
                   help="reconstruction steps: encoder + projector learn to reproduce the chunk (default %(default)s)")
    p.add_argument("--recon-lr", type=float, default=d.recon_lr,
                   help="reconstruction learning rate (default %(default)s)")
    p.add_argument("--cpt-steps", type=int, default=d.cpt_steps,
                   help="continual pre-training steps: predict the next paragraph from chunk embeddings (default %(default)s)")
    p.add_argument("--cpt-lr", type=float, default=d.cpt_lr,
                   help="continual pre-training learning rate (default %(default)s)")
    p.add_argument("--expand-p", type=float, default=d.expand_p,
                   help="fraction of chunks left as tokens at random in cpt (mixed input; default %(default)s)")
    p.add_argument("--train-decoder", action="store_true", help="unfreeze the decoder in cpt")
    p.add_argument("--rag-steps", type=int, default=d.rag_steps,
                   help="RAG distillation steps: answer from compressed FOLDOC passages as from their tokens "
                        "(stage rag; default %(default)s)")
    p.add_argument("--rag-lr", type=float, default=d.rag_lr, help="RAG distillation learning rate (default %(default)s)")
    p.add_argument("--rag-top-k", default=",".join(map(str, d.rag_top_k)),
                   help="passages per RAG question, drawn from [lo, hi) (default %(default)s)")
    p.add_argument("--rag-answer-tokens", type=int, default=d.rag_answer_tokens,
                   help="teacher answer tokens distilled per question (default %(default)s)")
    p.add_argument("--rag-expand", default=",".join(f"{f:g}" for f in d.rag_expand),
                   help="fractions of chunks expanded at random in the rag stage, in turn (default %(default)s)")
    p.add_argument("--decoder-lora-rank", type=int, default=d.decoder_lora_rank,
                   help="rank of the decoder's LoRA in the rag stage (0: decoder frozen; default %(default)s)")
    p.add_argument("--text", default=None,
                   help="training text, a gzipped dictd file (default: Debian's dict-foldoc)")
    p.add_argument("--ship", default=None,
                   help="after the rag stage, write the compact weights that ship here (ragattn/weights/refrag-k16)")
    p.add_argument("--rl-steps", type=int, default=d.rl_steps,
                   help="RL steps of the expansion policy (which chunks stay tokens; default %(default)s)")
    p.add_argument("--rl-lr", type=float, default=d.rl_lr,
                   help="RL policy learning rate (default %(default)s)")
    p.add_argument("--rl-chunks", type=int, default=d.rl_chunks,
                   help="chunks per RL example (L; default %(default)s)")
    p.add_argument("--rl-expand", type=int, default=d.rl_expand,
                   help="chunks the policy expands to tokens per example (T'; default %(default)s)")
    p.add_argument("--rl-group", type=int, default=d.rl_group,
                   help="selections sampled per example for the group baseline (G >= 2; default %(default)s)")
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs,
                   help="PPO epochs per RL step (default %(default)s)")
    p.add_argument("--clip-eps", type=float, default=d.clip_eps,
                   help="PPO clip range (default %(default)s)")
    p.add_argument("--encoder-layers", type=int, default=None,
                   help="train only the projector and the encoder's last N layers (default: all)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--checkpoint", default=None, help="default: RefragModel's default path for k")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint (and its policy) if present")
    p.add_argument("--init", default=None,
                   help="start from a --ship folder (e.g. ragattn/weights/refrag-k16): its projector, encoder "
                        "layers and decoder LoRA train further in the rag stage")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing checkpoint (default: write a new one beside it, <name>.runN.pt)")
    p.add_argument("--out", default=None, help="write curves.json / curves.png here")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar")
    a = p.parse_args(argv)
    cfg = TrainConfig(k=a.k, stages=tuple(s for s in a.stages.split(",") if s), device=a.device, seed=a.seed,
                      batch=a.batch, max_chunks=a.max_chunks, target_tokens=a.target_tokens,
                      curriculum_stages=a.curriculum_stages, eval_examples=a.eval_examples,
                      recon_steps=a.recon_steps, recon_lr=a.recon_lr, cpt_steps=a.cpt_steps, cpt_lr=a.cpt_lr,
                      expand_p=a.expand_p, train_decoder=a.train_decoder, rag_steps=a.rag_steps, rag_lr=a.rag_lr,
                      rag_top_k=_numbers(a.rag_top_k, int, "--rag-top-k"),
                      rag_answer_tokens=a.rag_answer_tokens,
                      rag_expand=_numbers(a.rag_expand, float, "--rag-expand"),
                      decoder_lora_rank=a.decoder_lora_rank, text=a.text, rl_steps=a.rl_steps, rl_lr=a.rl_lr,
                      rl_chunks=a.rl_chunks, rl_expand=a.rl_expand, rl_group=a.rl_group,
                      ppo_epochs=a.ppo_epochs, clip_eps=a.clip_eps, encoder_layers=a.encoder_layers,
                      threads=a.threads, progress=not a.no_progress)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    # before any model is loaded: the device, where the results go, the checkpoint to resume from
    parse_device(cfg.device)
    ckpt = Path(a.checkpoint) if a.checkpoint else default_checkpoint_path(cfg.k)
    writable_file(ckpt, "--checkpoint")
    writable_file(checkpoint_path_for_run(ckpt, a.overwrite), "--checkpoint")
    if a.out:
        writable_dir(a.out, "--out")
    if a.resume and ckpt.is_file():
        read_checkpoint_file(ckpt)
    command = "python -m ragattn refrag-train " + " ".join(argv if argv is not None else sys.argv[1:])
    rec = train(cfg, ckpt=ckpt, resume=a.resume, out_dir=Path(a.out) if a.out else None,
                command=command.strip(), overwrite=a.overwrite, ship_dir=Path(a.ship) if a.ship else None,
                init=Path(a.init) if a.init else None)
    for name, st in rec["stages"].items():
        print(f"{name}: {len(st['steps'])} steps in {st['seconds']:.0f} s; train loss "
              f"{st['loss'][0]:.3f} -> {st['loss'][-1]:.3f}" if st["loss"] else f"{name}: 0 steps")
        for key, before in st["heldout_before"].items():
            print(f"  held-out {key}: {before:.3f} -> {st['heldout_after'].get(key, float('nan')):.3f}")
    print(f"checkpoint: {rec['checkpoint']}")
    return 0
