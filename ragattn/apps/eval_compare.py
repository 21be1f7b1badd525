"""``python -m ragattn eval-compare``: two ``eval`` runs side by side (before / after a fine-tune).

    python -m ragattn eval --untuned --out runs/before ...      # the same questions, methods, top-k
    python -m ragattn eval --out runs/after ...
    python -m ragattn eval-compare runs/before runs/after --out docs/eval/block-tuned

Writes ``compare.md`` (per top-k, every method both runs hold: EM, EM as a share of full prefill's,
first-token agreement and KL against full attention, answers equal to full's; before -> after) and
``compare.png`` (the same as bars). Refuses runs over different questions or corpora.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from ragattn.methods.registry import BASELINE

_METRICS = (("em", "EM %", 100.0), ("first_token_agreement", "1st-token = full %", 100.0),
            ("mean_kl", "first-token KL", 1.0), ("answer_match", "answer = full %", 100.0))


class CompareError(RuntimeError):
    """The two runs cannot be compared (missing, or over different questions)."""


def load_run(folder) -> dict:
    f = Path(folder) / "results.json"
    if not f.is_file():
        raise CompareError(f"{f} is missing (a folder written by `python -m ragattn eval --out`)")
    return json.loads(f.read_text())


def _by_key(run: dict) -> Dict[Tuple[int, str, object], dict]:
    return {(a["top_k"], a["method"], a["ratio"]): a for a in run["aggregates"]}


def _label(method: str, ratio) -> str:
    return method if ratio is None else f"{method} @{ratio:g}%"


def compare(before: dict, after: dict) -> List[dict]:
    """One dict per (top-k, method, ratio) in both runs: ``before`` and ``after`` aggregates and
    full prefill's EM of each run (the share the issue's targets are stated in)."""
    qb, qa = ({r["question_id"] for r in run["rows"]} for run in (before, after))
    if qb != qa or before["config"]["corpus"] != after["config"]["corpus"]:
        raise CompareError("the two runs answered different questions or corpora "
                           f"({len(qb)} vs {len(qa)} questions, {before['config']['corpus']} vs {after['config']['corpus']})")
    b, a = _by_key(before), _by_key(after)
    out = []
    for key in a:
        if key in b:
            k = key[0]
            out.append(dict(top_k=k, method=key[1], ratio=key[2], before=b[key], after=a[key],
                            full_em_before=b.get((k, BASELINE, None), {}).get("em"),
                            full_em_after=a.get((k, BASELINE, None), {}).get("em")))
    return out


def _cell(x, scale) -> str:
    if x is None:
        return "-"
    return f"{x * scale:.1f}" if scale != 1.0 else f"{x:.3g}"


def format_compare(pairs: List[dict], before: dict, after: dict) -> str:
    cb, ca = before["config"], after["config"]
    lines = [f"# ragattn eval: before -> after ({ca['questions']} questions, {ca['multi_hop']} multi-hop)", "",
             f"- before: `{cb['command']}` at `{cb['commit']}` ({cb['date']})",
             f"- after: `{ca['command']}` at `{ca['commit']}` ({ca['date']})",
             "- EM / full: the method's EM as a share of full prefill's EM in the same run; KL: KL(full || method) "
             "of the first-token distribution (nats), mean over questions", ""]
    head = ["method"] + [f"{name} (before -> after)" for _, name, _ in _METRICS] + ["EM / full % (after)"]
    for k in sorted({p["top_k"] for p in pairs}):
        lines += [f"## top-{k}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for p in (p for p in pairs if p["top_k"] == k):
            cells = [_label(p["method"], p["ratio"])]
            for key, _, scale in _METRICS:
                cells.append(f"{_cell(p['before'][key], scale)} -> {_cell(p['after'][key], scale)}")
            full = p["full_em_after"]
            cells.append("-" if not full else f"{100 * p['after']['em'] / full:.0f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def plot_compare(pairs: List[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted({p["top_k"] for p in pairs})
    fig, axes = plt.subplots(2, len(ks), figsize=(6.5 * len(ks), 7), squeeze=False)
    for col, k in enumerate(ks):
        ps = [p for p in pairs if p["top_k"] == k]
        labels = [_label(p["method"], p["ratio"]) for p in ps]
        x = range(len(ps))
        for row, (key, name, scale) in enumerate((_METRICS[0], _METRICS[2])):
            ax = axes[row][col]
            ax.bar([i - 0.2 for i in x], [p["before"][key] * scale for p in ps], 0.4, label="before")
            ax.bar([i + 0.2 for i in x], [p["after"][key] * scale for p in ps], 0.4, label="after")
            ax.set_xticks(list(x))
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
            ax.set_ylabel(name)
            ax.set_title(f"top-{k}: {name}")
            ax.grid(axis="y", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from ragattn.apps.cli import OneLineParser, run_command, save_or_keep, writable_dir

    def go():
        p = OneLineParser(prog="python -m ragattn eval-compare", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("before", help="folder of the first eval run (results.json)")
        p.add_argument("after", help="folder of the second eval run")
        p.add_argument("--out", required=True, metavar="DIR", help="where compare.md and compare.png go")
        p.add_argument("--no-plot", action="store_true", help="skip the plot")
        args = p.parse_args(argv)
        out = writable_dir(args.out, "--out")
        before, after = load_run(args.before), load_run(args.after)
        pairs = compare(before, after)
        if not pairs:
            raise CompareError("the two runs have no (top-k, method, ratio) in common")
        text = format_compare(pairs, before, after)
        print(text)
        save_or_keep(lambda f: f.write_text(text), out / "compare.md", "--out")
        if not args.no_plot:
            title = f"before ({before['config']['commit']}) -> after ({after['config']['commit']})"
            save_or_keep(lambda f: plot_compare(pairs, f, title), out / "compare.png", "--out")
        return 0

    return run_command(go, "python -m ragattn eval-compare")


if __name__ == "__main__":
    sys.exit(main())
