"""One served step's attention, ragattn's vLLM backend against vLLM's CPU_ATTN ops, at SmolLM2's
shapes (30 layers, 9 query heads, 3 KV heads, head dim 64, vLLM's CPU block size 128, float32):
where ``bench.served``'s ragattn rows spend their attention time. Run in the vLLM environment:

    .venv-vllm/bin/python -m bench.vllm_attention_step [--threads 1] [--repeats 20] [--cases decode]

Per case (decode rows of 1 and 4 requests over 1.6K and 3.1K-token contexts; a 1.5K-token
prefill), the median time (every part of both backends called in turn, ``--repeats`` rounds) of:
the step's metadata (ragattn: ``RagattnAttentionMetadataBuilder.build``, the ``PageTable`` and
``PagedAttentionStep``; vLLM: ``cpu_attn_get_scheduler_metadata``), then per layer the cache
write (ragattn: ``do_kv_cache_update``'s indexing; vLLM: ``cpu_attn_reshape_and_cache``) and
the attention (ragattn: ``forward``; vLLM: ``cpu_attention_with_kv_cache``), times the layers;
and the torch profiler's top operators of one ragattn step. Only the attention: the model's
linear layers, the same on both servers, are not here.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

LAYERS, H, HKV, D, BLOCK = 30, 9, 3, 64, 128
CASES = {  # name: (context per request, query rows per request, requests)
    "decode, 1584-token context": (1584, 1, 1), "decode, 1584-token context, 4 requests": (1584, 1, 4),
    "decode, 3114-token context": (3114, 1, 1), "decode, 3114-token context, 4 requests": (3114, 1, 4),
    "prefill, 1584 tokens": (1584, 1584, 1)}
PROFILED = ("decode, 3114-token context", "prefill, 1584 tokens")   # the torch profiler's tables


def _interleaved_ms(parts: dict, repeats: int) -> dict:
    """``{name: median ms}`` of every callable of ``parts``, called in turn ``repeats`` times
    (after one warm-up call each), so the machine's load falls on each alike."""
    for fn in parts.values():
        fn()
    times = {name: [] for name in parts}
    for _ in range(repeats):
        for name, fn in parts.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _inputs(seq_len: int, q_len: int, reqs: int):
    """``reqs`` requests of ``seq_len`` tokens on scattered blocks, each with its last ``q_len``
    tokens as this step's rows: (blocks in the pool, vLLM's metadata, q, k, v)."""
    g = torch.Generator().manual_seed(0)
    blocks = (seq_len + BLOCK - 1) // BLOCK
    table = torch.randperm(reqs * blocks + 2, generator=g)[:reqs * blocks].to(torch.int32).view(reqs, blocks)
    pos = torch.arange(seq_len - q_len, seq_len)
    slots = (table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).reshape(-1)
    n = reqs * q_len
    meta = SimpleNamespace(causal=True, num_actual_tokens=n, num_reqs=reqs,
                           query_start_loc=torch.arange(0, n + 1, q_len, dtype=torch.int32),
                           seq_lens=torch.full((reqs,), seq_len, dtype=torch.int32), block_table_tensor=table,
                           max_query_len=q_len, max_seq_len=seq_len, slot_mapping=slots)
    q = torch.randn(n, H, D, generator=g)
    k = torch.randn(n, HKV, D, generator=g)
    v = torch.randn(n, HKV, D, generator=g)
    return reqs * blocks + 2, meta, q, k, v


def ragattn_step(seq_len: int, q_len: int, reqs: int):
    """The ragattn backend's (metadata, cache write, attention) callables, and one whole step."""
    from ragattn.vllm.backend import RagattnAttentionImpl, RagattnAttentionMetadataBuilder

    nb, m, q, k, v = _inputs(seq_len, q_len, reqs)
    cache = torch.randn(nb, BLOCK, HKV, 2 * D).transpose(1, 2)     # LBNHC: memory [B, N, Hkv, 2D]
    impl = RagattnAttentionImpl(H, D, D ** -0.5, HKV, None, None, "auto")
    builder = RagattnAttentionMetadataBuilder(None, [], None, torch.device("cpu"))
    out = torch.empty(q.shape[0], H * D)
    meta = builder.build(0, m)
    return {"metadata": lambda: builder.build(0, m),
            "cache write": lambda: impl.do_kv_cache_update(None, k, v, cache, m.slot_mapping),
            "attention": lambda: impl.forward(None, q, k, v, cache, meta, out)}, \
        lambda: _ragattn_layers(builder, impl, m, q, k, v, cache, out)


def _ragattn_layers(builder, impl, m, q, k, v, cache, out):
    meta = builder.build(0, m)
    for _ in range(LAYERS):
        impl.do_kv_cache_update(None, k, v, cache, m.slot_mapping)
        impl.forward(None, q, k, v, cache, meta, out)


def vllm_step(seq_len: int, q_len: int, reqs: int) -> dict:
    """vLLM CPU_ATTN's (metadata, cache write, attention) callables."""
    from vllm import _custom_ops as ops

    nb, m, q, k, v = _inputs(seq_len, q_len, reqs)
    cache = torch.randn(nb, HKV, BLOCK, 2 * D)                        # LBHNC, as CPU_ATTN asks
    key_cache, value_cache = cache.view(nb, HKV, BLOCK * 2, D).chunk(2, dim=2)
    out = torch.empty(q.shape[0], H * D)

    def metadata():
        return ops.cpu_attn_get_scheduler_metadata(
            num_reqs=reqs, num_heads=H, num_kv_heads=HKV, head_dim=D, seq_lens=m.seq_lens, dtype=torch.float32,
            query_start_loc=m.query_start_loc, causal=True, sliding_window_size=-1, isa="vec",
            enable_kv_split=False)

    sched = metadata()

    def attend():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out.view(q.shape[0], H, D),
            query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, scale=D ** -0.5, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=m.block_table_tensor, softcap=0.0,
            scheduler_metadata=sched, s_aux=None)

    return {"metadata": metadata,
            "cache write": lambda: ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, m.slot_mapping, "vec"),
            "attention": attend}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_attention_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--cases", default="", help="only the cases whose name contains this text")
    p.add_argument("--no-profile", action="store_true", help="no torch profiler tables")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    import os

    print(f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; ms, median of "
          f"{a.repeats}; a step = metadata + {LAYERS} x (cache write + attention)\n")
    print("| case | backend | metadata | cache write (per layer) | attention (per layer) | step |")
    print("|---|---|---:|---:|---:|---:|")
    profiles = {}
    with torch.inference_mode():
        for name, (seq_len, q_len, reqs) in CASES.items():
            if a.cases not in name:
                continue
            ours, profiles[name] = ragattn_step(seq_len, q_len, reqs)
            parts = {("vLLM CPU_ATTN", k): f for k, f in vllm_step(seq_len, q_len, reqs).items()}
            parts.update({("ragattn", k): f for k, f in ours.items()})
            t = _interleaved_ms(parts, a.repeats)
            for backend in ("vLLM CPU_ATTN", "ragattn"):
                r = {k: t[(backend, k)] for k in ("metadata", "cache write", "attention")}
                step = r["metadata"] + LAYERS * (r["cache write"] + r["attention"])
                print(f"| {name} | {backend} | {r['metadata']:.3f} | {r['cache write']:.3f} | "
                      f"{r['attention']:.3f} | {step:.1f} |")
        for name, run in profiles.items():
            if a.no_profile or name not in PROFILED:
                continue
            run()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run()
            print(f"\nragattn, {name}: one step's operators (torch profiler)\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
