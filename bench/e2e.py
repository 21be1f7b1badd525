"""End-to-end benchmark: time to first token, time per output token and the total time of an
answer against context length, full prefill vs cached chunks.

    python -m bench.e2e                                   # SmolLM2 on the CPU, CPU sizes
    python -m bench.e2e --device cuda --model llama3-8b-random --out OUT

For every context (``num_chunks x chunk_size`` tokens of random ids, plus a ``--question-len``
question) it measures the time to the first token's logits of

* ``full-prefill``: one causal forward pass (SDPA) over chunks + question (the baseline);
* ``final block alone (bound)``: the question's prefill with no context at all, the lower bound of
  any cached method's TTFT (its ``vs bound`` column is 1.00x);
* ``final block over the model's own cache``: the question's prefill continuing a transformers
  ``DynamicCache`` that already holds the whole context (computed untimed, cut back to the context
  after every call): what attending to the cached context costs the model itself, with no
  assembly and no re-rotation (the way transformers reuses a prefix cache);
* ``cached (on device)``: the chunks' KV already in the device-resident ``ChunkStore``; timed:
  gathering them into the request's paged cache with re-rotation (``copy_kv_``), then the
  question's prefill through ``paged_attention`` (Block-Attention / TurboRAG-reordered); on the
  CPU its ``assembly_ms`` is the median of the gathering alone;
* ``cached (KV from CPU)`` (CUDA only): the same, with the chunks' KV first copied from pinned
  host memory (TurboRAG's deployment, its Table 4 "with h2d").
* ``cached, zero-copy``: the same request on the store's own pages (``ChunkStore.request``: a
  page table of the chunks' shared, page-local pages and private pages for the question; RoPE
  in the attention kernel, no K/V copied).

For ``full-prefill`` and ``cached (on device)`` it also times a ``--answer-tokens`` answer (32 by
default) with ``model.generate()`` (greedy, no early stop): ``total`` is call to last token, and
``per token`` the median time between two consecutive tokens (one decode step at that context,
clocked inside generate()), with its ratio to full prefill's decode.

``--decode-rounds N`` adds the decode-step check: ``model()`` decode steps (one token each, at the
context's length) after a full prefill with the model's own ``DynamicCache`` (SDPA) against steps
after a cached assembly with the ``PagedCache`` ("ragattn"), once per CPU route of the paged
decode (``RAGATTN_HF_CPU_SDPA``: the default, ``ragattn.paged_attention``'s C++ kernel, and SDPA
over the pages). Each of
``N`` rounds (after a warm-up round) builds every path's cache afresh and runs
``--decode-steps`` steps, one step per path in turn (order rotated per step), so that a shared
machine's load falls on every path alike; median step time and its ratio to the model's own.
No ``generate()`` around the steps: the attention and the cache are all that differ.

Every figure is a median over ``--repeats`` rounds after a warm-up; each round runs every path
once, in a rotated order, so that the load of a shared machine falls on all paths alike. The
load average (``os.getloadavg``) before and after the run goes into the report.

``--memory-requests 1,4,16`` adds the memory case (no timing: bytes of the tensors held, on the
CPU): ``N`` concurrent requests over the same chunks (the largest context), each with room for the
question and the answer, through the copy path (each request's own paged cache of every chunk)
and zero-copy (the chunks' pages once, in the store; per request its private pages): the store's
chunk pages, the bytes per request, and the total.

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
from unittest import mock

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from .__main__ import _commit
from .harness import synchronize
from ragattn.store import ChunkStore
from ragattn.methods.generate import generate_paged, paged_forward

SIZES = {  # (num_chunks, chunk_size) per context
    "tiny": [(2, 16), (3, 16)],  # the pytest smoke test
    "cpu": [(2, 64), (4, 64), (4, 128), (8, 128)],
    "rag16": [(16, 42)],  # 16 retrieved passages, ~670 tokens (the end-to-end target case)
    "gpu": [(8, 512), (16, 512), (32, 512), (64, 512)],  # 4K .. 32K tokens
    "gpu-check": [(16, 512), (64, 512)],  # 8K and 32K
    "gpu-32k": [(64, 512)],  # 32K alone: scripts/gpu_check.sh's first call
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


class _StepClock(LogitsProcessor):
    """Notes the time of every generation step (generate() calls it once per new token)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores


def _timed(fn: Callable[[], object], device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _timed_answer(fn: Callable[[_StepClock], object], device):
    """(total ms, [ms between consecutive tokens]) of one answer."""
    clock = _StepClock()
    total = _timed(lambda: fn(clock), device)
    return total, [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:])]


@torch.no_grad()
def measure(model, sizes, question_len: int, repeats: int, seed: int = 0, answer_tokens: int = 32) -> List[Dict]:
    """One row per (context, path). Every figure is the median over ``repeats`` rounds after a
    warm-up; each round runs every path once, in an order rotated per round, so that a shared
    machine's load falls on all paths alike. ``per_token_ms`` is the median time between two
    consecutive tokens of the answers (the decode step at that context, read from a clock in
    generate()'s logits processors), ``total_ms`` the median time of a whole answer."""
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
        q = torch.tensor([question], device=device)
        base = dict(num_chunks=num_chunks, chunk_size=chunk_size, context_tokens=ctx, question_tokens=question_len)
        store = ChunkStore(model)
        keys = store.add(chunks)  # offline precompute, not timed

        def full():
            return model(input_ids=ids, use_cache=True, logits_to_keep=1).logits

        def full_answer(clock):
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=0,
                                  logits_processor=LogitsProcessorList([clock]))

        def bound():
            return model(input_ids=q, use_cache=True, logits_to_keep=1).logits

        own_cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :ctx], past_key_values=own_cache, use_cache=True, logits_to_keep=1)
        own_pos = torch.arange(ctx, ctx + question_len, device=device)[None]

        def over_own_cache():
            try:
                return model(input_ids=q, past_key_values=own_cache, position_ids=own_pos, use_cache=True,
                             logits_to_keep=1).logits
            finally:
                own_cache.crop(-question_len)   # back to the context alone for the next call

        assembly_ms = []

        def cached(record: bool = True):
            t0 = time.perf_counter()
            req = store.assemble(keys, positions="reordered", extra_slots=question_len + 1)
            if record and device.type == "cpu":   # on CUDA a sync here would serialise launches
                assembly_ms.append((time.perf_counter() - t0) * 1e3)
            pos = req.next_position + torch.arange(question_len, device=device)
            return paged_forward(model, q, pos, req.cache, logits_to_keep=1)[-1]

        def cached_answer(clock):
            t0 = time.perf_counter()
            req = store.assemble(keys, positions="reordered", extra_slots=question_len + n)
            return generate_paged(model, tok, req.cache, question, req.next_position, n, t0, "cached",
                                  ctx + question_len, min_new_tokens=n, logits_processor=[clock])

        def zero_copy():
            with store.request(keys, positions="reordered", extra_slots=question_len + 1) as req:
                pos = req.next_position + torch.arange(question_len, device=device)
                return paged_forward(model, q, pos, req.cache, logits_to_keep=1)[-1]

        def zero_copy_answer(clock):
            t0 = time.perf_counter()
            with store.request(keys, positions="reordered", extra_slots=question_len + n) as req:
                return generate_paged(model, tok, req.cache, question, req.next_position, n, t0, "zero-copy",
                                      ctx + question_len, min_new_tokens=n, logits_processor=[clock])

        ttft_fns = {"full-prefill": full, "final block alone (bound)": bound,
                    "final block over the model's own cache": over_own_cache, "cached (on device)": cached,
                    ZERO_COPY: zero_copy}
        answer_fns = ({"full-prefill": full_answer, "cached (on device)": cached_answer, ZERO_COPY: zero_copy_answer}
                      if n > 1 else {})
        ttft = {k: [] for k in ttft_fns}
        totals = {k: [] for k in answer_fns}
        steps = {k: [] for k in answer_fns}
        for f in list(ttft_fns.values()) + [lambda f=f: f(_StepClock()) for f in answer_fns.values()]:
            f()  # warm-up (Triton compilation, allocator)
        if device.type == "cuda":
            # the chunk KV lives in pinned host memory; the store's device pool is refilled from it.
            # Copied after the warm-up: a zero-copy request's private pages grow the pool, and a
            # copy taken before no longer matches it.
            host_k, host_v = store.pooled_kv("cpu", pin_memory=True)

            def from_host():
                store.load_pooled_kv_(host_k, host_v, non_blocking=True)
                return cached(record=False)

            ttft_fns["cached (KV from CPU)"] = from_host
            ttft["cached (KV from CPU)"] = []
            from_host()
        for r in range(repeats):
            names = list(ttft_fns)
            for k in names[r % len(names):] + names[:r % len(names)]:
                ttft[k].append(_timed(ttft_fns[k], device))
            names = list(answer_fns)
            for k in names[r % max(len(names), 1):] + names[:r % max(len(names), 1)]:
                total, gaps = _timed_answer(answer_fns[k], device)
                totals[k].append(total)
                steps[k] += gaps
        med = {k: statistics.median(v) for k, v in ttft.items()}
        t_full, t_bound = med["full-prefill"], med["final block alone (bound)"]
        for k, t in med.items():
            row = dict(base, path=k, ttft_ms=t, speedup=t_full / t, vs_bound=t / t_bound)
            if k in answer_fns:
                row.update(total_ms=statistics.median(totals[k]), per_token_ms=statistics.median(steps[k]))
            if k == "cached (on device)" and assembly_ms:
                row.update(assembly_ms=statistics.median(assembly_ms[-repeats:]))
            rows.append(row)
        if "per_token_ms" in rows[-len(med)]:
            full_tok = rows[-len(med)]["per_token_ms"]
            for row in rows[-len(med):]:
                if "per_token_ms" in row:
                    row["per_token_vs_full"] = row["per_token_ms"] / full_tok
        if device.type == "cuda":
            del host_k, host_v
        del store, own_cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


ZERO_COPY = "cached, zero-copy"
# the CPU routes of the paged decode step (RAGATTN_HF_CPU_SDPA): the default takes paged_attention;
# a zero-copy request has one route (the flag does not apply to it)
DECODE_ROUTES = {"cached, default (ragattn.paged_attention)": "auto", "cached, SDPA over the pages": "1",
                 ZERO_COPY: "zero-copy"}


@torch.no_grad()
def measure_decode_steps(model, sizes, question_len: int, rounds: int, steps: int, seed: int = 0,
                         routes: Dict[str, str] | None = None) -> List[Dict]:
    """The decode-step check (see the module docstring): one row per (context, path) with
    ``step_ms`` (median over ``rounds`` x ``steps`` steps, interleaved per step), ``vs_full`` (ratio
    of the medians) and ``vs_full_paired`` (median of the ratios of steps run back to back).
    ``routes``: path name -> ``RAGATTN_HF_CPU_SDPA`` value (default :data:`DECODE_ROUTES` on the CPU, the one CUDA path
    elsewhere)."""
    from ragattn.hf.registration import use_ragattn
    from ragattn.hf.cache import PagedCache

    device = next(model.parameters()).device
    if routes is None:
        routes = DECODE_ROUTES if device.type == "cpu" else {"cached": "1"}
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for num_chunks, chunk_size in sizes:
        chunks = [torch.randint(10, vocab, (chunk_size,), generator=gen).tolist() for _ in range(num_chunks)]
        question = torch.randint(10, vocab, (question_len,), generator=gen).tolist()
        ids = torch.tensor([sum(chunks, []) + question], device=device)
        n = ids.shape[1]
        toks = torch.randint(10, vocab, (steps, 1, 1), generator=gen).to(device)
        store = ChunkStore(model)
        keys = store.add(chunks)

        def step(cache, i):
            pos = torch.tensor([n + i], device=device)
            synchronize(device)
            t0 = time.perf_counter()
            model(input_ids=toks[i], past_key_values=cache, use_cache=True, position_ids=pos[None],
                  cache_position=pos, logits_to_keep=1)
            synchronize(device)
            return (time.perf_counter() - t0) * 1e3

        def full():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            return lambda i: step(cache, i)

        def cached(flag):
            if flag == "zero-copy":
                req = store.request(keys, positions="reordered", extra_slots=question_len + steps)
                flag = "auto"
            else:
                req = store.assemble(keys, positions="reordered", extra_slots=question_len + steps)
            paged_forward(model, torch.tensor([question], device=device),
                          req.next_position + torch.arange(question_len, device=device), req.cache)
            cache = PagedCache(req.cache, seen=n)

            def one(i, req=req):   # (holds a zero-copy request until the round's steppers go)
                with mock.patch.dict(os.environ, {"RAGATTN_HF_CPU_SDPA": flag}), use_ragattn(model):
                    return step(cache, i)
            return one

        setups = {"full-prefill (DynamicCache)": full}
        setups.update({name: (lambda f=flag: cached(f)) for name, flag in routes.items()})
        names = list(setups)
        times = {k: [] for k in names}
        for r in range(rounds + 1):   # round 0: warm-up
            stepper = {k: f() for k, f in setups.items()}
            for i in range(steps):    # one step per path in turn (order rotated): the load is shared
                for k in names[i % len(names):] + names[:i % len(names)]:
                    t = stepper[k](i)
                    if r:
                        times[k].append(t)
            del stepper
        full_ms = statistics.median(times[names[0]])
        for k in names:
            ms = statistics.median(times[k])
            paired = statistics.median(a / b for a, b in zip(times[k], times[names[0]]))
            rows.append(dict(num_chunks=num_chunks, chunk_size=chunk_size, context_tokens=n, path=k,
                             step_ms=ms, vs_full=ms / full_ms, vs_full_paired=paired, steps=len(times[k])))
        del store
    return rows


@torch.no_grad()
def measure_memory(model, num_chunks: int, chunk_size: int, question_len: int, answer_tokens: int,
                   concurrent=(1, 4, 16), seed: int = 0) -> List[Dict]:
    """The memory case: for each ``N`` in ``concurrent``, ``N`` live requests over the same chunks,
    each with the question prefilled and room for ``answer_tokens``; bytes of the tensors held
    (measured from the allocations: pool pages in use, each request's cache or private pages)."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    chunks = [torch.randint(10, vocab, (chunk_size,), generator=gen).tolist() for _ in range(num_chunks)]
    question = torch.randint(10, vocab, (question_len,), generator=gen).tolist()
    q = torch.tensor([question], device=device)
    rows = []
    for n in concurrent:
        store = ChunkStore(model)
        keys = store.add(chunks)
        page_bytes = store.page_size * store.row_bytes
        in_use = lambda: sum(s.pages - len(s.free) for s in store._pool.slabs) * page_bytes  # noqa: E731
        chunk_bytes = in_use()
        base = dict(num_chunks=num_chunks, chunk_size=chunk_size, context_tokens=num_chunks * chunk_size,
                    question_tokens=question_len, answer_tokens=answer_tokens, requests=n,
                    store_chunk_bytes=chunk_bytes, store_pool_bytes=store.pool_bytes)
        extra = question_len + answer_tokens
        copies = [store.assemble(keys, positions="reordered", extra_slots=extra) for _ in range(n)]
        for r in copies:
            paged_forward(model, q, r.next_position + torch.arange(question_len, device=device), r.cache,
                          logits_to_keep=1)
        per = [sum(t.numel() * t.element_size() for t in r.cache.k + r.cache.v) for r in copies]
        rows.append(dict(base, path="copy (assemble)", per_request_bytes=statistics.mean(per),
                         total_bytes=chunk_bytes + sum(per)))
        del copies
        reqs = [store.request(keys, positions="reordered", extra_slots=extra) for _ in range(n)]
        for r in reqs:
            paged_forward(model, q, r.next_position + torch.arange(question_len, device=device), r.cache,
                          logits_to_keep=1)
        per = [r.private_bytes for r in reqs]
        assert in_use() == chunk_bytes + sum(per)    # the chunks' pages once, plus the private ones
        rows.append(dict(base, path="zero-copy (request)", per_request_bytes=statistics.mean(per),
                         total_bytes=in_use()))
        for r in reqs:
            r.release()
        del store
    return rows


def format_memory_table(rows: List[Dict]) -> str:
    mib = 1 << 20
    lines = ["| chunks x size | concurrent requests | path | store chunk pages (MiB) | per request (MiB) "
             "| total (MiB) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['num_chunks']} x {r['chunk_size']} | {r['requests']} | {r['path']} | "
                     f"{r['store_chunk_bytes'] / mib:.2f} | {r['per_request_bytes'] / mib:.3f} | "
                     f"{r['total_bytes'] / mib:.2f} |")
    return "\n".join(lines)


def format_decode_table(rows: List[Dict]) -> str:
    lines = ["| chunks x size | slots at the first step | path | decode step (ms, median) | vs full prefill's "
             "| paired (median of step ratios) | steps |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['num_chunks']} x {r['chunk_size']} | {r['context_tokens']} | {r['path']} | "
                     f"{r['step_ms']:.2f} | {r['vs_full']:.3f}x | {r['vs_full_paired']:.3f}x | {r['steps']} |")
    return "\n".join(lines)


class _IdTokenizer:
    """generate_paged needs only EOS/pad ids and decode; the benchmark's ids are random."""
    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def format_table(rows: List[Dict]) -> str:
    lines = ["| chunks x size | context tokens | path | TTFT (ms) | of which assembly (ms) | vs bound "
             "| speedup vs full prefill | per output token (ms) | vs full prefill's | total, answer (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, k, fmt):
        return fmt.format(r[k]) if k in r else "-"

    for r in rows:
        lines.append(f"| {r['num_chunks']} x {r['chunk_size']} | {r['context_tokens']} | {r['path']} | "
                     f"{r['ttft_ms']:.1f} | {f(r, 'assembly_ms', '{:.1f}')} | {f(r, 'vs_bound', '{:.2f}x')} | "
                     f"{r['speedup']:.2f}x | "
                     f"{f(r, 'per_token_ms', '{:.1f}')} | {f(r, 'per_token_vs_full', '{:.2f}x')} | "
                     f"{f(r, 'total_ms', '{:.0f}')} |")
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
    from ragattn.bench.__main__ import command_name

    p = argparse.ArgumentParser(prog=command_name("e2e"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--model", default=None, choices=("smollm2", "llama3-8b-random", "tiny-random"),
                   help="default: smollm2 on the CPU, llama3-8b-random on CUDA")
    p.add_argument("--sizes", default=None, choices=tuple(SIZES), help="context set (default by device)")
    p.add_argument("--layers", type=int, default=None, help="depth override for random models")
    p.add_argument("--question-len", type=int, default=50)
    p.add_argument("--answer-tokens", type=int, default=32, help="tokens per timed answer (1: TTFT only)")
    p.add_argument("--repeats", type=int, default=None, help="rounds per point (each path once per round; medians reported)")
    p.add_argument("--decode-rounds", type=int, default=0,
                   help="rounds of the decode-step check (0: skip it)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per path and round")
    p.add_argument("--memory-requests", default="1,4,16",
                   help="concurrent requests of the memory case, comma-separated ('' or 0: skip it)")
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
    load_before = os.getloadavg()
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for size in sizes:  # each context's rows printed and saved as they finish: a run cut at a deadline keeps them
        part = measure(model, [size], args.question_len, repeats, answer_tokens=args.answer_tokens)
        print(format_table(part), flush=True)
        rows += part
        with open(os.path.join(args.out, "e2e.partial.json"), "w") as f:
            json.dump({"model": model_name, "commit": _commit(), "rows": rows}, f, indent=2)
    decode_rows = []
    if args.decode_rounds > 0:
        decode_rows = measure_decode_steps(model, sizes, args.question_len, args.decode_rounds,
                                           args.decode_steps)
    concurrent = [int(x) for x in args.memory_requests.split(",") if x.strip() and int(x) > 0]
    memory_rows = []
    if concurrent:
        memory_rows = measure_memory(model, *max(sizes, key=lambda s: s[0] * s[1]), args.question_len,
                                     args.answer_tokens, concurrent)
    meta = dict(model=model_name, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                dtype=str(dtype).replace("torch.", ""), question_tokens=args.question_len, repeats=repeats,
                answer_tokens=args.answer_tokens,
                date=datetime.date.today().isoformat(), torch=torch.__version__, commit=_commit(),
                threads=torch.get_num_threads(), loadavg_before=load_before, loadavg_after=os.getloadavg())
    load = " / ".join(f"{x:.1f}" for x in meta["loadavg_before"]) + " before, " + \
        " / ".join(f"{x:.1f}" for x in meta["loadavg_after"]) + " after (1 / 5 / 15 min)"
    header = (f"# ragattn end-to-end: TTFT, time per output token, answer time\n\n- model: {meta['model']} ({meta['dtype']})\n- device: {meta['device']}"
              f" ({meta['threads']} threads; load average {load})\n- question: {args.question_len} tokens; "
              f"median of {repeats} interleaved rounds after a warm-up ({args.answer_tokens}-token answers)\n"
              f"- date: {meta['date']}, commit {meta['commit']}, torch {meta['torch']}\n\n")
    table = format_table(rows)
    if decode_rows:
        table += (f"\n\nDecode-step check ({args.decode_rounds} rounds x {args.decode_steps} `model()` "
                  f"steps per path, the paths' steps interleaved, no generate()):\n\n" + format_decode_table(decode_rows))
    if memory_rows:
        table += ("\n\nMemory per request (bytes of the tensors held, measured on the CPU; each request has "
                  "its question prefilled and room for the answer):\n\n" + format_memory_table(memory_rows))
    print(header + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "decode_steps": decode_rows, "memory": memory_rows}, f, indent=2)
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write(header + table + "\n\n![TTFT vs context](e2e.png)\n")
    plot(rows, os.path.join(args.out, "e2e.png"), f"TTFT, {model_name} {meta['dtype']} on {meta['device']}")
    print(f"\nsaved {args.out}/e2e.json, e2e.md, e2e.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
