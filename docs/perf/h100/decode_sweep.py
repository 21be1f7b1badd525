"""Sweep paged decode launch configs on the GPU at hand (ad-hoc, for the split heuristic)."""
import dataclasses, itertools, json, math, sys, time, os
import torch, triton
from triton.testing import do_bench
sys.path.insert(0, os.getcwd())
from triton_kernels import paged_attention as pa

dev = torch.device("cuda")
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 80.0
out_path = sys.argv[2] if len(sys.argv) > 2 else "/tmp/sweep.jsonl"
t_start = time.time()
gen = torch.Generator().manual_seed(0)
I32 = torch.int32
rows = []

def case(batch, ctx, heads=32, kv_heads=8, d=128, page=16, window=-1):
    pages = math.ceil(ctx / page)
    perm = torch.randperm(batch * pages, generator=gen).to(I32)
    bt = perm.view(batch, pages).to(dev)
    k = torch.randn(batch * pages, page, kv_heads, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(batch * pages, page, kv_heads, d, device=dev, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
    q_pos = torch.full((batch,), ctx - 1, dtype=I32, device=dev)
    cu = torch.arange(batch + 1, dtype=I32, device=dev)
    kv_lens = torch.full((batch,), ctx, dtype=I32, device=dev)
    lo = 0 if window < 0 else ctx - window
    kc = k[bt.long()].reshape(batch, -1, kv_heads, d)[:, lo:ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(batch, -1, kv_heads, d)[:, lo:ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True), warmup=10, rep=40)
    del kc, vc
    return dict(batch=batch, ctx=ctx, heads=heads, kv_heads=kv_heads, d=d, page=page, window=window,
                k=k, v=v, q=q, q_pos=q_pos, cu=cu, bt=bt, kv_lens=kv_lens, sdpa_ms=sdpa)

def run(c, plan):
    wl = c["window"] - 1 if c["window"] > 0 else -1
    return lambda: pa.run_paged_attention(plan, c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"], None, wl)

def sweep(c, splits_l, bn_l, warps_l, stages_l, tag):
    wl = c["window"] - 1 if c["window"] > 0 else -1
    base = pa.plan_paged_attention(c["cu"], c["kv_lens"], num_heads=c["heads"], num_kv_heads=c["kv_heads"], head_dim=c["d"],
                                   dtype=torch.bfloat16, window_left=wl)
    ref = run(c, base)()[0].float()
    t0 = do_bench(run(c, base), warmup=10, rep=40)
    span = c["ctx"] if wl < 0 else c["window"]
    kvb = 2.0 * c["batch"] * span * c["kv_heads"] * c["d"] * 2
    print(f"[{tag}] default splits={base.num_splits} bn={base.block_n} w={base.num_warps} st={base.num_stages}: {t0*1e3:.0f} us "
          f"({kvb / (t0 * 1e-3) / 1e9:.0f} GB/s); sdpa {c['sdpa_ms']*1e3:.0f} us", flush=True)
    rows.append(dict(tag=tag, default=True, splits=base.num_splits, bn=base.block_n, warps=base.num_warps, stages=base.num_stages,
                     us=t0 * 1e3, sdpa_us=c["sdpa_ms"] * 1e3, gbs=kvb / (t0 * 1e-3) / 1e9))
    best = (t0, "default")
    for bn, w, st, s in itertools.product(bn_l, warps_l, stages_l, splits_l):
        if time.time() - t_start > budget:
            print("budget reached", flush=True); return
        split_span = span if wl < 0 else c["window"]
        split_len = triton.cdiv(triton.cdiv(split_span, s), bn) * bn
        ns = max(1, triton.cdiv(split_span, split_len))
        plan = dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=st, num_splits=ns, split_len=split_len)
        try:
            o = run(c, plan)()[0].float()
            err = (o - ref).abs().max().item()
            t = do_bench(run(c, plan), warmup=5, rep=25)
        except Exception as e:  # noqa
            print(f"  bn={bn} w={w} st={st} s={s}: {type(e).__name__} {str(e)[:80]}", flush=True); continue
        rows.append(dict(tag=tag, splits=ns, bn=bn, warps=w, stages=st, us=t * 1e3, err=err, gbs=kvb / (t * 1e-3) / 1e9))
        if t < best[0]:
            best = (t, f"bn={bn} w={w} st={st} s={ns}")
        print(f"  bn={bn} w={w} st={st} s={ns}: {t*1e3:.0f} us {kvb / (t * 1e-3) / 1e9:.0f} GB/s err {err:.1e}", flush=True)
    print(f"[{tag}] best {best[1]}: {best[0]*1e3:.0f} us", flush=True)

c = case(32, 32768)
sweep(c, [4, 8, 16, 32], [16, 32, 64], [4, 2], [2, 3, 4], "b32_ctx32k")
del c
c = case(32, 32768, window=4096)
sweep(c, [2, 4, 8, 16], [32, 64], [4], [3], "b32_ctx32k_win4096")
del c
c = case(4, 32768)
sweep(c, [8, 16, 32, 64], [32, 64], [4], [3], "b4_ctx32k")
del c
c = case(128, 4096)
sweep(c, [1, 2, 4, 8], [32, 64], [4], [3], "b128_ctx4k")
with open(out_path, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
print("sweep done in", round(time.time() - t_start), "s")
