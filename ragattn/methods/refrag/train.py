"""REFRAG training recipe at CPU scale: reconstruction -> continual pre-training -> RL policy.

The algorithm (stages, GRPO, checkpoint paths); the run driver, the data, the curves and the
command line are :mod:`ragattn.apps.refrag_train`:

    python -m ragattn refrag-train [--k 8] [--stages recon,cpt,rl] [--device cpu|cuda] ...

The three stages of the paper (notes §4) on SmolLM2-135M (decoder) + MiniLM-L6 (chunk encoder),
on the passages shipped in ``ragattn/data/qa_eval`` and ``ragattn/data/qa`` (nothing downloaded):

1. **Reconstruction** (``recon``): decoder frozen; encoder + projector learn to let the decoder
   reproduce a context's tokens from its chunk embeddings. Layout ``[e^cnk_1 .. e^cnk_m][x_1 .. x_mk]``
   with the loss on ``x`` (teacher forced). Curriculum: the number of chunks m per example grows
   from 1 to ``--max-chunks`` over ``--stages-curriculum`` stages.
2. **Continual pre-training** (``cpt``): next-paragraph prediction. Context = m chunks of a passage
   (compressed), target = the next ``--target-tokens`` tokens of the same passage; loss on the
   target only. Same curriculum, and a fraction ``--expand-p`` of each context's chunks is expanded
   back to tokens at random (the paper's mixed-input CPT). Encoder + projector train; the decoder
   stays frozen by default (``--train-decoder`` unfreezes it: minutes per step on this CPU).
3. **RL policy** (``rl``): the paper's GRPO (Eq. 1). Per example, G ordered selections of T' chunks
   are drawn from the ``PolicyNetwork`` (Gumbel-top-T'); reward = negative next-paragraph
   log-perplexity (mean target NLL) under each selection's mixed layout, from the decoder;
   advantages are group-normalised; ``--ppo-epochs`` PPO-clip updates reuse the samples.

Each stage reports a held-out loss before and after (fixed held-out passages, fixed windows), and
the run writes the per-step loss curves (``curves.json`` + ``curves.png``) to ``--out``. The
encoder/projector checkpoint goes to ``RefragModel``'s default path
(``~/.cache/ragattn/refrag/smollm2-minilm-k{K}.pt``, ``$RAGATTN_REFRAG_CKPT`` overrides); the
policy to ``...-policy.pt`` beside it; an existing checkpoint is never replaced without
``--overwrite`` (the run writes ``<name>.run2.pt``, ... beside it and says so). Optimiser: AdamW, 4 % linear warm-up then cosine decay,
gradient clipping at 1.0 (the paper's schedule, at a tiny scale).
"""
from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ragattn.methods.refrag.expansion import (
    PolicyNetwork, grpo_clip_loss, group_advantages, gumbel_top_k, selection_step_log_probs)

STAGES = ("recon", "cpt", "rag", "rl")


class TrainError(ValueError):
    """A user-facing error of the recipe (a bad option, a corpus or checkpoint that cannot serve):
    ``python -m ragattn refrag-train`` reports it as one ``error:`` line, exit status 2."""


# ----------------------------------------------------------------------------- data

# ----------------------------------------------------------------------------- data

def split_documents(docs: Sequence[torch.Tensor], heldout_frac: float, seed: int):
    """Deterministic train / held-out split of whole documents (topics): (train, heldout)."""
    if not 0 < heldout_frac < 1:
        raise TrainError(f"refrag-train: heldout_frac must be in (0, 1), got {heldout_frac}")
    idx = list(range(len(docs)))
    random.Random(seed).shuffle(idx)
    n_held = max(1, round(len(docs) * heldout_frac))
    return [docs[i] for i in idx[n_held:]], [docs[i] for i in idx[:n_held]]


@dataclasses.dataclass
class Window:
    """One training example: ``context`` int64 [m*k] (m chunks) and ``target`` int64 [o]."""
    context: torch.Tensor
    target: torch.Tensor


def sample_windows(docs: Sequence[torch.Tensor], n: int, n_context: int, n_target: int,
                   rng: random.Random) -> List[Window]:
    """``n`` windows ``(doc[a : a+n_context], doc[a+n_context : a+n_context+n_target])`` at random
    passages and offsets. Raises ValueError when no passage is long enough."""
    need = n_context + n_target
    fit = [d for d in docs if d.numel() >= need]
    if not fit:
        raise TrainError(f"refrag-train: no passage has {need} tokens ({n_context} context + "
                         f"{n_target} target); lower --max-chunks or --target-tokens")
    out = []
    for _ in range(n):
        d = fit[rng.randrange(len(fit))]
        a = rng.randrange(d.numel() - need + 1)
        out.append(Window(d[a:a + n_context], d[a + n_context:a + need]))
    return out


def curriculum_num_chunks(step: int, total_steps: int, max_chunks: int, n_stages: int,
                          rng: random.Random) -> int:
    """Number of chunks per example at ``step`` under the curriculum (notes §4.1, Table 8 shape).

    Training is split into ``n_stages`` equal stages; stage j allows 1..m_j chunks with m_j growing
    linearly from 1 to ``max_chunks``, and draws m with weight 2^m, so most examples are the
    hardest allowed (the paper allocates more samples to longer contexts; its exact schedule is
    not in the text). ``n_stages=1`` means no curriculum: always ``max_chunks``.
    """
    if max_chunks < 1 or n_stages < 1 or total_steps < 1 or not 0 <= step < total_steps:
        raise ValueError(f"curriculum_num_chunks: bad arguments step={step}, total_steps={total_steps}, "
                         f"max_chunks={max_chunks}, n_stages={n_stages}")
    if n_stages == 1:
        return max_chunks
    stage = min(n_stages - 1, step * n_stages // total_steps)
    hi = 1 + round(stage * (max_chunks - 1) / (n_stages - 1))
    choices = list(range(1, hi + 1))
    return rng.choices(choices, weights=[2.0 ** m for m in choices])[0]


def random_expand_masks(batch: int, n_chunks: int, n_expand: int, rng: random.Random) -> torch.Tensor:
    """bool [batch, n_chunks] with exactly ``n_expand`` True per row, uniformly at random."""
    m = torch.zeros(batch, n_chunks, dtype=torch.bool)
    for b in range(batch):
        m[b, rng.sample(range(n_chunks), n_expand)] = True
    return m


# ----------------------------------------------------------------------------- optimisation

def warmup_cosine(step: int, total: int, warmup_frac: float = 0.04) -> float:
    """LR multiplier: linear warm-up over ``warmup_frac`` of the steps, then cosine to 0."""
    warm = max(1, round(total * warmup_frac))
    if step < warm:
        return (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * t))


def make_optimizer(params, lr: float, total_steps: int):
    params = [p for p in params if p.requires_grad]
    if not params:
        raise TrainError("refrag-train: nothing to train (all parameters frozen)")
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, total_steps))
    return opt, sched, params


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True)


# ----------------------------------------------------------------------------- configuration

@dataclasses.dataclass
class TrainConfig:
    """Every knob of the recipe (the CLI flags mirror these; defaults = the documented CPU run)."""
    k: int = 8                       # tokens per chunk (compression rate)
    stages: Tuple[str, ...] = ("recon", "cpt", "rl")   # "rag" is opt-in (it needs the training text)
    device: str = "cpu"
    seed: int = 0
    batch: int = 4                   # examples per step (recon / cpt); RL: examples per step
    max_chunks: int = 4              # curriculum end (and the held-out evaluation's chunk count)
    target_tokens: int = 16          # o: next-paragraph tokens predicted in cpt / rl
    curriculum_stages: int = 4       # 1 = no curriculum (always max_chunks)
    heldout_frac: float = 0.15       # documents (topics) held out for the before/after losses
    eval_examples: int = 8
    # reconstruction
    recon_steps: int = 24
    recon_lr: float = 1e-3
    # continual pre-training
    cpt_steps: int = 24
    cpt_lr: float = 3e-4
    expand_p: float = 0.25           # fraction of chunks expanded at random in cpt (mixed input)
    train_decoder: bool = False
    # RAG distillation (ragattn.apps.refrag_distill): questions over compressed passages answered as the
    # decoder answers them over the passages' tokens; the decoder gets a LoRA of this rank (0: frozen)
    rag_steps: int = 0
    rag_lr: float = 3e-4
    rag_top_k: Tuple[int, int] = (4, 17)   # passages per question, drawn from [lo, hi)
    rag_answer_tokens: int = 16
    rag_expand: Tuple[float, ...] = (0.0, 0.25)   # expanded fractions, taken in turn
    decoder_lora_rank: int = 8
    text: Optional[str] = None        # training text (default: Debian's dict-foldoc)
    # RL policy
    rl_steps: int = 30
    rl_lr: float = 1e-3
    rl_chunks: int = 6               # L for the policy examples
    rl_expand: int = 2               # T' chunks expanded per example
    rl_group: int = 4                # G selections per example
    ppo_epochs: int = 2
    clip_eps: float = 0.2
    policy_width: int = 128
    # trainable encoder depth: None = whole encoder + projector, n = projector + last n layers
    encoder_layers: Optional[int] = None
    threads: Optional[int] = None
    progress: bool = True

    def validate(self) -> "TrainConfig":
        bad = [s for s in self.stages if s not in STAGES]
        if bad or not self.stages:
            raise TrainError(f"refrag-train: stages must be a non-empty subset of {STAGES}, got {self.stages}")
        for name in ("k", "batch", "max_chunks", "target_tokens", "curriculum_stages", "eval_examples",
                     "rl_chunks", "rl_group", "ppo_epochs", "policy_width"):
            if getattr(self, name) < 1:
                raise TrainError(f"refrag-train: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("recon_steps", "cpt_steps", "rag_steps", "rl_steps", "decoder_lora_rank"):
            if getattr(self, name) < 0:
                raise TrainError(f"refrag-train: {name} must be >= 0, got {getattr(self, name)}")
        if self.rl_group < 2:
            raise TrainError("refrag-train: rl_group (G) must be >= 2 for group advantages")
        if not 0 < self.rl_expand < self.rl_chunks:
            raise TrainError(f"refrag-train: rl_expand must be in [1, rl_chunks - 1] = [1, {self.rl_chunks - 1}], "
                             f"got {self.rl_expand}")
        if not 0 < self.clip_eps < 1:
            raise TrainError(f"refrag-train: clip_eps must be in (0, 1), got {self.clip_eps}")
        if not 0 <= self.expand_p <= 1:
            raise TrainError(f"refrag-train: expand_p must be in [0, 1], got {self.expand_p}")
        lo, hi = (tuple(self.rag_top_k) + (0, 0))[:2]
        if len(self.rag_top_k) != 2 or not 1 <= lo < hi or self.rag_answer_tokens < 1:
            raise TrainError(f"refrag-train: rag_top_k must be lo,hi with 1 <= lo < hi and rag_answer_tokens >= 1, "
                             f"got {self.rag_top_k} and {self.rag_answer_tokens}")
        if not self.rag_expand or not all(0 <= f <= 1 for f in self.rag_expand):
            raise TrainError(f"refrag-train: rag_expand must be fractions in [0, 1], got {self.rag_expand}")
        for name in ("recon_lr", "cpt_lr", "rag_lr", "rl_lr"):   # NaN fails too
            if not (isinstance(getattr(self, name), (int, float)) and 0 < getattr(self, name) < math.inf):
                raise TrainError(f"refrag-train: {name} must be a finite number > 0, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise TrainError(f"refrag-train: threads must be >= 1, got {self.threads}")
        if self.encoder_layers is not None and self.encoder_layers < 0:
            raise TrainError(f"refrag-train: encoder_layers must be >= 0, got {self.encoder_layers}")
        return self


# ----------------------------------------------------------------------------- model plumbing

def _examples(windows: Sequence[Window], k: int, reconstruct: bool):
    """RefragExamples ``[context chunks][target]``; reconstruction targets the context itself."""
    from ragattn.methods.refrag.chunking import chunk_context
    from ragattn.methods.refrag.layout import RefragExample

    return [RefragExample(chunk_context(w.context, k, allowed_k=None),
                          target=w.context if reconstruct else w.target) for w in windows]


def example_nll(rm, windows: Sequence[Window], reconstruct: bool = False,
                expand_masks: Optional[Sequence[torch.Tensor]] = None) -> torch.Tensor:
    """float32 [B]: each window's mean target NLL under the REFRAG layout (differentiable)."""
    return rm.loss(rm.build_inputs(_examples(windows, rm.k, reconstruct), expand_masks))


@torch.no_grad()
def no_context_nll(rm, windows: Sequence[Window]) -> torch.Tensor:
    """float32 [B]: target NLL from the decoder alone, after a BOS token (the "no context" baseline)."""
    bos = rm.tokenizer.bos_token_id
    if bos is None:
        raise TrainError("refrag-train: the decoder's tokenizer has no BOS token for the no-context baseline")
    ids = torch.stack([torch.cat([w.target.new_tensor([bos]), w.target]) for w in windows]).to(rm.device)
    logits = rm.decoder(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def trainable_encoder_params(rm, encoder_layers: Optional[int]) -> List[torch.nn.Parameter]:
    """Freeze the decoder's and, with ``encoder_layers=n``, all but the projector and the encoder's
    last n transformer layers; returns the trainable parameters."""
    for p in rm.encoder.parameters():
        p.requires_grad_(encoder_layers is None)
    for p in rm.encoder.projector.parameters():
        p.requires_grad_(True)
    if encoder_layers is not None:
        layers = rm.encoder.encoder.encoder.layer
        if not 0 <= encoder_layers <= len(layers):
            raise TrainError(f"refrag-train: encoder_layers must be in [0, {len(layers)}], got {encoder_layers}")
        for layer in layers[len(layers) - encoder_layers:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    return [p for p in rm.encoder.parameters() if p.requires_grad]


def set_decoder_trainable(rm, flag: bool) -> List[torch.nn.Parameter]:
    for p in rm.decoder.parameters():
        p.requires_grad_(flag)
    rm.decoder.train(flag)
    return list(rm.decoder.parameters()) if flag else []


def policy_checkpoint_path(model_ckpt: Path) -> Path:
    """The learned policy's file beside the model checkpoint: ``<stem>-policy.pt``."""
    model_ckpt = Path(model_ckpt)
    return model_ckpt.with_name(model_ckpt.stem + "-policy.pt")


# ----------------------------------------------------------------------------- stages

@dataclasses.dataclass
class StageResult:
    name: str
    steps: List[int] = dataclasses.field(default_factory=list)
    loss: List[float] = dataclasses.field(default_factory=list)      # training loss per step
    chunks: List[int] = dataclasses.field(default_factory=list)      # m (curriculum) per step
    extra: Dict[str, list] = dataclasses.field(default_factory=dict)  # e.g. mean reward per step
    heldout_before: Dict[str, float] = dataclasses.field(default_factory=dict)
    heldout_after: Dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def _optimise(params, lr: float, steps: int, step_fn: Callable[[int], Tuple[torch.Tensor, dict]],
              result: StageResult, progress: bool) -> None:
    """``steps`` AdamW steps (warm-up + cosine, grad-norm clip 1.0) of ``step_fn(step) -> (loss, info)``."""
    opt, sched, params = make_optimizer(params, lr, steps)
    bar = _bar(steps, result.name, progress)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss, info = step_fn(step)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"refrag-train {result.name}: loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        result.steps.append(step)
        result.loss.append(float(loss.detach()))
        result.chunks.append(int(info.pop("m", 0)))
        for key, v in info.items():
            result.extra.setdefault(key, []).append(float(v))
        bar.set_postfix(loss=f"{result.loss[-1]:.3f}", **{key: f"{float(v):.3f}" for key, v in info.items()})
        bar.update(1)
    bar.close()


def run_reconstruction(rm, cfg: TrainConfig, train_docs, eval_windows: Sequence[Window]) -> StageResult:
    """Stage 1: decoder frozen, encoder + projector trained to reproduce the context (curriculum)."""
    res = StageResult("recon")
    params = trainable_encoder_params(rm, cfg.encoder_layers)
    set_decoder_trainable(rm, False)
    rng = random.Random(cfg.seed + 1)

    def evaluate():
        rm.encoder.eval()
        with torch.no_grad():
            return {"recon_nll": float(example_nll(rm, eval_windows, reconstruct=True).mean())}

    res.heldout_before = evaluate()
    t0 = time.perf_counter()
    rm.encoder.train()

    def step(i):
        m = curriculum_num_chunks(i, cfg.recon_steps, cfg.max_chunks, cfg.curriculum_stages, rng)
        w = sample_windows(train_docs, cfg.batch, m * cfg.k, 0, rng)
        return example_nll(rm, w, reconstruct=True).mean(), {"m": m}

    _optimise(params, cfg.recon_lr, cfg.recon_steps, step, res, cfg.progress)
    res.seconds = time.perf_counter() - t0
    res.heldout_after = evaluate()
    return res


def _eval_cpt(rm, eval_windows: Sequence[Window], expand_p: float, seed: int) -> Dict[str, float]:
    """Held-out next-paragraph NLL: compressed (no expansion), random expansion at ``expand_p``,
    and the references full context (every chunk expanded) and no context (decoder alone)."""
    rm.encoder.eval()
    rm.decoder.eval()
    L = eval_windows[0].context.numel() // rm.k
    n = round(expand_p * L)
    rng = random.Random(seed)
    with torch.no_grad():
        out = {"nll_compressed": float(example_nll(rm, eval_windows).mean()),
               "nll_no_context": float(no_context_nll(rm, eval_windows).mean()),
               "nll_full_context": float(example_nll(
                   rm, eval_windows, expand_masks=[torch.ones(L, dtype=torch.bool)] * len(eval_windows)).mean())}
        if n:
            masks = list(random_expand_masks(len(eval_windows), L, n, rng))
            out[f"nll_random_expand_{n}of{L}"] = float(example_nll(rm, eval_windows, expand_masks=masks).mean())
    return out


def run_cpt(rm, cfg: TrainConfig, train_docs, eval_windows: Sequence[Window]) -> StageResult:
    """Stage 2: next-paragraph prediction from the compressed context (curriculum + random expansion)."""
    res = StageResult("cpt")
    params = trainable_encoder_params(rm, cfg.encoder_layers) + set_decoder_trainable(rm, cfg.train_decoder)
    rng = random.Random(cfg.seed + 2)
    res.heldout_before = _eval_cpt(rm, eval_windows, cfg.expand_p, cfg.seed)
    t0 = time.perf_counter()
    rm.encoder.train()
    rm.decoder.train(cfg.train_decoder)

    def step(i):
        m = curriculum_num_chunks(i, cfg.cpt_steps, cfg.max_chunks, cfg.curriculum_stages, rng)
        w = sample_windows(train_docs, cfg.batch, m * cfg.k, cfg.target_tokens, rng)
        masks = list(random_expand_masks(len(w), m, round(cfg.expand_p * m), rng))
        return example_nll(rm, w, expand_masks=masks).mean(), {"m": m}

    _optimise(params, cfg.cpt_lr, cfg.cpt_steps, step, res, cfg.progress)
    res.seconds = time.perf_counter() - t0
    set_decoder_trainable(rm, False)
    res.heldout_after = _eval_cpt(rm, eval_windows, cfg.expand_p, cfg.seed)
    return res


@torch.no_grad()
def _chunk_vectors(rm, windows: Sequence[Window]) -> torch.Tensor:
    """float32 [B, L, d_enc]: the encoder's chunk vectors c of each window's context (L equal)."""
    rm.encoder.eval()
    chunks = [ch for w in windows for ch in w.context.split(rm.k)]
    c = rm.encoder.encode(chunks)
    return c.reshape(len(windows), -1, c.shape[-1])


@torch.no_grad()
def selection_rewards(rm, windows: Sequence[Window], orders: torch.Tensor) -> torch.Tensor:
    """float32 [B, G]: reward = -(mean next-paragraph NLL) of window b with chunks ``orders[b, g]``
    expanded (orders int64 [B, G, T']). One batched decoder forward over the B*G layouts."""
    B, G, _ = orders.shape
    L = windows[0].context.numel() // rm.k
    masks = torch.zeros(B, G, L, dtype=torch.bool)
    masks.scatter_(2, orders.cpu(), True)
    rep = [w for w in windows for _ in range(G)]
    return -example_nll(rm, rep, expand_masks=list(masks.reshape(B * G, L))).reshape(B, G).cpu()


def grpo_step(net, opt, sched, params, c: torch.Tensor, reward_fn: Callable[[torch.Tensor], torch.Tensor],
              n_expand: int, group: int, ppo_epochs: int, clip_eps: float,
              generator: Optional[torch.Generator] = None):
    """One GRPO iteration on a batch: sample, score, ``ppo_epochs`` PPO-clip updates.

    c: float [B, L, d_enc] chunk vectors; reward_fn(orders int64 [B, G, T']) -> float [B, G].
    The G ordered selections per example come from Gumbel-top-T' on the current (old) logits;
    their per-step log-probs under the old policy are fixed, the new ones recomputed each epoch.
    Returns ``(last PPO loss, rewards [B, G])``.
    """
    net.eval()
    with torch.no_grad():
        s_old = net(c).unsqueeze(1).expand(-1, group, -1)                   # [B, G, L]
        # sampled on the CPU (the generator is a CPU one), scored where the policy lives
        orders = gumbel_top_k(s_old.cpu(), n_expand, generator=generator).to(s_old.device)  # [B, G, T']
        logp_old = selection_step_log_probs(s_old, orders)
    rewards = reward_fn(orders)
    adv = group_advantages(rewards.double()).float().to(s_old.device)
    net.train()
    for _ in range(ppo_epochs):
        s_new = net(c).unsqueeze(1).expand(-1, group, -1)
        loss = grpo_clip_loss(selection_step_log_probs(s_new, orders), logp_old, adv, clip_eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
    net.eval()
    return loss.detach(), rewards


def evaluate_policies(rm, net, eval_windows: Sequence[Window], n_expand: int, seed: int) -> Dict[str, float]:
    """Held-out next-paragraph NLL at ``n_expand`` expanded chunks under each policy (Fig. 3 analogue):
    none, random, perplexity-asc/desc, the learned policy (greedy), and every chunk expanded."""
    from ragattn.methods.refrag.expansion import LearnedPolicy, PerplexityPolicy
    from ragattn.methods.refrag.policy import RandomPolicy

    L = eval_windows[0].context.numel() // rm.k
    c = _chunk_vectors(rm, eval_windows)
    policies = {"random": RandomPolicy(seed), "ppl_desc": PerplexityPolicy(rm.decoder, rm.tokenizer, "desc"),
                "ppl_asc": PerplexityPolicy(rm.decoder, rm.tokenizer, "asc")}
    if net is not None:
        net.eval()
        policies["learned"] = LearnedPolicy(net, "greedy")
    out = {}
    with torch.no_grad():
        out["nll_none"] = float(example_nll(rm, eval_windows).mean())
        for name, pol in policies.items():
            masks = [pol.select(c[b], list(w.context.split(rm.k)), n_expand) for b, w in enumerate(eval_windows)]
            out[f"nll_{name}"] = float(example_nll(rm, eval_windows, expand_masks=masks).mean())
        out["nll_all"] = float(example_nll(
            rm, eval_windows, expand_masks=[torch.ones(L, dtype=torch.bool)] * len(eval_windows)).mean())
    return out


def run_rl(rm, cfg: TrainConfig, train_docs, eval_windows: Sequence[Window], net=None):
    """Stage 3: GRPO on the PolicyNetwork (encoder, projector and decoder frozen). Returns
    ``(StageResult, net)``; the stage's loss curve is the PPO-clip loss, ``extra["reward"]`` the
    mean reward of the sampled selections per step."""
    res = StageResult("rl")
    set_decoder_trainable(rm, False)
    for p in rm.encoder.parameters():
        p.requires_grad_(False)
    rm.encoder.eval()
    g = torch.Generator().manual_seed(cfg.seed + 3)
    if net is None:
        torch.manual_seed(cfg.seed + 3)
        net = PolicyNetwork(rm.encoder.d_enc, d_model=cfg.policy_width, n_layers=2, n_heads=4).to(rm.device)
    res.heldout_before = evaluate_policies(rm, net, eval_windows, cfg.rl_expand, cfg.seed)
    rng = random.Random(cfg.seed + 3)
    opt, sched, params = make_optimizer(net.parameters(), cfg.rl_lr, cfg.rl_steps * cfg.ppo_epochs)
    bar = _bar(cfg.rl_steps, "rl", cfg.progress)
    t0 = time.perf_counter()
    T, G = cfg.rl_expand, cfg.rl_group
    for step in range(cfg.rl_steps):
        w = sample_windows(train_docs, cfg.batch, cfg.rl_chunks * rm.k, cfg.target_tokens, rng)
        loss, rewards = grpo_step(net, opt, sched, params, _chunk_vectors(rm, w),
                                  lambda orders: selection_rewards(rm, w, orders), T, G, cfg.ppo_epochs,
                                  cfg.clip_eps, g)
        res.steps.append(step)
        res.loss.append(float(loss.detach()))
        res.chunks.append(cfg.rl_chunks)
        res.extra.setdefault("reward", []).append(float(rewards.mean()))
        bar.set_postfix(loss=f"{res.loss[-1]:.3f}", reward=f"{res.extra['reward'][-1]:.3f}")
        bar.update(1)
    bar.close()
    res.seconds = time.perf_counter() - t0
    net.eval()
    res.heldout_after = evaluate_policies(rm, net, eval_windows, cfg.rl_expand, cfg.seed)
    return res, net


# ----------------------------------------------------------------------------- driver

def checkpoint_path_for_run(ckpt: Path, overwrite: bool = False) -> Path:
    """Where a run writes its checkpoint: ``ckpt`` when it (and its policy) does not exist yet or
    ``overwrite``, else the first free ``<stem>.run<N><suffix>`` beside it (a trained checkpoint
    is never replaced without asking)."""
    ckpt = Path(ckpt)
    taken = lambda p: p.exists() or policy_checkpoint_path(p).exists()   # noqa: E731
    if overwrite or not taken(ckpt):
        return ckpt
    n = 2
    while taken(ckpt.with_name(f"{ckpt.stem}.run{n}{ckpt.suffix}")):
        n += 1
    return ckpt.with_name(f"{ckpt.stem}.run{n}{ckpt.suffix}")


def read_checkpoint_file(path: Path) -> dict:
    """A REFRAG checkpoint's contents (CPU), or TrainError naming the file (e.g. for ``--resume``,
    checked before any model is loaded)."""
    from ragattn.methods.refrag.model import CHECKPOINT_FORMAT

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:   # noqa: BLE001 (truncated, not a torch file, unpickling refused)
        raise TrainError(f"refrag-train: {path} is not a readable checkpoint ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise TrainError(f"refrag-train: {path} is not a {CHECKPOINT_FORMAT} checkpoint")
    return state
