"""``python -m ragattn <command>``.

    python -m ragattn demo [--method M ...] [--question TEXT] [--corpus DIR] [--model NAME]
                           [--top-k K] [--repeats N] [--max-new-tokens N] [--limit N] [--device cpu|cuda]
    python -m ragattn build-store --corpus DIR --out DIR [--neighbours N] [--shard i/n] [--batch B]
    python -m ragattn eval [--corpus DIR] [--model NAME] [--methods M,M] [--top-k 8,16]
                           [--ratios 0,5,15,30,100] [--limit N] [--device cpu|cuda] [--out DIR]
    python -m ragattn eval-compare BEFORE AFTER --out DIR   # two eval runs side by side
    python -m ragattn check-model MODEL [--methods M,M] [--probes N] [--json] [...]
                                         # quality gate: each cached-chunk method vs full prefill
    python -m ragattn finetune --out DIR [...]   # the block-attention adapter (docs/finetune.md)
    python -m ragattn refrag-train [--stages recon,cpt,rl] [--k 8] [--device cpu|cuda] [--out DIR] [...]
                                         # REFRAG training recipe (docs/refrag.md, "Training")
    python -m ragattn bench [...]        # micro-benchmarks (== python -m bench in a checkout)
    python -m ragattn bench e2e [...]    # end-to-end TTFT benchmark (== python -m bench.e2e)
    python -m ragattn bench sm90 [...]   # static H100 report, no GPU (== python -m bench.sm90)
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    """Run a sub-command. Every one fails the same way: bad arguments and user-facing errors
    (corpus, model, device, output path, chunk store, ...) print one ``error: ...`` line and
    return 2 (:func:`ragattn.apps.cli.run_command`); anything else is a bug and keeps its traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    entry = _COMMANDS.get(cmd)
    if entry is None:
        print(f"error: python -m ragattn: unknown command {cmd!r} (commands: {', '.join(_COMMANDS)})",
              file=sys.stderr)
        return 2
    from ragattn.apps.cli import run_command

    return run_command(lambda: entry(rest), f"python -m ragattn {cmd}")


def _demo(rest):
    from ragattn.apps.demo import main as demo_main

    return demo_main(rest)


def _build_store(rest):
    from ragattn.apps.build_store import main as build_store_main

    return build_store_main(rest)


def _eval(rest):
    from ragattn.apps.eval import main as eval_main

    return eval_main(rest)


def _eval_compare(rest):
    from ragattn.apps.eval_compare import main as eval_compare_main

    return eval_compare_main(rest)


def _check_model(rest):
    from ragattn.apps.check_model import main as check_model_main

    return check_model_main(rest)


def _finetune(rest):
    from ragattn.apps.finetune import main as finetune_main

    return finetune_main(rest)


def _refrag_train(rest):
    from ragattn.apps.refrag_train import main as refrag_train_main

    return refrag_train_main(rest)


def _bench(rest):
    if rest[:1] == ["e2e"]:
        from ragattn.bench.e2e import main as e2e_main

        return e2e_main(rest[1:])
    if rest[:1] == ["sm90"]:
        from ragattn.bench.sm90 import main as sm90_main

        sm90_main(rest[1:])
        return 0
    from ragattn.bench.__main__ import main as bench_main

    return bench_main(rest)


_COMMANDS = {"demo": _demo, "build-store": _build_store, "eval": _eval, "eval-compare": _eval_compare,
             "check-model": _check_model, "finetune": _finetune,
             "refrag-train": _refrag_train, "bench": _bench}


if __name__ == "__main__":
    sys.exit(main())
