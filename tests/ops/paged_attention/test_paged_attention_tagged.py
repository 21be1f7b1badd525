"""Position-tagged pages (PageTable.from_entries) and RoPE in the kernel against the float64 reference."""
from __future__ import annotations
import math
import pytest
import torch
from ragattn import PageTable, run_paged_attention
from tests.helpers import randn_nonzero

from tests.ops.paged_attention.test_paged_attention_plan import I32, _plan, backend  # noqa: F401 (fixtures)


# ------------------------------------------------- position-tagged pages and in-kernel RoPE

def make_tagged_case(chunk_lens, scheme, *, page_size, num_heads, num_kv_heads, head_dim, dtype, device,
                     question_len=3, gen=None):
    """One request over chunk pages whose K is stored *page-local* (random keys: any values are
    keys rotated by their page offset): entries (page, first
    position, valid slots) with the chunks positioned by ``scheme`` ("composite": every chunk from
    0; "reordered": consecutive; "gapped": consecutive with random gaps; "runs": consecutive, each
    chunk entry a run of its page from a random first slot, ``entry_start``, at most the offset of
    a row in it), then a private question entry. Rows: the question's tokens and one scattered row
    inside each chunk (selective recompute). A second request shares the first chunk's pages at
    another position."""
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
    starts = None
    if scheme == "runs":
        starts = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in valid[:-counts[-1]]] + [0] * counts[-1]
        for r in rows:   # a row's own slot stays in its entry's run (every row sees a slot)
            e = max(i for i, f in enumerate(first) if f <= r)
            starts[e] = min(starts[e], r - first[e])
    # request 2: chunk 0's pages at position 100 (a shared chunk, another position), then its question
    pages2 = pages[: counts[0]] + pages[-counts[-1]:]
    first2 = [100 + e * page_size for e in range(counts[0])] + [100 + chunk_lens[0] + e * page_size
                                                               for e in range(counts[-1])]
    valid2 = valid[: counts[0]] + valid[-counts[-1]:]
    t = lambda x: torch.tensor(x, dtype=I32, device=device)  # noqa: E731
    indptr = t([0, len(pages), len(pages) + len(pages2)])
    starts2 = None if starts is None else starts[: counts[0]] + [0] * counts[-1]
    table = PageTable.from_entries(indptr, t(pages + pages2), t(first + first2), t(valid + valid2), page_size,
                                   None if starts is None else t(starts + starts2))
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
    start = table.entry_start
    return paged_attention_table(*a, entry_start=start), paged_attention_table(*a, entry_start=start, upcast=False)


def _assert_rotated_near_reference(q, q_pos, cu, k, v, table, windows):
    """The op with NeoX RoPE over all 64 dims, per window, at the float64 reference's precision."""
    from tests.helpers import assert_precision

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    for window_left in windows:
        plan = _plan(dict(cu=cu, q=q, k=k), table, window_left)
        got = run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq)
        (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, window_left, (inv_freq, 64, False))
        assert_precision(got[0], o64, olp)
        assert_precision(got[1], l64, llp, what="lse")


@pytest.mark.parametrize("scheme", ["composite", "reordered", "gapped", "runs"])
@pytest.mark.parametrize("rope", ["none", "neox", "gptj-partial"])
def test_position_tagged_pages_with_in_kernel_rope(backend, device, seed, scheme, rope):
    """Zero-copy requests: keys stored page-local in shared chunk pages, positions and valid
    slots from the page list, moved to their positions in the kernel; vs the float64 reference
    (rotate each key by its entry's first position, then varlen attention by position), with the
    precision rule."""
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    head_dim = 64
    dtype = {"composite": torch.bfloat16, "reordered": torch.float16, "gapped": torch.float32,
             "runs": torch.bfloat16}[scheme]
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
                                                 table.entry_len, table.entry_start))),
                                             window_left, tuple(x.cpu() if torch.is_tensor(x) else x for x in rp))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        assert_precision(out.cpu(), o64, olp)
        assert_precision(lse.cpu(), l64, llp, what="lse")


@pytest.mark.parametrize("rope", ["neox", "gptj-partial"])
def test_page_local_keys_attend_as_keys_rotated_at_their_positions(backend, device, seed, rope):
    """What "page-local" means, from the definition of RoPE and not from the reference: keys
    ``x`` of every slot rotated by their page offset (``rope_rotate(x, o)``), placed by the table
    and moved in the kernel, attend as the same ``x`` rotated at their positions and stored
    as a plain cache holds them (``rope_rotate(x, p0 + o)``, no ``inv_freq``): the run with RoPE in
    the kernel against the float64 reference of the run without it."""
    from ragattn.reference.kv_cache import rope_rotate
    from ragattn.reference.paged_attention_table import table_slots
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    head_dim, page_size = 64, 8
    rotary_dim, interleaved = (64, False) if rope == "neox" else (32, True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    q, q_pos, cu, x, v, table = make_tagged_case([13, 8, 21], "gapped", page_size=page_size, num_heads=6,
                                                 num_kv_heads=2, head_dim=head_dim, dtype=torch.float32,
                                                 device=torch.device("cpu"), gen=gen)
    # request 2 puts chunk 0's pages at another position: one physical key, two rotations; keep
    # request 1 only, so that each physical slot has one position
    n1 = int(table.row_start[1])
    keep = int(cu[1])
    table = PageTable.from_entries(torch.tensor([0, n1], dtype=I32), table.pages[:n1], table.entry_pos[:n1],
                                   table.entry_len[:n1], page_size)
    q, q_pos, cu = q[:keep], q_pos[:keep], cu[:2]
    offsets = torch.arange(page_size).repeat(x.shape[0])
    local = rope_rotate(x.double().reshape(-1, x.shape[2], head_dim), offsets, inv_freq, rotary_dim, interleaved,
                        compute_dtype=torch.float64).reshape(x.shape)
    placed = local.clone()
    (page, off, pos), = table_slots(table.pages, table.row_start, table.kv_lens, page_size, table.entry_pos,
                                    table.entry_len)
    placed[page, off] = rope_rotate(x.double()[page, off], pos, inv_freq, rotary_dim, interleaved,
                                    compute_dtype=torch.float64)
    dev = lambda t: t.to(device)  # noqa: E731
    dtable = PageTable(*(None if t is None else dev(t) for t in (table.pages, table.kv_lens, table.row_start,
                                                                  table.entry_pos, table.entry_len)))
    plan = _plan(dict(cu=dev(cu), q=dev(q), k=dev(x)), dtable)
    out, lse = run_paged_attention(plan, dev(q), dev(q_pos), dev(local.float()), dev(v), inv_freq=dev(inv_freq),
                                   rotary_dim=rotary_dim, interleaved=interleaved)
    (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, placed.float(), v, table, -1, (None, 0, False))
    assert_precision(out.cpu(), o64, olp)
    assert_precision(lse.cpu(), l64, llp, what="lse")


@pytest.mark.parametrize("rope", ["none", "neox"])
def test_runs_of_shared_pages_around_private_rows_attend_as_a_private_copy(backend, device, seed, rope):
    """Copy on write by rows, the form a selective-recompute request takes over shared chunk pages:
    the chunks' pages read as runs (``entry_start``) around the rows the request recomputed, and
    those rows from a private page of their own (one entry each, at its slot of that page), attend
    exactly as a private copy of the chunks with the recomputed rows written in place; keys
    page-local (RoPE in the kernel) or rotated, float64 reference of the copy."""
    from ragattn.reference.kv_cache import rope_rotate
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    page_size, head_dim, hq, hkv = 8, 64, 6, 2
    lens, head = [13, 8, 21], 5                                  # chunk tokens, then 4 question rows
    pos = torch.arange(head, head + sum(lens))                   # chunk token positions
    n = pos.numel()
    recomputed = torch.randperm(n, generator=gen)[:7].sort().values   # chunk token indices held privately
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

    def stored(x, offsets):   # keys as a page holds them: page-local (rotated by the slot's offset)
        if rope == "none":
            return x
        return rope_rotate(x, offsets, inv_freq, head_dim, False, compute_dtype=torch.float64)

    x_shared = randn_nonzero(n, hkv, head_dim, dtype=torch.float64, generator=gen)   # the chunks' keys, values
    v_shared = randn_nonzero(n, hkv, head_dim, dtype=torch.float64, generator=gen)
    x_fresh = randn_nonzero(recomputed.numel(), hkv, head_dim, dtype=torch.float64, generator=gen)
    v_fresh = randn_nonzero(recomputed.numel(), hkv, head_dim, dtype=torch.float64, generator=gen)
    x_q = randn_nonzero(4, hkv, head_dim, dtype=torch.float64, generator=gen)           # the question's own
    v_q = randn_nonzero(4, hkv, head_dim, dtype=torch.float64, generator=gen)
    # chunk c's token j at slot j of the chunk's pages (page-local: every page starts a chunk's run)
    tok_page, tok_off, pages_of = [], [], []
    num = 0
    for c, L in enumerate(lens):
        m = math.ceil(L / page_size)
        pages_of.append(list(range(num, num + m)))
        tok_page += [num + j // page_size for j in range(L)]
        tok_off += [j % page_size for j in range(L)]
        num += m
    tok_page, tok_off = torch.tensor(tok_page), torch.tensor(tok_off)
    chunk_first = [0] + torch.tensor(lens).cumsum(0).tolist()
    priv = num                          # the private page of the recomputed rows (slot i: row i)
    qpage = num + 1                     # the question's page
    copy0 = num + 2                     # the private copy's pages (the reference's request)
    k = torch.full((copy0 + num, page_size, hkv, head_dim), float("nan"), dtype=torch.float64)
    v = k.clone()
    k[tok_page, tok_off] = stored(x_shared, tok_off)
    v[tok_page, tok_off] = v_shared
    slots = torch.arange(recomputed.numel())
    k[priv, slots] = stored(x_fresh, slots)
    v[priv, slots] = v_fresh
    k[qpage, :4] = stored(x_q, torch.arange(4))
    v[qpage, :4] = v_q
    x_copy, v_copy = x_shared.clone(), v_shared.clone()
    x_copy[recomputed], v_copy[recomputed] = x_fresh, v_fresh
    k[copy0 + tok_page, tok_off] = stored(x_copy, tok_off)
    v[copy0 + tok_page, tok_off] = v_copy
    q_end = head + n

    # request 1: the chunk pages as runs around the recomputed rows, the private rows, the question
    held = torch.zeros(n, dtype=torch.bool)
    held[recomputed] = True
    e_page, e_first, e_start, e_len = [], [], [], []
    for c, L in enumerate(lens):
        for i, p in enumerate(pages_of[c]):
            a, b = chunk_first[c] + i * page_size, chunk_first[c] + min(L, (i + 1) * page_size)
            run_from = a
            for t in range(a, b + 1):        # runs of shared slots between held rows
                if t == b or held[t]:
                    if t > run_from:
                        e_page.append(p), e_first.append(int(pos[a])), e_start.append(run_from - a)
                        e_len.append(t - a)
                    run_from = t + 1
    for i, r in enumerate(recomputed.tolist()):
        e_page.append(priv), e_first.append(int(pos[r]) - i), e_start.append(i), e_len.append(i + 1)
    e_page.append(qpage), e_first.append(q_end), e_start.append(0), e_len.append(4)
    # request 2: the private copy, whole pages from slot 0
    c_page = [copy0 + p for ps in pages_of for p in ps] + [qpage]
    c_first = [int(pos[chunk_first[c] + i * page_size]) for c, ps in enumerate(pages_of) for i in range(len(ps))]
    c_len = [min(page_size, L - i * page_size) for c, L in enumerate(lens) for i in range(len(pages_of[c]))]
    c_first, c_len = c_first + [q_end], c_len + [4]
    i32 = lambda x: torch.tensor(x, dtype=I32)  # noqa: E731
    runs = PageTable.from_entries(i32([0, len(e_page)]), i32(e_page), i32(e_first), i32(e_len), page_size,
                                  i32(e_start))
    copy = PageTable.from_entries(i32([0, len(c_page)]), i32(c_page), i32(c_first), i32(c_len), page_size)
    # rows: the question, and a few recomputed rows themselves (each sees the chunks up to it)
    q_pos = torch.cat([pos[recomputed[::2]], torch.arange(q_end, q_end + 4)]).to(I32)
    q = randn_nonzero(q_pos.numel(), hq, head_dim, dtype=torch.float32, generator=gen)
    cu = i32([0, q_pos.numel()])
    rp = (inv_freq, head_dim, False) if rope == "neox" else (None, 0, False)
    kw = dict(inv_freq=inv_freq.to(device), rotary_dim=head_dim) if rope == "neox" else {}
    dev = lambda t: t.to(device)  # noqa: E731
    dtable = PageTable(*(None if t is None else dev(t) for t in (runs.pages, runs.kv_lens, runs.row_start,
                                                                  runs.entry_pos, runs.entry_len, runs.entry_start)))
    plan = _plan(dict(cu=dev(cu), q=dev(q), k=dev(k.float())), dtable)
    out = torch.full_like(dev(q), float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    run_paged_attention(plan, dev(q), dev(q_pos), dev(k.float()), dev(v.float()), out=out, lse_out=lse, **kw)
    (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k.float(), v.float(), copy, -1, rp)
    assert_precision(out.cpu(), o64, olp)
    assert_precision(lse.cpu(), l64, llp, what="lse")
    # and the runs matter: the shared pages read whole (stale rows, no private ones) differ
    whole = PageTable.from_entries(i32([0, len(c_page)]), i32([p - copy0 for p in c_page[:-1]] + [qpage]),
                                   i32(c_first), i32(c_len), page_size)
    (s64, _), _ = _table_refs(q, q_pos, cu, k.float(), v.float(), whole, -1, rp)
    assert (s64 - o64).abs().max() > 1e-3

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
def test_cpu_tagged_kernel_row_blocks(seed, rows):
    """The C++ tagged kernel: row blocks (slots every row of a block sees, then each row's others)
    and decode rows, the query rotated by -p0 per entry (page size 5: several entries within one
    128-slot softmax chunk, each scored with its own rotation). Against the float64 reference,
    GQA 3, a window, bf16."""
    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([13, 4, 9], "reordered", page_size=5, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                                                 gen=gen, question_len=4)
    if rows == "one per sequence":   # each request's last row (its question's last token)
        last = (cu[1:] - 1).long()
        q, q_pos, cu = q[last], q_pos[last], torch.arange(3, dtype=I32)
    _assert_rotated_near_reference(q, q_pos, cu, k, v, table, windows=(-1, 7))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tagged_kernel_decode_rows_split_their_slots(seed, dtype):
    """Decode rows (one per sequence) over long page lists: fewer items than the kernel wants
    (row blocks x kv heads), so each sequence's entries are split into parts merged after
    (split-KV). The float64 reference's precision with a window that leaves most parts empty; the
    same bits on 1 and 3 threads and beside another sequence (the split is the sequence's own); a
    NaN key in one part poisons exactly its kv head's heads, an inf value only its own dim."""
    import dataclasses

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([130, 77, 201, 95], "gapped", page_size=13, num_heads=6,
                                                 num_kv_heads=2, head_dim=64, dtype=dtype,
                                                 device=torch.device("cpu"), gen=gen, question_len=5)
    last = (cu[1:] - 1).long()
    q, q_pos, cu = q[last], q_pos[last], torch.arange(3, dtype=I32)
    assert int(table.kv_lens.max()) >= 2 * 128   # long enough to split
    _assert_rotated_near_reference(q, q_pos, cu, k, v, table, windows=(-1, 7))
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        clean = run_paged_attention(plan, q, q_pos, k, v)
        torch.set_num_threads(3)
        again = run_paged_attention(plan, q, q_pos, k, v)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(clean[0], again[0]) and torch.equal(clean[1], again[1])
    three = dataclasses.replace(table, row_start=torch.cat([table.row_start, table.row_start[1:]]),
                                kv_lens=torch.cat([table.kv_lens, table.kv_lens[1:]]))
    q3, q_pos3, cu3 = torch.cat([q, q[1:]]), torch.cat([q_pos, q_pos[1:]]), torch.arange(4, dtype=I32)
    got = run_paged_attention(_plan(dict(cu=cu3, q=q3, k=k), three), q3, q_pos3, k, v)
    assert torch.equal(got[0][:2], clean[0]) and torch.equal(got[1][:2], clean[1])
    e = int(table.row_start[0]) + 10 + 6 + 3   # a page of chunk 2, request 0's alone (its row sees it)
    page = int(table.pages[e])
    k2, v2 = k.clone(), v.clone()
    k2[page, 0, 1] = float("nan")
    v2[page, 0, 0, 5] = float("inf")
    out, lse = run_paged_attention(plan, q, q_pos, k2, v)
    assert torch.isnan(out[0, 3:]).all() and torch.isnan(lse[0, 3:]).all()
    assert torch.equal(out[0, :3], clean[0][0, :3]) and torch.equal(out[1], clean[0][1])
    out, lse = run_paged_attention(plan, q, q_pos, k, v2)
    assert torch.isnan(out[0, :3, 5]).all() and torch.isfinite(lse).all()
    rest = torch.ones_like(out, dtype=torch.bool)
    rest[0, :3, 5] = False
    assert torch.equal(out[rest], clean[0][rest])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_tagged_kernel_many_rows_per_sequence(seed, dtype):
    """The C++ tagged kernel's route for sequences with many query rows (a recompute pass: rows
    scattered over the chunks, then a 40-token question; GEMMs over tiles of rows): the float64
    reference's precision with and without RoPE, a window and GQA 3; a NaN key that some rows see
    poisons exactly their heads of its kv head; an inf value some rows see makes their outputs NaN
    and leaves the rest near the reference."""
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([70, 45, 90, 33], "gapped", page_size=8, num_heads=6,
                                                 num_kv_heads=2, head_dim=64, dtype=dtype,
                                                 device=torch.device("cpu"), gen=gen, question_len=40)
    assert int(cu[1]) >= 40
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    for rope in ((None, 0, False), (inv_freq, 64, False)):
        kw = dict(inv_freq=rope[0]) if rope[0] is not None else {}
        for window_left in (-1, 30):
            plan = _plan(dict(cu=cu, q=q, k=k), table, window_left)
            got = run_paged_attention(plan, q, q_pos, k, v, **kw)
            (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, window_left, rope)
            assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all()
            assert_precision(got[0], o64, olp)
            assert_precision(got[1], l64, llp, what="lse")
    # the question's first token sees the slot below; rows before it do not (positions ascend)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    clean = run_paged_attention(plan, q, q_pos, k, v)
    first_q = int(cu[1]) - 40
    e = int(table.row_start[0]) + (int(table.kv_lens[0]) - 40) // 8  # the question's first page
    page, pos = int(table.pages[e]), int(table.entry_pos[e])
    sees = (q_pos[: int(cu[1])] >= pos)
    assert sees[first_q:].all() and not sees[:first_q].any()
    k2 = k.clone()
    k2[page, 0, 1] = float("nan")
    out, lse = run_paged_attention(plan, q, q_pos, k2, v)
    n = int(cu[1])
    assert torch.isnan(out[:n][sees][:, 3:]).all() and torch.isnan(lse[:n][sees][:, 3:]).all()
    assert torch.equal(out[:n][sees][:, :3], clean[0][:n][sees][:, :3])
    assert torch.equal(out[:n][~sees], clean[0][:n][~sees]) and torch.equal(lse[:n][~sees], clean[1][:n][~sees])
    v2 = v.clone()
    v2[page, 0, 0, 5] = float("inf")
    out, lse = run_paged_attention(plan, q, q_pos, k, v2)
    assert torch.isnan(out[:n][sees][:, :3, 5]).all() and torch.isfinite(lse[:n]).all()
    rest = torch.ones_like(out[:n], dtype=torch.bool)  # (request 2 shares the question's pages)
    rest[sees.nonzero()[:, 0], :3, 5] = False
    torch.testing.assert_close(out[:n][rest], clean[0][:n][rest], atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)



@pytest.mark.parametrize("threads", [1, 3])
def test_cpu_tagged_kernel_many_rows_threads_agree(seed, threads):
    """The many-rows route (tiles of rows through ATen GEMMs, which may run on several threads):
    the result does not depend on the thread count (bit for bit), within the float64 reference's
    precision."""
    from tests.helpers import assert_precision

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([70, 45, 90, 33], "gapped", page_size=8, num_heads=6,
                                                 num_kv_heads=2, head_dim=64, dtype=torch.float32,
                                                 device=torch.device("cpu"), gen=gen, question_len=100)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq)
        torch.set_num_threads(threads)
        got = run_paged_attention(plan, q, q_pos, k, v, inv_freq=inv_freq)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, -1, (inv_freq, 64, False))
    assert_precision(got[0], o64, olp)
    assert_precision(got[1], l64, llp, what="lse")


@pytest.mark.parametrize("rope", [(64, False), (32, True)], ids=["neox", "gptj-partial"])
def test_cpu_tagged_kernel_many_rows_rotated_as_gathered(seed, rope):
    """The route for many rows per sequence rotates the keys by their entry's p0 as it gathers
    them; the other sequences take the row blocks (query rotated per entry). Both at the float64
    reference's precision; an inf value that some rows of the many-row sequence see sends that
    sequence to the row blocks: those rows NaN in that dim, the rest near the clean result."""
    from tests.helpers import assert_precision

    rotary_dim, interleaved = rope
    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([70, 45, 90, 33], "gapped", page_size=8, num_heads=6,
                                                 num_kv_heads=2, head_dim=64, dtype=torch.float32,
                                                 device=torch.device("cpu"), gen=gen, question_len=40)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    kw = dict(inv_freq=inv_freq, rotary_dim=rotary_dim, interleaved=interleaved)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    got = run_paged_attention(plan, q, q_pos, k, v, **kw)
    (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, -1, (inv_freq, rotary_dim, interleaved))
    assert_precision(got[0], o64, olp)
    assert_precision(got[1], l64, llp, what="lse")
    n = int(cu[1])
    e = int(table.row_start[0]) + (int(table.kv_lens[0]) - 40) // 8  # the question's first page
    page, pos = int(table.pages[e]), int(table.entry_pos[e])
    sees = q_pos[:n] >= pos
    v2 = v.clone()
    v2[page, 0, 0, 5] = float("inf")
    out, lse = run_paged_attention(plan, q, q_pos, k, v2, **kw)
    assert torch.isnan(out[:n][sees][:, :3, 5]).all() and torch.isfinite(lse[:n]).all()
    rest = torch.ones_like(out[:n], dtype=torch.bool)   # (request 2 shares the question's pages)
    rest[sees.nonzero()[:, 0], :3, 5] = False
    torch.testing.assert_close(out[:n][rest], got[0][:n][rest], atol=1e-5, rtol=0)

def test_cpu_tagged_private_op_checks_like_its_fake():
    """``ragattn::_paged_attention_tagged_cpu`` (the C++ kernel the CPU route calls directly):
    opcheck, and out-of-range index values refused before any read."""
    q, q_pos, cu, k, v, table = make_tagged_case([6, 9], "runs", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    from ragattn.ops.paged_kernels import rope_position_table

    cos, sin = rope_position_table(torch.rand(32) * 0.5 + 0.01, int(q_pos.max()) + 1)
    op = torch.ops.ragattn._paged_attention_tagged_cpu.default
    args = [q, q_pos, cu, k, v, table.pages, table.row_start, table.kv_lens, table.entry_pos, table.entry_len,
            table.entry_start, cos, sin, 64, False, 0.125, -1, 0.0]
    torch.library.opcheck(op, tuple(args))
    for bad, msg, values in [({5: table.pages + k.shape[0]}, "must lie in", True),
                             ({11: cos[:-1], 12: sin[:-1]}, "RoPE table has", True),
                             ({9: table.entry_len + 4}, "entry_len", True),
                             ({10: table.entry_len + 1}, r"entry_start\[\d+\] must lie in \[0, entry_len", True),
                             ({10: table.entry_start[:-1]}, "entry_start must be", False),
                             ({12: None}, "go together", False),
                             ({13: 63}, "rotary_dim must be even", False),
                             ({11: cos.double(), 12: sin.double()}, "contiguous float32", False),
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
    q, q_pos, cu, k, v, table = make_tagged_case([6, 9], "runs", page_size=4, num_heads=4, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=device)
    plan = _plan(dict(cu=cu, q=q, k=k), table)
    inv_freq = torch.rand(32, device=device) * 0.5 + 0.01
    args = (q, q_pos, cu, k, v, table.pages, table.row_start, table.kv_lens, plan.tile_seq, plan.tile_row0,
            list(plan.launch), None, -1, table.entry_pos, table.entry_len, table.entry_start, inv_freq, 64, False)
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
    with pytest.raises(ValueError, match=r"start must lie in \[0, valid\] \(entry 1: start 3, valid 2\)"):
        PageTable.from_entries(torch.tensor([0, 2]), torch.tensor([0, 1]), torch.tensor([0, 4]), torch.tensor([4, 2]),
                               4, torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="start must have shape"):
        PageTable.from_entries(torch.tensor([0, 1]), torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), 4,
                               torch.tensor([0, 0]))
