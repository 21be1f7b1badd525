"""ragattn.kv.shared_entries: a batch whose rows read shared chunk pages (keys page-local), hold
recomputed rows in their own pages (copy on write by rows) and attend in two passes merged by LSE
gives what each row's own copy (keys rotated at their positions, one pass) gives; run_passes over
any split of a table's entries is the one-pass answer."""
from __future__ import annotations

import pytest
import torch

from ragattn import ops
from ragattn.kv import Pass, PassStep, SharedEntries, entry_tables, run_passes

H, HQ, D, BS = 2, 6, 32, 16


class Rope:
    def __init__(self, rotary_dim=D, interleaved=False):
        self.inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.rotary_dim, self.interleaved = rotary_dim, interleaved


def _rotate(k: torch.Tensor, delta: torch.Tensor, rope: Rope) -> torch.Tensor:
    """``k`` ``[n, H, D]`` rotated by ``delta`` ``[n]``."""
    k = k.clone()
    ops.rerotate_keys_([k], torch.arange(k.shape[0]), delta.to(torch.int32), rope.inv_freq, rope.rotary_dim,
                       rope.interleaved)
    return k


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rows_over_shared_pages_and_held_rows_attend_as_their_copies(seed, interleaved):
    g = torch.Generator().manual_seed(seed)
    rope = Rope(D if seed != 1 else D // 2, interleaved)
    # row 0: a head and two chunks of awkward lengths on shared pages, then its question
    cuts = sorted(torch.randperm(60, generator=g)[:2].add(5).tolist())
    end = cuts[1] + 23 + int(torch.randint(0, 9, (1,), generator=g))
    spans = [(0, cuts[0]), (cuts[0], cuts[1]), (cuts[1], end)]
    n0 = end + 1 + int(torch.randint(0, 20, (1,), generator=g))
    n1 = 3 + int(torch.randint(0, 40, (1,), generator=g))         # row 1: a plain request
    private_from = end // BS * BS
    held = sorted(torch.randperm(private_from, generator=g)[:1 + seed * 7].tolist())
    num_pages = 64
    perm = torch.randperm(num_pages, generator=g).tolist()
    take = lambda n: [perm.pop() for _ in range(n)]   # noqa: E731
    own0, own1 = take(-(-n0 // BS)), take(-(-n1 // BS))
    chunk_blocks = [take(-(-(e - s) // BS)) for s, e in spans]
    held_blocks = take(-(-len(held) // BS))
    k_raw = [torch.randn(n, H, D, generator=g) for n in (n0, n1)]   # keys before RoPE
    v = [torch.randn(n, H, D, generator=g) for n in (n0, n1)]
    k_new = torch.randn(len(held), H, D, generator=g)               # the held rows' recomputed K/V
    v_new = torch.randn(len(held), H, D, generator=g)

    copy_k, copy_v = (torch.full((num_pages, BS, H, D), float("nan")) for _ in range(2))
    shr_k, shr_v = (torch.full((num_pages, BS, H, D), float("nan")) for _ in range(2))
    for r, (own, n) in enumerate(((own0, n0), (own1, n1))):
        pos = torch.arange(n)
        blk, off = torch.tensor(own)[pos // BS], pos % BS
        kk, vv = _rotate(k_raw[r], pos, rope), v[r].clone()
        if r == 0:
            kk[held], vv[held] = _rotate(k_new, torch.tensor(held), rope), v_new
        copy_k[blk, off], copy_v[blk, off] = kk, vv
        keep = pos >= (private_from if r == 0 else 0)                 # own pages, by position
        shr_k[blk[keep], off[keep]], shr_v[blk[keep], off[keep]] = kk[keep], vv[keep]
    for (s, e), blocks in zip(spans, chunk_blocks):                   # chunk pages, keys page-local
        t = torch.arange(s, e)
        blk, off = torch.tensor(blocks)[(t - s) // BS], (t - s) % BS
        shr_k[blk, off], shr_v[blk, off] = _rotate(k_raw[0][t], off, rope), v[0][t]
    hi = torch.arange(len(held))
    blk, off = torch.tensor(held_blocks, dtype=torch.int64)[hi // BS], hi % BS
    shr_k[blk, off], shr_v[blk, off] = _rotate(k_new, torch.tensor(held), rope), v_new

    e0 = SharedEntries.build(spans, chunk_blocks, BS, held=held, held_blocks=held_blocks)
    assert torch.equal(e0.slots(torch.tensor(held), own0, BS), blk * BS + off)
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0, :len(own0)], table[1, :len(own1)] = torch.tensor(own0), torch.tensor(own1)
    lens = torch.tensor([n0, n1], dtype=torch.int32)
    q_lens = [n0 - end, n1]
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    q_pos = torch.cat([torch.arange(end, n0), torch.arange(n1)]).to(torch.int32)
    q = torch.randn(sum(q_lens), HQ, D, generator=g)
    step = PassStep(entry_tables([e0, None], table, lens, BS), cu, max(q_lens), rope)
    got, got_lse = step.run(q, q_pos, shr_k, shr_v, D ** -0.5)
    ref = ops.PagedAttentionStep(cu, ops.PageTable.from_block_table(table, lens), max_q_len=max(q_lens))
    want, want_lse = ref.run(q, q_pos, copy_k, copy_v, D ** -0.5)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-5, rtol=2e-5)
    # into the caller's buffers
    out, lse = torch.full_like(want, 7.0), torch.full_like(want_lse, 7.0)
    step.run(q, q_pos, shr_k, shr_v, D ** -0.5, out=out, lse_out=lse)
    assert torch.equal(out, got) and torch.equal(lse, got_lse)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_run_passes_over_a_split_of_the_entries_is_one_pass(seed, parts):
    g = torch.Generator().manual_seed(seed)
    n_kv, n_q, num_pages = 37 + seed * 50, 5 + seed, 16
    pages = torch.randperm(num_pages, generator=g)[:-(-n_kv // BS)].to(torch.int32)
    k, v = torch.randn(num_pages, BS, H, D, generator=g), torch.randn(num_pages, BS, H, D, generator=g)
    first = torch.arange(pages.numel(), dtype=torch.int32) * BS
    valid = torch.clamp(n_kv - first, max=BS).to(torch.int32)
    cu = torch.tensor([0, n_q], dtype=torch.int32)
    q = torch.randn(n_q, HQ, D, generator=g)
    q_pos = torch.arange(n_kv - n_q, n_kv, dtype=torch.int32)

    def step(idx):
        idx = torch.tensor(idx, dtype=torch.int64)
        t = ops.PageTable.from_entries(torch.tensor([0, idx.numel()], dtype=torch.int32), pages[idx], first[idx],
                                       valid[idx], BS)
        return ops.PagedAttentionStep(cu, t, max_q_len=n_q)

    everything = list(range(pages.numel()))
    want, want_lse = step(everything).run(q, q_pos, k, v, D ** -0.5)
    split = [everything[i::parts] for i in range(parts)]
    got, got_lse = run_passes([Pass(step(s), k, v) for s in split], q, q_pos, D ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_lse, want_lse, atol=2e-5, rtol=2e-5)
    assert run_passes([], q, q_pos, D ** -0.5) == (None, None)
