"""FusionRAG / CacheBlend / Full Reuse time to first token against full prefill (a benchmark).

    python -m ragattn.bench.fusionrag_ttft [--contexts 800,2000] [--ratio 0.15] [--repeats 3]
                                           [--device cpu] [--out OUT]

Contexts are real passages of the shipped eval set (``ragattn/data/qa_eval``), added until the
prompt reaches about ``--contexts`` tokens, with one of its questions. The passages' KV is put in a
``ChunkStore`` before any timing (offline, as deployed). Per method: one warm-up, then the median
over ``--repeats`` of ``Answer.ttft_s`` (chunk lookup, assembly, selection, recompute; for
``full-prefill`` one SDPA forward), taken round after round over the methods, and for the
selective methods the median split into assembly / selection / recompute (selection =
FusionRAG's final-block pass + ``key_attention_scores`` + top-k; CacheBlend selects inside its
recompute pass, so its selection share is 0 here).

It also prints a *modelled* H100 figure (:func:`modelled_h100`): FLOPs and bytes of Llama-3-8B at
32K tokens against the H100 SXM's dense bf16 peak and HBM bandwidth, at one assumed efficiency for
every kernel. Modelled, not measured. Writes ``fusionrag_ttft.json`` / ``.md`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from .__main__ import _commit

H100 = dict(bf16_flops=989e12, hbm_bytes_per_s=3.35e12)  # SXM datasheet, dense
LLAMA3_8B = dict(params=6.98e9, layers=32, hidden=4096, kv_heads=8, head_dim=128)  # non-embedding params


def modelled_h100(tokens: int = 32768, ratio: float = 0.15, question: int = 32, efficiency: float = 0.6,
                  model: dict = LLAMA3_8B, gpu: dict = H100) -> dict:
    """Modelled TTFT (seconds) of full prefill, FusionRAG and CacheBlend for ``model`` on ``gpu``.

    FLOPs: linear ``2 * params * rows``; attention ``4 * hidden * sum(visible keys)`` per layer
    (causal prefill ``L^2 / 2`` keys; a recomputed row at a uniformly spread position sees ``L / 2``
    on average; question rows see ``L``). Bytes: the weights once per forward pass, and for the
    cached methods the request's KV written once (assembly) and read by every pass.
    Compute at ``efficiency`` x peak; the time of a pass is max(compute, bytes / bandwidth)."""
    L, h, n_l = tokens, model["hidden"], model["layers"]
    kv_bytes = L * n_l * model["kv_heads"] * model["head_dim"] * 2 * 2       # bf16 K and V
    w_bytes = model["params"] * 2
    flops_s, bw = gpu["bf16_flops"] * efficiency, gpu["hbm_bytes_per_s"]

    def forward(rows, keys_seen, reads_kv=True):
        flops = 2 * model["params"] * rows + 4 * h * n_l * keys_seen
        return max(flops / flops_s, (w_bytes + (kv_bytes if reads_kv else 0)) / bw)

    full = forward(L + question, (L + question) ** 2 / 2, reads_kv=False)
    k = int(ratio * L)
    assemble = 2 * kv_bytes / bw
    select = forward(question, question * L)
    recompute = forward(k + question, k * L / 2 + question * L)
    fusion = assemble + select + recompute
    # CacheBlend: layers 0-1 for every token, then 2r, 1.5r at the check layers 2-3, r after
    frac = (2 + 2 * ratio + 1.5 * ratio + (n_l - 4) * ratio) / n_l
    cacheblend = assemble + forward(frac * L + question, frac * L * L / 2 + question * L)
    return dict(tokens=L, ratio=ratio, efficiency=efficiency, full_s=full, fusionrag_s=fusion,
                fusionrag_select_s=select, cacheblend_s=cacheblend,
                fusionrag_speedup=full / fusion, cacheblend_speedup=full / cacheblend)


def _contexts(tokenizer, targets, question):
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus
    from ragattn.methods.prompt import prompt_parts

    passages = [p.render() for p in load_corpus(EVAL_CORPUS).passages]
    out = []
    for target in targets:
        chunks = []
        for p in passages:
            chunks.append(p)
            head, ids, tail = prompt_parts(tokenizer, chunks, question)
            if len(head) + sum(map(len, ids)) + len(tail) >= target:
                break
        out.append(chunks)
    return out


def measure(model, tokenizer, targets, ratio, repeats):
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus
    from ragattn.methods import fusionrag
    from ragattn.store import ChunkStore
    from ragattn.methods.baseline import full_prefill
    from ragattn.methods.prompt import prompt_parts

    question = load_corpus(EVAL_CORPUS).questions[0].question
    store = ChunkStore(model)
    methods = {
        "full-prefill": lambda c: full_prefill(model, tokenizer, c, question, max_new_tokens=1),
        "full-reuse": lambda c: fusionrag.full_reuse(model, tokenizer, c, question, max_new_tokens=1, store=store),
        "fusionrag": lambda c: fusionrag.answer(model, tokenizer, c, question, max_new_tokens=1, store=store,
                                                ratio=ratio),
        "cacheblend": lambda c: fusionrag.cacheblend(model, tokenizer, c, question, max_new_tokens=1,
                                                     store=store, ratio=ratio),
    }
    rows = []
    for chunks in _contexts(tokenizer, targets, question):
        head, ids, tail = prompt_parts(tokenizer, chunks, question)
        store.add([head] + ids)                                       # offline
        tokens = len(head) + sum(map(len, ids)) + len(tail)
        base = None
        for run in methods.values():
            run(chunks)                                               # warm-up
        # round after round over the methods: a drift of the machine's speed moves every method
        # alike instead of the ones measured last
        runs = {name: [] for name in methods}
        for _ in range(repeats):
            for name, run in methods.items():
                runs[name].append(run(chunks))
        for name, answers in runs.items():
            ttft = statistics.median(a.ttft_s for a in answers)
            row = dict(tokens=tokens, chunks=len(chunks), method=name, ttft_ms=ttft * 1e3)
            for part in ("assemble_s", "select_s", "recompute_s"):
                if part in answers[0].extra:
                    row[part[:-2] + "_ms"] = statistics.median(a.extra[part] for a in answers) * 1e3
            base = ttft if name == "full-prefill" else base
            row["speedup"] = base / ttft
            if "select_ms" in row:
                row["select_share"] = row["select_ms"] / row["ttft_ms"]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return rows


def format_table(rows, ratio) -> str:
    head = ["context tokens", "method", "TTFT ms", "speedup", "assemble ms", "select ms", "recompute ms",
            "selection share"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in rows:
        name = r["method"] + (f" @{ratio:.0%}" if r["method"] in ("fusionrag", "cacheblend") else "")
        lines.append("| " + " | ".join([str(r["tokens"]), name, f(r["ttft_ms"], ".0f"), f(r["speedup"], ".2f") + "x",
                                        f(r.get("assemble_ms"), ".0f"), f(r.get("select_ms"), ".0f"),
                                        f(r.get("recompute_ms"), ".0f"), f(r.get("select_share"), ".0%")]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ragattn.bench.fusionrag_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="800,2000", help="approximate prompt sizes in tokens")
    p.add_argument("--ratio", type=float, default=0.15)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--out", default=None, help="folder for fusionrag_ttft.json / .md")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from ragattn.hf.models import load_smollm2

    model, tok = load_smollm2(dtype=torch.float32, device=args.device)
    targets = [int(x) for x in args.contexts.split(",")]
    rows = measure(model, tok, targets, args.ratio, args.repeats)
    model_h100 = modelled_h100(ratio=args.ratio)
    text = (f"SmolLM2-135M-Instruct fp32, device {args.device}, torch threads {torch.get_num_threads()}, "
            f"load average {os.getloadavg()[0]:.1f}, commit {_commit()}, median of {args.repeats}\n\n"
            + format_table(rows, args.ratio)
            + "\n\nModelled (not measured) H100 SXM, Llama-3-8B bf16, {tokens} tokens, {ratio:.0%}, "
              "{efficiency:.0%} of peak: full prefill {full_s:.3f} s, FusionRAG {fusionrag_s:.3f} s "
              "({fusionrag_speedup:.1f}x; selection {fusionrag_select_s:.4f} s), CacheBlend "
              "{cacheblend_s:.3f} s ({cacheblend_speedup:.1f}x)".format(**model_h100))
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fusionrag_ttft.json"), "w") as f:
            json.dump(dict(rows=rows, modelled_h100=model_h100, commit=_commit()), f, indent=1)
        with open(os.path.join(args.out, "fusionrag_ttft.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
