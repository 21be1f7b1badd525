"""``ragattn.ops.PagedAttentionStep``: what belongs to the step is checked once, when it is made
(named errors, before any layer runs); a layer's run writes given outputs in place, equal to
the allocated result on every CPU backend, and refuses outputs that share memory with an input."""
from __future__ import annotations

import pytest
import torch

from ragattn import PageTable
from ragattn.ops import PagedAttentionStep
from tests.helpers import use_kernel_backend
from tests.ops.paged_attention.test_paged_attention import check_against_reference
from tests.ops.paged_attention.test_paged_attention_plan import make_csr_case


@pytest.fixture(params=["default", "reference", "triton"])
def backend(request, monkeypatch, device):
    use_kernel_backend(monkeypatch, device, request.param)
    return request.param


def _case(device, index_dtype=torch.int32):
    return make_csr_case([[40], [2, 3, 4], [9]], [41, 5, 10], num_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                         dtype=torch.float32, device=device, index_dtype=index_dtype)


@pytest.mark.parametrize("table_kind", ["padded", "csr"])
def test_outputs_given_are_written_in_place(backend, device, table_kind, seed):
    c = _case(device)
    table = (PageTable.from_block_table(c["bt"], c["kv_lens"]) if table_kind == "padded"
             else PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8))
    step = PagedAttentionStep(c["cu"], table)
    want_o, want_l = step.run(c["q"], c["q_pos"], c["k"], c["v"])
    out, lse = torch.full_like(c["q"], 7.0), torch.full(c["q"].shape[:2], 7.0, device=device)
    for layer in range(2):          # a step runs every layer: the same checks, the same result
        o, l = step.run(c["q"], c["q_pos"], c["k"], c["v"], out=out, lse_out=lse)
        assert o is out and l is lse
        torch.testing.assert_close(out, want_o, atol=0, rtol=0)
        torch.testing.assert_close(lse, want_l, atol=0, rtol=0)
    check_against_reference((c["q"], c["q_pos"], c["cu"], c["k"], c["v"], c["bt"], c["kv_lens"]), out, lse)
    strided = torch.zeros(c["q"].shape[0], c["q"].shape[1], 2 * c["q"].shape[2], device=device)[..., ::2]
    o, l = step.run(c["q"], c["q_pos"], c["k"], c["v"], out=strided)     # a strided out; lse allocated
    assert o is strided
    torch.testing.assert_close(strided, want_o, atol=0, rtol=0)
    torch.testing.assert_close(l, want_l, atol=0, rtol=0)


def test_outputs_sharing_memory_with_an_input_are_refused():
    c = _case("cpu")
    step = PagedAttentionStep(c["cu"], PageTable.from_block_table(c["bt"], c["kv_lens"]))
    lse = torch.empty(c["q"].shape[:2])
    with pytest.raises(ValueError, match="paged_attention: out must not share memory with q"):
        step.run(c["q"], c["q_pos"], c["k"], c["v"], out=c["q"], lse_out=lse)
    with pytest.raises(ValueError, match="paged_attention: out must not share memory with k_cache"):
        step.run(c["q"], c["q_pos"], c["k"], c["v"], out=c["k"].view(-1)[:c["q"].numel()].view(c["q"].shape),
                 lse_out=lse)
    with pytest.raises(ValueError, match="paged_attention: out must not share memory with lse_out"):
        out = torch.empty(c["q"].numel() + lse.numel())
        step.run(c["q"], c["q_pos"], c["k"], c["v"], out=out[:c["q"].numel()].view(c["q"].shape),
                 lse_out=out[c["q"].numel() - 1:-1].view(lse.shape))
    with pytest.raises(TypeError, match="paged_attention: out must be float32"):
        step.run(c["q"], c["q_pos"], c["k"], c["v"], out=torch.empty(c["q"].shape, dtype=torch.float64))


def test_the_steps_own_arguments_are_checked_when_it_is_made():
    """cu_seqlens_q, the bounds and the rows per sequence are the step's: refused by name when
    it is made (they were first seen by a layer's run, once per layer)."""
    c = _case("cpu")
    table = PageTable.from_block_table(c["bt"], c["kv_lens"])
    with pytest.raises(TypeError, match="PagedAttentionStep: cu_seqlens_q must be int32 or int64"):
        PagedAttentionStep(c["cu"].float(), table)
    with pytest.raises(ValueError, match=r"PagedAttentionStep: cu_seqlens_q must have shape \(4,\)"):
        PagedAttentionStep(c["cu"][:3], table)
    with pytest.raises(ValueError, match="PagedAttentionStep: max_kv_len must be None or a non-negative int"):
        PagedAttentionStep(c["cu"], table, max_kv_len=-1)
    with pytest.raises(ValueError, match="more than the max_q_len = 2 planned for: plan again"):
        PagedAttentionStep(c["cu"], table, max_q_len=2)
    with pytest.raises(TypeError, match="PagedAttentionStep: table must be a ragattn.PageTable"):
        PagedAttentionStep(c["cu"], c["bt"])


def test_out_of_range_pages_are_still_refused():
    """The C++ kernel checks the index values it follows on every call (O(pages), no tensor op)."""
    c = _case("cpu")
    bt = c["bt"].clone()
    bt[0, 1] = c["k"].shape[0]
    step = PagedAttentionStep(c["cu"], PageTable.from_block_table(bt, c["kv_lens"]))
    with pytest.raises(ValueError, match=r"block_table entries used by kv_lens must lie in \[0, num_pages"):
        step.run(c["q"], c["q_pos"], c["k"], c["v"], out=torch.empty_like(c["q"]))


@pytest.mark.parametrize("rope", ["none", "neox", "gptj-partial"])
def test_a_tagged_step_calls_the_cpu_kernel_directly(monkeypatch, seed, rope):
    """A position-tagged step of plain CPU tensors calls the tagged C++ kernel directly (no per-layer
    run-op checks): the checked path's result bit for bit, within the precision rule of the
    float64 reference; arguments the run op refuses are still refused by name."""
    from ragattn import run_paged_attention
    from ragattn.ops import paged_attention_step
    from tests.helpers import assert_precision
    from tests.ops.paged_attention.test_paged_attention_plan import _plan
    from tests.ops.paged_attention.test_paged_attention_tagged import _table_refs, make_tagged_case

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([13, 8, 21], "gapped", page_size=8, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.bfloat16, device=torch.device("cpu"),
                                                 gen=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    rp = {"none": (None, 0, False), "neox": (inv_freq, 64, False), "gptj-partial": (inv_freq[:16], 32, True)}[rope]
    kw = dict(inv_freq=rp[0], rotary_dim=rp[1] or None, interleaved=rp[2]) if rp[0] is not None else {}
    for window_left in (-1, 10):
        want = run_paged_attention(_plan(dict(cu=cu, q=q, k=k), table, window_left), q, q_pos, k, v, **kw)
        step = PagedAttentionStep(cu, table)
        calls = []
        monkeypatch.setattr(paged_attention_step, "validate_run", lambda *a, **k: calls.append(a))
        for layer in range(2):
            got = step.run(q, q_pos, k, v, window_left=window_left, **kw)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        monkeypatch.undo()
        assert not calls                           # the checked path never ran
        (o64, l64), (olp, llp) = _table_refs(q, q_pos, cu, k, v, table, window_left, rp)
        assert_precision(got[0], o64, olp)
        assert_precision(got[1], l64, llp, what="lse")
    step = PagedAttentionStep(cu, table)
    with pytest.raises(ValueError, match=r"paged_attention_run: inv_freq must have shape \(16,\)"):
        step.run(q, q_pos, k, v, inv_freq=inv_freq, rotary_dim=32)
    with pytest.raises(ValueError, match="paged_attention_run: rotary_dim = 32 is given without inv_freq"):
        step.run(q, q_pos, k, v, rotary_dim=32)
    with pytest.raises(TypeError, match="paged_attention_run: inv_freq must be float32"):
        step.run(q, q_pos, k, v, inv_freq=inv_freq.double())
    with pytest.raises(ValueError, match="paged_attention_run: rotary_dim must be even"):
        step.run(q, q_pos, k, v, inv_freq=inv_freq[:15], rotary_dim=31)


@pytest.mark.parametrize("mode", ["grad", "inference"])
def test_a_tagged_steps_rope_table_follows_its_inputs(seed, mode):
    """The step keeps its RoPE table from one layer to the next: an ``inv_freq`` written in place
    between layers, or other positions, give the fresh step's result bit for bit (never the
    previous layer's table); under ``inference_mode`` (inference tensors have no version counter)
    too."""
    from tests.ops.paged_attention.test_paged_attention_tagged import make_tagged_case

    gen = torch.Generator().manual_seed(seed)
    q, q_pos, cu, k, v, table = make_tagged_case([13, 8, 21], "gapped", page_size=8, num_heads=6, num_kv_heads=2,
                                                 head_dim=64, dtype=torch.float32, device=torch.device("cpu"),
                                                 gen=gen)
    ctx = torch.inference_mode() if mode == "inference" else torch.no_grad()
    with ctx:
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        step = PagedAttentionStep(cu, table)
        first = step.run(q, q_pos, k, v, inv_freq=inv_freq)
        assert torch.equal(step.run(q, q_pos, k, v, inv_freq=inv_freq)[0], first[0])
        inv_freq.mul_(0.5)                                   # in place, between two layers
        want = PagedAttentionStep(cu, table).run(q, q_pos, k, v, inv_freq=inv_freq)
        got = step.run(q, q_pos, k, v, inv_freq=inv_freq)
        assert not torch.equal(want[0], first[0])
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        moved = q_pos + 40                                   # other positions: a table that reaches them
        want = PagedAttentionStep(cu, table).run(q, moved, k, v, inv_freq=inv_freq)
        got = step.run(q, moved, k, v, inv_freq=inv_freq)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("table_kind", ["padded", "csr"])
def test_fp8_caches_take_their_scales(backend, device, table_kind, seed):
    """A step over float8 caches (vLLM's ``kv_cache_dtype="fp8"``) passes the per-tensor scales to
    the run: the same answer as ``run_paged_attention`` with them (itself checked against the
    reference over the dequantised caches), and refused without them."""
    from ragattn import plan_paged_attention, run_paged_attention

    c = make_csr_case([[40], [2, 3, 4], [9]], [41, 5, 10], num_heads=6, num_kv_heads=2, head_dim=64, page_size=8,
                      dtype=torch.bfloat16, device=device)
    ks, vs = torch.tensor([0.04], device=device), torch.tensor([0.03], device=device)
    k8, v8 = ((t.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn) for t, s in ((c["k"], ks), (c["v"], vs)))
    table = (PageTable.from_block_table(c["bt"], c["kv_lens"]) if table_kind == "padded"
             else PageTable.from_csr(c["indptr"], c["indices"], c["last"], 8))
    plan = plan_paged_attention(c["cu"], table, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    want_o, want_l = run_paged_attention(plan, c["q"], c["q_pos"], k8, v8, k_scale=ks, v_scale=vs)
    step = PagedAttentionStep(c["cu"], table)
    out, lse = torch.full_like(c["q"], 7.0), torch.full(c["q"].shape[:2], 7.0, device=device)
    o, l = step.run(c["q"], c["q_pos"], k8, v8, k_scale=ks, v_scale=vs, out=out, lse_out=lse)
    assert o is out and l is lse
    torch.testing.assert_close(out, want_o)
    torch.testing.assert_close(lse, want_l)
    with pytest.raises((TypeError, ValueError), match="needs k_scale and v_scale|k_cache must be bfloat16"):
        step.run(c["q"], c["q_pos"], k8, v8)
