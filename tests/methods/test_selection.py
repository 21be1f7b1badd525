"""ragattn.methods.selection.walk_layers: CacheBlend's gradual filtering between layers, on a walk
whose K/V deviations are known, against the rule written out directly; the module imports no
model library."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ragattn.methods.selection import cacheblend_schedule, kv_deviation, top_rows, walk_layers


class FakeWalk:
    """Rows with ids; layer ``l`` writes K/V whose deviation from the cache is ``dev[l, id]``."""

    def __init__(self, dev: torch.Tensor, stop_at: int | None = None):
        self.dev, self.stop_at = dev, stop_at
        self.num_layers = dev.shape[0]
        self.ids = torch.arange(dev.shape[1])
        self.ran: list[tuple[int, list[int]]] = []

    @property
    def rows(self):
        return self.ids.numel()

    def cached_kv(self, layer, n):
        z = torch.zeros(n, 2, 3)
        return z, z

    def run_layer(self, layer, capture_kv):
        self.ran.append((layer, self.ids.tolist()))
        return layer != self.stop_at

    def fresh_kv(self, layer, n):
        k = torch.zeros(n, 2, 3)
        k[:, 0, 0] = self.dev[layer, self.ids[:n]].sqrt()
        return k, torch.zeros_like(k)

    def keep(self, rows):
        self.ids = self.ids[rows]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradual_filtering_keeps_the_rows_that_moved_most(seed):
    g = torch.Generator().manual_seed(seed)
    n_cand, n_tail, layers = 37 + 11 * seed, 5, 6
    dev = torch.rand(layers, n_cand + n_tail, generator=g)
    checks = cacheblend_schedule(0.2 + 0.1 * seed, n_cand, (1, 2, 4))
    walk = FakeWalk(dev)
    assert walk_layers(walk, checks=checks, num_candidates=n_cand)
    # the rule written out: after a check layer the top `keep` candidates by deviation, then the tail
    ids, n = torch.arange(n_cand + n_tail), n_cand
    for layer in range(layers):
        assert walk.ran[layer] == (layer, ids.tolist())
        if layer in checks:
            d = dev[layer, ids[:n]]
            best = torch.sort(d, descending=True, stable=True).indices[:min(checks[layer], n)].sort().values
            ids = torch.cat([ids[best], ids[n:]])
            n = min(checks[layer], n)
    assert walk.ids.tolist() == ids.tolist()


def test_deviation_and_top_rows():
    new_k, old_k = torch.randn(9, 2, 4), torch.randn(9, 2, 4)
    v = torch.zeros(9, 2, 4)
    d = kv_deviation(new_k, v, old_k, v)
    torch.testing.assert_close(d, (new_k - old_k).square().sum((1, 2)))
    assert top_rows(d, 3).tolist() == sorted(torch.argsort(d, descending=True)[:3].tolist())


def test_every_row_a_candidate_and_an_early_stop():
    dev = torch.rand(4, 10)
    walk = FakeWalk(dev)
    assert walk_layers(walk, checks={1: 4, 2: 0})      # all rows candidates; none left after layer 2
    assert [layer for layer, _ in walk.ran] == [0, 1, 2] and walk.rows == 0
    walk = FakeWalk(dev, stop_at=3)
    assert not walk_layers(walk)                        # the walk has what it needed at layer 3
    assert [layer for layer, _ in walk.ran] == [0, 1, 2, 3]


def test_selection_imports_no_model_library():
    code = ("import sys; import ragattn.methods.selection; "
            "bad = [m for m in sys.modules if m.startswith(('transformers', 'ragattn.hf', 'vllm'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
