"""varlen_attention's launch plan (visible key tiles, longest first, split rows merged) and the default
CPU path's Block-Attention split and REFRAG encoder layout, forward and backward."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn.reference import varlen_attention as ref_varlen
from tests.helpers import assert_precision, max_abs_err, randn_nonzero, require_triton_on

from tests.ops.test_varlen_attention import OP, _case, _float64
import tests.ops.test_varlen_attention as varlen_core  # a test of it runs again here, under a table


# ----------------------------------------------------------------------------------------------
# The launch plan (visible key tiles per query tile, longest first, split long rows)
# ----------------------------------------------------------------------------------------------
def _tile_visibility(args, bm, bn):
    """Dense [q tiles, k tiles] any/all visibility (all: every pair visible and the key tile full)."""
    from ragattn.reference.varlen_attention import visible_mask

    q, k, _, cu_q, cu_k, q_pos, kv_pos, q_blk, kv_blk, causal = args[:10]
    window = args[11] if len(args) > 11 else -1
    anys, alls, q_tiles, k_tiles = [], [], [], []
    for b in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qp = torch.arange(qe - qs, dtype=torch.int32) if q_pos is None else q_pos[qs:qe]
        kp = torch.arange(ke - ks, dtype=torch.int32) if kv_pos is None else kv_pos[ks:ke]
        qb = torch.full((qe - qs,), -1, dtype=torch.int32) if q_blk is None else q_blk[qs:qe]
        kb = torch.full((ke - ks,), -1, dtype=torch.int32) if kv_blk is None else kv_blk[ks:ke]
        vis = visible_mask(qp, kp, qb, kb, causal, window)
        for i in range(0, qe - qs, bm):
            for j in range(0, ke - ks, bn):
                t = vis[i:i + bm, j:j + bn]
                q_tiles.append(qs + i)
                k_tiles.append(ks + j)
                anys.append(bool(t.any()))
                alls.append(bool(t.all()) and j + bn <= ke - ks)
    return q_tiles, k_tiles, anys, alls


@pytest.mark.parametrize("mask, causal, pos, window", [("chunks", True, "default", -1), ("sys", False, "offset", -1),
                                                       ("random", True, "shuffled", 5), ("many", True, "default", 9)])
def test_plan_lists_every_visible_tile_once_longest_first(mask, causal, pos, window):
    """The plan's work items cover exactly the visible tile pairs, fully visible ones in the
    mask-free range, split rows in consecutive pieces, and launch in descending order of work."""
    from ragattn.triton_kernels.varlen_plan import build_plan

    lens_k = [70, 0, 33, 1, 40]
    lens_q = [30, 0, 33, 1, 40] if pos == "offset" else lens_k
    args = _case(lens_q, lens_k, 2, 1, 16, torch.float32, "cpu", blocks=mask, causal=causal, pos=pos,
                 gen=torch.Generator().manual_seed(11)) + (None, window)
    bm, bn = 16, 8
    plan = build_plan(*args[3:9], sum(lens_q), sum(lens_k), block_m=bm, block_n=bn, causal=causal,
                      window_left=window, backward=True, split_len=2)
    q_tiles, k_tiles, anys, alls = _tile_visibility(args, bm, bn)
    visible = {(qt, kt) for qt, kt, a in zip(q_tiles, k_tiles, anys) if a}
    in_full = {(qt, kt) for qt, kt, full in zip(q_tiles, k_tiles, alls) if full}
    for csr, swap in ((plan.by_q, False), (plan.by_k, True)):
        work, rows = csr.work.long(), csr.rows.long()
        sizes = (work[:, 5] - work[:, 3]).tolist()
        assert sizes == sorted(sizes, reverse=True)  # longest first
        got = {}
        for start, end_row, _, e0, e1, e2, dest, _ in work.tolist():
            assert e0 <= e1 <= e2 and start < end_row
            for e in range(e0, e2):
                pair = (rows[e].item(), start) if swap else (start, rows[e].item())
                assert pair not in got, "a tile pair listed twice"
                got[pair] = e < e1
        # every visible pair is listed (the metadata may add a few invisible ones: min/max summaries),
        # and a pair on the mask-free path is visible in full
        assert visible <= set(got) and {p for p, full in got.items() if full} <= in_full
        assert len(got) < len(q_tiles) or not causal  # and tile pairs are skipped
        # every row tile has an item (rows with no visible tile write their zeros)
        cu, block = (args[4], bn) if swap else (args[3], bm)
        tiles = {int(cu[b]) + i for b in range(cu.numel() - 1) for i in range(0, int(cu[b + 1] - cu[b]), block)}
        assert set(work[:, 0].tolist()) == tiles
        assert len(visible) * 2 >= len(got) or mask == "random"
    assert plan.by_q.split_tiles > 0 and plan.by_q.max_splits > 1  # split_len 2 splits long rows
    assert plan.by_k.split_tiles == 0


def test_plan_is_cached_for_equal_and_inference_index_tensors():
    """A model builds new (or inference) index tensors in every layer: equal ones reuse the plan;
    different ones do not."""
    import ragattn.triton_kernels.varlen_attention as va

    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    blk = torch.arange(45, dtype=torch.int32) // 7
    params = dict(block_m=16, block_n=16, causal=True, window_left=-1, backward=False, split_len=None, split_slots=None)
    first = va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **params)
    assert va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **params) is first
    assert va._cached_plan((cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone()), 45, 45, **params) is first
    with torch.inference_mode():
        inf = (cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone())
        assert va._cached_plan(inf, 45, 45, **params) is first
        inf[4][3] = -1  # an in-place edit of an inference tensor is seen by content
        assert va._cached_plan(inf, 45, 45, **params) is not first
    assert va._cached_plan((cu, cu, None, None, blk, blk), 45, 45, **dict(params, causal=False)) is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_rows_are_merged(device, dtype):
    """Long rows split over several programs (split_len=2 tiles) and merged: the same answer as
    the float64 reference, including empty sequences, rows with no visible key, GQA, and masked
    NaN/inf keys inside a split row's key range that no query of it can see."""
    from ragattn.triton_kernels.varlen_attention import _cached_plan, varlen_attention_fwd

    require_triton_on(device)
    args = list(_case([45, 0, 3, 38], [45, 5, 0, 38], 4, 2, 64, dtype, device, blocks="chunks",
                      gen=torch.Generator().manual_seed(17)))
    k, v = args[1].clone(), args[2].clone()
    # keys 7..13 form chunk 1 of sequence 0: visible to chunk 1 and the global tail (rows 39..44) only;
    # key 40 (global tail) lies in the causal future of every row before it
    bad = [9, 40]
    k[bad, 0, 3] = float("nan")
    v[bad, 1, 5] = float("inf")
    args[1], args[2] = k, v
    out, lse = varlen_attention_fwd(*args, None, block_m=16, block_n=16, split_len=2)
    plan = _cached_plan(tuple(args[3:9]), 86, 88, block_m=16, block_n=16, causal=True, window_left=-1, backward=False,
                        split_len=2, split_slots=None)
    assert plan.by_q.split_tiles >= 2 and plan.by_q.max_splits >= 2
    from ragattn.reference.varlen_attention import visible_mask

    # the expectations on the CPU (the kernel may have run on CUDA)
    out, lse = out.cpu(), lse.cpu()
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]

    vis = visible_mask(torch.arange(45, dtype=torch.int32), torch.arange(45, dtype=torch.int32), args[7][:45],
                       args[8][:45], True, -1)
    blind = torch.cat([(~vis[:, bad].any(1)).nonzero().flatten(), torch.arange(48, 86)])  # + sequence 3
    clean = list(args)
    clean[1], clean[2] = clean[1].clone(), clean[2].clone()
    clean[1][bad], clean[2][bad] = 1.0, 1.0
    o64, l64 = ref_varlen(*_float64(clean))
    olp, llp = ref_varlen(*clean)
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[blind]).all()
    assert_precision(out[blind], o64[blind], olp[blind], what="out")
    assert_precision(lse[blind], l64[blind], llp[blind], what="lse")
    seen = torch.zeros(86, dtype=torch.bool)
    seen[:45] = vis[:, bad].any(1)
    assert seen.any() and not torch.isfinite(out[seen]).all(dim=(1, 2)).any()  # NaN propagates when seen
    assert torch.isneginf(lse[45:48]).all() and (out[45:48] == 0).all()  # sequence 2 has no keys


# ----------------------------------------------------------------------------------------------
# The default CPU path's Block-Attention split (chunk blocks as short sequences of
# their own, global rows over everything) and REFRAG's encoder layout, forward and backward
# ----------------------------------------------------------------------------------------------
def _block_layout(kind, n_seq_tokens, gen):
    """Block ids of one sequence: 'block_attention' = a global system prompt of 5, chunks of 23
    (the last one shorter), a global tail of 7; 'refrag' = independent chunks of 16 (the last
    one shorter), no global token."""
    if kind == "refrag":
        return [i // 16 for i in range(n_seq_tokens)]
    if n_seq_tokens < 20:  # a short question alone: global
        return [-1] * n_seq_tokens
    body = n_seq_tokens - 5 - 7
    return [-1] * 5 + [i // 23 for i in range(body)] + [-1] * 7


def _check_forward_backward(args, seed):
    """out, lse and dq/dk/dv of ragattn.varlen_attention(*args) against the float64 reference,
    within twice the error of the same computation in the input dtype."""
    out, lse = ragattn.varlen_attention(*args)
    o64, l64 = ref_varlen(*_float64(args))
    o_lp, l_lp = ref_varlen(*args, upcast=False)
    assert_precision(out, o64, o_lp, what="out")
    assert_precision(lse, l64, l_lp, what="lse")
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64))
    _check_gradients(args, randn_nonzero(*out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(seed)))


def _check_gradients(args, dout):
    """dq/dk/dv of ragattn.varlen_attention(*args) for the upstream gradient ``dout`` against the
    float64 reference, within twice the error of the same computation in the input dtype."""
    leaves = [t.detach().requires_grad_(True) for t in args[:3]]
    got = torch.autograd.grad(ragattn.varlen_attention(*leaves, *args[3:])[0], leaves, dout)
    l64s = [t.double().requires_grad_(True) for t in args[:3]]
    want64 = torch.autograd.grad(ref_varlen(*l64s, *args[3:])[0], l64s, dout.double())
    llp = [t.detach().requires_grad_(True) for t in args[:3]]
    want_lp = torch.autograd.grad(ref_varlen(*llp, *args[3:], upcast=False)[0], llp, dout)
    for name, g, w64, wlp in zip(("dq", "dk", "dv"), got, want64, want_lp):
        assert_precision(g, w64, wlp, what=name)


@pytest.mark.parametrize("kind, causal, dtype, ratio", [
    ("block_attention", True, torch.bfloat16, 3),
    ("block_attention", False, torch.float32, 1),
    ("refrag", False, torch.float16, 4),
])
def test_block_split_path_matches_reference(kind, causal, dtype, ratio):
    """Sequences long enough that the default CPU path splits them into per-chunk calls (checked),
    with an empty and a length-1 sequence beside them: out, lse, dq, dk, dv vs float64."""
    from ragattn.ops import _varlen_sdpa_cpu

    gen = torch.Generator().manual_seed(21)
    lens = [131, 0, 1, 97]
    hkv = 2
    args = list(_case(lens, lens, hkv * ratio, hkv, 64, dtype, "cpu", causal=causal, gen=gen))
    blk = torch.tensor(sum((_block_layout(kind, n, gen) for n in lens), []), dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    groups = _varlen_sdpa_cpu.plan(args[3], args[4], None, None, args[7], args[8], causal, -1, sum(lens), sum(lens))
    assert len(groups) >= 2 or kind == "refrag", "the split path was not taken"
    assert groups[-1].q_idx.shape[0] > 2, "chunks were not batched as sequences of their own"
    _check_forward_backward(args, seed=22)


def test_block_split_path_never_reads_masked_nan():
    """A NaN in the K/V of a chunk another chunk's rows cannot see stays out of those rows on the
    split path (the fused kernel would read it: the result is recomputed by the reference)."""
    gen = torch.Generator().manual_seed(23)
    lens = [131]
    args = list(_case(lens, lens, 4, 2, 64, torch.float32, "cpu", gen=gen))
    blk = torch.tensor(_block_layout("block_attention", 131, gen), dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    want, want_lse = ref_varlen(*_float64(args))
    bad = 5 + 23 + 4  # a token of chunk 1
    args[1][bad, 1, 3] = float("nan")
    args[2][bad, 0, 9] = float("nan")
    out, lse = ragattn.varlen_attention(*args)
    # rows that see the token: its chunk's and the global tail's, at or after it (causal)
    blind = ~((torch.arange(131) >= bad) & ((blk == 1) | (blk == -1)))
    assert torch.isfinite(out[blind]).all() and torch.isfinite(lse[blind]).all()
    assert max_abs_err(out[blind], want[blind]) < 1e-4
    assert not torch.isfinite(out[~blind]).all(dim=(1, 2)).any()


@pytest.mark.parametrize("causal", [True, False])
def test_equal_length_sequences_read_as_views(causal):
    """Sequences of one length packed back to back: the default CPU path reads and writes them as
    views of the packed tensors (no gather/scatter); out, lse and the gradients vs float64."""
    from ragattn.ops import _varlen_sdpa_cpu

    args = list(_case([24, 24, 24], [24, 24, 24], 6, 2, 64, torch.float32, "cpu", causal=causal,
                      gen=torch.Generator().manual_seed(31)))
    (group,) = _varlen_sdpa_cpu.plan(args[3], args[4], None, None, None, None, causal, -1, 72, 72)
    assert group.q_span == (0, 72) and group.k_span == (0, 72) and group.q_idx.shape == (3, 24)
    _check_forward_backward(args, seed=32)


# ----------------------------------------------------------------------------------------------
# The default CPU path's fixed cost (direct call, checks once per cached plan)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal, window, pos", [(True, -1, "default"), (True, 9, "default"), (False, 11, "shuffled")])
def test_block_split_trims_unseen_global_keys(causal, window, pos):
    """The split path gives each chunk only the global keys its rows may see (a global tail after
    the chunks is invisible to them when causal; a window cuts the keys far behind): vs float64,
    with NaN in a trimmed tail key (never read, so no reference fallback is needed either)."""
    from ragattn.ops import _varlen_sdpa_cpu

    gen = torch.Generator().manual_seed(41)
    lens = [3, 0, 90]
    args = list(_case(lens, lens, 4, 2, 64, torch.float32, "cpu", causal=causal, pos=pos, gen=gen))
    blk = torch.tensor(sum(([-1] * n if n < 20 else [i // 21 for i in range(n - 6)] + [-1] * 6 for n in lens), []),
                       dtype=torch.int32)
    args[7], args[8] = blk, blk.clone()
    args = args[:10] + [None, window]
    groups = _varlen_sdpa_cpu.plan(*args[3:9], causal, window, 93, 93)
    assert len(groups) == 2 and groups[1].q_idx.shape[0] == 4, "the split path was not taken"
    if causal and pos == "default":
        assert groups[1].k_idx.shape[1] <= 21  # no tail key
    _check_forward_backward(args, seed=42)
    if causal and pos == "default":
        args[1][92, 1, 5] = float("nan")  # the last tail key: only the tail's last row sees it
        out, _ = ragattn.varlen_attention(*args)
        assert torch.isfinite(out[:92]).all() and not torch.isfinite(out[92]).all()


def test_index_value_checks_hold_on_cached_plans():
    """The checks that read index values run once per cached plan: an index tensor edited in place
    (a new version, or for an inference tensor new contents) is checked again."""
    args = list(_case([20, 30], [20, 30], 4, 2, 64, torch.float32, "cpu", blocks="chunks",
                      gen=torch.Generator().manual_seed(43)))
    ragattn.varlen_attention(*args)
    args[3][1] = 60  # cu_seqlens_q no longer non-decreasing
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        ragattn.varlen_attention(*args)
    args[3][1] = 20
    pos = torch.arange(50, dtype=torch.int64)
    ragattn.varlen_attention(*args[:5], pos, pos)
    pos[7] = 2**40
    with pytest.raises(ValueError, match="q_pos values must fit in int32"):
        ragattn.varlen_attention(*args[:5], pos, pos)
    with torch.inference_mode():
        cu = args[4].clone()
        ragattn.varlen_attention(*args[:4], cu)
        cu[2] = 49  # the packed length is 50
        with pytest.raises(ValueError, match="cu_seqlens_k must start at 0 and end at 50"):
            ragattn.varlen_attention(*args[:4], cu)


def test_sdpa_plan_cached_for_equal_and_inference_index_tensors():
    """A model builds new (or inference) index tensors in every layer: the default CPU path reuses
    the plan for equal ones, and sees an in-place edit of an inference tensor."""
    from ragattn.ops import _varlen_sdpa_cpu as sc

    cu = torch.tensor([0, 20, 45], dtype=torch.int32)
    blk = torch.arange(45, dtype=torch.int32) // 7
    first = sc.cached_plan(cu, cu, None, None, blk, blk, True, -1, 45, 45)
    assert sc.cached_plan(cu, cu, None, None, blk, blk, True, -1, 45, 45) is first
    assert sc.cached_plan(cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone(), True, -1, 45, 45) is first
    with torch.inference_mode():
        inf = (cu.clone(), cu.clone(), None, None, blk.clone(), blk.clone())
        assert sc.cached_plan(*inf, True, -1, 45, 45) is first
        inf[4][3] = -1
        assert sc.cached_plan(*inf, True, -1, 45, 45) is not first
    assert sc.cached_plan(cu, cu, None, None, blk, blk, False, -1, 45, 45) is not first


# torch.jit.trace is deprecated in torch itself; the test still checks that tracing sees the op
@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")
def test_wrapper_dispatches_where_the_op_must_be_seen():
    """The wrapper calls the CPU impl directly only for plain CPU tensors that need no gradient,
    outside modes and transforms; a dispatch mode, FakeTensorMode, a tensor that requires grad and
    torch.compile all still see ``ragattn::varlen_attention`` (and get the same result)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from ragattn.ops._direct_call import plain_cpu_call

    args = list(_case([30, 5], [30, 5], 4, 2, 64, torch.float32, "cpu", blocks="chunks",
                      gen=torch.Generator().manual_seed(44)))
    want = OP(*args)
    got = ragattn.varlen_attention(*args)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert plain_cpu_call(*args[:9])
    with torch.inference_mode():
        assert plain_cpu_call(*args[:9])

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            self.ops.append(str(func))
            return func(*a, **(kw or {}))

    with Record() as rec:
        ragattn.varlen_attention(*args)
    assert any("ragattn.varlen_attention" in o for o in rec.ops), rec.ops[:5]
    traced = torch.jit.trace(lambda q, k, v: ragattn.varlen_attention(q, k, v, *args[3:])[0], tuple(args[:3]))
    assert "ragattn::varlen_attention" in str(traced.graph)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if torch.is_tensor(a) else a for a in args]
        out, lse = ragattn.varlen_attention(*fake)
        assert out.shape == args[0].shape and lse.shape == args[0].shape[:2]
    q = args[0].clone().requires_grad_(True)
    assert not plain_cpu_call(q, *args[1:9])
    out, _ = ragattn.varlen_attention(q, *args[1:])
    assert out.grad_fn is not None and torch.equal(out.detach(), want[0])
    with torch.no_grad():
        assert plain_cpu_call(q, *args[1:9])
    assert not plain_cpu_call(torch.nn.Parameter(args[0]), *args[1:9])


@pytest.mark.parametrize("kind", ["causal", "blocks", "window"])
def test_masked_tiles_in_slices(device, monkeypatch, tmp_path, kind):
    """The forward's masked loop taking each key tile in slices (config ``masked_sub``: what keeps
    a 128 x 64 tile spill-free on sm_90) keeps every rule: against the float64 reference with
    chunk blocks and a global tail, and no masked non-finite value reaching a query."""
    import json

    from ragattn.triton_kernels import gpu_configs

    table = json.load(open(gpu_configs.table_path("varlen_attention", gpu_configs.CONFIG_DIR)))
    table["devices"]["interpreter"]["configs"]["*"]["masked_sub"] = 2
    (tmp_path / "varlen_attention.json").write_text(json.dumps(table))
    monkeypatch.setenv("RAGATTN_CONFIG_DIR", str(tmp_path))
    gpu_configs.clear_cache()
    try:
        varlen_core.test_masked_nonfinite_never_reaches_a_query(device, "triton", monkeypatch, kind, float("nan"))
        if kind == "blocks":
            args = _case([70, 45], [70, 45], 4, 2, 64, torch.float16, device, blocks="chunks")
            _check_forward_backward(args, 5)
    finally:
        monkeypatch.delenv("RAGATTN_CONFIG_DIR")
        gpu_configs.clear_cache()
