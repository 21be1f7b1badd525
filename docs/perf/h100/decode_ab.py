"""A/B on the GPU: page ids per slot (mode 0) vs per page (auto), at a few decode configs; SDPA alongside."""
import dataclasses, math, sys, os, time
import torch, triton
from triton.testing import do_bench
sys.path.insert(0, os.getcwd())
import ragattn.triton_kernels.paged_attention as pa
dev = torch.device("cuda"); gen = torch.Generator().manual_seed(0); I32 = torch.int32
auto_mode = pa.page_mode
def case(batch, ctx, window=-1, heads=32, kv_heads=8, d=128, page=16):
    pages = math.ceil(ctx / page)
    bt = torch.randperm(batch * pages, generator=gen).to(I32).view(batch, pages).to(dev)
    k = torch.randn(batch * pages, page, kv_heads, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, heads, d, device=dev, dtype=torch.bfloat16)
    q_pos = torch.full((batch,), ctx - 1, dtype=I32, device=dev); cu = torch.arange(batch + 1, dtype=I32, device=dev)
    kv_lens = torch.full((batch,), ctx, dtype=I32, device=dev)
    lo = 0 if window < 0 else ctx - window
    kc = k[bt.long()].reshape(batch, -1, kv_heads, d)[:, lo:ctx].transpose(1, 2).contiguous()
    vc = v[bt.long()].reshape(batch, -1, kv_heads, d)[:, lo:ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    sd = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True), warmup=10, rep=50)
    del kc, vc
    wl = window - 1 if window > 0 else -1
    base = pa.plan_paged_attention(cu, kv_lens, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, dtype=torch.bfloat16, window_left=wl)
    span = ctx if window < 0 else window
    gb = 2.0 * batch * span * kv_heads * d * 2 / 1e9
    print(f"== b{batch} ctx{ctx} win{window}: sdpa {sd*1e3:.0f} us ({gb/sd*1e3:.0f} GB/s); default plan {base.launch()}", flush=True)
    ref = pa.run_paged_attention(base, q, q_pos, cu, k, v, bt, kv_lens, None, wl)[0].float()
    for bn, w, st in [(base.block_n, base.num_warps, base.num_stages), (64, 2, 2), (64, 4, 2), (32, 4, 3), (128, 4, 3)]:
        split_len = triton.cdiv(triton.cdiv(span + bn, base.num_splits), bn) * bn
        plan = dataclasses.replace(base, block_n=bn, num_warps=w, num_stages=st, split_len=split_len,
                                   num_splits=max(1, triton.cdiv(span + bn, split_len)))
        for mode in ("auto", "per-slot"):
            pa.page_mode = auto_mode if mode == "auto" else (lambda *a: 0)
            f = lambda: pa.run_paged_attention(plan, q, q_pos, cu, k, v, bt, kv_lens, None, wl)
            try:
                err = (f()[0].float() - ref).abs().max().item()
                t = do_bench(f, warmup=5, rep=30)
                print(f"  bn={bn} w={w} st={st} splits={plan.num_splits} {mode}: {t*1e3:.0f} us ({gb/t*1e3:.0f} GB/s, {sd/t:.2f}x sdpa) err {err:.1e}", flush=True)
            except Exception as e:
                print(f"  bn={bn} w={w} st={st} {mode}: {type(e).__name__} {str(e)[:100]}", flush=True)
        pa.page_mode = auto_mode
t0 = time.time()
for args in [(32, 32768), (32, 32768, 4096), (4, 32768), (128, 4096)]:
    case(*args)
print("ab done in", round(time.time() - t0), "s")
