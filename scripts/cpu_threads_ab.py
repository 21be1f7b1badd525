"""One-off A/B, kept for the commands docs/perf/cpu-micro.md records (not part of the benchmark suite).

The extension's C++ CPU kernels at 1 and 2 threads, interleaved: each round runs every case at
``torch.set_num_threads(1)`` and at 2 (order alternated per round), so a change of load on the
shared machine moves both; medians over the rounds.

    OMP_NUM_THREADS=2 python scripts/cpu_threads_ab.py [rounds]

Cases, at SmolLM2-135M's shapes (30 layers, 9 heads, 3 KV heads, head_dim 64, fp32):
  assemble           ``ChunkStore.assemble`` of 16 chunks x 42 tokens, reordered (re-rotated), as
                     bench.e2e's cached path calls it (a random model of that shape: only its
                     config is used)
  copy_kv_+rotate    the assembly's one ``copy_kv_`` alone (672 rows, one delta per chunk)
  copy_kv_           the same without rotation
  rerotate_keys_     the 672 rows of the 30 K layers in place
  paged decode       ``paged_attention`` of one row at slot 691 (692 slots, pages of 16)
  paged 51 rows      51 scattered query rows against the same cache
  paged prefill      1,638 causal rows over 1,638 slots (rows of growing cost: the threads' balance)
  varlen prefill     ``varlen_attention``, the same 1,638 causal rows
  tagged decode      ``run_paged_attention`` of one row over zero-copy entries (16 chunks of 42 tokens,
                     pages of 16 holding page-local keys, RoPE in the kernel; 3 kv heads: split-KV)
  tagged 259 rows    259 scattered rows over 1,638 tagged slots (the rows-GEMM route of a recompute)
  torch copy_        control: torch's contiguous copy of the same 31 MB. When it does not speed up
                     at 2 threads, the machine does not have two free cores and the other rows'
                     2-thread figures say nothing about the kernels.
A serial build (without OpenMP) shows 1.0x everywhere but the control. Before/after: run it from
two checkouts alternately.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch


def cases():
    import ragattn
    from ragattn.hf.models import random_llama
    from ragattn.store import ChunkStore

    L, H, Hkv, D, chunk, n_chunks, page = 30, 9, 3, 64, 42, 16, 16
    gen = torch.Generator().manual_seed(0)
    cfg = dict(hidden_size=16 * H, intermediate_size=64, num_hidden_layers=L, num_attention_heads=H,
               num_key_value_heads=Hkv, head_dim=D, vocab_size=1000, max_position_embeddings=8192,
               rope_theta=100000.0)
    store = ChunkStore(random_llama(cfg, dtype=torch.float32, seed=0))
    keys = store.add([torch.randint(10, 1000, (chunk,), generator=gen).tolist() for _ in range(n_chunks)])

    n = n_chunks * chunk
    src_k = [torch.randn(n, Hkv, D, generator=gen) for _ in range(L)]
    src_v = [torch.randn(n, Hkv, D, generator=gen) for _ in range(L)]
    pages = (n + 20) // page + 1
    dst_k = [torch.randn(pages, page, Hkv, D, generator=gen) for _ in range(L)]
    dst_v = [torch.randn(pages, page, Hkv, D, generator=gen) for _ in range(L)]
    rows = torch.arange(n)
    delta = (rows // chunk * chunk).int()  # chunk i moves by its start, as the assembly
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    big_src = torch.randn(2 * L * n * Hkv * D, generator=gen)
    big_dst = torch.empty_like(big_src).fill_(1.0)

    ctx = n + 20
    q1 = torch.randn(1, H, D, generator=gen)
    kv_lens = torch.tensor([ctx], dtype=torch.int32)
    block_table = torch.randperm(pages, generator=gen)[None].int()
    pos1, cu1 = torch.tensor([ctx - 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    qs = torch.randn(51, H, D, generator=gen)
    pos_s = torch.randperm(ctx, generator=gen)[:51].sort().values.int()
    cu_s = torch.tensor([0, 51], dtype=torch.int32)
    long = _long_cases(gen, H, Hkv, D, page, inv_freq)
    return {
        "assemble (ms)": lambda: store.assemble(keys, positions="reordered", extra_slots=21),
        "copy_kv_+rotate (ms)": lambda: ragattn.copy_kv_(dst_k, dst_v, src_k, src_v, rows, rows, delta, inv_freq,
                                                         D, False),
        "copy_kv_ (ms)": lambda: ragattn.copy_kv_(dst_k, dst_v, src_k, src_v, rows, rows),
        "rerotate_keys_ (ms)": lambda: ragattn.rerotate_keys_(src_k, rows, delta, inv_freq, D, False),
        "paged decode (us)": lambda: ragattn.paged_attention(q1, pos1, cu1, dst_k[0], dst_v[0], block_table,
                                                             kv_lens),
        "paged 51 rows (us)": lambda: ragattn.paged_attention(qs, pos_s, cu_s, dst_k[0], dst_v[0], block_table,
                                                              kv_lens),
        **long,
        "control: torch copy_ (ms)": lambda: big_dst.copy_(big_src),
    }


def _long_cases(gen, H, Hkv, D, page, inv_freq):
    """The attention kernels where the threads' balance matters: causal prefill rows (cost grows
    with position), a decode row over zero-copy entries (3 items: split-KV), a recompute's rows."""
    import ragattn
    from ragattn import PageTable
    from ragattn.ops.paged_kernels import rope_position_table

    n = 1638
    pages = (n + page - 1) // page
    k = torch.randn(pages, page, Hkv, D, generator=gen)
    v = torch.randn(pages, page, Hkv, D, generator=gen)
    q = torch.randn(n, H, D, generator=gen)
    pos = torch.arange(n, dtype=torch.int32)
    cu = torch.tensor([0, n], dtype=torch.int32)
    bt, lens = torch.arange(pages, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32)
    kf, vf = k.reshape(-1, Hkv, D)[:n], v.reshape(-1, Hkv, D)[:n]
    # zero-copy entries: 16 chunks of 42 tokens (pages of 16: 16, 16, 10 valid slots) and a
    # 50-token question, each entry's slot 0 at its position
    first, valid, at = [], [], 0
    for c in [42] * 16 + [50]:
        for e in range(0, c, page):
            first.append(at + e)
            valid.append(min(page, c - e))
        at += c
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    table = PageTable.from_entries(t([0, len(first)]), t(list(range(len(first)))), t(first), t(valid), page)
    cos, sin = rope_position_table(inv_freq, at)
    rows = torch.randperm(at, generator=gen)[:259].sort().values.int()

    def tagged(q_rows, q_pos):  # the C++ kernel itself (without run_paged_attention's per-call checks)
        return torch.ops.ragattn._paged_attention_tagged_cpu(
            q_rows, q_pos, t([0, q_rows.shape[0]]), k, v, table.pages, table.row_start, table.kv_lens,
            table.entry_pos, table.entry_len, None, cos, sin, D, False, D ** -0.5, -1, 0.0)
    return {
        "paged prefill (ms)": lambda: ragattn.paged_attention(q, pos, cu, k, v, bt, lens),
        "varlen prefill (ms)": lambda: ragattn.varlen_attention(q, kf, vf, cu, cu, causal=True),
        "tagged decode (us)": lambda: tagged(q[:1], t([at - 1])),
        "tagged 259 rows (ms)": lambda: tagged(q[:259], rows),
    }


@torch.inference_mode()
def main(rounds: int = 30) -> None:
    fns = cases()
    before = torch.get_num_threads()
    samples = {(k, t): [] for k in fns for t in (1, 2)}
    try:
        for r in range(rounds + 1):  # round 0: warm-up
            for name, f in fns.items():
                for t in ((1, 2) if r % 2 else (2, 1)):
                    torch.set_num_threads(t)
                    f()  # untimed: the first parallel region after a change of thread count resizes
                    # OpenMP's team (about as long as a decode call itself)
                    t0 = time.perf_counter()
                    f()
                    if r:
                        samples[(name, t)].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    for name in fns:
        scale = 1e6 if "(us)" in name else 1e3
        a, b = (statistics.median(samples[(name, t)]) * scale for t in (1, 2))
        print(f"{name:28s} 1 thread {a:9.2f}   2 threads {b:9.2f}   speedup {a / b:.2f}x", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
