"""Property test of the C++ CPU kernel for position-tagged page lists (``paged_attention_run`` with
``PageTable.from_entries`` and in-kernel RoPE, i.e. ``ragattn::_paged_attention_tagged_cpu``):
random sequences of entries (any first positions, partial and empty-looking valid counts, runs
of a page from a first slot, pages in any order, shared between sequences), random query rows
(scattered, repeated positions, rows before every slot), windows, GQA 1-4, head dims 8-72 with
partial rotary and both pair layouts, NaN in every slot no row may read; against the float64 reference with the precision rule. The
plan is made (from maxima) over stale contents of the table and ``cu_seqlens_q``, rewritten in
place before the run, as an engine does between steps."""
from __future__ import annotations

import pytest
import torch

from ragattn import PageTable, plan_paged_attention, run_paged_attention
from ragattn.reference.paged_attention_table import paged_attention_table
from tests.helpers import assert_precision

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def cases(draw):
    page_size = draw(st.sampled_from([1, 3, 4, 8]))
    kv_heads = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 3, 4]))
    head_dim = draw(st.sampled_from([8, 24, 64, 72]))
    rotary_dim = draw(st.sampled_from([head_dim, head_dim // 2 // 2 * 2 or 2]))
    interleaved = draw(st.booleans())
    window = draw(st.sampled_from([-1, 0, 5, 30]))
    runs = draw(st.booleans())   # entries from a first slot (entry_start), else from slot 0
    seqs = []
    for _ in range(draw(st.integers(1, 3))):
        entries = []
        for _ in range(draw(st.integers(0, 6))):
            n = draw(st.integers(1, page_size))
            entries.append((draw(st.integers(0, 200)), n, draw(st.integers(0, n)) if runs else 0))
        # rows: anywhere, or next to an entry's first position (inside or just past its slots,
        # so the rows of one block see different parts of a page: the kernel's per-row pass)
        near = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(-2, 9)), max_size=12))
        rows = draw(st.lists(st.integers(0, 260), max_size=8))
        rows += [max(0, entries[e % len(entries)][0] + d) for e, d in near] if entries else []
        seqs.append((entries, draw(st.permutations(rows))))
    seed = draw(st.integers(0, 2 ** 16))
    # the plan is made over other contents of the same tensors, rewritten in place before the run
    # (docs/ops.md, what a plan captures): another split of the query rows, other entries
    splits = draw(st.lists(st.integers(0, 20), min_size=len(seqs) - 1, max_size=len(seqs) - 1))
    return page_size, kv_heads, group, head_dim, rotary_dim, interleaved, window, runs, seqs, seed, splits


@settings(max_examples=max(150, settings.default.max_examples))   # C++: cheap per example
@given(cases())
def test_tagged_cpu_kernel_matches_float64(case):
    from ragattn import _extension

    if _extension.cpu_backend() != "default":
        pytest.skip("the C++ kernel is the default CPU backend's")
    page_size, kv_heads, group, head_dim, rotary_dim, interleaved, window, runs, seqs, seed, splits = case
    gen = torch.Generator().manual_seed(seed)
    n_entries = sum(len(e) for e, _ in seqs)
    num_pages = n_entries + 2
    perm = torch.randperm(num_pages, generator=gen).tolist()
    pages, first, valid, start, indptr, q_pos, cu = [], [], [], [], [0], [], [0]
    for entries, rows in seqs:
        for f, n, s in entries:
            pages.append(perm[len(pages)])
            first.append(f)
            valid.append(n)
            start.append(s)
        indptr.append(len(pages))
        q_pos += rows
        cu.append(len(q_pos))
    if seqs[-1][0] and len(seqs) > 1:   # the last sequence also reads the first one's first page
        pages[-1] = pages[0]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    table = PageTable.from_entries(i32(indptr), i32(pages), i32(first), i32(valid), page_size,
                                   i32(start) if runs else None)
    k = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    read = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for p, n, s in zip(pages, valid, start):   # slots outside every entry's [start, valid): never read
        read[p, s:n] = True
    k[~read], v[~read] = float("nan"), float("nan")
    q = torch.randn(len(q_pos), kv_heads * group, head_dim, generator=gen)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    # planned over stale contents (the same shapes: entries per sequence, rows in all), with maxima
    # covering both, then the real ones copied in place: the run must read the tensors, not the plan
    stale_cu = [0] + sorted(min(x, len(q_pos)) for x in splits) + [len(q_pos)]
    rows = [b - a for a, b in zip(cu, cu[1:])] + [b - a for a, b in zip(stale_cu, stale_cu[1:])]
    real = (i32(cu), i32(pages), i32(first), i32(valid), i32(start))
    cu_t = i32(stale_cu)
    table.pages.copy_(torch.randint(0, num_pages, (len(pages),), generator=gen))
    table.entry_pos.copy_(torch.randint(0, 300, (len(pages),), generator=gen))
    table.entry_len.copy_(torch.randint(0, page_size + 1, (len(pages),), generator=gen))
    if runs:
        table.entry_start.copy_(torch.minimum(table.entry_len, torch.randint(0, page_size + 1, (len(pages),),
                                                                             generator=gen)))
    plan = plan_paged_attention(cu_t, table, num_heads=q.shape[1], num_kv_heads=kv_heads, head_dim=head_dim,
                                dtype=q.dtype, window_left=window, max_q_len=max(rows), max_kv_len=max(1, max(
                                    [len(e) * page_size for e, _ in seqs])))
    for t, want in zip((cu_t, table.pages, table.entry_pos, table.entry_len, table.entry_start), real):
        if t is not None:
            t.copy_(want)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    run_paged_attention(plan, q, i32(q_pos), k, v, inv_freq=inv_freq, rotary_dim=rotary_dim,
                        interleaved=interleaved, out=out, lse_out=lse)
    a = (q, i32(q_pos), i32(cu), k, v, table.pages, table.row_start, table.kv_lens, table.entry_pos,
         table.entry_len, inv_freq, rotary_dim, interleaved, None, window)
    o64, l64 = paged_attention_table(*a, entry_start=table.entry_start)
    olp, llp = paged_attention_table(*a, entry_start=table.entry_start, upcast=False)
    assert not bool(l64.isnan().any())   # (no row can see a NaN here)
    seen = torch.isfinite(l64)   # rows that see nothing: out 0, lse -inf
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and bool((lse[~seen] == float("-inf")).all())
    if bool(seen.any()):
        assert_precision(out[seen], o64[seen], olp[seen])
        # (an lse is one score where a row sees one slot: its floor is an fp32 rounding of the
        # products the score sums, not of the score, which may cancel to near 0; the softmax
        # scale 1/sqrt(D) times the sqrt(D) growth of a sum of D products: max|q| max|k|)
        term = float(q.abs().max() * k[torch.isfinite(k)].abs().max())
        assert_precision(lse[seen], l64[seen], llp[seen], what="lse",
                         atol_floor=4 * torch.finfo(torch.float32).eps * max(term, float(l64[seen].abs().max())))
