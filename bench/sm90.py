"""Static H100 (sm_90) report: what the compiled kernels use, and a roofline model. No GPU needed.

    python -m ragattn.bench.sm90            # or: python -m bench.sm90, python -m ragattn bench sm90
    python -m ragattn.bench.sm90 --out DIR  # default docs/perf/sm90-static/

For every Triton kernel at the configuration its launcher picks for the benchmark's GPU sizes
(``bench/bench_*.py`` ``size == "gpu"``): compiled for ``GPUTarget("cuda", 90, 32)`` in a
subprocess with TRITON_INTERPRET unset, then its PTX is run through Triton's bundled ``ptxas -v``.
For every CUDA kernel (``csrc/**/*_kernels.cu``): ``nvcc -gencode=arch=compute_90a,code=sm_90a
-Xptxas -v``. Measured (from the compilers): registers per thread, spill bytes, shared memory, the
presence of asynchronous copies (``cp.async``/``cp.async.bulk``: a software-pipelined main loop).
Modelled (from the H100's published limits): CTAs per SM, a roofline lower bound per
benchmark case from its bytes and FLOPs, and whether paged decode and the kv_cache kernels keep
enough loads in flight to saturate HBM (Little's law at an assumed loaded DRAM latency,
``DRAM_LATENCY_NS``; ``bandwidth_cases``). Nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

# H100 SXM5 limits (CUDA C programming guide, compute capability 9.0) and peaks (datasheet)
# The config tables' entry the report compiles (triton_kernels/configs/*.json), and the window case of
# bench_varlen_attention (window_left = WINDOW_W - 1 over WINDOW_L tokens).
DEVICE_NAME = "NVIDIA H100 80GB HBM3"
WINDOW_W, WINDOW_L = 4096, 16384

H100 = dict(
    sms=132, regs_per_sm=65536, reg_alloc_per_warp=256, max_regs_per_thread=255,
    smem_per_sm=228 * 1024, smem_per_cta=227 * 1024, smem_reserved_per_cta=1024,
    threads_per_sm=2048, ctas_per_sm=32, hbm_bytes_per_s=3.35e12, bf16_flops_per_s=989e12,
)
# the benchmarks' GPU shapes the models below use (bench_paged_attention / bench_kv_cache, size "gpu")
PAGED_CTX, PAGED_BATCH, PAGED_WINDOW = 32768, 32, 4096  # decode: 32 sequences x 32K slots; window 4096
KV_CACHE_SHAPES = [("N8192", 32, 8192), ("chunk512", 32, 512)]  # (tag, layers, rows); 8 KV heads, d 128, bf16
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "perf" / "sm90-static"


# ---------------------------------------------------------------------------------------------
# occupancy model


def ctas_per_sm(regs: int, smem: int, threads: int) -> Tuple[int, str]:
    """CTAs per SM of an H100 and the limiting resource (modelled from the published limits)."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / H100["reg_alloc_per_warp"]) * H100["reg_alloc_per_warp"]
    limits = {
        "registers": (H100["regs_per_sm"] // regs_per_warp) // warps,
        "threads": H100["threads_per_sm"] // threads,
        "ctas": H100["ctas_per_sm"],
    }
    if smem:
        limits["shared"] = H100["smem_per_sm"] // (smem + H100["smem_reserved_per_cta"])
    bound = min(limits, key=lambda k: limits[k])
    return limits[bound], bound


def parse_ptxas(log: str) -> Dict[str, Dict[str, int]]:
    """``ptxas -v`` output -> {function name: {regs, spill_stores, spill_loads, static_smem, stack}}."""
    out: Dict[str, Dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?", line)
        if m:
            name = m.group(1)
            out.setdefault(name, dict(regs=0, spill_stores=0, spill_loads=0, static_smem=0, stack=0))
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[name]["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            out[name]["static_smem"] = int(s.group(1)) if s else 0
    return out


# ---------------------------------------------------------------------------------------------
# Triton kernels


def compile_sm90(fn, constexprs: dict, types: dict, *, num_warps: int = 4, num_stages: int = 3,
                 ints: Optional[Dict[str, int]] = None):
    """Compile the ``@triton.jit`` kernel ``fn`` for an H100; returns Triton's compiled kernel.

    ``constexprs`` maps constexpr argument names to values; ``types`` maps the other arguments to
    Triton type strings (``"*bf16"``, ``"fp32"``, ...); arguments in neither default to ``"i32"``.
    Integer specialisation as a real launch gets it: pointers are 16-byte aligned (torch
    allocations); an integer argument whose value is given in ``ints`` is marked divisible by 16
    when it is, and becomes the constant 1 when it is 1; ``stride*`` arguments not in ``ints`` are
    taken as multiples of 16. Must run where ``TRITON_INTERPRET`` is unset.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = dict(ints or {})
    constexprs = dict(constexprs)
    for p in fn.params:  # arguments a launch leaves at their defaults (None descriptors, USE_TMA=False)
        if p.name not in constexprs and p.name not in types and p.has_default:
            constexprs[p.name] = p.default
    for n, v in ints.items():
        if v == 1:
            constexprs[n] = 1  # Triton specialises integer arguments equal to 1
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}

    def div16(n):
        if sig[n].startswith("*"):
            return True
        if sig[n] != "i32":
            return False
        if n in ints:
            return ints[n] % 16 == 0
        return n.lower().startswith("stride")

    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if div16(n)}
    return triton.compile(
        ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def ptxas_report(ptx: str) -> Dict[str, int]:
    """Registers, spills and static shared memory of one PTX module, from Triton's bundled ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True, check=True)
    funcs = parse_ptxas(proc.stdout + proc.stderr)
    assert len(funcs) == 1, funcs
    return next(iter(funcs.values()))


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
    costs: Optional[List[int]] = None  # per program in launch order: main-loop trips + 1 (varlen)

    @property
    def label(self) -> str:
        return f"{self.kernel} [{self.case}]"


def schedule_balance(costs: List[int], slots: int) -> float:
    """Modelled load balance of a launch: programs start in launch order on the first free of
    ``slots`` CTA slots and run for their cost; returns (total / slots) / makespan (1.0: perfect)."""
    import heapq

    free = [0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return round(sum(costs) / slots / max(max(free), 1), 3)


def _varlen_costs(csr, heads: int) -> List[int]:
    """Main-loop trips + 1 of each program of a varlen launch, grid (heads, items): item-major."""
    trips = (csr.work[:, 5] - csr.work[:, 3] + 1).tolist()
    return [t for t in trips for _ in range(heads)]


def _fn(kernel: str):
    import importlib

    mod, name = kernel.rsplit(".", 1)
    return getattr(importlib.import_module("ragattn.triton_kernels." + mod), name)


def _varlen_bench_plan(va, n_chunks: int, chunk: int, tail: int, bm: int, bn: int, backward: bool, slots,
                       window_left: int = -1):
    """The varlen launcher's plan for bench_varlen_attention's GPU problem (CPU tensors: only its shape
    counts); ``window_left >= 0``: the sliding-window case (one causal sequence, no blocks)."""
    import torch

    L = n_chunks * chunk + tail
    cu = torch.tensor([0, L], dtype=torch.int32)
    if window_left >= 0:
        return va.build_plan(cu, cu, None, None, None, None, L, L, block_m=bm, block_n=bn, causal=True,
                             window_left=window_left, backward=backward, split_slots=slots)
    blk = torch.cat([torch.arange(n_chunks).repeat_interleave(chunk), torch.full((tail,), -1)]).to(torch.int32)
    return va.build_plan(cu, cu, None, None, blk, blk, L, L, block_m=bm, block_n=bn, causal=True, window_left=-1,
                         backward=backward, split_slots=slots)


def triton_specs() -> List[TritonSpec]:
    """Every Triton kernel at the benchmark's GPU sizes, configured by its launcher's own functions."""
    import torch
    import triton

    import ragattn.triton_kernels.key_attention_scores as kas
    import ragattn.triton_kernels.merge_attention_states as mas
    import ragattn.triton_kernels.paged_attention as pa
    import ragattn.triton_kernels.varlen_attention as va

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
            plan = _varlen_bench_plan(va, n_chunks, chunk, 0 if window else 50, bm, bn, kernel == "dkdv",
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

    # paged_attention (bench_paged_attention, gpu): sparse prefill, decode, windowed decode; bf16 d128 page 16
    types_pa = {n: "*i32" for n in ("Q_POS", "CU_SEQLENS_Q", "PAGES", "ROW_START", "KV_LENS", "TILE_SEQ", "TILE_ROW0")}
    types_pa.update(Q="*bf16", K_CACHE="*bf16", V_CACHE="*bf16", LSE="*fp32", qk_scale="fp32", softcap_log2="fp32")
    ctx, page = PAGED_CTX, 16
    for name, batch, rows, window in [("sparse_prefill", 1, 64, -1), ("decode", PAGED_BATCH, 1, -1),
                                      ("decode_window", PAGED_BATCH, 1, PAGED_WINDOW)]:
        group = H // Hkv
        group_pad = triton.next_power_of_2(group)
        m_tile = min(128, max(16, triton.next_power_of_2(rows * group_pad)))
        block_d = max(16, triton.next_power_of_2(D))
        cfg = pa.kernel_config(m_tile, block_d, 2, device_name=DEVICE_NAME)  # the table's H100 entry
        m_tile, block_n, stages, warps = cfg["m_tile"], cfg["BLOCK_N"], cfg["num_stages"], cfg["num_warps"]
        block_m = max(1, m_tile // group_pad)
        tiles = batch * triton.cdiv(rows, block_m)
        span = ctx if (window < 0 or min(block_m, rows) > 1) else min(ctx, window + block_n)
        splits = pa.splits_for_sms(tiles * Hkv, span, block_n, sms, cfg["waves"])
        split_len = triton.cdiv(triton.cdiv(span, splits), block_n) * block_n
        splits = max(1, triton.cdiv(span, split_len))
        consts = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                      HAS_WINDOW=window >= 0, ROW_STARTS=False, SOFTCAP=False, UPCAST=False, IEEE_FP32=False,
                      EVEN_D=D == block_d, PAGE_MODE=pa.page_mode(page, block_n, split_len),
                      PAGE_SIZE=page if pa.page_mode(page, block_n, split_len) else 1,
                      SPLIT_WHOLE_TILES=pa.split_whole_tiles(m_tile))
        types = dict(types_pa, OUT="*fp32" if splits > 1 else "*bf16")
        # strides of q [T, H, D], k/v cache [pages, page, Hkv, D], block table [B, pages], out, lse
        ints = dict(stride_qt=H * D, stride_qh=D, stride_kp=page * Hkv * D, stride_ko=Hkv * D, stride_kh=D,
                    stride_vp=page * Hkv * D, stride_vo=Hkv * D, stride_vh=D, stride_bt=ctx // page,
                    page_size=page, head_dim=D, split_len=split_len)
        if splits > 1:  # fp32 partials [splits, T, H, D] and lse [splits, T, H]
            ints.update(stride_os=batch * rows * H * D, stride_ot=H * D, stride_oh=D, stride_ls=batch * rows * H, stride_lt=H)
        else:
            ints.update(stride_os=0, stride_ot=H * D, stride_oh=D, stride_ls=0, stride_lt=H)
        specs.append(TritonSpec("paged_attention._paged_attention_kernel", f"paged_attention/{name}", True, consts,
                                types, warps, stages, (tiles, Hkv, splits), ints))
        if splits > 1:
            block_h = triton.next_power_of_2(H)
            specs.append(TritonSpec(
                "merge_attention_states._merge_split_kernel", f"paged_attention/{name}", True,
                dict(BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_H=block_h, BLOCK_D=block_d),
                {"parts_out": "*fp32", "parts_lse": "*fp32", "out": "*bf16", "lse": "*fp32"},
                mas._num_warps(block_h, block_d), 3, (batch * rows,),
                dict(stride_ps=batch * rows * H * D, stride_pt=H * D, stride_ph=D, stride_ls=batch * rows * H,
                     stride_lt=H, stride_ot=H * D, stride_oh=D, stride_lot=H, num_splits=splits, num_heads=H,
                     head_dim=D), loop=False))

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
    if splits > 1:  # the splits' LSE merge: one program per _MERGE_BLOCK (row, head) entries
        n = t_q * H
        specs.append(TritonSpec("key_attention_scores._merge_lse_kernel", case, True, dict(BLOCK=kas._MERGE_BLOCK),
                                {"parts_ptr": "*fp32", "lse_ptr": "*fp32"}, 4, 3,
                                (triton.cdiv(n, kas._MERGE_BLOCK),), dict(n=n, num_splits=splits), loop=False))
    specs.append(TritonSpec("key_attention_scores._column_sum_kernel", case, True, consts, types, warps, stages,
                            (k_tiles, 1, Hkv), dict(ints, total_k=t_k)))
    return specs


_ELT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "i8": 1, "i1": 1, "f64": 8}


def _shape_bytes(dims: str, dtype: str) -> int:
    return math.prod(int(x) for x in dims.split("x")) * _ELT_BYTES[dtype]


def loop_inflight(ttgir: str) -> Optional[dict]:
    """Global-load bytes one CTA keeps in flight in its main loop, read from the compiled TTGIR.

    The main loop is the first ``scf.for`` whose body has a dot. Its loads are either the
    software pipeliner's asynchronous copies, into multi-buffers ``ttg.local_alloc : () ->
    !ttg.memdesc<N x tile, mutable>`` (N buffers = N tiles in flight ahead of their use), or plain
    ``tt.load`` of a tensor in the loop body (issued and awaited within one trip: one tile in flight).
    Returns {async_buffers, loop_loads: [(shape, dtype, bytes)], inflight_bytes} or None (no loop).
    """
    lines = ttgir.splitlines()
    start = end = None
    for i, ln in enumerate(lines):
        if "scf.for" not in ln:
            continue
        indent = len(ln) - len(ln.lstrip())
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith("}") and len(lines[j]) - len(lines[j].lstrip()) <= indent):
            j += 1
        if any("tt.dot" in x or "warp_group_dot" in x for x in lines[i + 1:j]):
            start, end = i, j
            break
    if start is None:
        return None
    buffers = [(m.group(1), m.group(2), _shape_bytes(m.group(1), m.group(2)))
               for m in re.finditer(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([\dx]+)x(\w+),[^>]*mutable>", ttgir)]
    loads = [(m.group(1), m.group(2), _shape_bytes(m.group(1), m.group(2)))
             for ln in lines[start + 1:end] for m in [re.search(r"= tt\.load .*: tensor<([\dx]+)x!tt\.ptr<(\w+)>", ln)] if m]
    return dict(async_buffers=buffers, loop_loads=loads, inflight_bytes=sum(b for *_, b in buffers + loads))


def analyse_triton(spec: TritonSpec) -> dict:
    """Compile one spec and read what the compilers report (run with TRITON_INTERPRET unset)."""
    compiled = compile_sm90(_fn(spec.kernel), spec.constexprs, spec.types, num_warps=spec.num_warps,
                            num_stages=spec.num_stages, ints=spec.ints)
    ptx = compiled.asm["ptx"]
    ptxas = ptxas_report(ptx)
    threads = 32 * spec.num_warps
    smem = int(compiled.metadata.shared) + ptxas["static_smem"]
    ctas, bound = ctas_per_sm(ptxas["regs"], smem, threads)
    consts = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in spec.constexprs.items()}
    return dict(
        kernel=spec.kernel, case=spec.case, forward=spec.forward, has_main_loop=spec.loop,
        constexprs=consts, num_warps=spec.num_warps, num_stages=spec.num_stages, grid=list(spec.grid),
        threads=threads, regs=ptxas["regs"], spill_stores=ptxas["spill_stores"], spill_loads=ptxas["spill_loads"],
        smem=smem, ctas_per_sm=ctas, occupancy_bound=bound,
        warps_per_sm=ctas * spec.num_warps,
        cp_async="cp.async" in ptx, tma="cp.async.bulk" in ptx,
        waves=round(math.prod(spec.grid) / (ctas * H100["sms"]), 2) if ctas else None,
        balance=schedule_balance(spec.costs, ctas * H100["sms"]) if spec.costs and ctas else None,
        pipeline=loop_inflight(compiled.asm["ttgir"]) if spec.loop else None,
    )


def analyse_triton_all(select: Optional[List[str]] = None, workers: int = 2) -> List[dict]:
    """Compile the specs (all, or those whose label contains one of ``select``) over forked workers."""
    import multiprocessing

    # the specs travel to the workers: they must not run torch ops after the fork (a parent that
    # used torch's OpenMP pool can hang them)
    specs = [s for s in triton_specs() if not select or any(t in s.label for t in select)]
    if workers <= 1 or len(specs) <= 1:
        return [analyse_triton(s) for s in specs]
    with multiprocessing.get_context("fork").Pool(min(workers, len(specs))) as pool:
        return pool.map(analyse_triton, specs, chunksize=1)


def triton_report_subprocess(select: Optional[List[str]] = None, workers: int = 2) -> List[dict]:
    """``analyse_triton_all`` in a fresh Python with TRITON_INTERPRET unset (the caller's kernels may be
    interpreter objects)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAGATTN_CPU_BACKEND")}
    cmd = [sys.executable, "-m", "ragattn.bench.sm90", "--triton-json", "--workers", str(workers)]
    for s in select or []:
        cmd += ["--select", s]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# CUDA kernels


def _file_constant(cu: Path, name: str) -> Optional[int]:
    """``constexpr int <name> = N`` of a kernel file, from the file or its directory's headers
    (``kThreads``: the threads of its ``__launch_bounds__``)."""
    for f in [cu, *sorted(cu.parent.glob("*.h")), *sorted(cu.parent.glob("*.cuh"))]:
        m = re.search(rf"constexpr int {name} = (\d+)", f.read_text())
        if m:
            return int(m.group(1))
    return None


def _demangle(names: List[str]) -> Dict[str, str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def nvcc_version() -> Optional[str]:
    try:
        out = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release ([\d.]+), (V[\d.]+)", out)
    return m.group(2) if m else out.strip().splitlines()[-1]


def _toolkit_ptxas() -> str:
    """The ptxas of nvcc's own toolkit (the one ``nvcc -c`` would run)."""
    import shutil

    nvcc = shutil.which("nvcc")
    cand = Path(nvcc).resolve().parent / "ptxas" if nvcc else None
    return str(cand) if cand and cand.exists() else "ptxas"


def analyse_cuda(select: Optional[List[str]] = None, kernels: Optional[List[str]] = None) -> List[dict]:
    """Every ``csrc/**/*_kernels.cu`` (or those whose path contains one of ``select``) compiled for
    sm_90a, one row per kernel instantiation (empty without nvcc): ``nvcc -ptx`` then the toolkit's
    ``ptxas -v`` on the PTX (what ``nvcc -c -Xptxas -v`` runs). ``kernels``: only the instantiations
    whose demangled name contains one of these strings (ptxas ``--entry``: the rest is not assembled)."""
    if nvcc_version() is None:
        return []
    rows = []
    for cu in sorted((ROOT / "csrc").rglob("*_kernels.cu")):
        if select and not any(t in str(cu) for t in select):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = os.path.join(tmp, "k.ptx")
            subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-O3",
                            "--expt-relaxed-constexpr", f"-I{ROOT / 'csrc'}", "-ptx", str(cu), "-o", ptx],
                           capture_output=True, text=True, check=True)
            ptx_text = Path(ptx).read_text()
            entries = re.findall(r"^(?:\.visible\s+)?\.entry\s+([\w$]+)\(", ptx_text, re.M)
            names = _demangle(entries)
            chosen = [e for e in entries if not kernels or any(k in names[e] for k in kernels)]
            if not chosen:
                continue
            proc = subprocess.run([_toolkit_ptxas(), "-v", "--gpu-name=sm_90a", *(f"--entry={e}" for e in chosen), ptx,
                                   "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True)
        funcs = parse_ptxas(proc.stdout + proc.stderr)
        threads = _file_constant(cu, "kThreads")
        for mangled, r in sorted(funcs.items(), key=lambda kv: names[kv[0]]):
            ctas, bound = ctas_per_sm(r["regs"], r["static_smem"], threads) if threads else (None, None)
            rows.append(dict(file=str(cu.relative_to(ROOT)), kernel=names[mangled], threads=threads, regs=r["regs"],
                             spill_stores=r["spill_stores"], spill_loads=r["spill_loads"],
                             static_smem=r["static_smem"], ctas_per_sm=ctas, occupancy_bound=bound,
                             warps_per_sm=ctas * threads // 32 if ctas else None,
                             load16_runs=load16_runs(ptx_text, mangled)))
    return rows


def load16_runs(ptx: str, entry: str) -> List[int]:
    """Runs of 16-byte global loads (``ld.global[.nc].v4.b32``-like) between global stores, in the PTX
    order of one entry function: the loads a thread issues before it waits on any of them."""
    body = ptx[ptx.index(f".entry {entry}("):]
    body = body[:body.index("\n}")]
    runs, n = [], 0
    for op in re.findall(r"\b(ld|st)\.global(?:\.\w+)*?\.(v4\.(?:[usbf]32)|v2\.(?:[usbf]64))?\b", body):
        if op[0] == "ld" and op[1]:
            n += 1
        elif op[0] == "st" and n:
            runs.append(n)
            n = 0
    return runs + ([n] if n else [])


# kSliceLen of csrc/speculative/verify_draft_math.h (kSliceTiles x kThreads x kChunk tokens): the
# vocabulary share of one CTA of the verify_draft kernels, mirrored here
VERIFY_DRAFT_SLICE_LEN = 2 * 256 * 8


def verify_draft_slices(vocab: int) -> int:
    """Vocabulary slices of the verify_draft kernels (``num_slices`` in verify_draft_math.h)."""
    return -(-vocab // VERIFY_DRAFT_SLICE_LEN)


def verify_draft_grid(batch: int, g: int, vocab: int) -> dict:
    """CTAs of the verify_draft launches (csrc/speculative/verify_draft_kernels.cu, mirrored): phase 1
    (statistics; a second pass with eta > 0) over every (position, slice) of every row, the draw over
    (row, slice) of the one drawn position per row; with eta > 0 on sm_90 phase 1 is instead one
    cluster of min(8, slices) CTAs per position (``rapid``)."""
    ns = verify_draft_slices(vocab)
    return dict(stats=batch * (g + 1) * ns, draw=batch * ns, rapid=batch * (g + 1) * min(8, ns))


def verify_draft_coverage(cuda_rows: List[dict]) -> List[dict]:
    """SM coverage of the verify_draft statistics launch at the benchmark's shapes (modelled): grid =
    rows x positions x slices CTAs; a grid of at least one CTA per SM occupies min(grid, 132) SMs, in
    ceil(grid / (132 x CTAs/SM)) waves at the kernel's CTAs/SM (the statistics kernel's; the eta > 0
    one-pass kernel's CTAs/SM depend on its dynamic shared memory, not modelled here)."""
    vd = [r for r in cuda_rows if "verify_draft_stats_kernel" in r["kernel"]]
    per_sm = min((r["ctas_per_sm"] for r in vd), default=None)
    rows = []
    for b, g, vocab in [(1, 4, 32000), (1, 10, 128256), (8, 10, 128256), (64, 10, 128256)]:
        grid = verify_draft_grid(b, g, vocab)
        rows.append(dict(batch=b, g=g, vocab=vocab, slices=verify_draft_slices(vocab), ctas=grid["stats"],
                         draw_ctas=grid["draw"], rapid_ctas=grid["rapid"], sms_used=min(grid["stats"], H100["sms"]), ctas_per_sm=per_sm,
                         waves=math.ceil(grid["stats"] / (H100["sms"] * per_sm)) if per_sm else None))
    return rows


# ---------------------------------------------------------------------------------------------
# roofline (modelled)


def roofline_cases() -> List[dict]:
    """Bytes and FLOPs of each GPU-size benchmark case, from its shapes (no tensor is allocated).

    FLOPs match the benchmarks' ``Case.flops`` (visible pairs only); bytes are the compulsory
    traffic: every input read once, every output written once.
    """
    cases = []
    bf = 2
    H, Hkv, D = 32, 8, 128
    for n, c in [(64, 500), (8, 4096)]:  # bench_varlen_attention
        tail = 50
        L = n * c + tail
        pairs = n * c * (c + 1) / 2 + sum(n * c + i + 1 for i in range(tail))
        io = 2 * L * H * D * bf + 2 * L * Hkv * D * bf + L * H * 4
        cases.append(dict(case=f"varlen_attention/fwd_chunks{n}x{c}+{tail}", bytes=io, flops=4.0 * D * H * pairs))
        if c == 500:  # backward reads q,k,v,o,do,lse, writes dq,dk,dv
            bio = 4 * L * H * D * bf + 4 * L * Hkv * D * bf + 2 * L * H * 4
            cases.append(dict(case=f"varlen_attention/bwd_chunks{n}x{c}+{tail}", bytes=bio, flops=2.5 * 4.0 * D * H * pairs))
    L, W = WINDOW_L, WINDOW_W  # bench_varlen_attention window case: each query sees its last W keys
    pairs = sum(min(i + 1, W) for i in range(L))
    cases.append(dict(case=f"varlen_attention/fwd_window{W}_L{L}",
                      bytes=2 * L * H * D * bf + 2 * L * Hkv * D * bf + L * H * 4, flops=4.0 * D * H * pairs))
    ctx, tail = 32768, 64  # bench_paged_attention sparse prefill: one sequence, 64 new rows at the end
    pairs = sum(ctx - tail + i + 1 for i in range(tail))
    cases.append(dict(case="paged_attention/sparse_prefill", bytes=2 * ctx * Hkv * D * bf + 2 * tail * H * D * bf,
                      flops=4.0 * D * H * pairs))
    batch = PAGED_BATCH
    cases.append(dict(case="paged_attention/decode", bytes=2 * batch * ctx * Hkv * D * bf + 2 * batch * H * D * bf,
                      flops=4.0 * D * H * batch * ctx))
    window = PAGED_WINDOW
    cases.append(dict(case="paged_attention/decode_window",
                      bytes=2 * batch * (window + 1) * Hkv * D * bf + 2 * batch * H * D * bf,
                      flops=4.0 * D * H * batch * window))
    rows = 32 * 128
    cases.append(dict(case="merge_attention_states/merge", bytes=3.0 * rows * H * (D * bf + 4), flops=None))
    t_q, t_k = 64, 32768  # bench_key_attention_scores: two passes over q and K (row LSE, column sums)
    cases.append(dict(case="key_attention_scores/scores", bytes=2 * t_k * Hkv * D * bf + 2 * t_q * H * D * bf + t_k * 4,
                      flops=2 * 2.0 * H * t_q * t_k * D))
    for tag, layers, N in KV_CACHE_SHAPES:  # bench_kv_cache: H=8, D=128 bf16
        kv = N * layers * Hkv * D * bf
        cases.append(dict(case=f"kv_cache/rerotate_keys_ {tag}", bytes=2 * kv, flops=None))
        cases.append(dict(case=f"kv_cache/copy_kv_ {tag}", bytes=2 * 2 * kv, flops=None))
        cases.append(dict(case=f"kv_cache/copy_kv_+rotate {tag}", bytes=2 * 2 * kv, flops=None))
    for b, g, vocab in [(1, 4, 32000), (64, 10, 128256)]:  # bench_verify_draft: bf16 logits, fp32 draft probs
        # every position's logits row, whatever the acceptance (phase 1 covers all g + 1 positions); eta 0 reads
        # draft probs at the draft tokens and one rejected row (not counted), eta > 0 every drafted row (max q,
        # p_hat). Compulsory bytes: the eta > 0 pass over the modified logits re-reads logits and probs (up to 2x)
        per_row = g * 8 + (g + 1) * 4 + (g + 1) * 8 + 4 + g * 4
        logits = b * (g + 1) * vocab * bf
        cases.append(dict(case=f"verify_draft/B{b}_g{g}_V{vocab}_eta0",
                          bytes=float(logits + b * per_row), flops=None))
        cases.append(dict(case=f"verify_draft/B{b}_g{g}_V{vocab}_eta10",
                          bytes=float(logits + b * g * vocab * 4 + b * per_row), flops=None))
    for c in cases:
        t_mem = c["bytes"] / H100["hbm_bytes_per_s"]
        t_math = (c["flops"] or 0.0) / H100["bf16_flops_per_s"]
        c.update(lower_bound_us=round(1e6 * max(t_mem, t_math), 2), bound="memory" if t_mem >= t_math else "compute",
                 memory_us=round(1e6 * t_mem, 2), compute_us=round(1e6 * t_math, 2),
                 arithmetic_intensity=round(c["flops"] / c["bytes"], 1) if c["flops"] else None)
    return cases


# ---------------------------------------------------------------------------------------------
# bandwidth saturation (modelled): Little's law

# Loaded DRAM latency assumed for the H100 SXM5: the time from a global load's issue to its data
# while HBM is busy (an assumption, not measured here). Pointer-chasing microbenchmarks measure
# the *unloaded* latency, which is lower; queueing at high bandwidth adds to it, and 600-800 ns is
# the range commonly used for the loaded figure: 700 ns is its middle. Every "needed" figure
# scales linearly with it; the report also gives each launch's break-even latency.
DRAM_LATENCY_NS = 700.0
TARGET_PCT = 85.0  # issue 15: paged decode and rerotate/copy_kv must predict >= 85% of 3.35 TB/s
# Dependent global round trips before a CTA's first main-loop load (counted from the kernel source):
PROLOGUE_ROUND_TRIPS = {
    "paged": 4,  # tile map -> sequence bounds and kv_len -> q_pos -> page index -> first K tile
    "rerotate": 3,  # delta -> inv_freq (cos/sin staging, barrier) -> rows -> row data
    "copy_rotate": 3,  # delta -> inv_freq (barrier) -> src/dst rows -> row data
    "copy": 1,  # src/dst rows -> row data
    "merge": 0,  # every load of the program is independent
}


def bytes_in_flight_needed(read_fraction: float = 1.0, latency_ns: float = DRAM_LATENCY_NS) -> float:
    """Bytes of loads one SM must keep in flight for the whole H100 to move 3.35 TB/s (Little's law:
    bandwidth x latency / SMs). Stores are posted (nothing waits for them), so a launch whose
    traffic is ``read_fraction`` reads needs only that share of it as loads in flight."""
    return H100["hbm_bytes_per_s"] * latency_ns * 1e-9 * read_fraction / H100["sms"]


def launch_bandwidth(grid_ctas: int, ctas_per_sm: int, inflight_per_cta: float, read_fraction: float,
                     latency_ns: float = DRAM_LATENCY_NS) -> dict:
    """Modelled DRAM bandwidth of a launch of equal CTAs (Little's law, wave by wave).

    ``inflight_per_cta``: bytes of loads a CTA keeps in flight on average (per main-loop trip x the
    share of its round trips that are main-loop trips). Full waves hold ``ctas_per_sm`` x 132 CTAs,
    the tail the rest; a wave of n CTAs moves min(3.35 TB/s, n x inflight / latency / read_fraction),
    and each CTA moves the same bytes, so time is sum over waves of n / rate.
    """
    sms, peak = H100["sms"], H100["hbm_bytes_per_s"]
    slots = ctas_per_sm * sms
    full, tail = divmod(grid_ctas, slots)
    lat = latency_ns * 1e-9

    def rate(n):
        return min(peak, n * inflight_per_cta / (lat * read_fraction))

    time = full * slots / rate(slots) + (tail / rate(tail) if tail else 0.0)
    bw = grid_ctas / time
    per_sm = min(grid_ctas, slots) / min(grid_ctas, sms) * inflight_per_cta  # the first wave's
    return dict(grid_ctas=grid_ctas, ctas_per_sm=ctas_per_sm, waves=round(grid_ctas / slots, 2), tail_ctas=tail,
                tail_sms=min(tail, sms), inflight_per_sm=round(per_sm), needed_per_sm=round(bytes_in_flight_needed(read_fraction, latency_ns)),
                # the latency at which the first wave would fall to the target (the assumption's margin)
                latency_at_target_ns=round(min(grid_ctas, slots) * inflight_per_cta / (TARGET_PCT / 100 * peak * read_fraction) * 1e9),
                tbps=round(bw / 1e12, 3), pct=round(100 * bw / peak, 1))


def kv_cache_row_loops(kind: str, layers: int, heads: int, head_dim: int, rotary_dim: int, elt: int) -> List[Tuple[int, int]]:
    """The load loops of one CTA of the kv_cache kernels (one row, every layer), in code order, NeoX
    layout with 16-byte slots, mirroring csrc/kv_cache/kv_cache_kernels.cu: [(slots, bytes per slot)].
    Each trip of a loop issues kBatch slots per thread before any of their stores."""
    vec = 16 // elt
    if kind == "rerotate":
        return [(layers * heads * (rotary_dim // 2) // vec, 32)]  # rotate_slots: a slot and its NeoX partner
    v_row = (layers * heads * head_dim // vec, 16)  # copy_units: the V row
    if kind == "copy":
        return [(layers * heads * head_dim // vec, 16), v_row]  # copy_units: the K row
    # copy_kv_ with rotation: rotate_slots, copy_units of the unrotated dims, the V row
    return [(layers * heads * (rotary_dim // 2) // vec, 32), (layers * heads * (head_dim - rotary_dim) // vec, 16), v_row]


def _row_trips_bytes(loops: List[Tuple[int, int]], threads: int, batch: int) -> Tuple[int, int]:
    """(main-loop trips, bytes read) of one CTA running ``loops``."""
    return sum(math.ceil(n / (batch * threads)) for n, _ in loops), sum(n * b for n, b in loops)


def bandwidth_cases(triton_rows: List[dict], cuda_rows: List[dict]) -> List[dict]:
    """The Little's-law model of paged decode (split-KV kernel + its merge) and of rerotate_keys_ /
    copy_kv_ at the benchmarks' GPU shapes, from the compiled rows (CTAs/SM; for Triton the bytes
    in flight read from the TTGIR). Cases whose kernels are not among the rows are left out.

    Each launch gets ``launch_bandwidth``; a case's predicted bandwidth is its compulsory bytes
    (the roofline's) over the sum of its launches' modelled times, as % of 3.35 TB/s.
    """
    H, Hkv, D, bf = 32, 8, 128, 2
    compulsory = {c["case"]: c["bytes"] for c in roofline_cases()}
    out = []

    def case(name, launches):
        for ln in launches:
            ln.update(launch_bandwidth(ln["grid_ctas"], ln["ctas_per_sm"], ln["inflight_per_cta"],
                                       ln["read_bytes"] / ln["traffic_bytes"]))
            ln["time_us"] = ln["traffic_bytes"] / (ln["tbps"] * 1e12) * 1e6
        t = sum(ln["time_us"] for ln in launches)
        bw = compulsory[name] / (t * 1e-6)
        out.append(dict(case=name, launches=launches, time_us=round(t, 2), tbps=round(bw / 1e12, 3),
                        pct=round(100 * bw / H100["hbm_bytes_per_s"], 1)))

    for tag, window in (("decode", -1), ("decode_window", PAGED_WINDOW)):
        name = f"paged_attention/{tag}"
        rows = {r["kernel"].split(".")[-1]: r for r in triton_rows if r["case"] == name}
        k = rows.get("_paged_attention_kernel")
        if k is None:
            continue
        tiles, kv_heads, splits = k["grid"]
        span = PAGED_CTX if window < 0 else min(PAGED_CTX, window + 1)
        keys = span / splits  # per program (the last split is shorter)
        trips = keys / k["constexprs"]["BLOCK_N"]
        duty = trips / (trips + PROLOGUE_ROUND_TRIPS["paged"])
        q_bytes = PAGED_BATCH * H * D * bf
        kv_read = PAGED_BATCH * span * kv_heads * D * bf * 2
        part_out = splits * PAGED_BATCH * H * (D * 4 + 4) if splits > 1 else PAGED_BATCH * H * (D * bf + 4)
        launches = [dict(kernel=k["kernel"], grid_ctas=tiles * kv_heads * splits, ctas_per_sm=k["ctas_per_sm"],
                         inflight_per_trip=k["pipeline"]["inflight_bytes"], trips=round(trips, 1),
                         prologue_round_trips=PROLOGUE_ROUND_TRIPS["paged"],
                         inflight_per_cta=k["pipeline"]["inflight_bytes"] * duty,
                         inflight_source="TTGIR: " + ", ".join(
                             [f"cp.async buffers {s} {t}" for s, t, _ in k["pipeline"]["async_buffers"]]
                             + [f"loop load {s} {t}" for s, t, _ in k["pipeline"]["loop_loads"]]),
                         nominal_inflight_per_trip=(k["num_stages"] - 1) * 2 * k["constexprs"]["BLOCK_N"] * D * bf,
                         read_bytes=kv_read + q_bytes, traffic_bytes=kv_read + q_bytes + part_out)]
        m = rows.get("_merge_split_kernel")
        if splits > 1:
            if m is None:
                continue
            per_row = splits * H * (D * 4 + 4)  # one program per query row reads every split's partials at once
            launches.append(dict(kernel=m["kernel"], grid_ctas=m["grid"][0], ctas_per_sm=m["ctas_per_sm"],
                                 inflight_per_trip=per_row, trips=1, prologue_round_trips=PROLOGUE_ROUND_TRIPS["merge"],
                                 inflight_per_cta=per_row, inflight_source="source: all partials of a row in one load",
                                 nominal_inflight_per_trip=per_row, read_bytes=part_out,
                                 traffic_bytes=part_out + PAGED_BATCH * H * (D * bf + 4)))
        case(name, launches)

    kv_rows = [r for r in cuda_rows if "kv_cache" in r["file"]]
    kv_cu = ROOT / "csrc" / "kv_cache" / "kv_cache_kernels.cu"
    batch = _file_constant(kv_cu, "kBatch")
    # the benchmark's configuration: bf16 (16-byte slots: VEC 8), NeoX, rotary_dim = head_dim
    for kind, bench, instance in (("rerotate", "rerotate_keys_", "rerotate_keys_kernel<__nv_bfloat16, 8, false>"),
                                  ("copy", "copy_kv_", "copy_kv_kernel<__nv_bfloat16, __nv_bfloat16, 8, false, false>"),
                                  ("copy_rotate", "copy_kv_+rotate", "copy_kv_kernel<__nv_bfloat16, __nv_bfloat16, 8, false, true>")):
        row = next((r for r in kv_rows if instance in r["kernel"]), None)
        if row is None:
            continue
        for tag, layers, n in KV_CACHE_SHAPES:
            loops = kv_cache_row_loops(kind, layers, Hkv, D, D, bf)
            trips, read = _row_trips_bytes(loops, row["threads"], batch)
            pro = PROLOGUE_ROUND_TRIPS[kind]
            case(f"kv_cache/{bench} {tag}", [dict(
                kernel=instance, grid_ctas=n, ctas_per_sm=row["ctas_per_sm"], inflight_per_trip=round(read / trips),
                trips=trips, prologue_round_trips=pro, inflight_per_cta=read / (trips + pro),
                inflight_source=f"kBatch {batch} x {row['threads']} threads x 16 B slots (x2 rotated) per trip; "
                                f"PTX: runs of {row.get('load16_runs')} 16-byte loads per thread before their stores",
                nominal_inflight_per_trip=round(read / trips), read_bytes=n * read, traffic_bytes=2 * n * read)])
    return out


# ---------------------------------------------------------------------------------------------
# report


def _git_commit() -> str:
    from .provenance import project_commit  # ragattn's own commit only (issue 22.6)

    return project_commit(str(ROOT))


def build_report(workers: int = 2) -> dict:
    import triton

    return dict(
        note="Static report: compiled for sm_90 without a GPU. regs/spills/smem/cp.async are measured from the "
             "compilers; ctas_per_sm, waves, the roofline and the bandwidth-saturation model (Little's law at an "
             "assumed loaded DRAM latency) are modelled from the H100's limits. Nothing ran on a GPU.",
        triton=triton.__version__, nvcc=nvcc_version(), commit=_git_commit(), h100=H100,
        triton_kernels=(tri_rows := triton_report_subprocess(workers=workers)), cuda_kernels=(cuda := analyse_cuda()),
        verify_draft_coverage=verify_draft_coverage(cuda), roofline=roofline_cases(),
        dram_latency_ns=DRAM_LATENCY_NS, bandwidth=bandwidth_cases(tri_rows, cuda),
    )


def _yn(b) -> str:
    return "yes" if b else "no"


def to_markdown(r: dict) -> str:
    lines = [
        "# Static sm_90 (H100) report", "",
        f"Generated by `python -m ragattn.bench.sm90` at commit `{r['commit']}`, triton {r['triton']}, "
        f"nvcc {r['nvcc'] or 'absent'}. No GPU was used: registers, spills, shared memory and async copies are "
        "**measured** from the compilers (Triton's bundled `ptxas -v`, `nvcc -Xptxas -v`); CTAs/SM, waves and the "
        "roofline are **modelled** from the H100's limits (65536 regs, 228 KB smem, 2048 threads, 32 CTAs per SM; "
        "132 SMs, 3.35 TB/s, 989 TFLOP/s bf16 dense). Balance (varlen kernels, modelled): the launch's programs in "
        "launch order, each costing its main-loop trips + 1, on CTAs/SM x 132 slots; (total / slots) / makespan. "
        "The last section models whether paged decode and the kv_cache kernels keep enough loads in flight to "
        "saturate HBM (Little's law, **modelled**).", "",
        "## Triton kernels (benchmark GPU shapes, launcher configs)", "",
        "| kernel | case | warps | stages | regs | spill st/ld (B) | smem (B) | CTAs/SM (bound) | pipelined (cp.async) | grid | waves | balance |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for k in r["triton_kernels"]:
        pipe = _yn(k["cp_async"]) + (", TMA" if k.get("tma") else "") + ("" if k["has_main_loop"] else " (no loop)")
        lines.append(f"| `{k['kernel']}` | {k['case']} | {k['num_warps']} | {k['num_stages']} | {k['regs']} | "
                     f"{k['spill_stores']}/{k['spill_loads']} | {k['smem']} | {k['ctas_per_sm']} ({k['occupancy_bound']}) | "
                     f"{pipe} | {tuple(k['grid'])} | {k['waves']} | {k.get('balance') or '-'} |")
    lines += ["", "## CUDA kernels (`csrc/**/*_kernels.cu`, sm_90a, at `__launch_bounds__`)", ""]
    if not r["cuda_kernels"]:
        lines.append("nvcc absent: not compiled.")
    else:
        lines += ["| kernel | file | threads | regs | spill st/ld (B) | static smem (B) | CTAs/SM (bound) | 16 B loads before a store (PTX runs) |",
                  "|---|---|---|---|---|---|---|---|"]
        for k in r["cuda_kernels"]:
            lines.append(f"| `{k['kernel']}` | {k['file']} | {k['threads']} | {k['regs']} | "
                         f"{k['spill_stores']}/{k['spill_loads']} | {k['static_smem']} | {k['ctas_per_sm']} ({k['occupancy_bound']}) | "
                         f"{k.get('load16_runs') or '-'} |")
        lines += ["", "Static shared memory only: the kv_cache kernels' dynamic shared memory depends on the launch.", "",
                  "`verify_draft` splits every position of every row into vocabulary slices of "
                  f"{VERIFY_DRAFT_SLICE_LEN} tokens, one CTA each (phase 1: softmax statistics; a second pass with "
                  "eta > 0; on sm_90 with eta > 0 instead one cluster of up to 8 CTAs per position keeping its slices "
                  "in shared memory, the 'eta > 0 grid'), folds them per row in a warp, and draws the one token per "
                  "row over (row, slice) CTAs. SM coverage of phase 1 at the benchmark's shapes (modelled):", "",
                  "| batch | g | V | slices | grid (CTAs) | eta > 0 grid | draw grid | SMs used | CTAs/SM | waves |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in r.get("verify_draft_coverage", []):
            lines.append(f"| {c['batch']} | {c['g']} | {c['vocab']} | {c['slices']} | {c['ctas']} | {c.get('rapid_ctas')} | "
                         f"{c['draw_ctas']} | {c['sms_used']} of {H100['sms']} | {c['ctas_per_sm']} | {c['waves']} |")
    lines += ["", "## Roofline lower bounds (modelled)", "",
              "| case | bytes | FLOPs | FLOP/B | memory us | compute us | lower bound us | bound |",
              "|---|---|---|---|---|---|---|---|"]
    for c in r["roofline"]:
        lines.append(f"| {c['case']} | {c['bytes']:.3g} | {c['flops'] or 0:.3g} | {c['arithmetic_intensity']} | "
                     f"{c['memory_us']} | {c['compute_us']} | {c['lower_bound_us']} | {c['bound']} |")
    lines += bandwidth_markdown(r.get("bandwidth", []), r.get("dram_latency_ns", DRAM_LATENCY_NS))
    return "\n".join(lines) + "\n"


def bandwidth_markdown(cases: List[dict], latency_ns: float) -> List[str]:
    """The report's bandwidth-saturation section (all modelled)."""
    need = bytes_in_flight_needed(1.0, latency_ns)
    lines = [
        "", "## Bandwidth saturation (modelled: Little's law)", "",
        f"Assumption: loaded HBM3 latency **{latency_ns:.0f} ns** (`DRAM_LATENCY_NS`; the middle of the 600-800 ns "
        "range usually quoted for loaded Hopper DRAM latency; unloaded pointer-chase figures are lower; not measured "
        f"here). Sustaining 3.35 TB/s then needs 3.35 TB/s x {latency_ns:.0f} ns = "
        f"{H100['hbm_bytes_per_s'] * latency_ns * 1e-9 / 1e6:.2f} MB of loads in flight, **{need / 1024:.1f} KB per SM** "
        "over 132 SMs (x the read share of the traffic: stores are posted, nothing waits for them, so a copy that "
        "reads half its bytes needs half).", "",
        "Per launch (all **modelled**): *in flight / trip* = bytes of independent global loads a CTA has "
        "outstanding in one main-loop trip: for the Triton kernel read from its compiled TTGIR (the pipeliner's "
        "`cp.async` multi-buffers, N buffers = N tiles ahead, plus loads issued and awaited inside the loop body), "
        "next to the *nominal* (num_stages - 1) K and V tiles; for the CUDA kernels kBatch x threads x 16-byte slots "
        "(2 per slot when a slot is rotated with its NeoX partner). *Duty* = trips / (trips + prologue round trips), "
        "the dependent loads before the first main-loop load (tile map, positions, cos/sin staging), so "
        "in flight per CTA = in flight / trip x duty. A wave of n CTAs moves "
        "min(3.35 TB/s, n x in flight per CTA / latency / read share); full waves hold CTAs/SM x 132 CTAs, the "
        "tail the rest (too few CTAs cannot saturate); each CTA moves the same bytes, so the launch time is the "
        "sum over waves. *Break-even* = the latency at which the first wave would fall to 85% (the margin on the "
        "assumption). A case's % = its compulsory bytes (the roofline's) / the sum of its launches' modelled "
        "times / 3.35 TB/s. Not modelled: DRAM efficiency losses (refresh, row and read/write turnarounds), L2 "
        "effects, launch gaps: this is what occupancy and loads in flight allow, an upper bound, not a "
        "prediction of a measured number.", "",
        "| case | kernel | grid (CTAs) | CTAs/SM | in flight / trip (B): compiled (nominal) | trips/CTA | prologue | "
        "in flight / SM, wave 1 (B) | needed / SM (B) | waves (tail CTAs) | break-even ns | launch TB/s | case % of peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        for i, ln in enumerate(c["launches"]):
            lines.append(
                f"| {c['case'] if i == 0 else ''} | `{ln['kernel']}` | {ln['grid_ctas']} | {ln['ctas_per_sm']} | "
                f"{ln['inflight_per_trip']} ({ln['nominal_inflight_per_trip']}) | {ln['trips']} | "
                f"{ln['prologue_round_trips']} | {ln['inflight_per_sm']} | {ln['needed_per_sm']} | "
                f"{ln['waves']} ({ln['tail_ctas']}) | {ln['latency_at_target_ns']} | {ln['tbps']} | "
                f"{('**' + str(c['pct']) + '**') if i == len(c['launches']) - 1 else ''} |")
    lines += ["", "In-flight sources: " + "; ".join(
        sorted({f"`{ln['kernel']}`: {ln['inflight_source']}" for c in cases for ln in c["launches"]}))]
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m ragattn.bench.sm90", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--select", action="append", help="(with --triton-json) only kernels whose label contains this")
    p.add_argument("--triton-json", action="store_true", help="internal: print the Triton rows as JSON")
    a = p.parse_args(argv)
    if a.triton_json:
        print(json.dumps(analyse_triton_all(a.select, a.workers)))
        return
    report = build_report(a.workers)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "report.md").write_text(to_markdown(report))
    print(to_markdown(report))


if __name__ == "__main__":
    main()
