"""paged_attention vs the float64 reference, through the public op (default and Triton-interpreter paths)."""
from __future__ import annotations

import math

import pytest
import torch

import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from tests.helpers import assert_precision, randn_nonzero, run_compile_check, use_kernel_backend

I32 = torch.int32

# the Triton interpreter converts 1-element arrays to ints in range(); not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


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


def check_against_reference(args, out, lse):
    q = args[0]
    cpu = [a.cpu() for a in args]
    out64, lse64 = ref_paged(*[a.double() if a.is_floating_point() else a for a in cpu])
    out_lp, lse_lp = ref_paged(*cpu, compute_dtype=q.dtype)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
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


@pytest.mark.parametrize("head_dim,dtype", [(80, torch.float16), (256, torch.bfloat16)])
def test_other_head_dims(backend, device, seed, head_dim, dtype):
    """A head_dim that is not a power of two (padded tile) and the largest supported one."""
    args = make_case([[40], scattered_rows(50, 0.2, 4)], [41, 50], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                     page_size=16, dtype=dtype, device=device)
    out, lse = ragattn.paged_attention(*args)
    check_against_reference(args, out, lse)


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


def test_sampled_grid(backend, device, seed):
    """Random awkward configurations (sampled, to keep the interpreter cheap)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        nkv = int(torch.randint(1, 3, (1,), generator=gen))
        group = [1, 3, 4, 8][int(torch.randint(0, 4, (1,), generator=gen))]
        head_dim = [64, 128][int(torch.randint(0, 2, (1,), generator=gen))]
        dtype = [torch.float16, torch.bfloat16, torch.float32][int(torch.randint(0, 3, (1,), generator=gen))]
        page_size = [1, 16, 64][int(torch.randint(0, 3, (1,), generator=gen))]
        kv_lens = torch.randint(0, 90, (3,), generator=gen).tolist()
        q_positions = []
        for n in kv_lens:
            n_rows = int(torch.randint(0, min(n, 20) + 1, (1,), generator=gen))
            q_positions.append(torch.randperm(max(n, 1), generator=gen)[:n_rows].sort().values.tolist())
        args = make_case(q_positions, kv_lens, num_heads=nkv * group, num_kv_heads=nkv, head_dim=head_dim,
                         page_size=page_size, dtype=dtype, device=device)
        out, lse = ragattn.paged_attention(*args)
        check_against_reference(args, out, lse)


def test_reference_is_causal_by_position():
    """A recomputed middle row never sees later slots: changing slot 7's K/V leaves row q_pos=5 unchanged."""
    q, q_pos, cu, k, v, bt, kvl = make_case([[5, 9]], [12], num_heads=2, num_kv_heads=1, head_dim=64,
                                            page_size=4, dtype=torch.float64, device="cpu")
    out1, _ = ref_paged(q, q_pos, cu, k, v, bt, kvl)
    page, off = int(bt[0, 7 // 4]), 7 % 4
    k[page, off] += 1.0
    v[page, off] += 1.0
    out2, _ = ref_paged(q, q_pos, cu, k, v, bt, kvl)
    assert torch.equal(out1[0], out2[0]) and not torch.equal(out1[1], out2[1])


def test_reference_matches_sdpa():
    """Contiguous cache (one page per sequence), all rows: plain causal attention."""
    torch.manual_seed(0)
    n, h, d = 11, 4, 64
    q = torch.randn(n, h, d, dtype=torch.float64)
    k = torch.randn(1, n, h, d, dtype=torch.float64)
    v = torch.randn(1, n, h, d, dtype=torch.float64)
    out, _ = ref_paged(q, torch.arange(n, dtype=I32), torch.tensor([0, n], dtype=I32), k, v,
                                 torch.zeros(1, 1, dtype=I32), torch.tensor([n], dtype=I32))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k[0].transpose(0, 1),
                                                            v[0].transpose(0, 1), is_causal=True)
    torch.testing.assert_close(out, want.transpose(0, 1))


# ------------------------------------------------------------------------- opcheck, fakes, errors

def test_opcheck(backend, device):
    args = make_case([[3, 7], [0]], [8, 4], num_heads=4, num_kv_heads=2, head_dim=64,
                     page_size=4, dtype=torch.float32, device=device)
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, args)
    torch.library.opcheck(torch.ops.ragattn.paged_attention.default, (*args, 0.5))


def _good(device="cpu"):
    return list(make_case([[3, 7]], [8], num_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=4, dtype=torch.float16, device=device))


@pytest.mark.parametrize(
    "index,bad,exc,match",
    [
        (0, lambda a: a.float(), TypeError, "k_cache"),
        (0, lambda a: a[:, :3], ValueError, "num_heads"),
        (0, lambda a: a.long(), TypeError, "q must be"),
        (1, lambda a: a.long(), TypeError, "q_pos"),
        (1, lambda a: a[:1], ValueError, "q_pos"),
        (1, lambda a: a - 10, ValueError, "q_pos"),
        (2, lambda a: torch.tensor([0, 1], dtype=I32), ValueError, "cu_seqlens_q"),
        (4, lambda a: a[..., :32], ValueError, "v_cache"),
        (5, lambda a: a.long(), TypeError, "block_table"),
        (5, lambda a: a + 100, ValueError, "block_table"),
        (5, lambda a: a[0], ValueError, "block_table"),
        (6, lambda a: a + 100, ValueError, "kv_lens"),
        (6, lambda a: a.long(), TypeError, "kv_lens"),
    ],
)
def test_bad_inputs(index, bad, exc, match):
    args = _good()
    args[index] = bad(args[index])
    with pytest.raises(exc, match=f"ragattn.paged_attention.*{match}"):
        ragattn.paged_attention(*args)


_COMPILE_CHECK = r"""
import torch
import triton
import ragattn.triton_kernels.paged_attention as pa
from tests.helpers import SM90_CASES, compile_many_sm90

ints = ("Q_POS", "CU_SEQLENS_Q", "BLOCK_TABLE", "KV_LENS", "TILE_SEQ", "TILE_ROW0")
jobs = []
for elt, head_dim in SM90_CASES:
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[elt]
    # (query rows of the longest sequence, GQA group, split-KV): prefill, decode, verify
    for max_rows, group, split in [(1000, 4, False), (1, 8, True), (5, 1, True)][: 3 if head_dim == 128 else 2]:
        group_pad = triton.next_power_of_2(group)
        m_tile = min(128, max(16, triton.next_power_of_2(max_rows * group_pad)))
        block_d = max(16, triton.next_power_of_2(head_dim))
        m_tile, block_n, stages, warps = pa.tile_config(m_tile, block_d, dtype.itemsize, False)
        consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=max(1, m_tile // group_pad),
                      BLOCK_N=block_n, BLOCK_D=block_d, UPCAST=False, IEEE_FP32=dtype == torch.float32)
        types = {n: "*i32" for n in ints}
        types.update(Q="*" + elt, K_CACHE="*" + elt, V_CACHE="*" + elt, OUT="*fp32" if split else "*" + elt,
                     LSE="*fp32", qk_scale="fp32")
        jobs.append((pa._paged_attention_kernel, consts, types, dict(num_warps=warps, num_stages=stages)))
compile_many_sm90(jobs)
print("compiled")
"""


def test_kernel_compiles_for_sm90():
    """The kernel compiles for an H100 (sm_90) at the launcher's tile configs (prefill, decode,
    split-KV) in every dtype and head dim, within its shared memory; needs no GPU."""
    run_compile_check(_COMPILE_CHECK)
