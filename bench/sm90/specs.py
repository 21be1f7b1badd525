"""What the static report compiles: every Triton kernel at the configuration its launcher picks
for the benchmarks' GPU shapes (``bench/bench_*.py``, size "gpu")."""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from .h100 import DEVICE_NAME, H100, PAGED_BATCH, PAGED_CTX, PAGED_WINDOW, SPARSE_ROWS, SPARSE_TAIL, WINDOW_L, WINDOW_W


@dataclasses.dataclass
class TritonSpec:
    """One Triton kernel at one launcher-chosen configuration for a benchmark GPU shape."""

    kernel: str  # module.function
    case: str  # the benchmark case (bench family/name) whose shape this is
    forward: bool  # forward (inference) kernels must not spill and must be pipelined
    constexprs: dict
    types: dict
    num_warps: int
    num_stages: int
    grid: Tuple[int, ...]
    ints: Dict[str, int] = dataclasses.field(default_factory=dict)
    loop: bool = True  # has a main loop over key/query tiles (pipelining applies)
    costs: Optional[List[int]] = None  # per program in launch order: main-loop trips + 1 (varlen, sparse prefill)
    smem_model: Optional[int] = None  # the launcher's own model of the shared memory (paged attention)

    @property
    def label(self) -> str:
        return f"{self.kernel} [{self.case}]"



def _varlen_costs(csr, heads: int) -> List[int]:
    """Main-loop trips + 1 of each program of a varlen launch, grid (heads, items): item-major."""
    trips = (csr.work[:, 5] - csr.work[:, 3] + 1).tolist()
    return [t for t in trips for _ in range(heads)]


def kernel_fn(kernel: str):
    """The ``@triton.jit`` function ``module.name`` of ragattn.triton_kernels."""
    import importlib

    mod, name = kernel.rsplit(".", 1)
    return getattr(importlib.import_module("ragattn.triton_kernels." + mod), name)


def _varlen_bench_plan(varlen_plan, n_chunks: int, chunk: int, tail: int, bm: int, bn: int, backward: bool, slots,
                       window_left: int = -1):
    """The varlen launcher's plan for bench_varlen_attention's GPU problem (CPU tensors: only its shape
    counts); ``window_left >= 0``: the sliding-window case (one causal sequence, no blocks)."""
    import torch

    L = n_chunks * chunk + tail
    cu = torch.tensor([0, L], dtype=torch.int32)
    if window_left >= 0:
        return varlen_plan.build_plan(cu, cu, None, None, None, None, L, L, block_m=bm, block_n=bn, causal=True,
                             window_left=window_left, backward=backward, split_slots=slots)
    blk = torch.cat([torch.arange(n_chunks).repeat_interleave(chunk), torch.full((tail,), -1)]).to(torch.int32)
    return varlen_plan.build_plan(cu, cu, None, None, blk, blk, L, L, block_m=bm, block_n=bn, causal=True, window_left=-1,
                         backward=backward, split_slots=slots)


def sparse_prefill_positions() -> List[int]:
    """Query positions of bench_paged_attention's sparse prefill, modelled: 15% of the first
    PAGED_CTX - 64 slots spread evenly (the benchmark draws them at random) and the 64-slot tail."""
    n = SPARSE_ROWS - SPARSE_TAIL
    body = [int((r + 0.5) * (PAGED_CTX - SPARSE_TAIL) / n) for r in range(n)]
    return body + list(range(PAGED_CTX - SPARSE_TAIL, PAGED_CTX))


def paged_specs(name: str, batch: int, rows: int, window: int, change: Optional[dict] = None, variant: str = "",
                merge: bool = True, hnd: bool = False) -> List[TritonSpec]:
    """The paged kernel (and its split-KV merge) as ``plan_paged_attention`` launches it for ``batch``
    sequences of ``rows`` query rows over PAGED_CTX slots (32 query / 8 kv heads, d 128, bf16, page
    16) at the config table's H100 entry, with ``change`` applied to that entry (a variant). ``hnd``:
    head-major pages ``[pages, kv heads, page, d]`` (FlashInfer's HND) through the cache strides."""
    import triton

    import ragattn.triton_kernels.merge_attention_states as mas
    import ragattn.triton_kernels.paged_plan as pa
    from ragattn.triton_kernels import gpu_configs

    H, Hkv, D, ctx, page = 32, 8, 128, PAGED_CTX, 16
    group = H // Hkv
    group_pad = triton.next_power_of_2(group)
    m_tile = min(128, max(16, triton.next_power_of_2(rows * group_pad)))
    block_d = max(16, triton.next_power_of_2(D))
    key = pa.table_key(m_tile, block_d, 2, window >= 0, DEVICE_NAME)
    entry = dict(gpu_configs.get_config("paged_attention", DEVICE_NAME, key), **(change or {}))
    with gpu_configs.override("paged_attention", key, entry):  # the table's H100 entry
        cfg = pa.kernel_config(m_tile, block_d, 2, device_name=DEVICE_NAME, window=window >= 0)
    m_tile, block_n, stages, warps = cfg["m_tile"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"]
    block_m = max(1, m_tile // group_pad)
    tiles = batch * triton.cdiv(rows, block_m)
    span = ctx if (window < 0 or min(block_m, rows) > 1) else min(ctx, window + block_n)
    splits = pa.splits_for_sms(tiles * Hkv, span, block_n, H100["sms"], cfg["waves"])
    split_len = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n
    splits = max(1, triton.cdiv(span, split_len))
    consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                  HAS_WINDOW=window >= 0, ROW_STARTS=False, SOFTCAP=False, UPCAST=False, IEEE_FP32=False,
                  EVEN_D=D == block_d, PAGE_MODE=pa.page_mode(page, block_n, split_len),
                  PAGE_SIZE=page if pa.page_mode(page, block_n, split_len) else 1,
                  SPLIT_WHOLE_TILES=pa.split_whole_tiles(m_tile), PIPELINE_V=bool(entry.get("pipeline_v", False)),
                  EDGE_LOOP=bool(entry.get("edge_loop", False)))
    types = {n: "*i32" for n in ("Q_POS", "CU_SEQLENS_Q", "PAGES", "ROW_START", "KV_LENS", "TILE_SEQ", "TILE_ROW0")}
    types.update(Q="*bf16", K_CACHE="*bf16", V_CACHE="*bf16", LSE="*fp32", qk_scale="fp32", softcap_log2="fp32",
                 OUT="*fp32" if splits > 1 else "*bf16")
    # strides of q [T, H, D], k/v cache [pages, page, Hkv, D], block table [B, pages], out, lse
    slot, head = (D, page * D) if hnd else (Hkv * D, D)  # strides of a slot and a kv head within a page
    ints = dict(stride_qt=H * D, stride_qh=D, stride_kp=page * Hkv * D, stride_ko=slot, stride_kh=head,
                stride_vp=page * Hkv * D, stride_vo=slot, stride_vh=head, stride_bt=ctx // page,
                page_size=page, head_dim=D, split_len=split_len)
    if splits > 1:  # fp32 partials [splits, T, H, D] and lse [splits, T, H]
        ints.update(stride_os=batch * rows * H * D, stride_ot=H * D, stride_oh=D, stride_ls=batch * rows * H, stride_lt=H)
    else:
        ints.update(stride_os=0, stride_ot=H * D, stride_oh=D, stride_ls=0, stride_lt=H)
    costs = None
    if name == "sparse_prefill":  # key tiles + 1 of each program in launch order (last tiles first; kv heads)
        pos = sparse_prefill_positions()
        trips = [triton.cdiv(pos[min(rows, (t + 1) * block_m) - 1] + 1, block_n) + 1 for t in range(tiles)]
        costs = [trips[tiles - 1 - i] for _ in range(Hkv) for i in range(tiles)]
    case = f"paged_attention/{name}" + (f" ({variant})" if variant else "")
    out = [TritonSpec("paged_attention._paged_attention_kernel", case, True, consts, types, warps, stages,
                      (tiles, Hkv, splits), ints, costs=costs,
                      smem_model=pa.smem_bytes(m_tile, block_n, block_d, 2, stages))]
    if splits > 1 and merge:
        block_h = triton.next_power_of_2(H)
        out.append(TritonSpec(
            "merge_attention_states._merge_split_kernel", case, True,
            dict(BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_H=block_h, BLOCK_D=block_d),
            {"parts_out": "*fp32", "parts_lse": "*fp32", "out": "*bf16", "lse": "*fp32"},
            mas._num_warps(block_h, block_d), 3, (batch * rows,),
            dict(stride_ps=batch * rows * H * D, stride_pt=H * D, stride_ph=D, stride_ls=batch * rows * H,
                 stride_lt=H, stride_ot=H * D, stride_oh=D, stride_lot=H, num_splits=splits, num_heads=H,
                 head_dim=D), loop=False))
    return out


def triton_specs() -> List[TritonSpec]:
    """Every Triton kernel at the benchmark's GPU sizes, configured by its launcher's own functions."""
    import torch
    import triton

    import ragattn.triton_kernels.key_attention_scores as kas
    import ragattn.triton_kernels.merge_attention_states as mas
    import ragattn.triton_kernels.varlen_attention as va
    import ragattn.triton_kernels.varlen_plan as vp

    assert not va._INTERPRET, "triton_specs() must run with TRITON_INTERPRET unset"
    sms = H100["sms"]
    bf16 = torch.bfloat16
    specs: List[TritonSpec] = []

    # varlen_attention (bench_varlen_attention _shape("gpu")): one packed sequence of chunk blocks + tail;
    # the grid is the launcher's own plan for that shape (work items: query tiles, long rows split)
    H, Hkv, D = 32, 8, 128
    prec = va._prec(torch.empty(0, dtype=bf16, device="meta"))
    types_va = {n: "*i32" for n in ("QPos", "KPos", "QBlk", "KBlk", "Work", "KvRows", "QRows")}
    types_va.update({n: "*bf16" for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV")},
                    Lse="*fp32", Delta="*fp32", Parts="*fp32", PartsLse="*fp32", qk_scale="fp32", sm_scale="fp32",
                    softcap_log2="fp32")
    ints_va = dict(num_heads=H, window_left=0)  # no window: the launcher passes max(-1, 0)
    for n_chunks, chunk, name, kernels in [(64, 500, "fwd_chunks64x500+50", ("fwd",)),
                                            (8, 4096, "fwd_chunks8x4096+50", ("fwd",)),
                                            (64, 500, "bwd_chunks64x500+50", ("dq", "dkdv")),
                                            (1, WINDOW_L, f"fwd_window{WINDOW_W}_L{WINDOW_L}", ("fwd",))]:
        window = name.startswith("fwd_window")
        for kernel in kernels:
            bm, bn, warps, stages = va._config(D, kernel, bf16, window, DEVICE_NAME)
            plan = _varlen_bench_plan(vp, n_chunks, chunk, 0 if window else 50, bm, bn, kernel == "dkdv",
                                      2 * sms / H if kernel == "fwd" else None, WINDOW_W - 1 if window else -1)
            consts = dict(GROUP=H // Hkv, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=va.block_d(D), CAUSAL=True,
                          WINDOW=window, UPCAST=False, PREC=prec, SOFTCAP=False)
            fn, grid = {"fwd": ("_fwd_kernel", (H, plan.by_q.items)), "dq": ("_bwd_dq_kernel", (H, plan.by_q.items)),
                        "dkdv": ("_bwd_dkdv_kernel", (Hkv, plan.by_k.items if plan.by_k else 0))}[kernel]
            csr = plan.by_k if kernel == "dkdv" else plan.by_q
            specs.append(TritonSpec(f"varlen_attention.{fn}", f"varlen_attention/{name}", kernel == "fwd", consts,
                                    types_va, warps, stages, grid, ints_va, costs=_varlen_costs(csr, grid[0])))
            if kernel == "fwd" and name == "fwd_chunks8x4096+50":  # the TMA variant of the mask-free loop
                desc = f"tensordesc<bf16[{bn},{D}]>"
                specs.append(TritonSpec(f"varlen_attention.{fn}", f"varlen_attention/{name} (TMA)", True,
                                        dict(consts, USE_TMA=True), dict(types_va, KDesc=desc, VDesc=desc), warps,
                                        stages, grid, ints_va, costs=_varlen_costs(csr, grid[0])))
            if kernel == "fwd" and name != "fwd_chunks64x500+50":  # a wide key tile, masked tiles in halves
                wide = _varlen_bench_plan(vp, n_chunks, chunk, 0 if window else 50, bm, 64, False, 2 * sms / H,
                                          WINDOW_W - 1 if window else -1)
                specs.append(TritonSpec(f"varlen_attention.{fn}", f"varlen_attention/{name} (x64 keys, masked_sub 2)",
                                        True, dict(consts, BLOCK_N=64, MASKED_SUB=2), types_va, warps, stages,
                                        (H, wide.by_q.items), ints_va, costs=_varlen_costs(wide.by_q, H)))
            if plan.by_q.split_tiles and kernel == "fwd":  # the merge of split rows
                block_h = triton.next_power_of_2(H)
                rows = plan.by_q.split_tiles * bm
                specs.append(TritonSpec(
                    "merge_attention_states._merge_split_kernel", f"varlen_attention/{name}", True,
                    dict(BLOCK_S=max(2, triton.next_power_of_2(plan.by_q.max_splits)), BLOCK_H=block_h, BLOCK_D=D),
                    {"parts_out": "*fp32", "parts_lse": "*fp32", "out": "*bf16", "lse": "*fp32"},
                    mas._num_warps(block_h, D), 3, (rows,),
                    dict(stride_ps=rows * H * D, stride_pt=H * D, stride_ph=D, stride_ls=rows * H, stride_lt=H,
                         stride_ot=H * D, stride_oh=D, stride_lot=H, num_splits=plan.by_q.max_splits, num_heads=H,
                         head_dim=D), loop=False))

    # paged_attention (bench_paged_attention, gpu): sparse prefill, decode, windowed decode; bf16 d128 page 16;
    # then the variants the config table can choose (bench.tune times them on a GPU)
    specs += paged_specs("sparse_prefill", 1, SPARSE_ROWS, -1)
    specs += paged_specs("decode", PAGED_BATCH, 1, -1)
    specs += paged_specs("decode_window", PAGED_BATCH, 1, PAGED_WINDOW)
    # the window decode's loops before the edge loop (68e7ebf's: three loops, 3 stages)
    specs += paged_specs("decode_window", PAGED_BATCH, 1, PAGED_WINDOW, dict(edge_loop=False, num_stages=3),
                         "three loops, 3 stages", merge=False)
    specs += paged_specs("decode", PAGED_BATCH, 1, -1, dict(num_stages=5), "5 stages", merge=False)
    specs += paged_specs("decode", PAGED_BATCH, 1, -1, None, "HND pages", merge=False, hnd=True)
    specs += paged_specs("sparse_prefill", 1, SPARSE_ROWS, -1, dict(pipeline_v=False), "V register load")
    specs += paged_specs("sparse_prefill", 1, SPARSE_ROWS, -1, dict(BLOCK_M=64, num_warps=4), "64-row tiles")

    # merge_attention_states (bench_paged_attention _merge, gpu): rows 4096, heads 32, d128 bf16
    rows = 32 * 128
    block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D)
    specs.append(TritonSpec(
        "merge_attention_states._merge_two_kernel", "merge_attention_states/merge", True,
        dict(BLOCK_H=block_h, BLOCK_D=block_d),
        {"out_a": "*bf16", "out_b": "*bf16", "out": "*bf16", "lse_a": "*fp32", "lse_b": "*fp32", "lse": "*fp32"},
        mas._num_warps(block_h, block_d), 3, (rows,),
        dict(stride_at=H * D, stride_ah=D, stride_bt=H * D, stride_bh=D, stride_ot=H * D, stride_oh=D,
             stride_lat=H, stride_lah=1, stride_lbt=H, stride_lbh=1, stride_lot=H, stride_loh=1,
             num_heads=H, head_dim=D), loop=False))

    # key_attention_scores (bench_key_attention_scores, gpu): t_q 64, t_k 32768, the table's H100 entry
    t_q, t_k = 64, 32768
    cfg = kas.kernel_config(bf16, D, DEVICE_NAME)
    block_m, block_n, warps, stages = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["num_stages"]
    group = H // Hkv
    q_tiles = triton.cdiv(t_q * group, block_m)
    k_tiles = triton.cdiv(t_k, block_n)
    splits = kas.splits_for_sms(q_tiles, 1, Hkv, k_tiles, sms, cfg["waves"])
    consts = dict(GROUP=group, HEAD_DIM=D, BLOCK_D=D, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=False, IEEE=False)
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "cu_q_ptr": "*i32", "cu_k_ptr": "*i32", "lse_ptr": "*fp32",
             "partial_ptr": "*fp32", "qk_scale": "fp32"}
    ints = dict(stride_qt=H * D, stride_qh=D, stride_kt=Hkv * D, stride_kh=D, num_heads=H)
    case = "key_attention_scores/scores"
    specs.append(TritonSpec("key_attention_scores._row_lse_kernel", case, True, consts, types, warps, stages,
                            (q_tiles, 1, Hkv * splits), dict(ints, total_q=t_q, num_splits=splits)))
    split_first = cfg.get("column_pass", "tile") == "split"
    tile_case = case + " (pass 2 per key tile)" if split_first else case
    if splits > 1:  # the "tile" design's LSE merge launch: one program per _MERGE_BLOCK (row, head) entries
        n = t_q * H
        specs.append(TritonSpec("key_attention_scores._merge_lse_kernel", tile_case, True,
                                dict(BLOCK=kas._MERGE_BLOCK), {"parts_ptr": "*fp32", "lse_ptr": "*fp32"}, 4, 3,
                                (triton.cdiv(n, kas._MERGE_BLOCK),), dict(n=n, num_splits=splits), loop=False))
    # pass 2: the table's design first, the other as a variant (what the A/B script times on a GPU)
    split_spec = TritonSpec("key_attention_scores._column_sum_split_kernel", case, True, consts, types, warps, stages,
                            (q_tiles, 1, Hkv * splits), dict(ints, total_q=t_q, total_k=t_k, num_kv_heads=Hkv,
                                                            num_splits=splits, num_q_tiles=q_tiles))
    tile_spec = TritonSpec("key_attention_scores._column_sum_kernel", tile_case, True, consts, types, warps, stages,
                           (k_tiles, 1, Hkv), dict(ints, total_k=t_k))
    if split_first:
        specs += [split_spec, tile_spec]
    else:
        specs += [tile_spec, dataclasses.replace(split_spec, case=case + " (pass 2 split)")]
    return specs

