"""End-to-end benchmark: time to first token, time per output token and the total time of an
answer against context length, full prefill vs cached chunks.

    python -m bench.e2e                                   # SmolLM2 on the CPU, CPU sizes
    python -m bench.e2e --device cuda --model llama3-8b-random --out docs/perf/h100-e2e

For every context (``num_chunks x chunk_size`` tokens of random ids, plus a ``--question-len``
question) it measures the time to the first token's logits of

* ``full-prefill``: one causal forward pass (SDPA) over chunks + question (the baseline);
* ``final block alone (bound)``: the question's prefill with no context at all, the lower bound of
  any cached method's TTFT (its ``vs bound`` column is 1.00x);
* ``cached (on device)``: the chunks' KV already in the device-resident ``ChunkStore``; timed:
  gathering them into the request's paged cache with re-rotation (``copy_kv_``), then the
  question's prefill through ``paged_attention`` (Block-Attention / TurboRAG-reordered);
* ``cached (KV from CPU)`` (CUDA only): the same, with the chunks' KV first copied from pinned
  host memory (TurboRAG's deployment, its Table 4 "with h2d").

For ``full-prefill`` and ``cached (on device)`` it also times a ``--answer-tokens`` answer (32 by
default) with ``model.generate()`` (greedy, no early stop): ``total`` is call to last token, and
``per token`` is ``(total - TTFT) / (answer_tokens - 1)``, the decode cost at that context.

Writes ``e2e.json``, ``e2e.md`` and ``e2e.png`` (TTFT vs context tokens, log-log) to ``--out``.
The module is named without the ``bench_`` prefix so the micro-benchmark discovery skips it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from .__main__ import _commit
from .harness import synchronize
from ragattn.methods.chunk_store import ChunkStore
from ragattn.methods.common import generate_paged, paged_forward

SIZES = {  # (num_chunks, chunk_size) per context
    "tiny": [(2, 16), (3, 16)],  # the pytest smoke test
    "cpu": [(2, 64), (4, 64), (4, 128), (8, 128)],
    "rag16": [(16, 42)],  # 16 retrieved passages, ~670 tokens (issue 15's end-to-end case)
    "gpu": [(8, 512), (16, 512), (32, 512), (64, 512)],  # 4K .. 32K tokens
}


def build_model(name: str, device: torch.device, dtype: torch.dtype, num_layers: int | None = None):
    """The benchmarked model: "smollm2" (real weights), "llama3-8b-random", or "tiny-random" (tests)."""
    if name == "smollm2":
        from ragattn.hf.models import load_smollm2

        model, _ = load_smollm2(dtype=dtype, device=device)
        return model
    if name in ("llama3-8b-random", "tiny-random"):
        shape = "llama3-8b" if name == "llama3-8b-random" else dict(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096)
        from ragattn.hf.models import random_llama

        return random_llama(shape, num_layers=num_layers, dtype=dtype, device=device)
    raise SystemExit(f"bench.e2e: unknown --model {name!r} (smollm2, llama3-8b-random, tiny-random)")


def _time_ms(fn: Callable[[], object], device, repeats: int) -> float:
    fn()  # warm-up (Triton compilation, allocator)
    samples = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    # CPU: best of N (a shared CPU's load only ever adds time); CUDA: median
    return min(samples) if device.type == "cpu" else statistics.median(samples)


@torch.no_grad()
def measure(model, sizes, question_len: int, repeats: int, seed: int = 0, answer_tokens: int = 32) -> List[Dict]:
    """One row per (context, path)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    tok = _IdTokenizer()
    n = answer_tokens
    for num_chunks, chunk_size in sizes:
        chunks = [torch.randint(10, vocab, (chunk_size,), generator=gen).tolist() for _ in range(num_chunks)]
        question = torch.randint(10, vocab, (question_len,), generator=gen).tolist()
        ctx = num_chunks * chunk_size
        ids = torch.tensor([sum(chunks, []) + question], device=device)
        base = dict(num_chunks=num_chunks, chunk_size=chunk_size, context_tokens=ctx, question_tokens=question_len)

        def full():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

        def full_answer():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0)

        t_full = _time_ms(full, device, repeats)
        t_full_n = _time_ms(full_answer, device, max(1, repeats - 1)) if n > 1 else t_full
        rows.append(dict(base, path="full-prefill", ttft_ms=t_full, speedup=1.0, total_ms=t_full_n,
                         per_token_ms=(t_full_n - t_full) / max(n - 1, 1)))
        q = torch.tensor([question], device=device)

        def bound():
            return model(input_ids=q, use_cache=True, logits_to_keep=1).logits

        t_bound = _time_ms(bound, device, repeats)
        rows.append(dict(base, path="final block alone (bound)", ttft_ms=t_bound, speedup=t_full / t_bound))
        store = ChunkStore(model)
        keys = store.add(chunks)  # offline precompute, not timed

        def cached():
            req = store.assemble(keys, positions="reordered", extra_slots=question_len + 1)
            pos = req.next_position + torch.arange(question_len, device=device)
            return paged_forward(model, q, pos, req.cache)[-1]

        def cached_answer():
            t0 = time.perf_counter()
            req = store.assemble(keys, positions="reordered", extra_slots=question_len + n)
            return generate_paged(model, tok, req.cache, question, req.next_position, n, t0, "cached",
                                  ctx + question_len, min_new_tokens=n)

        t_cached = _time_ms(cached, device, repeats)
        t_cached_n = _time_ms(cached_answer, device, max(1, repeats - 1)) if n > 1 else t_cached
        rows.append(dict(base, path="cached (on device)", ttft_ms=t_cached, speedup=t_full / t_cached,
                         total_ms=t_cached_n, per_token_ms=(t_cached_n - t_cached) / max(n - 1, 1)))
        if device.type == "cuda":
            # the chunk KV lives in pinned host memory; the store's device pool is refilled from it
            host_k, host_v = store.pooled_kv("cpu", pin_memory=True)

            def from_host():
                store.load_pooled_kv_(host_k, host_v, non_blocking=True)
                return cached()

            t_h2d = _time_ms(from_host, device, repeats)
            rows.append(dict(base, path="cached (KV from CPU)", ttft_ms=t_h2d, speedup=t_full / t_h2d))
            del host_k, host_v
        for r in rows[-4:]:
            if r["context_tokens"] == ctx and r["num_chunks"] == num_chunks:
                r["vs_bound"] = r["ttft_ms"] / t_bound
        del store
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


class _IdTokenizer:
    """generate_paged needs only EOS/pad ids and decode; the benchmark's ids are random."""
    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def format_table(rows: List[Dict]) -> str:
    lines = ["| chunks x size | context tokens | path | TTFT (ms) | vs bound | speedup vs full prefill "
             "| per output token (ms) | total, answer (ms) |", "|---|---|---|---|---|---|---|---|"]

    def f(r, k, fmt):
        return fmt.format(r[k]) if k in r else "-"

    for r in rows:
        lines.append(f"| {r['num_chunks']} x {r['chunk_size']} | {r['context_tokens']} | {r['path']} | "
                     f"{r['ttft_ms']:.1f} | {f(r, 'vs_bound', '{:.2f}x')} | {r['speedup']:.2f}x | "
                     f"{f(r, 'per_token_ms', '{:.1f}')} | {f(r, 'total_ms', '{:.0f}')} |")
    return "\n".join(lines)


def plot(rows: List[Dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["path"] for r in rows):
        pts = sorted((r["context_tokens"], r["ttft_ms"]) for r in rows if r["path"] == name)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens (chunks x chunk size)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, choices=("smollm2", "llama3-8b-random", "tiny-random"),
                   help="default: smollm2 on the CPU, llama3-8b-random on CUDA")
    p.add_argument("--sizes", default=None, choices=tuple(SIZES), help="context set (default by device)")
    p.add_argument("--layers", type=int, default=None, help="depth override for random models")
    p.add_argument("--question-len", type=int, default=50)
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per timed answer (1: TTFT only)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per point (the best of them on the CPU, the median on CUDA)")
    p.add_argument("--out", default="bench_results/e2e")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    device = torch.device(args.device)
    if device.type == "cpu" and not torch.cuda.is_available():
        # only where no GPU exists: set in a process with CUDA (e.g. pytest calling main()), it
        # would turn every triton_kernels module imported later into interpreted kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
    model_name = args.model or ("llama3-8b-random" if device.type == "cuda" else "smollm2")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = SIZES[args.sizes or ("gpu" if device.type == "cuda" else "cpu")]
    repeats = args.repeats or (5 if device.type == "cuda" else 3)

    model = build_model(model_name, device, dtype, args.layers)
    rows = measure(model, sizes, args.question_len, repeats, answer_tokens=args.answer_tokens)
    meta = dict(model=model_name, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                dtype=str(dtype).replace("torch.", ""), question_tokens=args.question_len, repeats=repeats,
                answer_tokens=args.answer_tokens,
                date=datetime.date.today().isoformat(), torch=torch.__version__, commit=_commit(),
                threads=torch.get_num_threads())
    stat = "median" if device.type == "cuda" else "best"
    header = (f"# ragattn end-to-end TTFT\n\n- model: {meta['model']} ({meta['dtype']})\n- device: {meta['device']}"
              f" ({meta['threads']} threads)\n- question: {args.question_len} tokens; {stat} of {repeats} calls after a warm-up "
              f"(answers: {stat} of {max(1, repeats - 1)}, {args.answer_tokens} tokens)\n"
              f"- date: {meta['date']}, commit {meta['commit']}, torch {meta['torch']}\n\n")
    table = format_table(rows)
    print(header + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write(header + table + "\n\n![TTFT vs context](e2e.png)\n")
    plot(rows, os.path.join(args.out, "e2e.png"), f"TTFT, {model_name} {meta['dtype']} on {meta['device']}")
    print(f"\nsaved {args.out}/e2e.json, e2e.md, e2e.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
