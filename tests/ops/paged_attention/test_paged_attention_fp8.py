"""paged_attention over fp8 KV caches (per-tensor k/v scales) against the float64 reference."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn import PageTable, run_paged_attention
from tests.helpers import use_kernel_backend
from tests.ops.paged_attention.test_paged_attention import check_against_reference

from tests.ops.paged_attention.test_paged_attention_plan import _plan, backend, make_csr_case, triton_backend  # noqa: F401 (fixtures)
from tests.ops.paged_attention.test_paged_attention_tagged import _table_refs, make_tagged_case


# ----------------------------------------------------------------------- fp8 caches

@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_caches_with_scales(backend, device, seed, fp8):
    """vLLM's fp8 KV caches (per-tensor k/v scales): the kernel dequantises what it loads; vs the
    float64 reference over the dequantised caches, with the precision rule (the low-precision
    baseline dequantises into q's dtype, as the kernel feeds its dots), plain and position-tagged
    with in-kernel RoPE."""
    from tests.helpers import assert_precision

    c = make_csr_case([[33], [4, 9, 17]], [34, 18], num_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.bfloat16, device=device)
    ks, vs = torch.tensor([0.05], device=device), torch.tensor(0.03, device=device)
    k8, v8 = (c["k"].float() / ks).to(fp8), (c["v"].float() / vs).to(fp8)
    k_deq, v_deq = k8.double() * ks.double(), v8.double() * vs.double()
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8)
    plan = _plan(c, table, num_splits=2 if backend == "triton" else None)
    out, lse = run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=ks, v_scale=vs)
    from ragattn.reference.paged_attention import paged_attention as ref_paged

    cpu = lambda t: t.cpu()  # noqa: E731
    idx = (cpu(c["q_pos"]), cpu(c["cu"]))
    bt, kvl = cpu(c["bt"]), cpu(c["kv_lens"])
    o64, l64 = ref_paged(cpu(c["q"]).double(), *idx, cpu(k_deq), cpu(v_deq), bt, kvl)
    olp, llp = ref_paged(cpu(c["q"]), *idx, cpu(k_deq).to(torch.bfloat16), cpu(v_deq).to(torch.bfloat16), bt, kvl,
                         compute_dtype=torch.bfloat16)
    assert_precision(out.cpu(), o64, olp)
    assert_precision(lse.cpu(), l64, llp, what="lse")
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        run_paged_attention(plan, c["q"], c["q_pos"], k8, v8)
    with pytest.raises(ValueError, match="go together"):
        run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=ks)
    with pytest.raises(ValueError, match="one per-tensor scale"):
        run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=ks.expand(2), v_scale=vs)


def test_fp8_tagged_pages_under_bf16_queries(triton_backend, device):
    """bf16 queries over an fp8 cache (vLLM's usual pairing) of position-tagged pages, GQA 8, d128,
    chunks over several key tiles: the kernel within the precision rule of the same computation with
    the dequantised K/V rounded to bf16 (the table reference keeps fp32 softmax statistics: a tight
    bar for the lse). The interpreter's fp32 -> bf16 cast truncates (twice the error of
    round-to-nearest), so there the kernel keeps dequantised tiles in fp32, as it does a rotated key;
    rounding them failed the rule on about half of all inputs (fixed seeds here)."""
    from ragattn.reference.paged_attention_table import paged_attention_table
    from tests.helpers import assert_precision, poison_like

    for s in range(3):
        torch.manual_seed(s)
        q, q_pos, cu, k, v, table = make_tagged_case([70, 9, 40], "gapped", page_size=16, num_heads=8,
                                                     num_kv_heads=1, head_dim=128, dtype=torch.bfloat16,
                                                     device=device, gen=torch.Generator().manual_seed(s))
        ks, vs = torch.tensor(0.04, device=device), torch.tensor(0.02, device=device)
        k8, v8 = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
        k_deq, v_deq = (k8.double() * ks.double()).cpu(), (v8.double() * vs.double()).cpu()
        out, lse = poison_like(q), poison_like(q[..., 0].float())
        run_paged_attention(_plan(dict(cu=cu, q=q, k=k), table), q, q_pos, k8, v8, k_scale=ks, v_scale=vs, out=out,
                            lse_out=lse)
        t = [x.cpu() for x in (table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len)]
        a = (q.cpu(), q_pos.cpu(), cu.cpu())
        o64, l64 = paged_attention_table(*a, k_deq, v_deq, *t, None, 0, False)
        olp, llp = paged_attention_table(*a, k_deq.bfloat16(), v_deq.bfloat16(), *t, None, 0, False, upcast=False)
        assert_precision(out.cpu(), o64, olp, what=f"out (seed {s})")
        assert_precision(lse.cpu(), l64, llp, what=f"lse (seed {s})")


def test_fp8_tagged_pages_with_rope(backend, device, seed):
    from ragattn.reference.paged_attention_table import paged_attention_table
    from tests.helpers import assert_precision

    q, q_pos, cu, k, v, table = make_tagged_case([9, 14], "composite", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float16, device=device)
    ks, vs = torch.tensor(0.04, device=device), torch.tensor(0.02, device=device)
    k8, v8 = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(device)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    out, lse = run_paged_attention(plan, q, q_pos, k8, v8, inv_freq=inv_freq, k_scale=ks, v_scale=vs)
    t = [x.cpu() if torch.is_tensor(x) else x for x in (table.pages, table.row_start, table.kv_lens, table.entry_pos,
                                                         table.entry_len)]
    k_deq, v_deq = (k8.double() * ks.double()).cpu(), (v8.double() * vs.double()).cpu()
    a = (q.cpu(), q_pos.cpu(), cu.cpu())
    o64, l64 = paged_attention_table(*a, k_deq, v_deq, *t, inv_freq.cpu(), 64, False)
    olp, llp = paged_attention_table(*a, k_deq.half(), v_deq.half(), *t, inv_freq.cpu(), 64, False, upcast=False)
    assert_precision(out.cpu(), o64, olp)
    assert_precision(lse.cpu(), l64, llp, what="lse")


def test_soft_cap_through_the_run(backend, device, seed):
    """logits_soft_cap (Gemma 2/3) on the plan/run pair: equal to the one-call op over the padded
    table, and on position-tagged pages equal to the float64 reference's capped scores."""
    c = make_csr_case([[20], [3, 9]], [21, 10], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.float32, device=device)
    plan = _plan(c, PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8))
    out, lse = run_paged_attention(plan, c["q"] * 4, c["q_pos"], c["k"], c["v"], logits_soft_cap=2.5)
    want = ragattn.paged_attention(c["q"] * 4, c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"],
                                   logits_soft_cap=2.5)
    torch.testing.assert_close(out, want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, want[1], atol=2e-5, rtol=2e-5)
    plain = run_paged_attention(plan, c["q"] * 4, c["q_pos"], c["k"], c["v"])
    assert (plain[1] - lse).abs().max() > 1e-2, "the cap must change the result"
    from ragattn.reference.paged_attention_table import paged_attention_table

    q, q_pos, cu, k, v, table = make_tagged_case([7, 12], "gapped", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=device)
    got = run_paged_attention(_plan(dict(cu=cu, q=q, k=k), table), q * 4, q_pos, k, v, logits_soft_cap=1.5)
    t = [x.cpu() for x in (table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len)]
    o64, l64 = paged_attention_table((q * 4).cpu(), q_pos.cpu(), cu.cpu(), k.cpu(), v.cpu(), *t, None, 0, False,
                                     None, -1, 1.5)
    torch.testing.assert_close(got[0].cpu().double(), o64, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got[1].cpu().double(), l64.double(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("page_size,mode", [(5, 0), (16, 1), (64, 2), (128, 2)])
def test_every_page_mode_of_the_kernel(triton_backend, device, seed, page_size, mode):
    """The kernel reads the page list once per slot (page sizes that are not powers of two), once per
    page (pages smaller than a key tile) or once per tile (pages holding whole tiles: page ids
    loaded once per page): each mode, with windows that start inside a page, split-KV
    partitions, an uneven head dim and position-tagged entries, against the reference."""
    import ragattn.triton_kernels.paged_attention as pa

    kv_lens = [300, 1, 130, 0, 77]
    q_positions = [[299, 150, 3], [0], [129], [], [76, 40]]
    for head_dim, dtype in ((64, torch.float16), (80, torch.bfloat16)):
        c = make_csr_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                          page_size=page_size, dtype=dtype, device=device)
        args = (c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"])
        table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], page_size)
        for window_left, splits in ((-1, 1), (37, 3), (5, 2)):
            plan = _plan(c, table, window_left, num_splits=splits)
            block_n, split_len = plan.launch[1], plan.launch[6]
            assert pa.page_mode(page_size, block_n, split_len) == mode
            out = torch.full_like(c["q"], float("nan"))
            lse = torch.full(c["q"].shape[:2], float("nan"), device=device)
            run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"], out=out, lse_out=lse)
            check_against_reference(args, out, lse, window_left)
    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([70, 9, 140], "gapped", page_size=page_size, num_heads=4,
                                                 num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device,
                                                 gen=gen)
    for window_left in (-1, 10):
        plan = _plan(dict(cu=cu, q=q, k=k), table, window_left, num_splits=2)
        out, lse = run_paged_attention(plan, q, q_pos, k, v)
        (o64, l64), (olp, llp) = _table_refs(*(x.cpu() for x in (q, q_pos, cu, k, v)),
                                             PageTable(*(None if x is None else x.cpu() for x in (
                                                 table.pages, table.kv_lens, table.row_start, table.entry_pos,
                                                 table.entry_len))), window_left, (None, 0, False))
        from tests.helpers import assert_precision

        assert_precision(out.cpu(), o64, olp)
        assert_precision(lse.cpu(), l64, llp, what="lse")


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype,rotary_dim,interleaved,page_size,fp8", [
    (1, 1, 96, torch.bfloat16, 96, False, 16, False),  # GQA 1, d96 (a padded tile), NeoX; page ids per page
    (8, 1, 128, torch.float16, 64, True, 64, True),    # GQA 8, partial GPT-J, fp8 cache; one page a key tile
    (8, 2, 256, torch.float32, 256, False, 5, False),  # GQA 4, d256; page ids per slot
    (16, 2, 80, torch.bfloat16, 48, True, 8, False),   # GQA 8, d80, partial GPT-J
])
@pytest.mark.parametrize("kernel", ["default", "triton"])
def test_tagged_pages_across_gqa_and_head_dims(kernel, monkeypatch, device, seed, num_heads, num_kv_heads, head_dim,
                                              dtype, rotary_dim, interleaved, page_size, fp8):
    """Position-tagged pages with in-kernel RoPE at GQA 1/4/8 and head dims 80/96/128/256
    (rotation partners inside a padded head-dim tile, partial rotary dims), a chunk spanning several
    key tiles, gapped positions, an fp8 cache, a 19-token question (several of the C++ kernel's
    16-vector row blocks); Triton: page ids read per slot, page or tile, split-KV; with a window;
    NaN past each entry's valid count and in unused pages, outputs poisoned; vs the float64
    reference with the precision rule."""
    from ragattn.reference.paged_attention_table import paged_attention_table
    from tests.helpers import assert_precision, poison_like

    use_kernel_backend(monkeypatch, device, kernel)
    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([70, 9, 40], "gapped", page_size=page_size, num_heads=num_heads,
                                                 num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                                 device=device, gen=gen, question_len=19)
    inv_freq = (1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))).to(device)
    scales = {}
    k_ref, v_ref = k.double(), v.double()
    if fp8:
        ks, vs = torch.tensor(0.04, device=device), torch.tensor(0.02, device=device)
        k, v = (k.float() / ks).to(torch.float8_e4m3fn), (v.float() / vs).to(torch.float8_e4m3fn)
        k_ref, v_ref = k.double() * ks.double(), v.double() * vs.double()
        scales = dict(k_scale=ks, v_scale=vs)
    k_run, v_run = k.clone(), v.clone()
    used = set(table.pages.tolist())
    for p, n in zip(table.pages.tolist(), table.entry_len.tolist()):
        k_run[p, n:], v_run[p, n:] = float("nan"), float("nan")
    for p in set(range(k.shape[0])) - used:
        k_run[p], v_run[p] = float("nan"), float("nan")
    t = [x.cpu() for x in (table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len)]
    for window_left, splits in ((-1, 1), (30, 3)):
        plan = _plan(dict(cu=cu, q=q, k=k), table, window_left, num_splits=splits)
        out, lse = poison_like(q), poison_like(q[..., 0].float())
        run_paged_attention(plan, q, q_pos, k_run, v_run, out=out, lse_out=lse, inv_freq=inv_freq,
                            rotary_dim=rotary_dim, interleaved=interleaved, **scales)
        a = (q.cpu(), q_pos.cpu(), cu.cpu())
        rope = (inv_freq.cpu(), rotary_dim, interleaved, None, window_left)
        o64, l64 = paged_attention_table(*a, k_ref.cpu(), v_ref.cpu(), *t, *rope)
        olp, llp = paged_attention_table(*a, k_ref.cpu().to(dtype), v_ref.cpu().to(dtype), *t, *rope, upcast=False)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        # fp32: the torch reference in fp32 is within a few eps of float64, so the 2x rule alone
        # measures rounding noise; the Triton kernel's online softmax (log2(e)-scaled exponents,
        # split-KV rescales) rounds at the scores' magnitude: up to 3.7x the reference's error over
        # 80 seeds (2 of them failed the default floor of 4 eps), hence a floor of 16 eps
        floor = 16 * torch.finfo(dtype).eps * float(o64.abs().max()) if dtype == torch.float32 else None
        assert_precision(out.cpu(), o64, olp, atol_floor=floor)
        assert_precision(lse.cpu(), l64, llp, what="lse")


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_fp8_scale_must_be_finite_and_positive(backend, device, monkeypatch, bad):
    """run_paged_attention refuses a k_scale or v_scale that is not finite and > 0 on every backend
    (a 0 read every key as 0: a uniform softmax, silently); CUDA checks under RAGATTN_DEBUG=1."""
    if device != "cpu":
        monkeypatch.setenv("RAGATTN_DEBUG", "1")
    c = make_csr_case([[9], [4, 7]], [10, 8], num_heads=4, num_kv_heads=2, head_dim=32, page_size=8,
                      dtype=torch.bfloat16, device=device)
    good = torch.tensor([0.05], device=device)
    k8, v8 = (c["k"].float() / good).to(torch.float8_e4m3fn), (c["v"].float() / good).to(torch.float8_e4m3fn)
    plan = _plan(c, PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8))
    s = torch.tensor([bad], device=device)
    with pytest.raises(ValueError, match=r"paged_attention_run: k_scale must be finite and > 0"):
        run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=s, v_scale=good)
    with pytest.raises(ValueError, match=r"paged_attention_run: v_scale must be finite and > 0"):
        run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=good, v_scale=s)
