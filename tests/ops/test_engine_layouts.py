"""Every engine KV-cache layout of docs/ops.md's table ("Engine KV-cache layouts"), each
run through views (no copy of the cache) by the ops that touch caches: copy_kv_ writes chunk rows
into the engine's slots (keys re-rotated), rerotate_keys_ moves them, paged_attention reads them.
Each must equal the same calls on ragattn's native contiguous caches, bit for bit."""
from __future__ import annotations

import pytest
import torch

import ragattn
from tests.helpers import randn_nonzero, use_kernel_backend

PAGES, PS, H, D, L = 5, 4, 2, 32, 2  # 20 slots per layer


class Layout:
    """One engine layout: ``make()`` allocates one layer's engine cache; ``pages(c)`` gives the
    ``[pages, page_size, H, D]`` K and V views paged_attention reads; ``rows(c)`` the K and V layer
    lists the row ops take (whole-row views, or one view per head) and their ``num_kv_heads``."""

    def __init__(self, name, make, pages, rows):
        self.name, self.make, self.pages, self.rows = name, make, pages, rows


def _per_head(k4, v4):
    """[pages, page_size, H, D] views whose [H, D] block is not contiguous -> one view per head."""
    return [k4[:, :, h:h + 1] for h in range(H)], [v4[:, :, h:h + 1] for h in range(H)], 1


def _vllm033_channel_pages(c, phys_nhd):
    logical = c.permute(0, 2, 1, 3) if phys_nhd else c  # [B, Hkv, N, 2D]
    return logical[..., :D].permute(0, 2, 1, 3), logical[..., D:].permute(0, 2, 1, 3)


def _vllm033_rows_pages(c):
    tiles = c.view(PAGES, H, 2 * PS, D)  # each (block, head) tile [N, 2D] read as [2N, D]
    return tiles[:, :, :PS].permute(0, 2, 1, 3), tiles[:, :, PS:].permute(0, 2, 1, 3)


LAYOUTS = [
    Layout("ragattn native [pages, page_size, H, D] x 2",
           lambda: torch.zeros(2, PAGES, PS, H, D).unbind(0),
           lambda c: (c[0], c[1]), lambda c: ([c[0]], [c[1]], H)),
    Layout("vLLM FlashAttention [2, blocks, block_size, H, D]",
           lambda: torch.zeros(2, PAGES, PS, H, D),
           lambda c: (c[0], c[1]), lambda c: ([c[0]], [c[1]], H)),
    Layout("vLLM 0.33 per-layer [B, Hkv, N, 2D], channel split, head-major",
           lambda: torch.zeros(PAGES, H, PS, 2 * D),
           lambda c: _vllm033_channel_pages(c, False), lambda c: _per_head(*_vllm033_channel_pages(c, False))),
    Layout("vLLM 0.33 per-layer [B, Hkv, N, 2D], channel split, token-major storage",
           lambda: torch.zeros(PAGES, PS, H, 2 * D),
           lambda c: _vllm033_channel_pages(c, True), lambda c: _per_head(*_vllm033_channel_pages(c, True))),
    Layout("vLLM 0.33 per-layer [B, Hkv, N, 2D], rows split (CPU_ATTN)",
           lambda: torch.zeros(PAGES, H, PS, 2 * D),
           _vllm033_rows_pages, lambda c: _per_head(*_vllm033_rows_pages(c))),
    Layout("FlashInfer NHD [pages, 2, page_size, H, D]",
           lambda: torch.zeros(PAGES, 2, PS, H, D),
           lambda c: (c[:, 0], c[:, 1]), lambda c: ([c[:, 0]], [c[:, 1]], H)),
    Layout("FlashInfer HND [pages, 2, H, page_size, D]",
           lambda: torch.zeros(PAGES, 2, H, PS, D),
           lambda c: (c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2)),
           lambda c: _per_head(c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2))),
]


def _split_heads(layers, per_head):
    """Source rows [n, H, D] as the row ops want them for a layout (one [n, 1, D] per head)."""
    return [t[:, h:h + 1] for t in layers for h in range(H)] if per_head else list(layers)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[l.name for l in LAYOUTS])
def test_layout_through_views(index):
    layout = LAYOUTS[index]
    gen = torch.Generator().manual_seed(60 + index)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    engine = [layout.make() for _ in range(L)]
    native = [(randn_nonzero(PAGES, PS, H, D, generator=gen), randn_nonzero(PAGES, PS, H, D, generator=gen))
              for _ in range(L)]
    for c, (k, v) in zip(engine, native):  # the same starting contents, written through the views
        ek, ev = layout.pages(c)
        ek.copy_(k)
        ev.copy_(v)
    n = 13
    chunk_k = [randn_nonzero(n, H, D, generator=gen) for _ in range(L)]
    chunk_v = [randn_nonzero(n, H, D, generator=gen) for _ in range(L)]
    slots = torch.randperm(PAGES * PS, generator=gen)[:n]             # vLLM slot_mapping order
    delta = torch.randint(-500, 500, (n,), generator=gen)             # int64, as vLLM's positions
    src = torch.arange(n)

    # copy_kv_ into the engine cache (views) vs into native caches
    rows = [layout.rows(c) for c in engine]
    per_head = rows[0][2] == 1
    dk = [t for r in rows for t in r[0]]
    dv = [t for r in rows for t in r[1]]
    ragattn.copy_kv_(dk, dv, _split_heads(chunk_k, per_head), _split_heads(chunk_v, per_head), src, slots, delta,
                     inv_freq, D, False, num_kv_heads=rows[0][2])
    ragattn.copy_kv_([k for k, _ in native], [v for _, v in native], chunk_k, chunk_v, src, slots, delta, inv_freq, D,
                     False, num_kv_heads=H)
    for c, (k, v) in zip(engine, native):
        ek, ev = layout.pages(c)
        assert ek.shape == (PAGES, PS, H, D)
        assert torch.equal(ek, k) and torch.equal(ev, v), layout.name

    # rerotate_keys_ of some written slots, in place through the same views
    moved = slots[::2]
    d2 = torch.randint(-300, 300, (moved.numel(),), generator=gen)
    ragattn.rerotate_keys_(dk, moved, d2, inv_freq, D, False, num_kv_heads=rows[0][2])
    ragattn.rerotate_keys_([k for k, _ in native], moved, d2, inv_freq, D, False, num_kv_heads=H)
    for c, (k, _) in zip(engine, native):
        assert torch.equal(layout.pages(c)[0], k), layout.name

    # paged_attention reads every page through the [pages, page_size, H, D] views: decode and a tail
    q = randn_nonzero(4, 2 * H, D, generator=gen)                   # GQA 2
    q_pos = torch.tensor([17, 9, 10, 11])
    cu = torch.tensor([0, 1, 4])
    block_table = torch.tensor([[3, 0, 4, 1, 2], [2, 4, 1, 0, 3]])
    lens = torch.tensor([18, 12])
    for c, (k, v) in zip(engine, native):
        ek, ev = layout.pages(c)
        got = ragattn.paged_attention(q, q_pos, cu, ek, ev, block_table, lens)
        want = ragattn.paged_attention(q, q_pos, cu, k, v, block_table, lens)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), layout.name


def test_head_major_whole_rows_refused():
    """The HND rows of the table are passed per head; the whole head-major page is refused by the
    row ops (its [H, D] block is not contiguous), and read as NHD with num_kv_heads it is caught."""
    hnd = torch.zeros(PAGES, 2, H, PS, D)
    with pytest.raises(ValueError, match=r"copy_kv_: dst_k\[0\] must have contiguous \[num_kv_heads, head_dim\] rows"):
        ragattn.copy_kv_([hnd[:, 0].transpose(1, 2)], [], [torch.ones(3, H, D)], [], torch.arange(3), torch.arange(3))
    with pytest.raises(ValueError, match=r"has 4 heads .* num_kv_heads=2"):
        ragattn.copy_kv_([hnd[:, 0]], [], [torch.ones(3, PS, D)], [], torch.arange(3), torch.arange(3), num_kv_heads=H)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_varlen_lse_out_transposed_view(monkeypatch, backend):
    """varlen_attention's lse_out takes an engine's [H, total_q] buffer as .t() (a strided
    [total_q, H] view), as paged_attention's does, on the default and the Triton path."""
    use_kernel_backend(monkeypatch, torch.device("cpu"), backend)
    gen = torch.Generator().manual_seed(70)
    q, k, v = (randn_nonzero(n, h, D, generator=gen) for n, h in ((11, 4), (13, 2), (13, 2)))
    cu_q, cu_k = torch.tensor([0, 5, 11]), torch.tensor([0, 6, 13])
    want_o, want_l = ragattn.varlen_attention(q, k, v, cu_q, cu_k)
    buf = torch.full((4, 11), float("nan"))   # [H, total_q]
    out = torch.full_like(q, float("nan"))
    o, l = ragattn.varlen_attention(q, k, v, cu_q, cu_k, out=out, lse_out=buf.t())
    assert torch.equal(out, want_o) and torch.equal(buf.t(), want_l)
    assert o is out and l.data_ptr() == buf.data_ptr()
