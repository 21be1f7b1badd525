"""The "ragattn" attention against SDPA with every cache and mask transformers builds, the
features it refuses, and model.generate() over the paged request cache (PagedCache)."""
import warnings

import pytest
import torch

import ragattn.hf
from ragattn.hf import attention as hfattn
from ragattn.hf import masks as hfmasks
from ragattn.ops import paged_attention_step
from ragattn.hf.registration import use_ragattn
from ragattn.kv import PagedKV, cpu_sdpa_enabled
from ragattn.hf.models import random_llama
from tests.helpers import cuda_usable, require_triton_on

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rope_theta=1000.0)


def _model(family="llama", **over):
    model = random_llama(dict(SHAPE, **over), dtype=torch.float32, family=family, seed=3)
    model.generation_config.pad_token_id = 0
    return model


def _gen(model, impl, **kw):
    model.set_attn_implementation(impl)
    try:
        return model.generate(**kw, do_sample=False, output_logits=True, return_dict_in_generate=True)
    finally:
        model.set_attn_implementation("sdpa")


def _inputs(batch, padded, n=11, seed=1):
    ids = torch.randint(1, 97, (batch, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, :4] = 0
    return ids, mask


CACHES = [None, "static"] + (["offloaded"] if cuda_usable() else [])


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_equals_sdpa_every_cache(family):
    """Dynamic and static (and, on CUDA, offloaded) caches, batch 1 and 2, padded and not: the
    same tokens as SDPA and logits within float rounding. The static cache gave logits 0.45 to
    0.73 off before the query slots were taken from the mask."""
    model = _model(family)
    for cache in CACHES:
        for batch, padded in [(1, False), (2, False), (2, True)]:
            ids, mask = _inputs(batch, padded)
            kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
            if cache:
                kw["cache_implementation"] = cache
            ref, got = _gen(model, "sdpa", **kw), _gen(model, "ragattn", **kw)
            assert torch.equal(ref.sequences, got.sequences), (cache, batch, padded)
            for a, b in zip(ref.logits, got.logits):
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="transformers' offloaded cache needs CUDA (it moves layers between GPU and CPU memory)")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_offloaded_cache_equals_sdpa_on_cuda(family):
    """The README's "any cache ... offloaded": on a CUDA model, the same tokens and logits as SDPA."""
    model = _model(family).cuda()
    for batch, padded in [(1, False), (2, True)]:
        ids, mask = _inputs(batch, padded)
        kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=6, min_new_tokens=6,
                  cache_implementation="offloaded")
        ref, got = _gen(model, "sdpa", **kw), _gen(model, "ragattn", **kw)
        assert torch.equal(ref.sequences, got.sequences), (batch, padded)
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_sliding_window_model_equals_sdpa():
    """Mistral with a window shorter than the prompt: the sliding mask is honoured (prefill runs
    varlen_attention with the window, decode reads only the window's slots)."""
    model = _model("mistral", sliding_window=5)
    ids, mask = _inputs(2, True, n=12)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6)
    ref, got = _gen(model, "sdpa", **kw), _gen(model, "ragattn", **kw)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.logits, got.logits):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_sliding_window_prefill_runs_varlen_and_equals_eager(monkeypatch, family):
    """A prefill longer than the window (padded batch; Qwen2 with full and sliding layers) runs
    varlen_attention with window_left = W - 1, never the SDPA fallback, and its logits lie as
    close to the float64 reference (SDPA with transformers' sliding mask: float64 eager turns the
    padded rows into NaN and spreads them) as float32 eager's do. Before the window reached
    varlen, every such prefill fell back to SDPA (the fallback raises here)."""
    over = dict(sliding_window=4)
    if family == "qwen2":   # layer 0 full attention, layer 1 sliding
        over.update(use_sliding_window=True, max_window_layers=1)
    model = _model(family, **over)
    ids, mask = _inputs(2, True, n=13, seed=5)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref64 = model.double()(ids, attention_mask=mask).logits
        model.set_attn_implementation("eager")
        ref32 = model.float()(ids, attention_mask=mask).logits
        calls = []
        real = hfattn._ops.varlen_attention
        monkeypatch.setattr(hfattn._ops, "varlen_attention", lambda *a: calls.append(a[11]) or real(*a))  # window_left
        monkeypatch.setattr(hfattn, "_sdpa_fallback", lambda *a, **k: pytest.fail("SDPA fallback"))
        model.set_attn_implementation("ragattn")
        try:
            got = model(ids, attention_mask=mask).logits
        finally:
            model.set_attn_implementation("sdpa")
    assert calls == ([-1, 3] if family == "qwen2" else [3, 3])
    real_rows = mask.bool()   # padded query rows' outputs are never used
    err = (got.double() - ref64)[real_rows].abs().max()
    assert err <= 2 * (ref32.double() - ref64)[real_rows].abs().max() + 1e-5


@pytest.mark.parametrize("kind", ["float", "bool"])
def test_custom_4d_mask_is_honoured(kind):
    """A block-diagonal mask is not "causal + padding": it must give eager's logits (it gave
    logits 0.4 away when reduced to row/column validity)."""
    model = _model()
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(4))
    blk = torch.tensor([0] * 4 + [1] * 6)
    allow = torch.ones(10, 10, dtype=torch.bool).tril() & (blk[:, None] == blk[None, :])
    mask = allow if kind == "bool" else torch.zeros(10, 10).masked_fill(~allow, float("-inf"))
    mask = mask[None, None].expand(2, 1, 10, 10)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        ref = model(ids, attention_mask=mask if kind == "float" else torch.where(mask, 0.0, float("-inf"))).logits
        model.set_attn_implementation("ragattn")
        got = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_refused_features_are_named():
    model = _model()
    ids = torch.randint(1, 97, (1, 5))
    with use_ragattn(model), torch.no_grad():
        # (soft-capping runs in the kernels: tests/hf/test_hf_families.py; unsupported families are
        # refused when loading, and by this runtime guard for a config changed afterwards)
        model.config.model_type = "gpt_neox"
        try:
            with pytest.raises(NotImplementedError, match="gpt_neox"):
                model(ids)
        finally:
            model.config.model_type = "llama"
        model(ids)  # and it runs again


def test_enable_registers_and_runs():
    from transformers import AttentionInterface

    ragattn.hf.enable()
    ragattn.hf.enable()  # idempotent
    assert "ragattn" in AttentionInterface._global_mapping
    model = random_llama(SHAPE, dtype=torch.float32, seed=3, attn_implementation="ragattn")
    assert model.config._attn_implementation == "ragattn"


def test_inference_mode_generate_and_paged():
    """Serving code runs under inference_mode: generate() and the paged path (append_plan read
    lengths._version, which inference tensors do not have)."""
    model = _model()
    ids, mask = _inputs(2, True)
    with torch.inference_mode():
        ref = _gen(model, "sdpa", input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
        got = _gen(model, "ragattn", input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
        assert torch.equal(ref.sequences, got.sequences)
        cache = PagedKV(2, 1, 16, 2, 16, page_size=4)
        with use_ragattn(model):
            a = model(input_ids=ids[:1, :6], position_ids=torch.arange(6)[None], use_cache=False,
                      ragattn_paged=cache).logits
            cache.lengths += 6
            b = model(input_ids=ids[:1, 6:], position_ids=torch.arange(6, 11)[None], use_cache=False,
                      ragattn_paged=cache).logits
        full = model(ids[:1]).logits
    torch.testing.assert_close(torch.cat([a, b], 1), full, rtol=1e-4, atol=1e-4)


def test_unpadded_forward_compiles_without_graph_breaks():
    """No host sync and no boolean-mask packing on an unpadded batch: dynamo sees one graph
    (the old path had 13 graph breaks)."""
    model = _model()
    ids = torch.randint(1, 97, (2, 9))
    model.set_attn_implementation("ragattn")
    try:
        with torch.no_grad():
            exp = torch._dynamo.explain(lambda x: model(input_ids=x, use_cache=False).logits)(ids)
    finally:
        model.set_attn_implementation("sdpa")
    assert exp.graph_break_count == 0, [str(b.reason)[:200] for b in exp.break_reasons]


@pytest.mark.parametrize("cpu_sdpa", ["1", "0"])
def test_decode_step_compiles_fullgraph(monkeypatch, cpu_sdpa):
    """The proof on the HF side: a decode step's attention traces under
    ``torch.compile(fullgraph=True)`` (a host sync such as ``.item()`` or ``bool(tensor)`` is a
    graph break, an error under fullgraph): the transformers-cache step (no mask, and a padding
    mask: plan built from tensors only) and the paged request cache's step at a layer after the
    first (the step's plan, with its one host sync, was made at layer 0), on both CPU paths."""
    monkeypatch.setenv("RAGATTN_HF_CPU_SDPA", cpu_sdpa)
    model = _model()
    m0, m1 = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 4, 16, generator=g).transpose(1, 2)              # [B, Hq, 1, D] view
    k, v = (torch.randn(2, 2, 13, 16, generator=g) for _ in range(2))
    pad = torch.ones(2, 1, 1, 13, dtype=torch.bool)
    pad[1, ..., :4] = False

    def hf_step(q, k, v, mask):
        return hfattn.ragattn_attention_forward(m1, q, k, v, mask, scaling=0.25)[0]

    cache = PagedKV(2, 2, 32, 2, 16, page_size=4)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    cache.lengths.copy_(torch.tensor([9, 5], dtype=torch.int32))
    kn, vn = (torch.randn(2, 2, 1, 16, generator=g) for _ in range(2))
    hfattn._paged_forward(m0, q, kn, vn, 0.25, cache)                     # layer 0 plans the step

    def paged_step(q, k, v):
        return hfattn._paged_forward(m1, q, k, v, 0.25, cache)[0][0]

    with torch.no_grad():
        for fn, args in [(hf_step, (q, k, v, None)), (hf_step, (q, k, v, pad)), (paged_step, (q, kn, vn))]:
            torch._dynamo.reset()
            want = fn(*args)
            got = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_paged_cache_generate_batch_matches_rows_alone():
    """PagedCache under generate(): two rows with different cached lengths (prefix left-padded in
    input_ids) and padded new tokens give each row's tokens when generated alone, and those equal
    a plain dynamic-cache generation of the full prompt."""
    from ragattn.hf.cache import PagedCache

    model = _model()
    g = torch.Generator().manual_seed(9)
    prefix = [torch.randint(1, 97, (n,), generator=g) for n in (7, 4)]
    new = [torch.randint(1, 97, (n,), generator=g) for n in (3, 5)]

    def fill(rows):
        cache = PagedKV(2, len(rows), 32, 2, 16, page_size=4)
        with use_ragattn(model), torch.no_grad():
            for b, r in enumerate(rows):
                one = PagedKV(2, 1, 32, 2, 16, page_size=4)
                one.block_table = cache.block_table[b:b + 1]
                one.k, one.v = cache.k, cache.v
                model(input_ids=prefix[r][None], use_cache=False, ragattn_paged=one)
                cache.lengths[b] = len(prefix[r])
        return cache

    def run(rows):
        P = max(len(prefix[r]) for r in rows)
        T = max(len(new[r]) for r in rows)
        ids = torch.zeros(len(rows), P + T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, P - len(prefix[r]):P], ids[b, P + T - len(new[r]):] = prefix[r], new[r]
            mask[b, P - len(prefix[r]):P] = 1
            mask[b, P + T - len(new[r]):] = 1
        pos = (mask.cumsum(1) - 1).clamp_min(0)
        with use_ragattn(model):
            out = model.generate(input_ids=ids, attention_mask=mask, position_ids=pos,
                                 past_key_values=PagedCache(fill(rows), seen=P), max_new_tokens=5,
                                 min_new_tokens=5, do_sample=False)
        return out[:, P + T:]

    both = run([0, 1])
    for b in (0, 1):
        assert torch.equal(both[b], run([b])[0])
        full = torch.cat([prefix[b], new[b]])[None]
        ref = model.generate(input_ids=full, attention_mask=torch.ones_like(full), max_new_tokens=5,
                             min_new_tokens=5, do_sample=False)[:, full.shape[1]:]
        assert torch.equal(both[b], ref[0])


def test_paged_cpu_sdpa_path_equals_paged_op(monkeypatch):
    """The CPU shortcut (SDPA over a row's consecutive pages) and ragattn.paged_attention give the
    same prefill + decode logits (rows of different lengths, GQA)."""
    model = _model()
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RAGATTN_HF_CPU_SDPA", flag)
        cache = PagedKV(2, 2, 16, 2, 16, page_size=4)
        gen = torch.Generator().manual_seed(0)
        for t in cache.k + cache.v:
            t.copy_(torch.randn(t.shape, generator=gen))
        cache.lengths[1] = 3   # row 1 starts with 3 earlier slots it attends to as well
        with use_ragattn(model), torch.no_grad():
            a = model(input_ids=ids[:, :7], position_ids=torch.arange(7)[None].expand(2, 7),
                      use_cache=False, ragattn_paged=cache).logits
            cache.lengths += 7
            b = model(input_ids=ids[:, 7:8], position_ids=torch.full((2, 1), 7), use_cache=False,
                      ragattn_paged=cache).logits
        outs.append(torch.cat([a, b], 1))
    assert cpu_sdpa_enabled(1) is False and cpu_sdpa_enabled(7) is False
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["auto", "1", "0"])
def test_paged_cache_decode_routes_equal_full_prefill(monkeypatch, route):
    """Every CPU route of the PagedCache step (default: paged_attention for decode rows, SDPA for
    the prefill; forced SDPA; forced kernel) writes the new K/V into the right slots and gives
    generate()'s tokens and logits of the model's own decode after a full prefill. Pages poisoned
    with NaN: a slot read before it is written (or past the row's length) shows up as NaN; rows of
    9 and 5 cached slots cross 4-slot page boundaries; GQA 4/2."""
    from ragattn.hf.cache import PagedCache

    monkeypatch.setenv("RAGATTN_HF_CPU_SDPA", route)
    model = _model()
    g = torch.Generator().manual_seed(11)
    for n in (9, 5):
        ids = torch.randint(1, 97, (1, n + 2), generator=g)
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             min_new_tokens=6, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        cache = PagedKV(2, 1, n + 9, 2, 16, page_size=4)
        for t in cache.k + cache.v:
            t.fill_(float("nan"))
        with use_ragattn(model), torch.no_grad():
            model(input_ids=ids[:, :n], use_cache=False, ragattn_paged=cache)   # q = n > 1: prefill
            cache.lengths += n
            got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 past_key_values=PagedCache(cache), max_new_tokens=6, min_new_tokens=6,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert torch.equal(got.sequences, ref.sequences), (route, n)
        for a, b in zip(ref.logits, got.logits):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert int(cache.lengths[0]) == n + 2 + 5          # the prompt's 2 new tokens + 5 decoded
        assert not any(t.view(-1, 2, 16)[:n + 7].isnan().any() for t in cache.k + cache.v)


@pytest.mark.parametrize("cpu_sdpa", ["1", "0"])
def test_paged_cache_sliding_window_equals_sdpa(monkeypatch, cpu_sdpa):
    """Mistral with a window shorter than the cached prefix: the paged path applies the window
    (paged_attention's window_left = W - 1, or the CPU shortcut's mask) in the prefix's own
    prefill and under generate(), and equals SDPA over the whole prompt."""
    from ragattn.hf.cache import PagedCache

    monkeypatch.setenv("RAGATTN_HF_CPU_SDPA", cpu_sdpa)
    model = _model("mistral", sliding_window=4)
    ids = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(6))
    ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                         min_new_tokens=5, do_sample=False)
    cache = PagedKV(2, 1, 32, 2, 16, page_size=4)
    with use_ragattn(model), torch.no_grad():
        model(input_ids=ids[:, :7], use_cache=False, ragattn_paged=cache)
        cache.lengths += 7
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             past_key_values=PagedCache(cache), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False)
    assert torch.equal(got, ref)


# ----- Per-forward work and in-place cache reads --------------------------
def test_prefill_plan_and_tile_plan_are_built_once_per_forward(monkeypatch):
    """A padded prefill packs its rows once per forward (layer 0) and every later layer
    reuses that plan; the varlen op then sees the very same index tensors, so its tile-plan cache
    hits instead of re-planning per layer (the old path built new cu/pos tensors per layer; the
    default CPU forward, C++, plans nothing: every layer's call gets the same index objects)."""
    model = _model(num_hidden_layers=3)
    ids, mask = _inputs(2, True, n=13, seed=4)
    plans, index_args = [], []

    class CountedPlan(hfmasks._Plan):
        __slots__ = ()

        def __init__(self):
            plans.append(1)

    def recorded_varlen(*a, _f=hfattn._ops.varlen_attention, **kw):
        index_args.append(a[3:7])  # cu_q, cu_k, q_pos, kv_pos
        return _f(*a, **kw)

    monkeypatch.setattr(hfmasks, "_Plan", CountedPlan)
    monkeypatch.setattr(hfattn._ops, "varlen_attention", recorded_varlen)
    monkeypatch.delenv("RAGATTN_CPU_BACKEND", raising=False)
    with use_ragattn(model), torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert len(plans) == 1 and len(index_args) == 3, (len(plans), len(index_args))
    assert all(x is y for a in index_args[1:] for x, y in zip(index_args[0], a))
    want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("padded", [False, True])
def test_decode_reads_the_cache_in_place(monkeypatch, padded):
    """A decode step hands paged_attention the transformers cache's own storage
    (page views by strides), never a copy of K/V (the old path copied the whole cache with
    ``kt.contiguous()`` in every layer, every token)."""
    model = _model()
    m1 = model.model.layers[1].self_attn
    g = torch.Generator().manual_seed(12)
    q = torch.randn(2, 4, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, 13, 16, generator=g) for _ in range(2))
    mask = None
    if padded:
        mask = torch.ones(2, 1, 1, 13, dtype=torch.bool)
        mask[1, ..., :4] = False
    seen = []
    real = paged_attention_step.cpu_kernel   # (the decode step's call of the CPU kernel)

    def spy(q, q_pos, cu, k_cache, v_cache, *rest):
        seen.append((k_cache.untyped_storage().data_ptr(), v_cache.untyped_storage().data_ptr()))
        return real(q, q_pos, cu, k_cache, v_cache, *rest)

    monkeypatch.setattr(paged_attention_step, "cpu_kernel", spy)
    with torch.no_grad():
        out = hfattn.ragattn_attention_forward(m1, q, k, v, mask, scaling=0.25)[0]
    assert seen == [(k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())]
    vis = torch.ones(2, 13, dtype=torch.bool) if mask is None else mask[:, 0, 0]
    for b in range(2):   # against plain attention over the visible keys (GQA: kv head = h // 2)
        kb, vb = k[b, :, vis[b]].repeat_interleave(2, 0), v[b, :, vis[b]].repeat_interleave(2, 0)
        want = torch.softmax(q[b].double() @ kb.double().transpose(1, 2) * 0.25, -1) @ vb.double()
        torch.testing.assert_close(out[b, 0].double(), want[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["transformers-cache", "paged"])
def test_decode_step_plans_the_paged_launch_once(monkeypatch, route):
    """A decode step plans the paged launch once (its one host sync: cu_seqlens and
    kv_lens to the host) and runs every layer without a sync, so the step is CUDA-graph
    capturable. Seen on the CPU through the Triton backend, which takes the CUDA code path; both
    routes: a transformers cache (mask-planned decode) and ``ragattn_paged`` (the PagedKV step).
    Before the fix every layer called the one-call op, which plans: 3 plans for 3 layers."""
    import ragattn.triton_kernels.paged_attention as pa
    import ragattn.triton_kernels.paged_plan as pp

    require_triton_on(torch.device("cpu"))   # the CPU model through the Triton kernels: the interpreter
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "triton")
    monkeypatch.setenv("RAGATTN_HF_CPU_SDPA", "0")   # the CPU's SDPA shortcut would skip the op
    plans, runs = [], []
    real_plan, real_run = pp.plan_paged_attention, pa.run_paged_attention
    monkeypatch.setattr(pp, "plan_paged_attention", lambda *a, **kw: plans.append(1) or real_plan(*a, **kw))
    monkeypatch.setattr(pa, "run_paged_attention", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    model = _model(num_hidden_layers=3)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(5))
    with use_ragattn(model), torch.no_grad():
        if route == "paged":
            cache = PagedKV(3, 2, 16, 2, 16, page_size=4)
            model(input_ids=ids[:, :8], use_cache=False, ragattn_paged=cache)
            cache.lengths += 8
            plans.clear(), runs.clear()
            got = model(input_ids=ids[:, 8:], position_ids=torch.full((2, 1), 8), use_cache=False,
                        ragattn_paged=cache).logits
        else:
            past = model(input_ids=ids[:, :8], use_cache=True).past_key_values
            plans.clear(), runs.clear()
            got = model(input_ids=ids[:, 8:], past_key_values=past, use_cache=True).logits
    assert (len(plans), len(runs)) == (1, 3), f"{len(plans)} plans (host syncs), {len(runs)} launches in a 3-layer step"
    want = model(input_ids=ids).logits[:, -1:]   # stock attention over the whole sequence
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_serving_prefill_compares_index_tensors_once_per_forward(monkeypatch):
    """The per-forward packing under serving conditions (``torch.inference_mode()``, the Triton path CUDA takes):
    the layers after the first reuse the forward's tile plan without reading the index tensors
    again (each ``torch.equal`` on CUDA is a host sync)."""
    import ragattn.triton_kernels.plan_cache as plan_cache

    require_triton_on(torch.device("cpu"))   # the CPU model through the Triton kernels: the interpreter
    monkeypatch.setenv("RAGATTN_CPU_BACKEND", "triton")
    compared = []
    real = plan_cache._same
    monkeypatch.setattr(plan_cache, "_same", lambda a, b: compared.append(1) or real(a, b))
    model = _model(num_hidden_layers=3)
    ids, mask = _inputs(2, True, n=13, seed=4)
    with use_ragattn(model), torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
        compared.clear()
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(compared) <= 6, f"{len(compared)} index-tensor comparisons in one 3-layer forward (6 per layer)"
