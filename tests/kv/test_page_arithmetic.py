"""The page arithmetic beside ``PageTable`` (ragattn.ops.page_table: page_offset, page_row,
page_index, num_pages, page_rows, slot_rows), the one home of ``% page_size`` and slot -> row for the store and
the request caches, against the slot rule written out by hand."""
from __future__ import annotations

import pytest
import torch

from ragattn.kv import PagedKV
from ragattn.ops.page_table import num_pages, page_index, page_offset, page_row, page_rows, slot_rows


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_slot_rows_follow_the_slot_rule(page_size):
    g = torch.Generator().manual_seed(page_size)
    table = torch.randperm(40, generator=g)[:12].view(3, 4).to(torch.int32)
    slots = torch.randint(0, 4 * page_size, (3, 7), generator=g)
    want = torch.tensor([[int(table[b, j // page_size]) * page_size + j % page_size for j in row.tolist()]
                         for b, row in enumerate(slots)])
    assert torch.equal(slot_rows(table, slots, page_size), want)                     # [B, P] with [B, n]
    assert torch.equal(slot_rows(table[1], slots[1], page_size), want[1])            # [P] with [n]
    assert torch.equal(slot_rows(table[1].tolist(), slots[1].to(torch.int32), page_size), want[1])   # a list
    assert slot_rows(table, slots, page_size).dtype == torch.int64


def test_page_rows_offsets_and_counts():
    assert page_rows([5, 2], 3).tolist() == [15, 16, 17, 6, 7, 8]
    assert page_rows(torch.tensor([1], dtype=torch.int32), 4).tolist() == [4, 5, 6, 7]
    rows = torch.arange(20)
    assert torch.equal(page_offset(rows, 6), rows % 6) and page_offset(13, 6) == 1
    assert page_row(3, 2, 6) == 20 and torch.equal(page_row(rows // 6, page_offset(rows, 6), 6), rows)
    assert [num_pages(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert torch.equal(page_row(page_index(rows, 7), page_offset(rows, 7), 7), rows) and page_index(13, 6) == 2
    lens = torch.tensor([0, 1, 4, 5, 8, 9, 37])
    assert num_pages(lens, 4).tolist() == [num_pages(int(n), 4) for n in lens] == [0, 1, 1, 2, 2, 3, 10]


@pytest.mark.parametrize("page_size", [2, 5])
def test_slot_rows_on_the_slots_device(page_size):
    """A page list given as a host list follows the slots to their device (the request caches and
    the vLLM worker index device positions with a host block list): values on CUDA, the device on
    the meta device elsewhere."""
    dev = "cuda" if torch.cuda.is_available() else "meta"
    slots = torch.arange(3 * page_size, device=dev)
    rows = slot_rows([4, 0, 9], slots, page_size)
    assert rows.device == slots.device and rows.shape == slots.shape
    if dev == "cuda":
        assert rows.cpu().tolist() == [b * page_size + o for b in (4, 0, 9) for o in range(page_size)]


def test_paged_kv_rows_are_slot_rows():
    cache = PagedKV(1, 2, 10, 1, 4, page_size=3)
    cache.block_table = torch.tensor([[7, 1, 4, 0], [2, 6, 3, 5]], dtype=torch.int32)
    slots = torch.tensor([[0, 4, 9, 11], [2, 3, 5, 10]])
    assert torch.equal(cache.all_slot_rows(slots), slot_rows(cache.block_table, slots, 3))
    assert cache.slot_rows(1, slots[1]).tolist() == [8, 18, 20, 16]
