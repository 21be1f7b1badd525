"""The engine-facing plan/run pair of paged_attention: ``ragattn.PageTable`` from a
padded block table or FlashInfer's CSR page lists, ``plan_paged_attention`` once per step (exact,
or for a maximum with no host read), ``run_paged_attention`` per layer
(``torch.ops.ragattn.paged_attention_run``: no host sync, traceable, opcheck'd), against the
float64 reference on every CPU backend and the Triton kernel in the interpreter."""
from __future__ import annotations

import math

import pytest
import torch

from ragattn import PageTable, plan_paged_attention, run_paged_attention
from tests.helpers import randn_nonzero, use_kernel_backend
from tests.ops.paged_attention.test_paged_attention import check_against_reference

I32 = torch.int32


@pytest.fixture(params=["default", "reference", "triton"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


def make_csr_case(q_positions, kv_lens, *, num_heads, num_kv_heads, head_dim, page_size, dtype, device,
                  index_dtype=I32, spare=4):
    """A shuffled page pool with FlashInfer CSR page lists (and the equivalent padded table)."""
    counts = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(counts) + spare
    perm = torch.randperm(num_pages)
    indptr = torch.tensor([0] + torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist(), dtype=index_dtype)
    indices = perm[: sum(counts)].to(index_dtype)
    last = torch.tensor([n - (c - 1) * page_size if c else 0 for n, c in zip(kv_lens, counts)], dtype=index_dtype)
    width = max(counts + [1])
    bt = torch.full((len(kv_lens), width), -1, dtype=index_dtype)
    for b, c in enumerate(counts):
        bt[b, :c] = indices[int(indptr[b]): int(indptr[b]) + c]
    k = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    cu = torch.tensor([0] + torch.tensor([len(p) for p in q_positions]).cumsum(0).tolist(), dtype=index_dtype)
    q_pos = torch.tensor([p for ps in q_positions for p in ps], dtype=index_dtype)
    q = randn_nonzero(q_pos.numel(), num_heads, head_dim, dtype=dtype, device=device)
    kvl = torch.tensor(kv_lens, dtype=index_dtype)
    d = lambda t: t.to(device)  # noqa: E731
    return dict(q=q, q_pos=d(q_pos), cu=d(cu), k=k, v=v, indptr=d(indptr), indices=d(indices), last=d(last),
                bt=d(bt), kv_lens=d(kvl))


def _plan(c, table, window_left=-1, **kw):
    return plan_paged_attention(c["cu"], table, num_heads=c["q"].shape[1], num_kv_heads=c["k"].shape[2],
                                head_dim=c["q"].shape[2], dtype=c["q"].dtype, window_left=window_left, **kw)


CASES = [  # (q_positions, kv_lens, heads, kv heads, head_dim, page_size, dtype)
    ([[40], [0], [], [6, 7, 8]], [41, 1, 5, 9], 6, 2, 64, 16, torch.float16),       # decode, empty, tail rows
    ([[3, 17, 29, 30], [12]], [31, 13], 3, 1, 80, 7, torch.bfloat16),             # page size 7, GQA 3, d80
    ([[99], [5, 50]], [100, 51], 8, 8, 128, 1, torch.float32),                      # page size 1, MHA
    ([[], []], [0, 3], 4, 2, 64, 16, torch.float16),                                # no query rows
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("window_left", [-1, 6])
def test_csr_and_padded_tables_match_the_reference(backend, device, seed, case, window_left):
    """Both page-table forms, planned exactly, give the reference's result (outputs poisoned first)."""
    q_positions, kv_lens, h, hkv, d, ps, dtype = CASES[case]
    c = make_csr_case(q_positions, kv_lens, num_heads=h, num_kv_heads=hkv, head_dim=d, page_size=ps, dtype=dtype,
                      device=device)
    args = (c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"])
    csr = PageTable.from_csr(c["indptr"], c["indices"], c["last"], ps)
    assert torch.equal(csr.kv_lens.cpu().long(), c["kv_lens"].cpu().long())
    for table in (csr, PageTable.from_block_table(c["bt"], c["kv_lens"])):
        plan = _plan(c, table, window_left, num_splits=2 if backend == "triton" else None)
        out = torch.full_like(c["q"], float("nan"))
        lse = torch.full(c["q"].shape[:2], float("nan"), device=device)
        got = run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"], out=out, lse_out=lse)
        assert got[0] is out and got[1] is lse
        check_against_reference(args, out, lse, window_left)
        out2, lse2 = run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"])
        torch.testing.assert_close(out2, out, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=0, equal_nan=True)


def test_int64_csr_and_shared_pages(backend, device, seed):
    """int64 page lists (engines' dtype), and two sequences sharing their first pages (a common
    prefix read through the same entries: row starts may overlap)."""
    ps = 8
    c = make_csr_case([[20], [13, 14]], [21, 15], num_heads=4, num_kv_heads=2, head_dim=64, page_size=ps,
                      dtype=torch.float32, device=device, index_dtype=torch.int64)
    shared = torch.cat([c["indices"][:3], c["indices"][:2]])   # seq 1's 2 pages = seq 0's first 2
    indptr = torch.tensor([0, 3, 5], dtype=torch.int64, device=device)
    last = torch.tensor([5, 7], dtype=torch.int64, device=device)
    table = PageTable.from_csr(indptr, shared, last, ps)
    bt = torch.stack([shared[:3], torch.cat([shared[3:], shared[:1]])])
    out, lse = run_paged_attention(_plan(c, table), c["q"], c["q_pos"], c["k"], c["v"])
    check_against_reference((c["q"], c["q_pos"], c["cu"], c["k"], c["v"], bt, table.kv_lens.long()), out, lse)
    row_start = torch.tensor([0, 0], dtype=torch.int64, device=device)   # both read entries 0, 1, ...
    table2 = PageTable(pages=shared, kv_lens=torch.tensor([21, 15], device=device), row_start=row_start)
    out2, lse2 = run_paged_attention(_plan(c, table2), c["q"], c["q_pos"], c["k"], c["v"])
    bt2 = torch.stack([shared[:3], shared[:3]])
    check_against_reference((c["q"], c["q_pos"], c["cu"], c["k"], c["v"], bt2, table2.kv_lens), out2, lse2)


def test_planned_for_a_maximum(triton_backend, device, seed):
    """A plan from maxima (no host read) runs batches whose contexts grew past max_kv_len, exactly:
    the last split-KV partition runs to the end of each row's visible range."""
    ps = 16
    c = make_csr_case([[70], [3], [100]], [71, 4, 101], num_heads=4, num_kv_heads=1, head_dim=64, page_size=ps,
                      dtype=torch.float16, device=device)
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], ps)
    args = (c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"])
    for max_kv, splits in [(200, None), (40, 2), (1, 3)]:
        plan = _plan(c, table, max_q_len=2, max_kv_len=max_kv, num_splits=splits)
        assert plan.tile_seq.numel() == 3 * math.ceil(2 / plan.launch[0])
        out, lse = run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"])
        check_against_reference(args, out, lse)


@pytest.fixture
def triton_backend(monkeypatch, device):
    use_kernel_backend(monkeypatch, device, "triton")
    return "triton"


def test_plan_for_a_maximum_reads_no_tensor(monkeypatch):
    """Given both maxima, planning reads nothing: it runs on meta tensors (where any value read,
    .item(), .tolist() or .cpu() copy raises), so it can sit inside a captured CUDA graph."""
    c = make_csr_case([[9], [4, 5]], [10, 6], num_heads=8, num_kv_heads=2, head_dim=64, page_size=4,
                      dtype=torch.bfloat16, device="cpu")
    table = PageTable(pages=c["indices"].to("meta"), kv_lens=c["kv_lens"].to("meta"),
                      row_start=c["indptr"][:-1].to("meta"))
    plan = plan_paged_attention(c["cu"].to("meta"), table, num_heads=8, num_kv_heads=2, head_dim=64,
                                dtype=torch.bfloat16, max_q_len=2, max_kv_len=4096)
    assert plan.tile_seq.device.type == "meta" and plan.tile_seq.numel() == 2 * math.ceil(2 / plan.launch[0])
    with pytest.raises(NotImplementedError):   # the exact plan does read (one host sync)
        plan_paged_attention(c["cu"].to("meta"), table, num_heads=8, num_kv_heads=2, head_dim=64,
                             dtype=torch.bfloat16)


def test_run_compiles_fullgraph_through_the_op(seed):
    """The public run is one custom op whose fake impl reads no value: a decode step around it
    compiles with fullgraph=True (a host read would be a graph break, an error here) and gives
    the eager result."""
    c = make_csr_case([[30], [7]], [31, 8], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                      dtype=torch.float32, device="cpu")
    plan = _plan(c, PageTable.from_csr(c["indptr"], c["indices"], c["last"], 16))

    def step(q, k, v):
        out, lse = run_paged_attention(plan, q * 0.5, c["q_pos"], k, v)
        return out.sum(-1), lse

    want = step(c["q"], c["k"], c["v"])
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(c["q"], c["k"], c["v"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_opcheck_run(backend, device):
    c = make_csr_case([[12], [2, 3]], [13, 4], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.float32, device=device)
    for table in (PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8),
                  PageTable.from_block_table(c["bt"], c["kv_lens"])):
        plan = _plan(c, table)
        t = plan.table
        args = (c["q"], c["q_pos"], c["cu"], c["k"], c["v"], t.pages, t.row_start, t.kv_lens, plan.tile_seq,
                plan.tile_row0, list(plan.launch))
        torch.library.opcheck(torch.ops.ragattn.paged_attention_run.default, args)
        torch.library.opcheck(torch.ops.ragattn.paged_attention_run.default, (*args, 0.3, 5))
        torch.library.opcheck(torch.ops.ragattn.paged_attention_run.out, args,
                              dict(out=torch.empty_like(c["q"]), lse_out=torch.empty(c["q"].shape[:2], device=device)))


def test_inference_mode(device):
    c = make_csr_case([[12], [2, 3]], [13, 4], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.float16, device=device)
    with torch.inference_mode():
        plan = _plan(c, PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8))
        out, lse = run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"])
    check_against_reference((c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"]), out, lse)


# ------------------------------------------------------------------------------ bad input

def _errors(fn):
    try:
        fn()
    except (ValueError, TypeError) as e:
        return type(e), str(e)
    raise AssertionError("no error raised")


def test_bad_csr_is_refused():
    c = make_csr_case([[5]], [6], num_heads=2, num_kv_heads=1, head_dim=64, page_size=4, dtype=torch.float32,
                      device="cpu")
    with pytest.raises(ValueError, match="indptr must start at 0"):
        PageTable.from_csr(c["indptr"] + 1, c["indices"], c["last"], 4)
    with pytest.raises(ValueError, match="end within indices"):
        PageTable.from_csr(torch.tensor([0, 9], dtype=I32), c["indices"], c["last"], 4)
    with pytest.raises(ValueError, match="last_page_len must lie in"):
        PageTable.from_csr(c["indptr"], c["indices"], c["last"] + 4, 4)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        PageTable.from_csr(c["indptr"], c["indices"], c["last"], 0)
    with pytest.raises(TypeError, match="indices must be int32 or int64"):
        PageTable.from_csr(c["indptr"], c["indices"].float(), c["last"], 4)


def test_bad_run_inputs_are_refused_like_the_fake():
    """Out-of-range pages, row starts past the list, a plan too small for the batch, a plan of
    another shape: clear errors, and the fake impl (no value reads) gives the same shape errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    c = make_csr_case([[9], [2, 3]], [10, 4], num_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                      dtype=torch.float32, device="cpu")
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 4)
    plan = _plan(c, table)
    run = lambda p, q=c["q"]: run_paged_attention(p, q, c["q_pos"], c["k"], c["v"])  # noqa: E731
    bad_page = PageTable(pages=c["indices"] + 100, kv_lens=table.kv_lens, row_start=table.row_start)
    with pytest.raises(ValueError, match=r"pages used by kv_lens must lie in \[0, num_pages"):
        run(_plan(c, bad_page))
    past = PageTable(pages=c["indices"], kv_lens=table.kv_lens, row_start=table.row_start + 2)
    with pytest.raises(ValueError, match="must lie in pages"):
        run(_plan(c, past))
    small = _plan(c, table, max_q_len=1, max_kv_len=10)
    if small.launch[0] == 1:   # one row per tile: sequence 1's second row has no tile
        with pytest.raises(ValueError, match="plan covers"):
            run(small)
    with pytest.raises(ValueError, match="as planned"):
        run(plan, c["q"][:, :2])
    # the op's shape checks, the same on fake tensors
    args = [c["q"], c["q_pos"], c["cu"], c["k"], c["v"], table.pages, table.row_start, table.kv_lens, plan.tile_seq,
            plan.tile_row0, list(plan.launch)]
    for i, bad in [(6, table.row_start[:1]), (5, table.pages[None]), (8, plan.tile_seq.long()), (10, [1, 2])]:
        broken = list(args)
        broken[i] = bad
        real = _errors(lambda: torch.ops.ragattn.paged_attention_run(*broken))
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in broken]
            assert _errors(lambda: torch.ops.ragattn.paged_attention_run(*fake)) == real


@pytest.mark.parametrize("kw,match", [
    (dict(num_splits=0), "num_splits must be None"), (dict(num_splits=-3), "num_splits must be None"),
    (dict(num_splits=2.0), "num_splits must be None"), (dict(num_splits=True), "num_splits must be None"),
    (dict(window_left=4.0), "window_left must be an int"), (dict(window_left=2**31), "window_left must be an int"),
    (dict(max_q_len=1.5), "max_q_len must be a non-negative int")])
def test_plan_refuses_bad_scalars_when_planning(kw, match):
    """A plan is made once and run per layer: its scalars are checked when planning (num_splits 0
    divided by zero; a float num_splits or window_left failed later, in the first run)."""
    c = make_csr_case([[5]], [6], num_heads=2, num_kv_heads=1, head_dim=64, page_size=4, dtype=torch.float32,
                      device="cpu")
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 4)
    with pytest.raises(ValueError, match=f"plan_paged_attention: {match}"):
        _plan(c, table, **kw)


@pytest.mark.parametrize("maxima", [False, True], ids=["exact", "for-maxima"])
def test_cu_seqlens_rewritten_in_place_after_planning(backend, device, maxima, seed):
    """A plan captures each sequence's tile count, not its row offsets: an engine that rewrites
    cu_seqlens_q (and q, q_pos) in place between plan and run, moving the sequence boundaries
    within that coverage, gets the new batch's exact result on every backend (the Triton path
    kept the planning-time offsets and left rows unwritten); past the coverage it is told to plan
    again, on every CPU backend alike."""
    kv = [40, 23, 57]
    rows0 = [5, 2, 9]
    c = make_csr_case([list(range(n - r, n)) for n, r in zip(kv, rows0)], kv, num_heads=4, num_kv_heads=2,
                      head_dim=64, page_size=8, dtype=torch.float32, device=device)
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8)
    plan = _plan(c, table, **(dict(max_q_len=9, max_kv_len=57) if maxima else {}))
    block_m = plan.launch[0]
    covered = torch.zeros(3, dtype=torch.int64).index_add_(0, plan.tile_seq.cpu().long(),
                                                           torch.full((plan.tile_seq.numel(),), block_m))
    rows = [2, 6, 8]   # the same 16 rows split anew: both boundaries move, each within its tiles and max_q_len
    assert all(r <= int(cv) for r, cv in zip(rows, covered)), (rows, covered)
    cu_new = torch.tensor([0, rows[0], rows[0] + rows[1], 16], dtype=c["cu"].dtype)
    c["cu"].copy_(cu_new.to(device))
    c["q_pos"].copy_(torch.tensor([p for n, r in zip(kv, rows) for p in range(n - r, n)], dtype=c["q_pos"].dtype)
                     .to(device))
    c["q"].copy_(randn_nonzero(*c["q"].shape, dtype=c["q"].dtype, device=device))
    out, lse = run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"])
    check_against_reference((c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"]), out, lse)
    # one sequence past its tiles' coverage: plan again
    over = int(covered[0]) + 1
    if over <= 16:
        c["cu"].copy_(torch.tensor([0, over, over, 16], dtype=c["cu"].dtype).to(device))
        if device.type == "cpu":
            with pytest.raises(ValueError, match="plan again"):
                run_paged_attention(plan, c["q"], c["q_pos"], c["k"], c["v"])


def test_rotary_dim_without_inv_freq_is_refused(backend, device):
    """rotary_dim only means something with inv_freq (keys rotated in the kernel); alone it was
    ignored silently. Refused by name on the plan path and the step alike."""
    from ragattn.ops import PagedAttentionStep

    c = make_csr_case([[12], [2, 3]], [13, 4], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.float32, device=device)
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8)
    with pytest.raises(ValueError, match="rotary_dim = 32 is given without inv_freq"):
        run_paged_attention(_plan(c, table), c["q"], c["q_pos"], c["k"], c["v"], rotary_dim=32)
    with pytest.raises(ValueError, match="rotary_dim = 32 is given without inv_freq"):
        PagedAttentionStep(c["cu"], table).run(c["q"], c["q_pos"], c["k"], c["v"], rotary_dim=32)


def test_more_rows_than_max_q_len_is_refused_on_every_backend(backend, device):
    """A sequence with more query rows than the plan's max_q_len: 'plan again' on the plan path and
    on the step's CPU kernels alike (the CPU step computed it silently, the Triton plan refused it)."""
    from ragattn.ops import PagedAttentionStep

    if device.type != "cpu":
        pytest.skip("a precondition on CUDA (RAGATTN_DEBUG=1 checks it)")
    c = make_csr_case([[12], [1, 2, 3]], [13, 4], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.float32, device=device)
    table = PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8)
    with pytest.raises(ValueError, match="more than the max_q_len = 2 planned for: plan again"):
        run_paged_attention(_plan(c, table, max_q_len=2, max_kv_len=16), c["q"], c["q_pos"], c["k"], c["v"])
    with pytest.raises(ValueError, match="more than the max_q_len = 2 planned for: plan again"):
        PagedAttentionStep(c["cu"], table, max_q_len=2, max_kv_len=16).run(c["q"], c["q_pos"], c["k"], c["v"])
