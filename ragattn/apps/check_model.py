"""``python -m ragattn check-model MODEL``: the quality gate of chunk reuse on a model.

    python -m ragattn check-model MODEL [--methods M,M] [--probes N] [--passages N] [--seed S]
                                  [--ratio PCT] [--min-agreement F] [--max-kl NATS] [--warn-kl NATS]
                                  [--max-rotation-error E] [--max-exact-kl NATS] [--store DIR]
                                  [--dtype float32|bfloat16|float16] [--device cpu|cuda] [--served]
                                  [--json] [--no-progress]

MODEL: "smollm2" (the shipped SmolLM2-135M-Instruct), a local HF checkpoint folder (e.g. the one a
vLLM server serves) or the id of one in the local HF cache; loaded in --dtype (default float32; give
the served dtype to check the model as it is served: the 16-bit limits below are looser).

First the model checks every cached-chunk method depends on: its family and RoPE are ones ragattn
re-rotates (YaRN/LongRoPE attention factors, dynamic NTK, per-layer-type frequencies are refused by
name), and ragattn's re-rotation of a passage's keys by 1000 positions equals the model's own keys
there (largest relative error over the layers; a model that rotates keys another way fails with
that figure); when CacheBlend or FusionRAG is checked, CacheBlend at ratio 1 (every chunk token
recomputed: full attention) must equal full prefill up to rounding (--max-exact-kl), or the ratio
methods fail. Then each cached-chunk method of the registry (TurboRAG composite and reordered,
Block-Attention, Full Reuse, CacheBlend and FusionRAG at --ratio) answers --probes short synthetic
RAG prompts (invented facts no eval or training text holds, generated from --seed) and is compared
with full prefill on the same tokens: first-token agreement and KL(full || method) of the first-token
distribution. The question without passages (no-context) is the floor.

Verdict per method: fail below --min-agreement (default 0.5) or above a mean KL of --max-kl (1.0
nats), or when the model checks fail; warn above --warn-kl (0.35) or when the mean KL is not below
no-context's; pass otherwise. The table goes to stdout (--json: the report as JSON instead).

Exit status: 0 when every method passes (warnings included), 1 when one fails or is refused, 2 for
bad arguments or a model that cannot be loaded (missing folder, unsupported architecture).

--store DIR keeps the report in DIR/quality-gate/, keyed by the model's fingerprint and the
settings, and reads it back on the next run: what a server does once per model at start-up
(ragattn.methods.quality_gate.stored_check). With --served (the server's settings: its methods, 3
probes), --store set to a vLLM server's chunk_dir and --dtype to the served dtype, this is the
verdict the server's start-up gate reads (docs/vllm.md, "Quality gate"): run it ahead, on any
device, and the server starts without running the gate.
"""
from __future__ import annotations

import argparse
import json
import sys

from ragattn.apps.cli import OneLineParser, UsageError, check_at_least, parse_device, writable_dir

PROG = "python -m ragattn check-model"


def parse_args(argv=None) -> argparse.Namespace:
    from ragattn.methods.quality_gate import DEFAULT_PASSAGES, DEFAULT_PROBES, DEFAULT_SEED, GATED, Thresholds

    t = Thresholds()
    p = OneLineParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="'smollm2', a local HF checkpoint folder, or a model id "
                   "already in the local HF cache")
    p.add_argument("--methods", default=None, metavar="M,M",
                   help=f"methods to check (default: all of {', '.join(GATED)})")
    p.add_argument("--probes", type=int, default=DEFAULT_PROBES, help=f"RAG prompts (default {DEFAULT_PROBES})")
    p.add_argument("--passages", type=int, default=DEFAULT_PASSAGES,
                   help=f"passages per prompt (default {DEFAULT_PASSAGES})")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"probe text seed (default {DEFAULT_SEED})")
    p.add_argument("--ratio", type=float, default=None, metavar="PCT",
                   help="recompute ratio of CacheBlend and FusionRAG, percent of the chunk tokens (default: "
                        "the registry's, 15)")
    p.add_argument("--min-agreement", type=float, default=t.min_agreement, metavar="F",
                   help=f"least share of first tokens equal to full prefill's (default {t.min_agreement})")
    p.add_argument("--max-kl", type=float, default=t.max_kl, metavar="NATS",
                   help=f"mean first-token KL above which a method fails (default {t.max_kl})")
    p.add_argument("--warn-kl", type=float, default=t.warn_kl, metavar="NATS",
                   help=f"mean first-token KL above which a method is warned (default {t.warn_kl})")
    p.add_argument("--max-rotation-error", type=float, default=None, metavar="E",
                   help="largest relative error of re-rotated keys (default 1e-3 for float32, 0.1 for 16-bit)")
    p.add_argument("--max-exact-kl", type=float, default=None, metavar="NATS",
                   help="first-token KL of recompute-all against full prefill (default 1e-6 for float32, 0.02 "
                        "for 16-bit)")
    p.add_argument("--served", action="store_true",
                   help="the settings of a vLLM server's start-up gate (the served methods, "
                        "3 probes, the other settings their defaults): with --store set to the server's chunk_dir and "
                        "--dtype to the served dtype, the server reads this verdict and loads nothing")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="keep the report in DIR/quality-gate/ and reuse it for the same model and settings")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="dtype the model is loaded in (default float32)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


# the flags that make the gate's settings (those a server's --served verdict is keyed by)
_GATE_FLAGS = ("methods", "probes", "passages", "seed", "ratio", "min_agreement", "max_kl", "warn_kl",
               "max_rotation_error", "max_exact_kl")


def _thresholds(args):
    from ragattn.methods.quality_gate import Thresholds

    try:
        return Thresholds(min_agreement=args.min_agreement, max_kl=args.max_kl, warn_kl=args.warn_kl,
                          max_rotation_error=args.max_rotation_error, max_exact_kl=args.max_exact_kl)
    except ValueError as exc:   # named by its flag
        msg = str(exc).replace("ragattn.methods.quality_gate.Thresholds: ", "")
        for field in ("min_agreement", "max_kl", "warn_kl", "max_rotation_error", "max_exact_kl"):
            msg = msg.replace(field, "--" + field.replace("_", "-"))
        raise UsageError(msg) from None


def run(args: argparse.Namespace, model_and_tokenizer=None, out=None):
    """Check the model; print the table (or JSON) on ``out`` (default: stdout); returns the GateReport."""
    import os

    import torch
    from tqdm import tqdm

    from ragattn.methods import quality_gate, registry

    thresholds = _thresholds(args)
    check_at_least(args.probes, 1, "--probes")
    check_at_least(args.passages, 1, "--passages")
    methods, probes = None, args.probes
    if args.served:
        defaults = vars(parse_args([args.model]))
        changed = [k for k in _GATE_FLAGS if getattr(args, k) != defaults[k]]
        if changed:
            raise UsageError("--served checks with the server's settings (its methods, 3 probes, the rest the "
                             "defaults): drop " + ", ".join("--" + k.replace("_", "-") for k in changed))
        served = quality_gate.served_settings()
        methods, probes = served["methods"], served["probes"]
    elif args.methods is not None:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        try:
            methods = [registry.canonical(m, quality_gate.GATED) for m in names] or None
        except ValueError as exc:
            raise UsageError(f"--methods: {exc}") from None
        if methods is None:
            raise UsageError(f"--methods: no method given (known: {', '.join(quality_gate.GATED)})")
    ratio = None
    if args.ratio is not None:
        if not 0.0 <= args.ratio <= 100.0:   # also NaN
            raise UsageError(f"--ratio is a percentage of recomputed chunk tokens in [0, 100], got {args.ratio}")
        ratio = args.ratio / 100.0
    device = parse_device(args.device)
    if args.store is not None:
        writable_dir(args.store, "--store")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model_and_tokenizer is None:
        from ragattn.apps.demo import load_model

        model, tok = load_model(args.model, device, "check-model", getattr(torch, args.dtype))
    else:
        model, tok = model_and_tokenizer
    bar = tqdm(total=quality_gate.steps(methods, probes), desc="check-model", unit="answer",
               file=sys.stderr, disable=args.no_progress)
    kw = dict(methods=methods, thresholds=thresholds, probes=probes, passages=args.passages, seed=args.seed,
              ratio=ratio, name=args.model, progress=lambda _: bar.update(1))
    if args.store is not None:
        report = quality_gate.stored_check(model, tok, args.store, **kw)
    else:
        report = quality_gate.check_model(model, tok, **kw)
    bar.close()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.format_table(),
          file=sys.stdout if out is None else out)
    return report


def main(argv=None) -> int:
    from ragattn.apps.cli import run_command

    argv = list(sys.argv[1:] if argv is None else argv)

    def go():
        args = parse_args(argv)
        return 0 if run(args).ok else 1

    return run_command(go, PROG)
