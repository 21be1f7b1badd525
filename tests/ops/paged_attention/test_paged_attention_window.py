"""paged_attention under a sliding window against the float64 reference and transformers' mask."""
from __future__ import annotations
import pytest
import torch
import ragattn
from ragattn.reference.paged_attention import paged_attention as ref_paged
from tests.helpers import poison_like

from tests.ops.paged_attention.test_paged_attention import (I32, backend, check_against_reference, make_case, poison_unseen,
                                            scattered_rows, triton_backend)  # noqa: F401 (fixtures)


# ------------------------------------------------------------------------- sliding window

@pytest.mark.parametrize("window_left", [0, 1, 6, 37, 500])
def test_sliding_window(backend, monkeypatch, device, seed, window_left):
    """Left window (FlashAttention window_size=(window_left, -1)): decode, a prefill tail, scattered
    rows, an empty cache, a window wider than the cache; GQA 3, page size 7; unsplit and split-KV."""
    kv_lens = [90, 0, 41, 130]
    q_positions = [[89], [0, 1], scattered_rows(41, 0.3, 5), list(range(100, 130))]
    args = make_case(q_positions, kv_lens, num_heads=6, num_kv_heads=2, head_dim=64, page_size=7,
                     dtype=torch.bfloat16, device=device)
    for splits in ("1", "3") if backend == "triton" else ("auto",):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args, None, window_left)
        check_against_reference(args, out, lse, window_left)


def test_window_decode_split_kv(triton_backend, monkeypatch, device, seed):
    """Decode under a window: the splits cover only the window, not the whole context."""
    args = make_case([[299], [150], [3]], [300, 151, 4], num_heads=4, num_kv_heads=1, head_dim=64, page_size=16,
                     dtype=torch.float32, device=device)
    for splits in ("1", "2", "5"):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = ragattn.paged_attention(*args, None, 70)
        check_against_reference(args, out, lse, 70)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,dtype,page_size",
                         [(2, 2, 96, torch.bfloat16, 64), (8, 1, 256, torch.float16, 16)])
def test_window_decode_split_kv_across_gqa_and_head_dims(triton_backend, monkeypatch, device, seed, num_heads,
                                                         num_kv_heads, head_dim, dtype, page_size):
    """One-row decode tiles under a window size their splits from the window, not the
    context, at GQA 1 and 8 and head dims 96 and 256, page ids read per tile and per page: a window
    that starts inside a key tile and a page, a context shorter than the window, a length-1 and an
    empty sequence; NaN in every slot no row sees, outputs poisoned."""
    q_positions = [[299], [50], [0], []]
    kv_lens = [300, 51, 1, 0]
    args = make_case(q_positions, kv_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, device=device)
    k, v = poison_unseen(args, q_positions, 70)
    for splits in ("2", "3"):
        monkeypatch.setenv("RAGATTN_PAGED_NUM_SPLITS", splits)
        out, lse = poison_like(args[0]), poison_like(args[0][..., 0].float())
        ragattn.paged_attention(*args[:3], k, v, *args[5:], None, 70, out=out, lse_out=lse)
        check_against_reference(args, out, lse, 70)


def test_window_matches_transformers_sliding_window():
    """transformers' sliding_window W (kv_idx > q_idx - W, on top of causal) is window_left = W - 1."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    from ragattn.reference.paged_attention import visible_slots

    for w in (1, 2, 5, 16):
        overlay = masking_utils.sliding_window_overlay(w)
        causal = masking_utils.causal_mask_function
        q_pos = torch.arange(0, 40, 3)
        want = torch.tensor([[bool(causal(0, 0, int(i), j)) and bool(overlay(0, 0, int(i), j)) for j in range(40)]
                             for i in q_pos])
        assert torch.equal(visible_slots(q_pos, 40, w - 1), want)


def test_reference_window_is_the_visible_set():
    """Window semantics on the reference alone: slot j visible iff q_pos - window_left <= j <= q_pos."""
    q, q_pos, cu, k, v, bt, kvl = make_case([[5, 9]], [12], num_heads=2, num_kv_heads=1, head_dim=64,
                                            page_size=4, dtype=torch.float64, device="cpu")
    out1, _ = ref_paged(q, q_pos, cu, k, v, bt, kvl, None, 3)
    for slot, changes in [(1, (False, False)), (2, (True, False)), (5, (True, False)), (6, (False, True)),
                          (9, (False, True)), (10, (False, False))]:
        k2, v2 = k.clone(), v.clone()
        k2[int(bt[0, slot // 4]), slot % 4] += 1.0
        v2[int(bt[0, slot // 4]), slot % 4] += 1.0
        out2, _ = ref_paged(q, q_pos, cu, k2, v2, bt, kvl, None, 3)
        assert (not torch.equal(out1[0], out2[0]), not torch.equal(out1[1], out2[1])) == changes, slot


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
