"""The engine-facing plan/run pair of paged_attention: ``ragattn.PageTable`` from a
padded block table or FlashInfer's CSR page lists, ``plan_paged_attention`` once per step (exact,
or for a maximum with no host read), ``run_paged_attention`` per layer
(``torch.ops.ragattn.paged_attention_run``: no host sync, traceable, opcheck'd), against the
float64 reference on every CPU backend and the Triton kernel in the interpreter."""
from __future__ import annotations

import math

import pytest
import torch

import ragattn
from ragattn import PageTable, plan_paged_attention, run_paged_attention
from tests.helpers import randn_nonzero, use_kernel_backend
from tests.ops.test_paged_attention import check_against_reference

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


# ------------------------------------------------- position-tagged pages and in-kernel RoPE (27)

def make_tagged_case(chunk_lens, scheme, *, page_size, num_heads, num_kv_heads, head_dim, dtype, device,
                     question_len=3, gen=None):
    """One request over chunk pages whose K is stored *without* RoPE: entries (page, first
    position, valid slots) with the chunks positioned by ``scheme`` ("composite": every chunk from
    0; "reordered": consecutive; "gapped": consecutive with random gaps), then a private question
    entry. Rows: the question's tokens and one scattered row inside each chunk (selective
    recompute). A second request shares the first chunk's pages at another position."""
    counts = [math.ceil(n / page_size) for n in chunk_lens] + [math.ceil(question_len / page_size)]
    num_pages = sum(counts) + 3
    perm = torch.randperm(num_pages, generator=gen)
    pages, first, valid, at, pos = [], [], [], 0, 0
    rows = []
    for c, n in enumerate(chunk_lens + [question_len]):
        start = 0 if (scheme == "composite" and c < len(chunk_lens)) else pos
        if scheme == "gapped":
            start += int(torch.randint(0, 9, (1,), generator=gen))
        for e in range(counts[c]):
            pages.append(int(perm[at + e]))
            first.append(start + e * page_size)
            valid.append(min(page_size, n - e * page_size))
        at += counts[c]
        if c < len(chunk_lens):
            rows.append(start + int(torch.randint(0, n, (1,), generator=gen)))
        pos = max(pos, start + n)
    question = [first[-counts[-1]] + i for i in range(question_len)]
    # request 2: chunk 0's pages at position 100 (a shared chunk, another position), then its question
    pages2 = pages[: counts[0]] + pages[-counts[-1]:]
    first2 = [100 + e * page_size for e in range(counts[0])] + [100 + chunk_lens[0] + e * page_size
                                                               for e in range(counts[-1])]
    valid2 = valid[: counts[0]] + valid[-counts[-1]:]
    t = lambda x: torch.tensor(x, dtype=I32, device=device)  # noqa: E731
    indptr = t([0, len(pages), len(pages) + len(pages2)])
    table = PageTable.from_entries(indptr, t(pages + pages2), t(first + first2), t(valid + valid2), page_size)
    q_pos = rows + question + [100 + chunk_lens[0]]
    cu = t([0, len(rows) + question_len, len(q_pos)])
    q = randn_nonzero(len(q_pos), num_heads, head_dim, dtype=dtype, device=device)
    k = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return q, t(q_pos), cu, k, v, table


def _table_refs(q, q_pos, cu, k, v, table, window_left, rope):
    from ragattn.reference.paged_attention_table import paged_attention_table

    a = (q, q_pos, cu, k, v, table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len,
         *rope, None, window_left)
    return paged_attention_table(*a), paged_attention_table(*a, upcast=False)


@pytest.mark.parametrize("scheme", ["composite", "reordered", "gapped"])
@pytest.mark.parametrize("rope", ["none", "neox", "gptj-partial"])
def test_position_tagged_pages_with_in_kernel_rope(backend, device, seed, scheme, rope):
    """Zero-copy requests: keys stored without RoPE in shared chunk pages, positions and valid
    slots from the page list, rotated in the kernel; vs the float64 reference (rotate each key by
    its position, then varlen attention by position), with the precision rule."""
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    head_dim = 64
    dtype = {"composite": torch.bfloat16, "reordered": torch.float16, "gapped": torch.float32}[scheme]
    q, q_pos, cu, k, v, table = make_tagged_case([13, 8, 21], scheme, page_size=8, num_heads=6, num_kv_heads=2,
                                                 head_dim=head_dim, dtype=dtype, device=device, gen=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ropes = {"none": (None, 0, False), "neox": (inv_freq.to(device), head_dim, False),
             "gptj-partial": (inv_freq[:16].to(device), 32, True)}
    rp = ropes[rope]
    for window_left in (-1, 10):
        plan = _plan(dict(cu=cu, q=q, k=k), table, window_left, num_splits=2 if backend == "triton" else None)
        out = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:2], float("nan"), device=device)
        kw = dict(inv_freq=rp[0], rotary_dim=rp[1] or None, interleaved=rp[2]) if rp[0] is not None else {}
        run_paged_attention(plan, q, q_pos, k, v, out=out, lse_out=lse, **kw)
        (o64, l64), (olp, llp) = _table_refs(*(x.cpu() for x in (q, q_pos, cu, k, v)),
                                             PageTable(*(None if x is None else x.cpu() for x in (
                                                 table.pages, table.kv_lens, table.row_start, table.entry_pos,
                                                 table.entry_len))),
                                             window_left, tuple(x.cpu() if torch.is_tensor(x) else x for x in rp))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_precision(out.cpu(), o64, olp)
        assert_precision(lse.cpu(), l64, llp, what="lse")


def _hf_inv_freq(rope_type):
    """inv_freq of a Llama RoPE with each scaling ragattn supports (those that only change the
    frequencies: default, linear, llama3), from transformers' own rotary embedding."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    params = {"default": {"rope_type": "default", "rope_theta": 10000.0},
              "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
              "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}[rope_type]
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=1 << 17, rope_parameters=params)
    return LlamaRotaryEmbedding(cfg).inv_freq.float()


def _check_far_positions(case, far, inv_freq, device):
    """``case`` (make_tagged_case's) moved ``far`` positions on (entries and rows alike: the same
    visibility), run with in-kernel RoPE, against the float64 reference with the precision rule."""
    from tests.helpers import assert_precision

    q, q_pos, cu, k, v, table = case
    table = PageTable(table.pages, table.kv_lens, table.row_start, table.entry_pos + far, table.entry_len)
    q_pos = q_pos + far
    out, lse = run_paged_attention(_plan(dict(cu=cu, q=q, k=k), table), q, q_pos, k, v, inv_freq=inv_freq.to(device))
    cpu = PageTable(*(None if x is None else x.cpu() for x in (table.pages, table.kv_lens, table.row_start,
                                                             table.entry_pos, table.entry_len)))
    (o64, l64), (olp, llp) = _table_refs(q.cpu(), q_pos.cpu(), cu.cpu(), k.cpu(), v.cpu(), cpu, -1,
                                         (inv_freq, q.shape[-1], False))
    assert_precision(out.cpu(), o64, olp)
    assert_precision(lse.cpu(), l64, llp, what="lse")


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_in_kernel_rope_scalings_at_long_positions(backend, device, seed, rope_type):
    """The in-kernel rotation with every RoPE scaling the chunk store accepts (ragattn.hf.rope:
    frequencies only), at positions past 40000 (chunks placed there with gaps), against the
    float64 reference, with the precision rule."""
    gen = torch.Generator().manual_seed(seed)
    case = make_tagged_case([9, 14], "gapped", page_size=8, num_heads=4, num_kv_heads=2, head_dim=64,
                            dtype=torch.float32, device=device, gen=gen)
    _check_far_positions(case, 40000 + int(torch.randint(0, 1000, (1,), generator=gen)), _hf_inv_freq(rope_type),
                         device)


def test_tagged_positions_near_int32_max(backend, device, seed):
    """Chunks and rows at positions near 2^31 - 1 (int32 tables): the same rule on every backend
    (on the CPU, positions past the C++ kernel's 2^20-row RoPE table run the reference)."""
    case = make_tagged_case([9, 6], "reordered", page_size=4, num_heads=4, num_kv_heads=2, head_dim=64,
                            dtype=torch.float32, device=device, gen=torch.Generator().manual_seed(seed))
    far = (1 << 31) - 1 - int(case[1].max())
    assert int(case[1].max()) + far == (1 << 31) - 1
    _check_far_positions(case, far, _hf_inv_freq("llama3"), device)


def test_slots_past_an_entrys_valid_count_are_never_read(backend, device, seed):
    """NaN in the slots past each entry's valid count (a chunk's partial last page) and in the
    request's unused pages change nothing."""
    q, q_pos, cu, k, v, table = make_tagged_case([11, 5], "reordered", page_size=8, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=device)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    clean = run_paged_attention(plan, q, q_pos, k, v)
    k2, v2 = k.clone(), v.clone()
    for e, (p, n) in enumerate(zip(table.pages.tolist(), table.entry_len.tolist())):
        k2[p, n:] = float("nan")
        v2[p, n:] = float("inf")
    used = set(table.pages.tolist())
    for p in range(k.shape[0]):
        if p not in used:
            k2[p], v2[p] = float("nan"), float("nan")
    got = run_paged_attention(plan, q, q_pos, k2, v2)
    torch.testing.assert_close(got[0], clean[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], clean[1], rtol=0, atol=0)


@pytest.mark.parametrize("rows", ["many", "one per sequence"])
def test_cpu_tagged_kernel_row_blocks_and_scratch_groups(seed, monkeypatch, rows):
    """The C++ tagged kernel: row blocks (slots every row of a block sees, then each row's others)
    and decode rows, keys rotated once into scratch in groups of sequences that fit its budget (a
    1-byte budget makes each sequence a group: bit for bit the same). Against the float64
    reference, GQA 3, page size 5, a window, bf16."""
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([13, 4, 9], "reordered", page_size=5, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                                                 gen=gen, question_len=4)
    if rows == "one per sequence":   # each request's last row (its question's last token)
        last = (cu[1:] - 1).long()
        q, q_pos, cu = q[last], q_pos[last], torch.arange(3, dtype=I32)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    for window_left in (-1, 7):
        plan = _plan(dict(cu=cu, q=q, k=k), table, window_left)
        got = run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq)
        (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, window_left, (inv_freq, 64, False))
        assert_precision(got[0], o64, olp)
        assert_precision(got[1], l64, llp, what="lse")
        monkeypatch.setenv("RAGATTN_TEST_TAGGED_SCRATCH_BYTES", "1")
        grouped = run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq)
        monkeypatch.delenv("RAGATTN_TEST_TAGGED_SCRATCH_BYTES")
        assert torch.equal(grouped[0], got[0]) and torch.equal(grouped[1], got[1])


def test_cpu_tagged_private_op_checks_like_its_fake():
    """``ragattn::_paged_attention_tagged_cpu`` (the C++ kernel the CPU route calls directly):
    opcheck, and out-of-range index values refused before any read."""
    q, q_pos, cu, k, v, table = make_tagged_case([6, 9], "gapped", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    from ragattn.ops.paged_attention_run import rope_position_table

    cos, sin = rope_position_table(torch.rand(32) * 0.5 + 0.01, int(q_pos.max()) + 1)
    op = torch.ops.ragattn._paged_attention_tagged_cpu.default
    args = [q, q_pos, cu, k, v, table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len, cos,
            sin, 64, False, 0.125, -1, 0.0]
    torch.library.opcheck(op, tuple(args))
    for bad, msg, values in [({5: table.pages + k.shape[0]}, "must lie in", True),
                             ({10: cos[:-1], 11: sin[:-1]}, "RoPE table has", True),
                             ({9: table.entry_len + 4}, "entry_len", True), ({11: None}, "go together", False),
                             ({12: 63}, "rotary_dim must be even", False),
                             ({10: cos.double(), 11: sin.double()}, "contiguous float32", False),
                             ({6: table.row_start[:1]}, "row_start must be", False)]:
        a = list(args)
        for i, x in bad.items():
            a[i] = x
        with pytest.raises(ValueError, match=msg):
            op(*a)
        if not values:   # the fake impl refuses what needs no index values, with the same message
            with torch._subclasses.fake_tensor.FakeTensorMode() as mode, pytest.raises(ValueError, match=msg):
                op(*[mode.from_tensor(x) if torch.is_tensor(x) else x for x in a])


def test_tagged_run_opcheck_and_errors(device):
    q, q_pos, cu, k, v, table = make_tagged_case([6, 9], "composite", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=device)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    inv_freq = torch.rand(32, device=device) * 0.5 + 0.01
    args = (q, q_pos, cu, k, v, table.pages, table.row_start, table.kv_lens, plan.tile_seq, plan.tile_row0,
            list(plan.launch), None, -1, table.entry_pos, table.entry_len, inv_freq, 64, False)
    torch.library.opcheck(torch.ops.ragattn.paged_attention_run.default, args)
    with pytest.raises(ValueError, match="rotary_dim must be even"):
        run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq[:16], rotary_dim=31)
    with pytest.raises(ValueError, match=r"inv_freq must have shape \(16,\)"):
        run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq, rotary_dim=32)
    with pytest.raises(ValueError, match="needs a flat page list"):
        bad = list(args)
        bad[6] = None
        bad[5] = table.pages.view(1, -1)
        torch.ops.ragattn.paged_attention_run(*bad)
    with pytest.raises(ValueError, match=r"valid must lie in \[0, page_size = 4\]"):
        PageTable.from_entries(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([5]), 4)
    with pytest.raises(ValueError, match="first_pos must be >= 0"):
        PageTable.from_entries(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([-1]), torch.tensor([2]), 4)


# ----------------------------------------------------------------------- fp8 caches (25.3)

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
    page (pages smaller than a key tile) or once per tile (pages holding whole tiles: the
    H100-measured "page ids loaded once per page"): each mode, with windows that start inside a page, split-KV
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
        assert_precision(out.cpu(), o64, olp)
        assert_precision(lse.cpu(), l64, llp, what="lse")
