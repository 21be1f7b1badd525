"""REFRAG time to first token against context length, next to the paper's analytic model, and
answer quality (exact match) on the shipped QA set (a benchmark, not a test).

    python -m ragattn.bench.refrag_ttft [--contexts 512,1024,2048,4096] [--ks 8,16,32] [--repeats 2]
                                        [--qa-limit 20] [--fractions 0,0.25] [--out OUT]

TTFT: contexts are real passages of the shipped eval set (``ragattn/data/qa_eval``) added until
the prompt reaches about the target size, with one of its questions; SmolLM2-135M-Instruct fp32
as the decoder, MiniLM as the chunk encoder. Per row: one warm-up, then the median over
``--repeats`` of ``Answer.ttft_s`` (one ``generate`` step): ``full-prefill`` (one SDPA forward
over the whole prompt), ``refrag k=K cached`` (chunk embeddings precomputed, the paper's "with
cache": chunking, cache lookup, ``refrag_assemble`` and the shorter prefill are timed) and
``refrag k=K uncached`` (the cache emptied before each call: re-tokenisation, the packed MiniLM
call and the projector are timed too).

Analytic model (paper §10.4, notes §5.3): ``TTFT = (24 d^2 + 4 d s) l s / f`` for a decoder of
width ``d``, ``l`` layers, ``s`` input slots; REFRAG's ``s`` is the compressed slot count (head
and question tokens + one slot per chunk), and "uncached" adds the encoder's
``(24 d_e^2 + 4 d_e k_e) l_e s_e / f`` over its ``s_e`` tokens (chunks of ``k_e`` tokens). For the
measured shape ``f`` is this CPU's measured fp32 matmul rate; the formula ignores GQA, the
vocabulary projection and non-matmul work, so only the *ratios* are comparable. The
Llama-2-7B + RoBERTa-large rows on an H100 SXM (989 TFLOP/s bf16 dense) are **modelled only**.

Quality: per question, the top-``--qa-top-k`` MiniLM-retrieved passages; greedy answers of at
most 16 tokens; ``EM`` as in ``python -m ragattn eval`` (a normalised gold answer occurs in the
normalised answer). With an untrained projector REFRAG's answers are expected to be poor.

Writes ``refrag_ttft.json`` / ``refrag_ttft.md`` / ``refrag_ttft.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from .__main__ import _commit
from .fusionrag_ttft import _contexts

H100_BF16 = 989e12
LLAMA2_7B = dict(d=4096, l=32)
ROBERTA_LARGE = dict(d=1024, l=24)
SMOLLM2 = dict(d=576, l=30)
MINILM = dict(d=384, l=6)


def analytic_ttft(slots: float, d: int, l: int, flops: float) -> float:
    """The paper's prefill model ``(24 d^2 + 4 d s) l s / f`` (seconds), batch 1."""
    return (24 * d * d + 4 * d * slots) * l * slots / flops


def analytic_row(ctx_tokens: int, other_tokens: int, k: int, dec: dict, enc: dict, flops: float,
                 enc_tokens_per_chunk: float) -> dict:
    """Modelled full / REFRAG (cached, uncached) TTFT for ``ctx_tokens`` context tokens."""
    chunks = math.ceil(ctx_tokens / k)
    full = analytic_ttft(ctx_tokens + other_tokens, dec["d"], dec["l"], flops)
    cached = analytic_ttft(chunks + other_tokens, dec["d"], dec["l"], flops)
    ke = enc_tokens_per_chunk
    encoder = (24 * enc["d"] ** 2 + 4 * enc["d"] * ke) * enc["l"] * chunks * ke / flops
    return dict(full_s=full, cached_s=cached, uncached_s=cached + encoder, cached_speedup=full / cached,
                uncached_speedup=full / (cached + encoder))


def measure_ttft(rm, targets, ks, repeats):
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus
    from ragattn.methods.baseline import full_prefill
    from ragattn.methods.prompt import prompt_parts

    model, tok = rm.decoder, rm.tokenizer
    question = load_corpus(EVAL_CORPUS).questions[0].question
    rows = []
    for chunks in _contexts(tok, targets, question):
        head, ids, tail = prompt_parts(tok, chunks, question)
        ctx_tokens = sum(map(len, ids))
        other = len(head) + len(tail)

        def timed(run):
            """(CPU seconds, wall seconds, Answer) of the fastest of ``repeats`` calls after a warm-up.
            One generated token: the call is the TTFT. CPU time of this process (single-threaded
            runs: its compute, whatever else the shared machine runs) is the primary figure."""
            run()                                                     # warm-up
            best = None
            for _ in range(repeats):
                c0, w0 = time.process_time(), time.perf_counter()
                ans = run()
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                if best is None or cpu < best[0]:
                    best = (cpu, wall, ans)
            return best

        base, base_wall, _ = timed(lambda: full_prefill(model, tok, chunks, question, max_new_tokens=1))
        row = dict(tokens=ctx_tokens + other, context_tokens=ctx_tokens, full_ms=base * 1e3,
                   full_wall_ms=base_wall * 1e3)
        for k in ks:
            rm.encoder.cache.clear()
            t_u, w_u, _ = timed(lambda: (rm.encoder.cache.clear(), rm.generate(question, chunks, max_new_tokens=1,
                                                                                 k=k))[1])
            rm.precompute(chunks, question, k=k)
            t_c, w_c, ans = timed(lambda: rm.generate(question, chunks, max_new_tokens=1, k=k))
            row[f"k{k}"] = dict(slots=ans.extra["slots"], chunks=ans.extra["chunks"], cached_ms=t_c * 1e3,
                                uncached_ms=t_u * 1e3, cached_wall_ms=w_c * 1e3, uncached_wall_ms=w_u * 1e3,
                                cached_speedup=base / t_c, uncached_speedup=base / t_u)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def measure_quality(rm, ks, fractions, limit, top_k, max_new_tokens=16):
    from tqdm import tqdm

    from ragattn.apps.corpus import EVAL_CORPUS, exact_match, load_corpus
    from ragattn.methods.baseline import full_prefill
    from ragattn.methods.refrag import RandomPolicy
    from ragattn.methods.retrieval import Retriever

    corpus = load_corpus(EVAL_CORPUS)
    questions = corpus.questions[:limit] if limit else corpus.questions
    retriever = Retriever([f"{p.title}. {p.text}" for p in corpus.passages])
    configs = [("full-prefill", None, None)] + [(f"refrag k={k} p={f:g}", k, f) for k in ks for f in fractions]
    em = {name: 0 for name, _, _ in configs}
    samples = []
    for q in tqdm(questions, desc="refrag EM", file=sys.stderr):
        idx, _ = retriever.top_k(q.question, top_k)
        chunks = [corpus.passages[i].render() for i in reversed(idx)]
        for name, k, f in configs:
            if k is None:
                ans = full_prefill(rm.decoder, rm.tokenizer, chunks, q.question, max_new_tokens=max_new_tokens)
            else:
                ans = rm.generate(q.question, chunks, max_new_tokens=max_new_tokens, k=k, expand_fraction=f,
                                  policy=RandomPolicy(0))
            hit = exact_match(ans.text.strip(), q.answers)
            em[name] += hit
            if len(samples) < 3 * len(configs):
                samples.append(dict(question=q.question, config=name, answer=ans.text.strip(), em=hit))
    n = len(questions)
    return dict(questions=n, top_k=top_k, em={name: v / n for name, v in em.items()}, samples=samples)


def format_report(res) -> str:
    lines = [res["header"], "", "### TTFT, measured (CPU) next to the analytic model for the same shape", ""]
    ks = res["ks"]
    head = ["prompt tokens", "full ms"] + [f"k={k} {m}" for k in ks for m in ("slots", "cached ms (x)", "uncached ms (x)",
                                                                           "analytic x cached / uncached")]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["ttft"]:
        cells = [str(r["tokens"]), f"{r['full_ms']:.0f}"]
        for k in ks:
            m, a = r[f"k{k}"], r[f"analytic_k{k}"]
            cells += [str(m["slots"]), f"{m['cached_ms']:.0f} ({m['cached_speedup']:.1f}x)",
                      f"{m['uncached_ms']:.0f} ({m['uncached_speedup']:.1f}x)",
                      f"{a['cached_speedup']:.1f}x / {a['uncached_speedup']:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "### Modelled only: Llama-2-7B decoder + RoBERTa-large encoder, H100 SXM bf16 "
              f"({H100_BF16 / 1e12:.0f} TFLOP/s dense, 100 % of peak), same formula", ""]
    head = ["context tokens", "full ms"] + [f"k={k} {m}" for k in ks for m in ("cached ms (x)", "uncached ms (x)")]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["modelled_h100"]:
        cells = [str(r["context_tokens"]), f"{r[f'k{ks[0]}']['full_s'] * 1e3:.1f}"]
        for k in ks:
            a = r[f"k{k}"]
            cells += [f"{a['cached_s'] * 1e3:.2f} ({a['cached_speedup']:.1f}x)",
                      f"{a['uncached_s'] * 1e3:.2f} ({a['uncached_speedup']:.1f}x)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_quality(res) -> str:
    qd = res["quality"]
    lines = [res["header"], "", f"### Exact match on the shipped QA set ({qd['questions']} questions, "
             f"top-{qd['top_k']} passages, greedy, 16 tokens; expansion by RandomPolicy(0))", "",
             "| configuration | EM |", "|---|---|"]
    lines += [f"| {name} | {v:.0%} |" for name, v in qd["em"].items()]
    lines += ["", "Sample answers:", ""] + [f"- {s['config']}: {s['question']!r} -> {s['answer']!r} "
                                           f"({'EM' if s['em'] else 'no EM'})" for s in qd["samples"]]
    return "\n".join(lines)


def plot(res, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["tokens"] for r in res["ttft"]]
    ax[0].plot(x, [r["full_ms"] for r in res["ttft"]], "k-o", label="full prefill")
    for k in res["ks"]:
        ax[0].plot(x, [r[f"k{k}"]["cached_ms"] for r in res["ttft"]], "-o", label=f"REFRAG k={k} cached")
        ax[0].plot(x, [r[f"k{k}"]["uncached_ms"] for r in res["ttft"]], "--x", label=f"REFRAG k={k} uncached")
    ax[0].set(xlabel="prompt tokens", ylabel="TTFT (ms)", xscale="log", yscale="log",
              title="measured: SmolLM2-135M + MiniLM, CPU")
    ax[0].legend(fontsize=7)
    for k in res["ks"]:
        line, = ax[1].plot(x, [r[f"k{k}"]["cached_speedup"] for r in res["ttft"]], "-o", label=f"k={k} measured")
        ax[1].plot(x, [r[f"analytic_k{k}"]["cached_speedup"] for r in res["ttft"]], ":", color=line.get_color(),
                   label=f"k={k} analytic")
    ax[1].set(xlabel="prompt tokens", ylabel="TTFT speedup over full prefill (cached)", xscale="log",
              title="speedup: measured vs paper's analytic model")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ragattn.bench.refrag_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="512,1024,2048,4096", help="approximate prompt sizes in tokens")
    p.add_argument("--ks", default="8,16,32")
    p.add_argument("--repeats", type=int, default=2, help="timed calls per row (the fastest is kept)")
    p.add_argument("--qa-limit", type=int, default=20, help="questions for the EM table (0 = all)")
    p.add_argument("--qa-top-k", type=int, default=3)
    p.add_argument("--fractions", default="0,0.25", help="expansion fractions for the EM table")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--part", default="all", choices=("all", "ttft", "quality"),
                   help="ttft writes refrag_ttft.*, quality refrag_quality.*; all both")
    p.add_argument("--out", default=None, help="folder for refrag_ttft.json / .md / .png, refrag_quality.json / .md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ragattn.bench.harness import measured_matmul_tflops
    from ragattn.methods.refrag.model import RefragModel

    ks = [int(x) for x in args.ks.split(",")]
    rm = RefragModel.from_smollm2(k=16, device=args.device)
    rm.eval()
    flops = measured_matmul_tflops(torch.device(args.device), torch.float32) * 1e12
    projector = (f"trained checkpoint {rm.checkpoint_path}" if rm.trained else
                 "UNTRAINED (no checkpoint found): REFRAG answers are not meaningful")
    header = (f"SmolLM2-135M-Instruct fp32 + all-MiniLM-L6-v2, device {args.device}, torch threads "
              f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}, measured fp32 matmul "
              f"{flops / 1e9:.0f} GFLOP/s, commit {_commit()}; projector: {projector}")
    outputs = {}
    if args.part in ("all", "ttft"):
        targets = [int(x) for x in args.contexts.split(",")]
        ttft = measure_ttft(rm, targets, ks, args.repeats)
        for r in ttft:
            other = r["tokens"] - r["context_tokens"]
            for k in ks:
                r[f"analytic_k{k}"] = analytic_row(r["context_tokens"], other, k, SMOLLM2, MINILM, flops, k + 2)
        modelled = [dict(context_tokens=s, **{f"k{k}": analytic_row(s, 64, k, LLAMA2_7B, ROBERTA_LARGE, H100_BF16,
                                                                     k + 2) for k in ks})
                    for s in sorted({r["context_tokens"] for r in ttft} | {16384})]
        res = dict(header="REFRAG TTFT: " + header + f"; TTFT = process CPU time of a 1-token generate call, "
                   f"fastest of {args.repeats} after a warm-up", ks=ks, ttft=ttft, modelled_h100=modelled,
                   projector=projector, commit=_commit(), matmul_flops=flops)
        outputs["refrag_ttft"] = (res, format_report(res))
    if args.part in ("all", "quality"):
        qd = measure_quality(rm, ks, [float(f) for f in args.fractions.split(",")], args.qa_limit, args.qa_top_k)
        res = dict(header="REFRAG answer quality: " + header, quality=qd, projector=projector, commit=_commit())
        outputs["refrag_quality"] = (res, format_quality(res))
    for name, (res, text) in outputs.items():
        print(text)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump(res, f, indent=1)
            with open(os.path.join(args.out, f"{name}.md"), "w") as f:
                f.write(text + "\n")
            if name == "refrag_ttft":
                plot(res, os.path.join(args.out, "refrag_ttft.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
