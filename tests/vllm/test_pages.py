"""ragattn.vllm without vLLM: the claim (scheduler side) and the page writer (worker side) on
CPU tensors in vLLM 0.33's cache layouts, checked against the HF path (ChunkStore.assemble) bit
for bit and against one Block-Attention-masked forward. tests/vllm/ runs the connector itself."""
import pytest
import torch

from ragattn.methods.block_attention import block_ids
from ragattn.reference import kv_cache as ref_kv
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.methods.generate import paged_forward
from ragattn.vllm.pages import CacheLayoutError, PageWriter, slot_rows
from ragattn.vllm.spans import (MethodChoice, ParamError, SpanError, check_spans, composite_positions, layer_index,
                                method_from_params, plan_claim, report_params, request_salt,
                                spans_from_params, spans_from_separator, Claim)
from tests.helpers import tiny_causal_lm

H, D, BS = 2, 16, 16   # the tiny model's KV heads and head size; vLLM's block size here


# ----- claims ---------------------------------------------------------------------------------
def _claim(prompt, spans, cached):
    return plan_claim(prompt, spans, lambda t: tuple(t), lambda k: k in cached)


def test_claim_chunks_at_offsets_and_repeats():
    a, b, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    prompt = a + b + a + c + [1, 2]           # chunk a twice, at offsets 0 and 5
    spans = [(0, 3), (3, 5), (5, 8), (8, 12)]
    cl = _claim(prompt, spans, {tuple(a), tuple(b), tuple(c)})
    assert cl.num_tokens == 12 and cl.spans == tuple(spans)
    assert cl.keys == (tuple(a), tuple(b), tuple(a), tuple(c))


def test_claim_stops_at_missing_chunk_gap_and_prompt_end():
    a, b, c = [5, 6, 7], [8, 9], [10, 11, 12, 13]
    prompt = a + b + c + [1]
    spans = [(0, 3), (3, 5), (5, 9)]
    assert _claim(prompt, spans, {tuple(a), tuple(c)}).num_tokens == 3          # b missing
    assert _claim(prompt, spans, {tuple(b), tuple(c)}).num_tokens == 0          # the first chunk missing
    assert _claim(prompt, [(0, 3), (4, 5)], {tuple(a), (9,)}).num_tokens == 3   # a gap at token 3
    full = a + b + c                                                             # fully cached prompt:
    cl = _claim(full, spans, {tuple(a), tuple(b), tuple(c)})                     # the last span is vLLM's
    assert cl.num_tokens == 5 and len(full) - cl.num_tokens == 4
    assert _claim([5], [(0, 1)], {(5,)}).num_tokens == 0                         # length-1 prompt
    assert _claim([], [], set()).num_tokens == 0


def test_spans_from_params_and_separator():
    assert spans_from_params(None, 9) is None and spans_from_params({"x": 1}, 9) is None
    assert spans_from_params({"ragattn_spans": [[0, 3], [3, 7]]}, 9) == ((0, 3), (3, 7))
    for bad in ([[0, 3], [2, 5]], [[0, 10]], [[3, 3]], [[0, 1.5]], [[0, 1, 2]], "0-3"):
        with pytest.raises(SpanError, match="ragattn.vllm"):
            spans_from_params({"ragattn_spans": bad}, 9)
    sep = 0
    assert spans_from_separator([4, 4, 0, 5, 0, 7, 8], sep) == ((0, 3), (3, 5))
    assert spans_from_separator([4, 5], sep) == ()
    assert check_spans([], 0) == ()
    assert layer_index("model.layers.11.self_attn.attn") == 11


def test_method_from_params():
    """A request's method and ratio: defaults, the HF path's default ratio, and every bad value
    refused with the field it names."""
    from ragattn.methods.registry import DEFAULT_RATIO

    assert method_from_params(None) == MethodChoice("block-attention", 0.0)
    assert method_from_params({"ragattn_spans": []}) == MethodChoice("block-attention", 0.0)
    assert method_from_params({"ragattn_method": "fusionrag"}) == MethodChoice("fusionrag", DEFAULT_RATIO)
    assert method_from_params({"ragattn_method": "cacheblend", "ragattn_ratio": 1}) == MethodChoice("cacheblend", 1.0)
    assert MethodChoice("cacheblend", 0.2).recomputes and not MethodChoice("turborag-composite").recomputes
    for bad, field in [({"ragattn_method": "cache-blend"}, "ragattn_method"),
                       ({"ragattn_method": None}, "ragattn_method"),
                       ({"ragattn_method": "fusionrag", "ragattn_ratio": -0.1}, "ragattn_ratio"),
                       ({"ragattn_method": "fusionrag", "ragattn_ratio": float("nan")}, "ragattn_ratio"),
                       ({"ragattn_method": "fusionrag", "ragattn_ratio": True}, "ragattn_ratio"),
                       ({"ragattn_method": "turborag-reordered", "ragattn_ratio": 0.0}, "ragattn_ratio"),
                       ({"ragattn_ratio": 0.2}, "ragattn_ratio")]:
        with pytest.raises(ParamError, match="ragattn.vllm") as exc:
            method_from_params(bad)
        assert exc.value.field == f"kv_transfer_params.{field}"


def test_request_salts_tell_computations_apart():
    """The server's salt: equal for equal computations (Block-Attention and TurboRAG-reordered are
    one), different for another layout, claim, method, ratio, server key, nonce or client salt."""
    spans = [[0, 3], [3, 5], [5, 9]]
    claim = Claim(((0, 3), (3, 5)), ("a", "b"))
    block, cb = MethodChoice("block-attention"), MethodChoice("cacheblend", 0.1)
    base = request_salt("k", spans, claim, block)
    assert base == request_salt("k", spans, claim, MethodChoice("turborag-reordered")) and base.startswith("ragattn-")
    others = {request_salt("k2", spans, claim, block), request_salt("k", [[0, 2], [2, 5], [5, 9]], claim, block),
              request_salt("k", spans, Claim(((0, 3),), ("a",)), block), request_salt("k", 7, claim, block),
              request_salt("k", spans, claim, MethodChoice("turborag-composite")), request_salt("k", spans, claim, cb),
              request_salt("k", spans, claim, MethodChoice("cacheblend", 0.2)),
              request_salt("k", spans, claim, cb, nonce="r1:0"), request_salt("k", spans, claim, cb, nonce="r1:1"),
              request_salt("k", spans, claim, block, client_salt="tenant")}
    assert len(others) == 10 and base not in others


def test_report_params():
    """What a response says: the counts add up to the prompt and the spans."""
    out = report_params(MethodChoice("fusionrag", 0.25), "fusionrag", "", 4, 3, 57, 40, [12, 30], 16)
    assert out == {"ragattn_method": "fusionrag", "ragattn_ratio": 0.25, "ragattn_recomputed": [12, 30],
                   "ragattn_answered_by": "fusionrag", "ragattn_reason": "", "ragattn_chunks_hit": 3,
                   "ragattn_chunks_missed": 1, "ragattn_tokens_reused": 38, "ragattn_tokens_recomputed": 2,
                   "ragattn_tokens_exact": 17, "ragattn_prefix_cache_tokens": 16}
    full = report_params(MethodChoice(), "full-attention", "why", 3, 0, 57, 0, None, 16)
    assert "ragattn_ratio" not in full and full["ragattn_tokens_exact"] == 57
    assert full["ragattn_prefix_cache_tokens"] == 0


def test_composite_positions_keep_the_composite_distances():
    """Each span from ``end - max n``: the final block (from ``end``) sees every chunk at the
    distances of TurboRAG's composite layout (every chunk from 0, the final block from max n)."""
    spans = [(0, 2), (2, 7), (7, 10)]
    pos = composite_positions(spans)
    assert pos == [5, 6, 5, 6, 7, 8, 9, 5, 6, 7]
    longest = max(b - a for a, b in spans)
    for (a, b) in spans:     # final block row t at 10 + t against chunk token j: distance longest + t - j
        assert [10 - pos[a + j] for j in range(b - a)] == [longest - j for j in range(b - a)]


# ----- pages ----------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2"])
def model(request):
    return tiny_causal_lm(request.param)


@pytest.fixture(scope="module")
def store(model):
    return ChunkStore(model, memory_budget=1 << 24)


def _vllm_caches(num_blocks, dtype=torch.float32):
    """Two layers of vLLM's per-layer cache [B, Hkv, N, 2D], NaN-poisoned."""
    return [torch.full((num_blocks, H, BS, 2 * D), float("nan"), dtype=dtype) for _ in range(2)]


def _read_pages(caches, split, rows):
    """K, V per layer at ``rows`` (vLLM slots) as [n, Hkv, D], read with vLLM's own views."""
    out = []
    for kv in caches:
        B, N = kv.shape[0], kv.shape[2]
        if split == "channel":   # flash_attn: kv.transpose(1, 2).split(D, -1)
            k, v = kv.transpose(1, 2).split(D, dim=-1)
        else:                    # cpu_attn: kv.view(B, H, 2N, D).chunk(2, dim=2)
            k, v = (t.transpose(1, 2) for t in kv.view(B, H, 2 * N, D).chunk(2, dim=2))
        out.append((k.reshape(B * N, H, D)[rows], v.reshape(B * N, H, D)[rows]))
    return out


def _chunks(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 211, (n,), generator=g).tolist() for n in (7, 19, 5)]


@pytest.mark.parametrize("split", ["channel", "rows"])
@pytest.mark.parametrize("skip", [0, 16])
@pytest.mark.parametrize("stage", [False, True])
def test_pages_equal_assembled_request(store, split, skip, stage):
    """Chunks at different offsets, one repeated, written into scattered blocks: the pages hold
    exactly the HF path's assembled request (bit for bit), and nothing else is touched."""
    k = store.add(_chunks(1))
    keys = [k[0], k[1], k[0], k[2]]
    lens = [7, 19, 7, 5]
    spans, s = [], 0
    for n in lens:
        spans.append((s, s + n))
        s += n
    total = s
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(total))
    block_ids = [6, 1, 4]                    # 38 tokens over 3 blocks, not in order
    caches = _vllm_caches(8)
    PageWriter(store, caches, BS, split).write(keys, spans, block_ids, skip=skip, stage=stage)
    rows = slot_rows(block_ids, BS, 0, total)
    for l, (pk, pv) in enumerate(_read_pages(caches, split, rows)):
        want_k = req.cache.k[l].reshape(-1, H, D)[ref_rows]
        want_v = req.cache.v[l].reshape(-1, H, D)[ref_rows]
        # staged or not, each key is rotated once from the pool's page-local key: bit for bit
        assert torch.equal(pk[skip:], want_k[skip:])
        assert torch.equal(pv[skip:], want_v[skip:])
        assert pk[:skip].isnan().all() and pv[:skip].isnan().all()    # vLLM's own prefix hit
    untouched = torch.ones(8 * BS, dtype=torch.bool)
    untouched[rows[skip:]] = False
    for pk, pv in _read_pages(caches, split, untouched.nonzero()[:, 0]):
        assert pk.isnan().all() and pv.isnan().all()


@pytest.mark.parametrize("split", ["channel", "rows"])
def test_final_block_over_pages_gives_block_attention_logits(model, store, split):
    """The final block run over the request's pages (gathered from vLLM's layout) gives the HF
    path's logits bit for bit, and Block-Attention's single masked forward within fp32 rounding."""
    blocks = _chunks(2)
    final = [3, 17, 29, 41, 5]
    keys = store.add(blocks)
    lens = [len(b) for b in blocks]
    total = sum(lens)
    spans = [(sum(lens[:i]), sum(lens[:i + 1])) for i in range(len(lens))]
    block_table = [2, 0, 5]
    caches = _vllm_caches(6)
    PageWriter(store, caches, BS, split).write(keys, spans, block_table)

    hf = store.assemble(keys, positions="reordered", extra_slots=len(final))
    mine = store.assemble(keys, positions="reordered", extra_slots=len(final))
    for l in range(len(mine.cache.k)):
        mine.cache.k[l].fill_(float("nan"))
        mine.cache.v[l].fill_(float("nan"))
    dst = mine.cache.slot_rows(0, torch.arange(total))
    for l, (pk, pv) in enumerate(_read_pages(caches, split, slot_rows(block_table, BS, 0, total))):
        mine.cache.k[l].view(-1, H, D)[dst] = pk
        mine.cache.v[l].view(-1, H, D)[dst] = pv
    pos = total + torch.arange(len(final))
    got = paged_forward(model, torch.tensor([final]), pos, mine.cache)
    want = paged_forward(model, torch.tensor([final]), pos, hf.cache)
    assert torch.equal(got, want)

    ids = torch.tensor([[t for b in blocks for t in b] + final])
    blk = block_ids(lens, len(final))
    n = ids.shape[1]
    allow = torch.ones(n, n, dtype=torch.bool).tril() & ((blk[:, None] == blk[None, :]) | (blk[:, None] == -1))
    mask = torch.zeros(n, n).masked_fill(~allow, float("-inf"))[None, None]
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=torch.arange(n)[None], attention_mask=mask,
                    use_cache=False).logits[0, -len(final):].float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= 1e-4


def test_unknown_chunk_writes_nothing(store):
    keys = store.add(_chunks(3))
    caches = _vllm_caches(4)
    with pytest.raises(ChunkStoreError, match="no chunk with key"):
        PageWriter(store, caches, BS, "channel").write([keys[0], "0" * 40], [(0, 7), (7, 26)], [0, 1])
    assert all(kv.isnan().all() for kv in caches)


def test_unsupported_layouts_are_refused(store):
    with pytest.raises(CacheLayoutError, match="shape"):
        PageWriter(store, [torch.zeros(4, H, BS, D) for _ in range(2)], BS, "channel")   # K only
    with pytest.raises(CacheLayoutError, match="shape"):
        PageWriter(store, _vllm_caches(4), 8, "channel")                               # other block size
    with pytest.raises(CacheLayoutError, match="dtype"):
        PageWriter(store, _vllm_caches(4, torch.bfloat16), BS, "channel")
    with pytest.raises(CacheLayoutError, match="attention layers"):
        PageWriter(store, _vllm_caches(4)[:1], BS, "channel")
    nhd = [torch.zeros(4, BS, H, 2 * D).transpose(1, 2) for _ in range(2)]              # LBNHC memory
    with pytest.raises(CacheLayoutError, match="'rows' split"):
        PageWriter(store, nhd, BS, "rows")
    with pytest.raises(CacheLayoutError, match="kv split"):
        PageWriter(store, _vllm_caches(4), BS, "hnd")


def test_nhd_memory_layout_channel_split(store):
    """The 'channel' split over an LBNHC (token-major) physical layout: the same bits."""
    keys = store.add(_chunks(4))
    spans = [(0, 7), (7, 26), (26, 31)]
    caches = [torch.full((3, BS, H, 2 * D), float("nan")).transpose(1, 2) for _ in range(2)]
    PageWriter(store, caches, BS, "channel").write(keys, spans, [2, 0])
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(31))
    for l, (pk, pv) in enumerate(_read_pages(caches, "channel", slot_rows([2, 0], BS, 0, 31))):
        assert torch.equal(pk, req.cache.k[l].reshape(-1, H, D)[ref_rows])
        assert torch.equal(pv, req.cache.v[l].reshape(-1, H, D)[ref_rows])


# ----- FlashInfer's layout (NHD and HND in memory) and KV cache groups -------------
def _planes_caches(num_blocks, hnd):
    """Two layers of vLLM's FlashInfer cache, logical [B, 2, N, Hkv, D], NaN-poisoned; HND: the
    memory order [B, 2, Hkv, N, D] (vLLM's FlashInfer stride order), viewed in the logical order."""
    if hnd:
        return [torch.full((num_blocks, 2, H, BS, D), float("nan")).transpose(2, 3) for _ in range(2)]
    return [torch.full((num_blocks, 2, BS, H, D), float("nan")) for _ in range(2)]


def _read_planes(caches, rows):
    """K, V per layer at ``rows`` as [n, Hkv, D], with FlashInfer's own reading of its cache."""
    return [(kv[:, 0].reshape(-1, H, D)[rows], kv[:, 1].reshape(-1, H, D)[rows]) for kv in caches]


@pytest.mark.parametrize("hnd", [False, True])
@pytest.mark.parametrize("skip", [0, 16])
def test_flashinfer_planes_equal_assembled_request(store, hnd, skip):
    """FLASHINFER's [B, 2, N, Hkv, D] pages, NHD or HND in memory: bit for bit the HF path's
    assembled request, nothing else touched."""
    keys = store.add(_chunks(5))
    spans = [(0, 7), (7, 26), (26, 31)]
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(31))
    block_ids = [5, 2]
    caches = _planes_caches(6, hnd)
    PageWriter(store, caches, BS, "planes").write(keys, spans, block_ids, skip=skip)
    rows = slot_rows(block_ids, BS, 0, 31)
    for l, (pk, pv) in enumerate(_read_planes(caches, rows)):
        assert torch.equal(pk[skip:], req.cache.k[l].reshape(-1, H, D)[ref_rows][skip:])
        assert torch.equal(pv[skip:], req.cache.v[l].reshape(-1, H, D)[ref_rows][skip:])
        assert pk[:skip].isnan().all() and pv[:skip].isnan().all()
    untouched = torch.ones(6 * BS, dtype=torch.bool)
    untouched[rows[skip:]] = False
    for pk, pv in _read_planes(caches, untouched.nonzero()[:, 0]):
        assert pk.isnan().all() and pv.isnan().all()
    with pytest.raises(CacheLayoutError, match="'planes' split"):
        PageWriter(store, _vllm_caches(4), BS, "planes")


@pytest.mark.parametrize("split", ["channel", "planes"])
def test_kv_cache_groups_with_a_sliding_window_group(store, split):
    """Two KV cache groups (layer 0 full attention, layer 1 sliding window), each with its own
    blocks: every group's pages hold the HF path's rows bit for bit; the sliding group's null block
    (id 0, pages outside the window) is never written."""
    keys = store.add(_chunks(6))
    spans = [(0, 7), (7, 26), (26, 31)]
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(31))
    caches = _vllm_caches(7) if split == "channel" else _planes_caches(7, True)
    full_ids, sliding_ids = [3, 6], [0, 4]       # the sliding group's first block is outside the window
    w = PageWriter(store, caches, BS, split, groups=[([0], False), ([1], True)])
    w.write(keys, spans, (full_ids, sliding_ids))
    read = (lambda c, r: _read_pages(c, "channel", r)) if split == "channel" else _read_planes
    pk, pv = read(caches[:1], slot_rows(full_ids, BS, 0, 31))[0]
    assert torch.equal(pk, req.cache.k[0].reshape(-1, H, D)[ref_rows])  # the staged path (several groups)
    assert torch.equal(pv, req.cache.v[0].reshape(-1, H, D)[ref_rows])
    pk, pv = read(caches[1:], slot_rows(sliding_ids, BS, 0, 31))[0]
    assert torch.equal(pk[BS:], req.cache.k[1].reshape(-1, H, D)[ref_rows][BS:])
    assert torch.equal(pv[BS:], req.cache.v[1].reshape(-1, H, D)[ref_rows][BS:])
    assert pk[:BS].isnan().all() and pv[:BS].isnan().all()      # block 0 untouched
    nulls = read(caches, torch.arange(BS))                          # block 0 of both layers
    assert all(k.isnan().all() and v.isnan().all() for k, v in nulls)
    with pytest.raises(CacheLayoutError, match="every one of the 2 layers exactly once"):
        PageWriter(store, caches, BS, split, groups=[([0], False), ([0], True)])
    with pytest.raises(ChunkStoreError, match="1 block lists for 2 KV cache groups"):
        w.write(keys, spans, full_ids)


# ----- fp8 caches (vLLM's kv_cache_dtype="fp8") and allocator blocks over kernel blocks ------
POISON = 0x7F   # an e4m3fn NaN byte


def _fp8_caches(split, num_blocks):
    """Two layers of vLLM's fp8 cache (uint8 storage, as vLLM allocates it), poisoned."""
    if split == "planes":
        return [torch.full((num_blocks, 2, H, BS, D), POISON, dtype=torch.uint8).transpose(2, 3) for _ in range(2)]
    return [torch.full((num_blocks, H, BS, 2 * D), POISON, dtype=torch.uint8) for _ in range(2)]


@pytest.mark.parametrize("split", ["channel", "rows", "planes"])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("skip", [0, 16])
def test_fp8_pages_equal_the_quantised_assembled_request(store, split, per_head, skip):
    """fp8 e4m3 pages with per-layer (or per-KV-head) k/v scales: every written byte equals the fp8
    reference's quantisation (``clamp(x / scale, -448, 448)``, round to nearest even) of the HF path's
    assembled request; one layer's k scale is small enough to saturate; nothing else is touched."""
    keys = store.add(_chunks(7))
    spans = [(0, 7), (7, 26), (26, 31)]
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(31))
    if per_head:
        scales = [(torch.tensor([0.0625, 0.011]), torch.tensor([0.021, 0.37])),
                  (torch.tensor([0.0011, 0.29]), torch.tensor([0.05, 0.0077]))]
    else:
        scales = [(torch.tensor(0.0625), torch.tensor(0.021)), (torch.tensor([0.0011]), torch.tensor([0.05]))]
    caches = _fp8_caches(split, 6)
    block_ids = [4, 1]
    PageWriter(store, caches, BS, split, scales=scales).write(keys, spans, block_ids, skip=skip)
    views = [c.view(ref_kv.FP8) for c in caches]
    rows = slot_rows(block_ids, BS, 0, 31)
    got = _read_planes(views, rows) if split == "planes" else _read_pages(views, split, rows)
    saturated = 0
    for l, (pk, pv) in enumerate(got):
        for t, have, scale in ((req.cache.k[l], pk, scales[l][0]), (req.cache.v[l], pv, scales[l][1])):
            full = t.reshape(-1, H, D)[ref_rows]
            want = ref_kv.quantize(full, scale.reshape(-1, 1), ref_kv.FP8)
            assert torch.equal(have[skip:].view(torch.uint8), want[skip:].view(torch.uint8))
            assert (have[:skip].view(torch.uint8) == POISON).all()         # vLLM's own prefix hit
            saturated += int((full[skip:].abs() / scale.reshape(-1, 1) > 448).sum())
    assert saturated > 0
    untouched = torch.ones(6 * BS, dtype=torch.bool)
    untouched[rows[skip:]] = False
    rest = untouched.nonzero()[:, 0]
    for pk, pv in (_read_planes(views, rest) if split == "planes" else _read_pages(views, split, rest)):
        assert (pk.view(torch.uint8) == POISON).all() and (pv.view(torch.uint8) == POISON).all()


def test_fp8_setups_are_refused(store):
    fp8 = _fp8_caches("channel", 4)
    with pytest.raises(CacheLayoutError, match="no \\(k_scale, v_scale\\)"):
        PageWriter(store, fp8, BS, "channel")
    with pytest.raises(CacheLayoutError, match="k_scale must be a float32 tensor of 1 or 2"):
        PageWriter(store, fp8, BS, "channel", scales=[(torch.ones(3), torch.ones(1))] * 2)
    with pytest.raises(CacheLayoutError, match="v_scale must be a float32"):
        PageWriter(store, fp8, BS, "channel", scales=[(torch.ones(1), torch.ones(1, dtype=torch.float64))] * 2)
    with pytest.raises(CacheLayoutError, match="not fp8, but has scales"):
        PageWriter(store, _vllm_caches(4), BS, "channel", scales=[(torch.ones(1), torch.ones(1))] * 2)
    with pytest.raises(CacheLayoutError, match="2 fp8 scale entries for 1 layers|attention layers"):
        PageWriter(store, fp8[:1], BS, "channel", scales=[None, None])


def test_mixed_fp8_and_plain_layers_in_sliding_groups_over_kernel_blocks(store):
    """vLLM's hybrid allocator: group 0 (layer 0, full attention, fp8 cache) and group 1 (layer 1,
    sliding window, the store's dtype) with 32-token allocator blocks over 16- and 8-token cache
    blocks (vLLM's kernel block size): each layer's pages hold its rows of the assembled request."""
    keys = store.add(_chunks(8))
    spans = [(0, 7), (7, 26), (26, 31)]
    req = store.assemble(keys, positions="reordered")
    ref_rows = req.cache.slot_rows(0, torch.arange(31))
    k_scale, v_scale = torch.tensor(0.05), torch.tensor(0.02)
    caches = [torch.full((8, H, BS, 2 * D), POISON, dtype=torch.uint8),          # 16-token cache blocks
              torch.full((16, H, 8, 2 * D), float("nan"))]                       # 8-token cache blocks
    full_ids, sliding_ids = [2], [3]           # 31 tokens: one 32-token block each
    w = PageWriter(store, caches, 32, "channel", groups=[([0], False), ([1], True, 32)],
                   scales=[(k_scale, v_scale), None])
    w.write(keys, spans, (full_ids, sliding_ids))
    pk, pv = _read_pages([caches[0].view(ref_kv.FP8)], "channel", slot_rows(full_ids, 32, 0, 31))[0]
    want_k = ref_kv.quantize(req.cache.k[0].reshape(-1, H, D)[ref_rows], k_scale, ref_kv.FP8)
    want_v = ref_kv.quantize(req.cache.v[0].reshape(-1, H, D)[ref_rows], v_scale, ref_kv.FP8)
    assert torch.equal(pk.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pv.view(torch.uint8), want_v.view(torch.uint8))
    rows = slot_rows(sliding_ids, 32, 0, 31)
    assert rows.tolist() == list(range(96, 127))         # block 3 of 32 tokens = 8-token cache blocks 12..15
    pk, pv = _read_pages(caches[1:], "channel", rows)[0]
    assert torch.equal(pk, req.cache.k[1].reshape(-1, H, D)[ref_rows])
    assert torch.equal(pv, req.cache.v[1].reshape(-1, H, D)[ref_rows])
    assert int((caches[0] != POISON).sum()) == 31 * H * 2 * D
    assert int((~caches[1].isnan()).sum()) == 31 * H * 2 * D
    with pytest.raises(CacheLayoutError, match="blocks of 16 tokens, which do not divide .* block size 8"):
        PageWriter(store, caches, 8, "channel", groups=[([0], False), ([1], True, 8)], scales=[(k_scale, v_scale), None])
