"""paged_attention vs the float64 reference, through the public op (default and Triton-interpreter paths)."""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from tests.helpers import assert_precision, poison_like, randn_nonzero, use_kernel_backend

I32 = torch.int32


def make_paged(kv_lens, page_size, num_kv_heads, head_dim, dtype, device, *, extra_pages=3):
    """Random K/V caches with every sequence's pages shuffled across the pool (plus unused pages)."""
    pages_per_seq = [max(1, math.ceil(n / page_size)) for n in kv_lens]
    max_pages = max(pages_per_seq) if pages_per_seq else 1
    num_pages = sum(pages_per_seq) + extra_pages
    perm = torch.randperm(num_pages)
    block_table = torch.full((len(kv_lens), max_pages), -1, dtype=I32)  # unused entries stay -1
    at = 0
    for b, n in enumerate(pages_per_seq):
        block_table[b, :n] = perm[at : at + n].to(I32)
        at += n
    k = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v = randn_nonzero(num_pages, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return k, v, block_table.to(device), torch.tensor(kv_lens, dtype=I32, device=device)


def make_case(q_positions, kv_lens, *, num_heads, num_kv_heads, head_dim, page_size, dtype, device):
    """q_positions: one list of absolute positions per sequence (its query rows)."""
    k, v, bt, kvl = make_paged(kv_lens, page_size, num_kv_heads, head_dim, dtype, device)
    cu = torch.tensor([0] + list(torch.tensor([len(p) for p in q_positions]).cumsum(0).tolist()), dtype=I32, device=device)
    q_pos = torch.tensor([p for ps in q_positions for p in ps], dtype=I32, device=device)
    q = randn_nonzero(q_pos.numel(), num_heads, head_dim, dtype=dtype, device=device)
    return q, q_pos, cu, k, v, bt, kvl


def check_against_reference(args, out, lse, window_left=-1, nan_at=None):
    """``nan_at`` (bool, like ``out``): the elements that must be NaN (a non-finite V value the
    reference in ``args`` does not hold); every other one is checked against the reference."""
    q = args[0]
    cpu = [a.cpu() for a in args]
    out64, lse64 = ref_paged(*[a.double() if a.is_floating_point() else a for a in cpu], None, window_left)
    out_lp, lse_lp = ref_paged(*cpu, None, window_left, compute_dtype=q.dtype)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    if nan_at is not None:
        nan_at = nan_at.cpu()
        assert torch.equal(torch.isnan(out.cpu()), nan_at), "NaN where a row does not see the NaN, or not where it does"
        out, out64, out_lp = (t.cpu().masked_fill(nan_at, 0) for t in (out, out64, out_lp))
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_precision(out.cpu(), out64, out_lp, what="out")
    assert_precision(lse.cpu(), lse64, lse_lp.float(), what="lse")
    # rows that see no key: exactly 0 and -inf
    dead = torch.isinf(lse64)
    assert torch.equal(torch.isinf(lse.cpu()), dead)
    assert (out.cpu()[dead] == 0).all()


def scattered_rows(n, frac, tail, gen=None):
    """FusionRAG-style selection: a random duplicate-free subset of 0..n-tail-1 plus the last `tail` rows."""
    body = torch.randperm(n - tail, generator=gen)[: max(1, int(frac * (n - tail)))].sort().values.tolist()
    return body + list(range(n - tail, n))


@pytest.fixture(params=["default", "triton"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


# ------------------------------------------------------------------------- correctness

@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype,page_size",
    [
        (2, 2, 64, torch.float16, 16),
        (6, 2, 128, torch.bfloat16, 1),
        (8, 2, 64, torch.float32, 64),
        (8, 1, 128, torch.bfloat16, 16),
    ],
)
def test_mixed_batch(backend, device, seed, num_heads, num_kv_heads, head_dim, dtype, page_size):
    """Decode, final-block prefill, scattered recompute, speculative tail, empty sequences in one batch."""
    kv_lens = [37, 0, 70, 5, 1, 45]
    q_positions = [
        [36],                           # decode
        [],                             # empty sequence, empty cache
        scattered_rows(70, 0.2, 9),     # scattered recompute + final block
        [],                             # no query rows
        [0],                            # length-1 sequence
        [42, 43, 44],                   # speculative tail (gamma=2)
    ]
    args = make_case(q_positions, kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=head_dim, page_size=page_size, dtype=dtype, device=device)
    out, lse = ragattn.paged_attention(*args)
    check_against_reference(args, out, lse)


@pytest.mark.parametrize("head_dim,dtype", [(80, torch.float16), (256, torch.bfloat16), (20, torch.float32)])
def test_other_head_dims(backend, device, seed, head_dim, dtype):
    """A head_dim that is not a power of two (padded tile), the largest supported one, and one
    that is not a multiple of 8 (the C++ CPU kernel's vector tail)."""
    args = make_case([[40], scattered_rows(50, 0.2, 4)], [41, 50], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     page_size=16, dtype=dtype, device=device)
    out, lse = ragattn.paged_attention(*args)
    check_against_reference(args, out, lse)


def poison_unseen(args, q_positions, window_left=-1):
    """Copies of the caches with NaN in K and V at every (page, offset) that no row sees (unused
    pages, stale slots past kv_lens, slots right of every row or left of every window): a kernel
    that reads one of them into a row, even at weight 0, returns NaN there."""
    from ragattn.reference.paged_attention import visible_slots

    k, v, bt, kvl = args[3].clone(), args[4].clone(), args[5].cpu(), args[6].cpu()
    page_size = k.shape[1]
    seen = torch.zeros(k.shape[:2], dtype=torch.bool)
    for b, rows in enumerate(q_positions):
        n = int(kvl[b])
        if rows and n:
            for j in visible_slots(torch.tensor(rows), n, window_left).any(0).nonzero().flatten().tolist():
                seen[int(bt[b, j // page_size]), j % page_size] = True
    k[~seen.to(k.device)] = float("nan")
    v[~seen.to(v.device)] = float("nan")
    return k, v


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,dtype,page_size",
    [
        (2, 2, 96, torch.float16, 16),    # GQA 1: page ids once per page (interpreter tiles: 64 keys)
        (8, 2, 128, torch.bfloat16, 64),  # GQA 4: once per key tile
        (8, 1, 256, torch.float32, 5),    # GQA 8: once per slot
        (16, 2, 96, torch.bfloat16, 32),  # GQA 8, two kv heads
    ],
)
def test_decode_tiles_across_gqa_and_head_dims(backend, monkeypatch, device, seed, num_heads, num_kv_heads, head_dim,
                                               dtype, page_size):
    """Decode and verify tiles (<= 64 stacked rows) at GQA 1/4/8 and head dims 96/128/256:
    the whole key tiles of a 150-slot context in their own loop, the masked tiles before them (a
    window starting inside a tile) and after them (the partial last tile), split-KV pieces of one
    tile each, an empty and a length-1 sequence; shuffled pages, NaN in every slot no row sees (a
    masked tile taken for a whole one reads them), outputs poisoned before the call."""
    kv_lens = [150, 0, 1, 75]
    q_positions = [[149], [], [0], [71, 72, 73]]  # decode, nothing, length 1, a speculative tail
    args = make_case(q_positions, kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, device=device)
    for window_left in (-1, 100):
        for splits in ("1", "3") if backend == "triton" else ("auto",):
            monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
            out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
            ragattn.paged_attention(*args[:3], *poison_unseen(args, q_positions, window_left), *args[5:], None,
                                    window_left, out=out, lse_out=lse)
            check_against_reference(args, out, lse, window_left)


@pytest.mark.parametrize("page_size", [7, 16, 64])
def test_prefill_tiles_with_whole_key_tiles(backend, monkeypatch, device, seed, page_size):
    """Prefill's 128-row query tiles decide per key tile whether every row sees it whole
    (one loop): the first query tile (rows at 66, 70, 100-129; 32 rows x GQA 4) sees [0, 64) whole
    and [64, 128) in part though it is not its last tile; the second (130-139) sees both whole.
    Without a window and with one that cuts into the first key tile; page ids once per slot, page
    or tile (page sizes 7, 16, 64); unsplit and split-KV; an empty and a length-1 sequence beside
    them. NaN in every slot no row sees, and a NaN in V at slot 100 that rows 66 and 70 do not see:
    a partial tile taken for a whole one gives them 0 * NaN."""
    kv_lens = [200, 1, 0, 66]
    q_positions = [[66, 70] + list(range(100, 140)), [0], [], [3, 40, 64, 65]]
    args = make_case(q_positions, kv_lens, num_heads=8, num_kv_heads=2, head_dim=64, page_size=page_size,
                     dtype=torch.float16, device=device)
    page, off = _slot(args[5][0].cpu(), 100, page_size)
    nan_at = torch.zeros_like(args[0], dtype=torch.bool)
    nan_at[2:42, :4, 3] = True  # sequence 0's rows at positions >= 100, the heads of kv head 0, dim 3
    for window_left in (-1, 100):
        k, v = poison_unseen(args, q_positions, window_left)
        v[page, off, 0, 3] = float("nan")
        for splits in ("1", "2") if backend == "triton" else ("auto",):
            monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
            out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
            ragattn.paged_attention(*args[:3], k, v, *args[5:], None, window_left, out=out, lse_out=lse)
            check_against_reference(args, out, lse, window_left, nan_at=nan_at)


@contextlib.contextmanager
def interpreter_config(monkeypatch, tmp_path, **fields):
    """Within the block, the paged table's interpreter entry has ``fields`` set (a copy of the
    committed table in ``tmp_path`` through RAGATTN_CONFIG_DIR)."""
    import json

    from ragattn.triton_kernels import gpu_configs

    table = json.load(open(gpu_configs.table_path("paged_attention", gpu_configs.CONFIG_DIR)))
    table["devices"]["interpreter"]["configs"]["*"].update(fields)
    (tmp_path / "paged_attention.json").write_text(json.dumps(table))
    monkeypatch.setenv("RAGATTN_CONFIG_DIR", str(tmp_path))
    gpu_configs.clear_cache()
    try:
        yield
    finally:
        monkeypatch.delenv("RAGATTN_CONFIG_DIR")
        gpu_configs.clear_cache()


@pytest.mark.parametrize("edge_loop", [False, True])
def test_decode_window_edge_tiles_either_loop(triton_backend, monkeypatch, tmp_path, device, seed, edge_loop):
    """A window decode's partly visible key tiles left and right of the whole ones in a masked loop
    each (three loops) or in one masked loop after the whole-tile loop (config ``edge_loop``): the
    same rule on the decode-tiles case (a window starting inside a key tile, the partial last
    tile, split-KV pieces, NaN in every unseen slot), whichever the table picks."""
    with interpreter_config(monkeypatch, tmp_path, edge_loop=edge_loop):
        test_decode_tiles_across_gqa_and_head_dims("triton", monkeypatch, device, seed, 8, 2, 128, torch.bfloat16, 16)


@pytest.mark.parametrize("pipeline_v", [False, True])
def test_prefill_tiles_either_v_load(triton_backend, monkeypatch, tmp_path, device, seed, pipeline_v):
    """The prefill loop's two forms (config ``pipeline_v``: V used outside the per-tile whole/masked
    test, so it can be pipelined, or inside it, a plain register load) on the whole-key-tiles case:
    the same rule, whichever the table picks (the interpreter's entry holds one of them)."""
    with interpreter_config(monkeypatch, tmp_path, pipeline_v=pipeline_v):
        test_prefill_tiles_with_whole_key_tiles("triton", monkeypatch, device, seed, 16)


def test_rows_that_see_no_key(backend, device, seed):
    """Query rows against an empty cache: out 0, lse -inf, never NaN."""
    args = make_case([[3, 4], [2]], [0, 9], num_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=16, dtype=torch.float16, device=device)
    out, lse = ragattn.paged_attention(*args)
    assert torch.isinf(lse[:2]).all() and (lse[:2] < 0).all()
    assert (out[:2] == 0).all()
    check_against_reference(args, out, lse)


def test_zero_query_rows(backend, device):
    args = make_case([[], []], [5, 17], num_heads=4, num_kv_heads=4, head_dim=64,
                     page_size=16, dtype=torch.float32, device=device)
    out, lse = ragattn.paged_attention(*args)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_empty_batch(backend, device):
    q = torch.empty(0, 4, 64, device=device)
    k = randn_nonzero(2, 16, 2, 64, device=device)
    args = (q, torch.empty(0, dtype=I32, device=device), torch.zeros(1, dtype=I32, device=device), k, k.clone(),
            torch.empty(0, 2, dtype=I32, device=device), torch.empty(0, dtype=I32, device=device))
    out, lse = ragattn.paged_attention(*args)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_strided_inputs(backend, device, seed):
    """q as a view of a [H, T, D] tensor, caches as views with padded head_dim, block_table a column slice."""
    q, q_pos, cu, k, v, bt, kvl = make_case([[4, 30], [12]], [31, 13], num_heads=4, num_kv_heads=2, head_dim=64,
                                            page_size=16, dtype=torch.float16, device=device)
    q_t = q.transpose(0, 1).contiguous().transpose(0, 1)
    k_pad = torch.cat([k, k[..., :8]], dim=-1)[..., :64]
    v_pad = torch.cat([v, v[..., :8]], dim=-1)[..., :64]
    bt_wide = torch.cat([bt, bt], dim=1)[:, : bt.shape[1]]
    args = (q_t, q_pos, cu, k_pad, v_pad, bt_wide, kvl)
    assert not q_t.is_contiguous() and not k_pad.is_contiguous() and not bt_wide.is_contiguous()
    out, lse = ragattn.paged_attention(*args)
    check_against_reference((q, q_pos, cu, k, v, bt, kvl), out, lse)


def test_scale(backend, device, seed):
    args = make_case([[10, 20]], [21], num_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=16, dtype=torch.float32, device=device)
    out, lse = ragattn.paged_attention(*args, 0.3)
    cpu = [a.cpu().double() if a.is_floating_point() else a.cpu() for a in args]
    out64, lse64 = ref_paged(*cpu, 0.3)
    torch.testing.assert_close(out.cpu().double(), out64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().double(), lse64, atol=1e-5, rtol=1e-5)


@pytest.fixture
def triton_backend(monkeypatch, device):
    """The Triton kernel itself (interpreter on CPU, compiled on CUDA)."""
    use_kernel_backend(monkeypatch, device, "triton")


@pytest.mark.parametrize("num_heads,num_kv_heads,dtype", [(4, 4, torch.float32), (8, 2, torch.bfloat16)])
def test_split_kv_matches_unsplit(triton_backend, monkeypatch, device, seed, num_heads, num_kv_heads, dtype):
    """Decode of a few long sequences and a short speculative tail: 1, 3 and 7 key partitions agree."""
    kv_lens = [301, 2, 190]
    q_positions = [[300], [1], [187, 188, 189]]
    args = make_case(q_positions, kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                     page_size=16, dtype=dtype, device=device)
    results = []
    for splits in ("1", "3", "7"):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        results.append(ragattn.paged_attention(*args))
        check_against_reference(args, *results[-1])
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], **tol)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)


def test_invisible_slots_are_never_read(backend, monkeypatch, device, seed):
    """NaN in every slot a row cannot see (later positions, past kv_lens, unused pages) leaves the output finite."""
    q_positions = [[5, 20, 33], [70]]
    kv_lens = [60, 71]
    args = list(make_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=16, dtype=torch.float16, device=device))
    clean = ragattn.paged_attention(*args)
    k, v, bt = args[3].clone(), args[4].clone(), args[5]
    keep = torch.zeros(k.shape[:2], dtype=torch.bool, device=device)
    for b, ps in enumerate(q_positions):
        for j in range(min(kv_lens[b], max(ps) + 1)):
            keep[int(bt[b, j // 16]), j % 16] = True
    k[~keep] = float("nan")
    v[~keep] = float("nan")
    for splits in ("1", "2"):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args[:3], k, v, *args[5:])
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        torch.testing.assert_close(out, clean[0], atol=2e-3, rtol=2e-3)


def _slot(bt, j, page_size):
    return int(bt[j // page_size]), j % page_size


def check_nonfinite_rule(args, out, lse, window_left=-1):
    """Against the float64 reference: the same NaN positions, the finite values within tolerance."""
    cpu = [a.cpu() for a in args]
    out64, lse64 = ref_paged(*[a.double() if a.is_floating_point() else a for a in cpu], None, window_left)
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(torch.isnan(out), torch.isnan(out64)), "NaN pattern of out differs from the reference"
    assert torch.equal(torch.isnan(lse), torch.isnan(lse64)), "NaN pattern of lse differs from the reference"
    assert not torch.isinf(out).any()
    tol = dict(atol=2e-3, rtol=2e-3) if args[0].dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out, out64, equal_nan=True, **tol)
    torch.testing.assert_close(lse, lse64, equal_nan=True, **tol)


@pytest.mark.parametrize("window_left", [-1, 9])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_v_reaches_only_the_rows_that_see_it(backend, monkeypatch, device, seed, window_left, poison):
    """Non-finite V in slots some rows of a tile see and others do not (after a row's
    q_pos, left of its window, past kv_lens in the last page): only the rows that see the slot get
    NaN, in that element; fully visible tiles and split-KV follow the same rule."""
    ps = 8
    q_positions = [[5, 20, 33, 34], [66, 70], [2]]
    kv_lens = [45, 71, 3]
    args = list(make_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=ps, dtype=torch.float32, device=device))
    v = args[4].clone()
    bt = args[5].cpu()
    for b, j, d in [(0, 20, 3), (0, 34, 5), (0, 12, 9), (0, 46, 1), (1, 2, 11), (1, 60, 13), (2, 3, 0), (2, 7, 2)]:
        page, off = _slot(bt[b], j, ps)
        v[page, off, :, d] = poison  # j >= kv_lens (stale page slots) included: (0, 46), (2, 3), (2, 7)
    args[4] = v
    for splits in ("1", "2") if backend == "triton" else ("auto",):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args, None, window_left)
        check_nonfinite_rule(args, out, lse, window_left)
        assert torch.isfinite(out[0]).all(), "row q_pos=5 sees none of the poisoned slots"
        assert torch.isfinite(out[6]).all(), "the last sequence's poisoned slots lie past kv_lens"


def test_nonfinite_k_poisons_only_the_rows_that_see_it(backend, monkeypatch, device, seed):
    """A NaN visible score makes that (row, head) NaN in out and lse; invisible ones do nothing."""
    ps = 16
    args = list(make_case([[4, 10, 30]], [40], num_heads=2, num_kv_heads=1, head_dim=64, page_size=ps,
                          dtype=torch.float16, device=device))
    k = args[3].clone()
    page, off = _slot(args[5][0].cpu(), 8, ps)
    k[page, off, 0, 0] = float("nan")
    page, off = _slot(args[5][0].cpu(), 35, ps)
    k[page, off, 0, 1] = float("inf")  # after every row's position
    args[3] = k
    for splits in ("1", "3") if backend == "triton" else ("auto",):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args)
        check_nonfinite_rule(args, out, lse)
        assert torch.isfinite(out[0]).all() and torch.isfinite(lse[0]).all()
        assert torch.isnan(out[1:]).all() and torch.isnan(lse[1:]).all()


def test_minus_inf_score_has_weight_zero_as_in_varlen(backend, monkeypatch, device, seed):
    """One -inf rule: a visible key whose score is -inf has weight 0 (not NaN) in the
    decode/sparse-prefill op, exactly as in varlen_attention (prefill), so the HF prefill and the
    decode of one cache agree; a row whose visible scores are all -inf gets out 0 and lse -inf;
    NaN and +inf still poison their row."""
    ps = 8
    q_positions = [[0, 3, 11, 20], [6]]
    kv_lens = [21, 9]
    args = list(make_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=64, page_size=ps,
                          dtype=torch.float32, device=device))
    q, k, bt = args[0].clone(), args[3].clone(), args[5].cpu()
    q[..., 0] = q[..., 0].abs() + 0.5   # score = finite + q0 * k0: -inf where k0 = -inf
    for b, j in [(0, 0), (0, 5), (0, 17), (1, 2)]:
        page, off = _slot(bt[b], j, ps)
        k[page, off, :, 0] = float("-inf")
    args[0], args[3] = q, k
    for splits in ("1", "2") if backend == "triton" else ("auto",):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args)
        check_nonfinite_rule(args, out, lse)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "-inf scores must not poison a row"
        assert (out[0] == 0).all() and (lse[0] == float("-inf")).all(), "q_pos=0 sees only a -inf key"
        # the same keys as one contiguous prefill: varlen_attention must give the same rows
        for b, (r0, r1) in enumerate([(0, 4), (4, 5)]):
            idx = torch.arange(kv_lens[b])
            pages = bt[b][idx // ps].to(device)
            kk, vv = k[pages, (idx % ps).to(device)], args[4][pages, (idx % ps).to(device)]
            cu_q = torch.tensor([0, r1 - r0], dtype=I32, device=device)
            cu_k = torch.tensor([0, kv_lens[b]], dtype=I32, device=device)
            o_v, l_v = ragattn.varlen_attention(q[r0:r1], kk, vv, cu_q, cu_k, q_pos=args[1][r0:r1],
                                                kv_pos=idx.to(device=device, dtype=I32))
            torch.testing.assert_close(out[r0:r1], o_v, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse[r0:r1], l_v, atol=2e-5, rtol=2e-5)
    page, off = _slot(bt[0], 2, ps)
    k[page, off, :, 0] = float("inf")   # +inf: rows 3, 11, 20 of sequence 0 see it
    out, lse = ragattn.paged_attention(*args)
    check_nonfinite_rule(args, out, lse)
    assert torch.isnan(lse[1:4]).all() and not torch.isnan(lse[4]).any()


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_largest_positions_see_every_slot(backend, device, seed, index_dtype):
    """q_pos = 2^31 - 1 (int32 max; and beyond, in int64) sees every slot, with and
    without a window wide enough to reach slot 0; the Triton kernel used to wrap max(q_pos) + 1."""
    args = list(make_case([[0, 1], [0]], [37, 20], num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          dtype=torch.float32, device=device))
    big = [2**31 - 1, 2**31 - 2, 2**31 - 1] if index_dtype == torch.int32 else [2**40, 2**31, 2**62]
    args[1] = torch.tensor(big, dtype=index_dtype, device=device)
    args[2], args[5], args[6] = (a.to(index_dtype) for a in (args[2], args[5], args[6]))
    out, lse = ragattn.paged_attention(*args)
    check_against_reference(args, out, lse)
    assert torch.isfinite(lse).all()
    out_w, lse_w = ragattn.paged_attention(*args, None, 2**62)
    torch.testing.assert_close(out_w, out)
    out_n, lse_n = ragattn.paged_attention(*args, None, 5)  # a window far right of every cached slot
    assert (out_n == 0).all() and (lse_n == float("-inf")).all()


def test_int64_metadata_matches_int32(backend, device, seed):
    """Engines pass int64 positions, offsets, page tables and lengths: same results as int32."""
    args = make_case([[36], scattered_rows(50, 0.3, 4), []], [37, 50, 9], num_heads=6, num_kv_heads=2,
                     head_dim=64, page_size=16, dtype=torch.float16, device=device)
    want = ragattn.paged_attention(*args, None, 20)
    args64 = [a.long() if i in (1, 2, 5, 6) else a for i, a in enumerate(args)]
    got = ragattn.paged_attention(*args64, None, 20)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)


def test_flashinfer_style_cache_views(backend, device, seed):
    """K and V as views of one [pages, 2, page_size, H, D] tensor (FlashInfer's NHD layout) and of
    a [pages, page_size, 2, H, D] one: the kernel takes the strides, no copy of the cache."""
    args = make_case([[44], [3, 9, 10]], [45, 11], num_heads=4, num_kv_heads=2, head_dim=64, page_size=8,
                     dtype=torch.bfloat16, device=device)
    q, q_pos, cu, k, v, bt, kvl = args
    want = ragattn.paged_attention(*args)
    for dim in (1, 2):
        kv = torch.stack([k, v], dim=dim)
        kv_k, kv_v = kv.select(dim, 0), kv.select(dim, 1)
        assert not kv_k.is_contiguous()
        got = ragattn.paged_attention(q, q_pos, cu, kv_k, kv_v, bt, kvl)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)


def test_preallocated_outputs(backend, device, seed):
    """out= / lse_out= are written and returned (contiguous or strided views); refused when they
    overlap an input, or have the wrong shape, dtype or device."""
    args = make_case([[36], scattered_rows(50, 0.3, 4)], [37, 50], num_heads=6, num_kv_heads=2, head_dim=64,
                     page_size=16, dtype=torch.float16, device=device)
    q = args[0]
    want = ragattn.paged_attention(*args, None, 10)
    out = torch.full_like(q, float("nan"))
    lse_wide = torch.full((q.shape[0], q.shape[1], 2), float("nan"), device=device)
    lse = lse_wide[..., 0]  # a strided view
    got = ragattn.paged_attention(*args, None, 10, out=out, lse_out=lse)
    assert got[0] is out and got[1] is lse
    torch.testing.assert_close(out, want[0], atol=0, rtol=0)
    torch.testing.assert_close(lse, want[1], atol=0, rtol=0)
    assert torch.isnan(lse_wide[..., 1]).all()
    got = ragattn.paged_attention(*args, out=torch.empty_like(q))  # lse_out allocated
    torch.testing.assert_close(got[0], ragattn.paged_attention(*args)[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="paged_attention: out must not share memory with q"):
        ragattn.paged_attention(*args, out=q)
    with pytest.raises(ValueError, match="paged_attention: out must have shape"):
        ragattn.paged_attention(*args, out=q[:1].clone())
    with pytest.raises(TypeError, match="paged_attention: lse_out must be float32"):
        ragattn.paged_attention(*args, lse_out=torch.empty(q.shape[:2], dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="paged_attention: lse_out must be on"):
        ragattn.paged_attention(*args, lse_out=torch.empty(q.shape[:2], device="meta"))


def test_inference_mode(backend, device, seed):
    """Every path runs on inference tensors (plain, windowed, split, out=)."""
    with torch.inference_mode():
        args = make_case([[36], scattered_rows(50, 0.3, 4)], [37, 50], num_heads=4, num_kv_heads=2, head_dim=64,
                         page_size=16, dtype=torch.float32, device=device)
        out, lse = ragattn.paged_attention(*args)
        check_against_reference(args, out, lse)
        out2, lse2 = ragattn.paged_attention(*args, None, 7, out=torch.empty_like(args[0]))
        check_against_reference(args, out2, lse2, 7)


def _good(device="cpu"):
    return list(make_case([[3, 7]], [8], num_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=4, dtype=torch.float16, device=device))


def test_fake_validates_like_the_real_op():
    """A meta tensor among CPU tensors raises (it used to return an uninitialised
    tensor); meta and fake inputs get the shape/dtype/device checks of the real op."""
    args = _good()
    for i in (0, 1, 3, 5):
        mixed = list(args)
        mixed[i] = mixed[i].to("meta")
        with pytest.raises(ValueError, match="ragattn.paged_attention: .* must be on"):
            torch.ops.ragattn.paged_attention(*mixed)
    meta = [a.to("meta") for a in args]
    out, lse = torch.ops.ragattn.paged_attention(*meta)
    assert out.device.type == "meta" and out.shape == args[0].shape and lse.dtype == torch.float32
    bad = list(meta)
    bad[4] = bad[4][..., :32]
    with pytest.raises(ValueError, match="ragattn.paged_attention: v_cache"):
        torch.ops.ragattn.paged_attention(*bad)
    with pytest.raises(ValueError, match="must not share memory"):
        torch.ops.ragattn.paged_attention.out(*meta, None, -1, out=meta[0], lse_out=torch.empty(2, 4, device="meta"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    k_float = args[3].float()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) for a in args]
        out, lse = torch.ops.ragattn.paged_attention(*fake, None, 3)
        assert out.shape == args[0].shape
        fake[3] = mode.from_tensor(k_float)
        with pytest.raises(TypeError, match="ragattn.paged_attention: k_cache"):
            torch.ops.ragattn.paged_attention(*fake)
