"""``python -m ragattn eval``: answer quality and time to first token of every RAG method, against
gold answers and against full attention, over a QA folder (default: ``ragattn/data/qa_eval``).

    python -m ragattn eval [--corpus DIR] [--model smollm2|CHECKPOINT] [--methods M,M,...]
                           [--top-k 8,16] [--ratios 0,5,15,30,100] [--limit N]
                           [--max-new-tokens N] [--device cpu|cuda] [--out DIR]
                           [--fusion-neighbours N] [--store DIR] [--no-plot] [--no-progress]

For each question the passages are ranked once by MiniLM (``ragattn.methods.retrieval``) and the
top-k of that ranking (for each ``--top-k``) form the context, most relevant last, as in the demo.
Every method answers from the same passages with greedy decoding; the methods that reuse chunk KV
share one :class:`~ragattn.store.ChunkStore`, filled before any timing (offline,
as in deployment); FusionRAG's fused caches (``--fusion-neighbours``, its offline stage) are
built into it too. Methods that take a recompute ratio (FusionRAG, CacheBlend) run once per
``--ratios`` entry (percent of the context's chunk tokens); the others once.

Metrics, per question, then aggregated per (top-k, method, ratio):

* quality against gold: ``EM`` (a normalised gold answer occurs in the normalised answer:
  Block-Attention's best-subspan EM, since a chat model answers in a sentence) and ``F1`` (SQuAD
  token F1 against the best gold answer; SQuAD normalisation: lower case, no punctuation, no
  articles), also split by single-hop / multi-hop questions;
* fidelity to full attention (``full-prefill`` on the same prompt): first-token agreement (argmax),
  KL(full || method) of the first-token distribution, and answer match (normalised answers equal);
* time to first token (the method's own ``Answer.ttft_s``: chunk lookup, assembly, selection,
  recompute, final-block prefill) and speedup = full prefill's TTFT / the method's, per question.

Outputs under ``--out``: ``results.json`` (configuration, per-question rows, aggregates),
``results.md`` (the tables) and ``results.png`` (EM, KL and TTFT against the recompute ratio, one
line per method, one column per top-k; ratio-free methods are horizontal lines).

Methods come from :mod:`ragattn.methods.registry` (name, module, function, fixed options, whether
it takes ``ratio=``; :data:`REGISTRY` here: its entries with an answer function); every function has the signature of ``ragattn.methods.baseline.full_prefill``
(``answer(model, tokenizer, chunks, question, max_new_tokens=..., store=..., **options) ->
Answer``). An entry whose module is not in this checkout is absent from the run, not faked. An
ablation (a variant of a method, e.g. ``fusionrag-standalone``: FusionRAG selecting with the final
block alone) runs only when ``--methods`` names it.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from ragattn.apps.corpus import EVAL_CORPUS, CorpusError, exact_match, load_corpus, normalize_answer, token_f1
from ragattn.methods import registry as _registry
from ragattn.methods.registry import BASELINE, Method

DEFAULT_TOP_K = "8,16"
DEFAULT_RATIOS = "0,5,15,30,100"
DEFAULT_OUT = "bench_results/eval"


class EvalError(RuntimeError):
    """A user-facing error of the eval (bad arguments, corpus, model or method)."""


# ----------------------------------------------------------------------------------------------
# the methods: ragattn.methods.registry's entries with an answer function


REGISTRY = _registry.REGISTRY


def available_methods(registry: Sequence[Method] = REGISTRY) -> Dict[str, Method]:
    """name -> Method for every registry entry whose function exists in this checkout."""
    return {m.name: m for m in registry if m.resolve() is not None}


# ----------------------------------------------------------------------------------------------
# arguments


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr, exit status 2
        print(f"error: python -m ragattn eval: {message}", file=sys.stderr)
        raise SystemExit(2)


def _int_list(text: str, flag: str, lo: int) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < lo for v in vals):
        raise EvalError(f"{flag} needs integers >= {lo}, got {text!r}")
    return sorted(set(vals))


def _ratio_list(text: str) -> List[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise EvalError(f"--ratios must be a comma-separated list of percentages, got {text!r}") from None
    if not vals or any(not (0.0 <= v <= 100.0) for v in vals):  # also rejects NaN
        raise EvalError(f"--ratios are percentages of recomputed chunk tokens in [0, 100], got {text!r}")
    return sorted(set(vals))


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="python -m ragattn eval", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None, metavar="DIR",
                   help="QA folder in the demo's format (default: the shipped eval set, ragattn/data/qa_eval)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), a local HF checkpoint folder "
                   "(e.g. a Block-Attention fine-tune) or a model id already in the local HF cache")
    p.add_argument("--methods", default=None, metavar="M,M",
                   help="comma-separated methods (default: every available one but the ablations, "
                        "e.g. fusionrag-standalone); full-prefill always runs")
    p.add_argument("--top-k", default=DEFAULT_TOP_K, metavar="K,K", help=f"passages per question (default {DEFAULT_TOP_K})")
    p.add_argument("--ratios", default=DEFAULT_RATIOS, metavar="R,R",
                   help=f"recompute ratios in percent, for the methods that take one (default {DEFAULT_RATIOS})")
    p.add_argument("--limit", type=int, default=0, help="first N questions only (default 0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer length cap (default 16)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--fusion-neighbours", type=int, default=10, metavar="N",
                   help="FusionRAG's offline fusion: similar passages each fused chunk cache has seen "
                        "(default 10, capped by the corpus; 0 = no fused caches)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="chunk store directory to read and fill (e.g. from `python -m ragattn build-store`)")
    p.add_argument("--untuned", action="store_true",
                   help="run every method on the model as loaded, without the shipped block-attention "
                        "adapter (the 'before' of the fine-tuning)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        args.top_k = _int_list(args.top_k, "--top-k", 1)
        args.ratios = _ratio_list(args.ratios)
    except EvalError as exc:
        p.error(str(exc))
    if args.limit < 0:
        p.error(f"--limit must be >= 0, got {args.limit}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.fusion_neighbours < 0:
        p.error(f"--fusion-neighbours must be >= 0, got {args.fusion_neighbours}")
    avail = available_methods()
    if args.methods is None:
        args.methods = [name for name, m in avail.items() if not m.ablation]
    else:
        names = [m.strip() for m in args.methods.split(",") if m.strip()]
        known = {m.name for m in REGISTRY}
        unknown = [m for m in names if getattr(_registry.find(m), "name", None) not in known]
        names = [_registry.canonical(m) for m in names if m not in unknown]
        if unknown or not names:
            p.error(f"unknown method(s) {unknown or names}; known: {', '.join(m.name for m in REGISTRY)}")
        absent = [m for m in names if m not in avail]
        if absent:
            p.error(f"method(s) {absent} are not available in this checkout (available: {', '.join(avail)})")
        args.methods = [m for m in avail if m in names or m == BASELINE]  # registry order, baseline first
    return args


# ----------------------------------------------------------------------------------------------
# the run


@dataclasses.dataclass
class Row:
    top_k: int
    question_id: str
    multi_hop: bool
    support_retrieved: bool   # every supporting passage is among the top-k
    method: str
    ratio: Optional[float]    # percent; None for methods without a recompute ratio
    context_tokens: int
    ttft_ms: float
    speedup: float
    answer: str
    em: bool
    f1: float
    first_token_match: bool
    kl: float
    answer_match: bool
    recomputed: Optional[int]  # chunk tokens recomputed (ratio methods)
    select_ms: Optional[float]  # selection time inside the TTFT (ratio methods)


def _runs(methods: Sequence[Method], ratios: Sequence[float]):
    """(Method, ratio percent or None) for every timed configuration, baseline first."""
    return [(m, r) for m in methods for r in (ratios if m.ratio else [None])]


def _call(run, model, store, tok, chunks, question, n):
    """Answer with one configuration on ``model`` (the loaded one or its tuned copy) and its store."""
    m, r = run
    return m.answer(model, tok, chunks, question, max_new_tokens=n, store=store,
                    ratio=None if r is None else r / 100.0)


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run(args: argparse.Namespace, model_and_tokenizer=None, out=sys.stdout) -> dict:
    """Run the evaluation, write the outputs, print the tables; returns the results dict."""
    from tqdm import tqdm

    from ragattn.apps.cli import parse_device, save_or_keep, writable_dir
    from ragattn.apps.demo import DemoError, load_model
    from ragattn.methods.generate import kl_divergence
    from ragattn.store import ChunkStore
    from ragattn.methods.prompt import prompt_parts
    from ragattn.methods.retrieval import Retriever

    commit, started = _git_commit(), datetime.datetime.now(datetime.timezone.utc)  # the code that runs
    try:
        corpus = load_corpus(args.corpus if args.corpus is not None else EVAL_CORPUS)
    except CorpusError as exc:
        raise EvalError(str(exc)) from None
    if max(args.top_k) > len(corpus.passages):
        raise EvalError(f"--top-k {max(args.top_k)} exceeds the corpus's {len(corpus.passages)} passages")
    questions = corpus.questions[: args.limit] if args.limit else corpus.questions
    device = parse_device(args.device)
    outdir = writable_dir(args.out, "--out")            # before the work, which a late failure would lose
    if args.store is not None:
        writable_dir(args.store, "--store")
    progress = not args.no_progress
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if model_and_tokenizer is None:
        try:
            model, tok = load_model(args.model, device, "eval")
        except DemoError as exc:
            raise EvalError(str(exc).replace("ragattn demo: ", "")) from None
    else:
        model, tok = model_and_tokenizer
    methods = [m for m in REGISTRY if m.name in args.methods]
    runs = _runs(methods, args.ratios)

    # retrieval: one ranking per question, shared by every top-k and method
    retriever = Retriever([f"{p.title}. {p.text}" for p in corpus.passages])
    kmax = max(args.top_k)
    ranking = {q.id: retriever.top_k(q.question, kmax)[0] for q in questions}
    rendered = [p.render() for p in corpus.passages]
    pid_index = {p.id: i for i, p in enumerate(corpus.passages)}

    # the tuned copies the methods run on (ragattn.hf.adapters), unless --untuned
    models, adapters = {None: model}, {}
    for name in sorted({m.adapter for m in methods if m.adapter} if not args.untuned else set()):
        from ragattn.hf.adapters import AdapterError, AdapterMismatch, shipped_adapter, tuned_model

        try:
            manifest = shipped_adapter(name)
            models[name] = tuned_model(model, name)
        except AdapterMismatch as exc:     # another model: its methods run untuned, and the report says so
            adapters[name] = f"not applied ({exc})"
            print(f"warning: {exc}; the methods run on the model as loaded", file=sys.stderr)
            continue
        except AdapterError as exc:
            raise EvalError(f"{exc} (--untuned runs without it)") from None
        adapters[name] = dict(commit=manifest.get("commit"), steps=manifest.get("steps"),
                              files=manifest.get("files"))

    # offline: every retrieved chunk's KV (and FusionRAG's fused caches) in one shared store per model
    cached = [m for m in methods if m.store]
    weights = {m.name: m.adapter if m.adapter in models else None for m in methods}   # -> a key of models
    stores = {a: ChunkStore(models[a], directory=args.store) for a in {weights[m.name] for m in cached}}
    store = stores.get(None)
    on = {m.name: (models[weights[m.name]], stores.get(weights[m.name])) for m in methods}   # model, store
    used = sorted({i for q in questions for i in ranking[q.id]})
    fusion = dict(neighbours=0, chunks=0, seconds=0.0)
    head, chunk_ids, _ = prompt_parts(tok, rendered, "")
    for st in stores.values():
        st.add([head] + [chunk_ids[i] for i in used])
    if store is not None:
        if args.fusion_neighbours and any(m.fused for m in cached):
            import time

            from ragattn.methods import fusionrag

            nbrs = fusionrag.neighbours(retriever.embeddings, args.fusion_neighbours)  # over the corpus
            # fuse the retrieved chunks only; their neighbours' raw caches are all fuse_chunks reads
            used_set = set(used)
            sub = sorted(used_set | {j for i in used for j in nbrs[i]})
            at = {c: n for n, c in enumerate(sub)}
            t0 = time.perf_counter()
            bar = tqdm(total=len(used), desc="fusing chunks (offline)", unit="chunk", file=sys.stderr,
                       disable=not progress)
            fusionrag.fuse_chunks(model, store, head, [chunk_ids[c] for c in sub],
                                  [[at[j] for j in nbrs[c]] if c in used_set else [] for c in sub],
                                  [at[i] for i in used],
                                  progress=bar.update)
            bar.close()
            fusion = dict(neighbours=len(nbrs[0]) if nbrs else 0, chunks=len(used),
                          seconds=round(time.perf_counter() - t0, 2))

    # warm-up of every configuration (allocator, first-call overheads), not reported
    q0 = questions[0]
    warm_chunks = [rendered[i] for i in reversed(ranking[q0.id][: min(args.top_k)])]
    for r in runs:
        _call(r, *on[r[0].name], tok, warm_chunks, q0.question, 2)

    rows: List[Row] = []
    bar = tqdm(total=len(args.top_k) * len(questions) * len(runs), desc="eval", unit="run",
               file=sys.stderr, disable=not progress)
    for k in args.top_k:
        for q in questions:
            top = ranking[q.id][:k]
            chunks = [rendered[i] for i in reversed(top)]  # most relevant last
            retrieved = all(pid_index[x] in top for x in q.passage_ids) if q.passage_ids else False
            base = None
            for r in runs:
                m, ratio = r
                bar.set_postfix_str(f"top-{k} {q.id} {m.name}" + ("" if ratio is None else f" {ratio:g}%"))
                ans = _call(r, *on[r[0].name], tok, chunks, q.question, args.max_new_tokens)
                if base is None:
                    base = ans  # the baseline runs first
                text = ans.text.strip()
                extra = ans.extra or {}
                rows.append(Row(
                    top_k=k, question_id=q.id, multi_hop=q.multi_hop, support_retrieved=retrieved,
                    method=m.name, ratio=ratio, context_tokens=int(ans.prompt_len),
                    ttft_ms=ans.ttft_s * 1e3, speedup=base.ttft_s / ans.ttft_s, answer=text,
                    em=exact_match(text, q.answers), f1=token_f1(text, q.answers),
                    first_token_match=ans.tokens[0] == base.tokens[0],
                    kl=kl_divergence(base.first_logits.float().cpu(), ans.first_logits.float().cpu()),
                    answer_match=normalize_answer(text) == normalize_answer(base.text),
                    recomputed=len(extra["recomputed_slots"]) if "recomputed_slots" in extra else None,
                    select_ms=extra["select_s"] * 1e3 if "select_s" in extra else None,
                ))
                bar.update(1)
    bar.close()

    results = dict(
        config=dict(command="python -m ragattn eval " + " ".join(getattr(args, "argv", []) or []),
                    commit=commit, date=started.strftime("%Y-%m-%d %H:%M UTC"),
                    model=args.model, device=str(device), torch_threads=torch.get_num_threads(),
                    corpus=shown_path(corpus.root), questions=len(questions),
                    multi_hop=sum(q.multi_hop for q in questions), passages=len(corpus.passages),
                    top_k=args.top_k, ratios=args.ratios, methods=args.methods,
                    max_new_tokens=args.max_new_tokens, fusion=fusion, adapters=adapters,
                    untuned=bool(args.untuned)),
        aggregates=aggregate(rows), rows=[dataclasses.asdict(r) for r in rows])
    table = format_tables(results)
    print(table, file=out)                              # first: a failed write below loses nothing
    text = json.dumps(results, indent=1) + "\n"
    save_or_keep(lambda p: p.write_text(text), outdir / "results.json", "--out")
    save_or_keep(lambda p: p.write_text(table + "\n"), outdir / "results.md", "--out")
    if not args.no_plot:
        save_or_keep(lambda p: plot(results, p), outdir / "results.png", "--out")
    return results


def _mean(xs) -> Optional[float]:
    xs = list(xs)
    return statistics.fmean(xs) if xs else None



def shown_path(path) -> str:
    """``path`` as a report shows it: relative to the package's parent (``ragattn/data/qa_eval``)
    or to the working directory when under either, so that a committed report names no machine's
    folders; else as given."""
    path = Path(path).resolve()
    for base in (Path(__file__).resolve().parents[2], Path.cwd().resolve()):
        try:
            return str(path.relative_to(base))
        except ValueError:
            continue
    return str(path)

def aggregate(rows: Sequence[Row]) -> List[dict]:
    """One dict per (top_k, method, ratio), in run order."""
    groups: Dict[tuple, List[Row]] = {}
    for r in rows:
        groups.setdefault((r.top_k, r.method, r.ratio), []).append(r)
    out = []
    for (k, m, ratio), rs in groups.items():
        sel = [r.select_ms / r.ttft_ms for r in rs if r.select_ms is not None]
        out.append(dict(
            top_k=k, method=m, ratio=ratio, questions=len(rs),
            context_tokens=statistics.median(r.context_tokens for r in rs),
            em=_mean(r.em for r in rs), f1=_mean(r.f1 for r in rs),
            em_single_hop=_mean(r.em for r in rs if not r.multi_hop),
            em_multi_hop=_mean(r.em for r in rs if r.multi_hop),
            em_support_retrieved=_mean(r.em for r in rs if r.support_retrieved),
            first_token_agreement=_mean(r.first_token_match for r in rs),
            mean_kl=_mean(r.kl for r in rs), answer_match=_mean(r.answer_match for r in rs),
            ttft_ms=statistics.median(r.ttft_ms for r in rs),
            speedup=statistics.median(r.speedup for r in rs),
            recomputed=_mean(r.recomputed for r in rs if r.recomputed is not None),
            select_share=statistics.median(sel) if sel else None,
        ))
    return out


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _weights_line(c: dict) -> str:
    if c.get("untuned"):
        return "every method on the model as loaded (--untuned)"
    parts = [f"{name} adapter ({a.get('steps')} steps, trained at {str(a.get('commit'))[:10]}) for the methods "
             "that use it" if isinstance(a, dict) else f"{name}: {a}" for name, a in (c.get("adapters") or {}).items()]
    return "; ".join(parts) or "the model as loaded"


def format_tables(results: dict) -> str:
    c = results["config"]
    lines = [f"# ragattn eval: {c['model']} on {c['device']}, {c['questions']} questions "
             f"({c['multi_hop']} multi-hop) over {c['passages']} passages", "",
             f"- command: `{c['command']}`", f"- commit: `{c['commit']}`, {c['date']}, torch threads {c['torch_threads']}",
             f"- corpus: `{c['corpus']}`; retriever all-MiniLM-L6-v2; greedy, max {c['max_new_tokens']} new tokens",
             f"- FusionRAG fused caches: {c['fusion']['chunks']} chunks, {c['fusion']['neighbours']} neighbours each "
             f"(offline, {c['fusion']['seconds']} s, not in the TTFT)",
             "- weights: " + _weights_line(c),
             "- EM: a normalised gold answer occurs in the answer; F1: SQuAD token F1; KL: KL(full || method) "
             "of the first-token distribution, nats; answer = full: normalised answers equal; TTFT: median; "
             "speedup: median of per-question full-prefill TTFT / method TTFT; select: median share of the "
             "TTFT spent selecting tokens", ""]
    head = ["method", "ratio %", "EM %", "F1 %", "EM 1-hop %", "EM 2-hop %", "EM support retrieved %",
            "1st-token agree %", "mean KL", "answer = full %", "ctx tokens", "TTFT ms", "speedup", "select %"]
    for k in c["top_k"]:
        aggs = [a for a in results["aggregates"] if a["top_k"] == k]
        if not aggs:
            continue
        lines += [f"## top-{k}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for a in aggs:
            lines.append("| " + " | ".join([
                a["method"], "-" if a["ratio"] is None else f"{a['ratio']:g}", _pct(a["em"]), _pct(a["f1"]),
                _pct(a["em_single_hop"]), _pct(a["em_multi_hop"]), _pct(a["em_support_retrieved"]),
                _pct(a["first_token_agreement"]), f"{a['mean_kl']:.3g}", _pct(a["answer_match"]),
                f"{a['context_tokens']:.0f}", f"{a['ttft_ms']:.1f}", f"{a['speedup']:.2f}x",
                _pct(a["select_share"])]) + " |")
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(results: dict, path: Path) -> None:
    """EM, mean first-token KL and TTFT against the recompute ratio; one column per top-k."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = results["config"]
    ks = c["top_k"]
    metrics = [("em", "EM (%)", 100.0, False), ("mean_kl", "mean first-token KL (nats)", 1.0, True),
               ("ttft_ms", "TTFT (ms, median)", 1.0, False)]
    fig, axes = plt.subplots(len(metrics), len(ks), figsize=(5.2 * len(ks), 3.4 * len(metrics)), squeeze=False)
    names = list(dict.fromkeys(a["method"] for a in results["aggregates"]))
    colors = {m: f"C{i}" for i, m in enumerate(names)}
    for col, k in enumerate(ks):
        aggs = [a for a in results["aggregates"] if a["top_k"] == k]
        for row, (key, label, scale, logy) in enumerate(metrics):
            ax = axes[row][col]
            for m in names:
                pts = [a for a in aggs if a["method"] == m]
                if not pts or (logy and m == BASELINE):
                    continue
                if pts[0]["ratio"] is None:
                    ax.axhline(pts[0][key] * scale, color=colors[m], ls="--", lw=1.2, label=m)
                else:
                    pts.sort(key=lambda a: a["ratio"])
                    ax.plot([a["ratio"] for a in pts], [a[key] * scale for a in pts], "o-", color=colors[m], label=m)
            if logy:
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_xlabel("recompute ratio (% of chunk tokens)")
            ax.set_ylabel(label)
            ax.set_title(f"top-{k}")
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle(f"ragattn eval: {c['model']} on {c['device']}, {c['questions']} questions, commit {c['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from ragattn.apps.cli import run_command

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.argv = argv

    def go():
        run(args)
        return 0

    return run_command(go, "python -m ragattn eval")
