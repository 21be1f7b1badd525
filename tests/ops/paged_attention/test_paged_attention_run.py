"""paged_attention past 2^31 elements, the plan/run pair (one plan per step, no host sync, fullgraph
under torch.compile) and a sampled grid of shapes."""
from __future__ import annotations
import torch
import ragattn
from tests.helpers import run_offsets_check

from tests.ops.paged_attention.test_paged_attention import (backend, check_against_reference, make_case, triton_backend) # noqa: F401 (fixtures)


_HUGE_OFFSETS = r"""
import torch
from tests.ops.paged_attention.test_paged_attention import make_case
from ragattn.reference.paged_attention import paged_attention as ref_paged
from ragattn.reference.merge_attention_states import merge_attention_states as ref_merge
from ragattn.triton_kernels.paged_attention import paged_attention_fwd
from ragattn.triton_kernels.merge_attention_states import merge_two_states
from tests.helpers import huge_rows

torch.manual_seed(0)
q, q_pos, cu, k, v, bt, kvl = make_case([[3, 5, 6, 7]], [8], num_heads=2, num_kv_heads=2, head_dim=16,
                                        page_size=8, dtype=torch.float16, device=DEVICE)
want, want_lse = ref_paged(q.double(), q_pos, cu, k.double(), v.double(), bt, kvl)
for splits in (1, 2):
    out = huge_rows(torch.zeros_like(q))
    paged_attention_fwd(huge_rows(q), q_pos, cu, k, v, bt, kvl, num_splits=splits, out=out)
    assert (out.double() - want).abs().max() < 2e-3, ("paged", splits)
del out
oa, ob = torch.randn(4, 2, 16, device=DEVICE).half(), torch.randn(4, 2, 16, device=DEVICE).half()
la, lb = torch.randn(4, 2, device=DEVICE), torch.randn(4, 2, device=DEVICE)
out = huge_rows(torch.zeros_like(oa))
merge_two_states(huge_rows(oa), la, huge_rows(ob), lb, out)
assert (out.double() - ref_merge(oa.double(), la.double(), ob.double(), lb.double())[0]).abs().max() < 2e-3, "merge"
del out
# K/V pages past 2^31 elements: page * page stride must be int64 too (4 pages, 2^30 elements apart)
q, q_pos, cu, k, v, bt, kvl = make_case([[0, 9, 17, 29]], [30], num_heads=2, num_kv_heads=1, head_dim=16,
                                        page_size=8, dtype=torch.float16, device=DEVICE)
used = bt[0, :4].long()   # the sequence's 4 pages, renumbered 0..3 (huge_rows spaces 4 rows)
k, v, bt = k[used], v[used], torch.arange(4, dtype=bt.dtype, device=DEVICE)[None]
want, _ = ref_paged(q.double(), q_pos, cu, k.double(), v.double(), bt, kvl)
for splits in (1, 2):
    hk, hv = huge_rows(k), huge_rows(v)
    out, _ = paged_attention_fwd(q, q_pos, cu, hk, hv, bt, kvl, num_splits=splits)
    del hk, hv
    assert (out.double() - want).abs().max() < 2e-3, ("paged K/V pages", splits)
print("compiled")  # run_compile_check's success marker
"""


def test_offsets_past_2_31_elements(device):
    """Q, out, K/V cache pages and merge inputs whose rows lie past 2^31 elements
    (views with a row or page stride of 2^30 over virtual storage), in the interpreter on the CPU
    and compiled on CUDA: int32 row * stride products wrapped (the old kernels read a negative
    offset and crashed). A subprocess, so a crash is a failure."""
    run_offsets_check(_HUGE_OFFSETS, device, cuda_gib=20)


def test_plan_once_run_per_layer(triton_backend, device, seed):
    """One plan (the only host sync) serves every layer's run; results match the reference."""
    from ragattn.triton_kernels.paged_attention import plan_paged_attention, run_paged_attention

    q_positions, kv_lens = [[80], [10, 11, 12], [0]], [81, 13, 1]
    meta_args = make_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                          dtype=torch.float16, device=device)
    plan = plan_paged_attention(meta_args[2], meta_args[6], num_heads=4, num_kv_heads=2, head_dim=64,
                                dtype=torch.float16, window_left=30, num_splits=2)
    for _layer in range(2):
        args = make_case(q_positions, kv_lens, num_heads=4, num_kv_heads=2, head_dim=64, page_size=16,
                         dtype=torch.float16, device=device)
        args = (args[0], meta_args[1], meta_args[2], args[3], args[4], meta_args[5], meta_args[6])
        out, lse = run_paged_attention(plan, *args, None, 30)
        check_against_reference(args, out, lse, 30)


def test_run_has_no_host_sync(monkeypatch):
    """The run path reads no tensor value and copies nothing to the host, so it is
    CUDA-graph capturable given a plan. Proven on the CPU by running it on meta tensors (any
    .item(), .tolist(), bool(), .cpu() or data-dependent op on them raises) with the kernel
    launches recorded instead of executed."""
    import dataclasses

    import ragattn.triton_kernels.paged_attention as pa

    args = make_case([[80], [10, 11, 12], []], [81, 13, 4], num_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, dtype=torch.bfloat16, device="cpu")
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append(("attention", grid))

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    monkeypatch.setattr(pa, "merge_split_states", lambda *a: launches.append(("merge",)))
    for splits, window in [(1, -1), (3, 40)]:
        launches.clear()
        plan = pa.plan_paged_attention(args[2], args[6], num_heads=8, num_kv_heads=2, head_dim=64,
                                       dtype=torch.bfloat16, window_left=window, num_splits=splits)
        meta = [a.to("meta") for a in args]
        plan = dataclasses.replace(plan, tile_seq=plan.tile_seq.to("meta"), tile_row0=plan.tile_row0.to("meta"))
        out, lse = pa.run_paged_attention(plan, *meta, None, window)
        assert out.device.type == "meta" and out.shape == args[0].shape and lse.shape == args[0].shape[:2]
        want = [("attention", (plan.num_tiles, 2, plan.num_splits))] + ([("merge",)] if plan.num_splits > 1 else [])
        assert launches == want
        pa.run_paged_attention(plan, *meta, None, window, out=torch.empty_like(meta[0]),
                               lse_out=torch.empty(meta[0].shape[:2], device="meta"))


def test_run_compiles_fullgraph(monkeypatch):
    """The proof: ``run_paged_attention`` with a ready plan traces under
    ``torch.compile(fullgraph=True)``, so it holds no host sync (``.item()``, ``bool(tensor)``,
    ``.tolist()`` are graph breaks, and fullgraph turns a break into an error). The Triton launches
    are replaced by traceable stand-ins (dynamo would trace into the CPU interpreter itself; on
    CUDA it captures a real launch as one node): everything around them is the real run path."""
    import ragattn.triton_kernels.paged_attention as pa

    class StandIn:   # kernel[grid](...) writes a value that depends on its inputs
        def __getitem__(self, grid):
            def launch(q, q_pos, cu, k, v, pages, row_start, kvl, tile_seq, tile_row0, o, lse, *rest, **kw):
                o.copy_((q.float() * 2 + k.float().mean()).expand_as(o).to(o.dtype))
                lse.fill_(float(grid[2]))
            return launch

    def merge_standin(o_buf, l_buf, out, lse_out):
        out.copy_(o_buf.sum(0).to(out.dtype))
        lse_out.copy_(l_buf.amax(0))

    monkeypatch.setattr(pa, "_paged_attention_kernel", StandIn())
    monkeypatch.setattr(pa, "merge_split_states", merge_standin)
    args = make_case([[80], [10, 11, 12], [5]], [81, 13, 6], num_heads=8, num_kv_heads=2, head_dim=64,
                     page_size=16, dtype=torch.bfloat16, device="cpu")
    for splits, window in [(1, -1), (3, 40)]:
        plan = pa.plan_paged_attention(args[2], args[6], num_heads=8, num_kv_heads=2, head_dim=64,
                                       dtype=torch.bfloat16, window_left=window, num_splits=splits)

        def step(*a):
            return pa.run_paged_attention(plan, *a, None, window)

        torch._dynamo.reset()
        want = step(*args)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_sampled_grid(backend, device, seed):
    """Random awkward configurations (sampled, to keep the interpreter cheap)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        nkv = int(torch.randint(1, 3, (1,), generator=gen))
        group = [1, 3, 4, 8][int(torch.randint(0, 4, (1,), generator=gen))]
        head_dim = [64, 128][int(torch.randint(0, 2, (1,), generator=gen))]
        dtype = [torch.float16, torch.bfloat16, torch.float32][int(torch.randint(0, 3, (1,), generator=gen))]
        page_size = [1, 16, 64][int(torch.randint(0, 3, (1,), generator=gen))]
        kv_lens = torch.randint(0, 90, (3,), generator=gen).tolist()
        q_positions = []
        for n in kv_lens:
            n_rows = int(torch.randint(0, min(n, 20) + 1, (1,), generator=gen))
            q_positions.append(torch.randperm(max(n, 1), generator=gen)[:n_rows].sort().values.tolist())
        args = make_case(q_positions, kv_lens, num_heads=nkv * group, num_kv_heads=nkv, head_dim=head_dim,
                         page_size=page_size, dtype=dtype, device=device)
        out, lse = ragattn.paged_attention(*args)
        check_against_reference(args, out, lse)
