"""Compiling the Triton kernels for sm_90 without a GPU and reading what the compilers report:
registers, spills, shared memory, asynchronous copies and the main loops' loads in flight."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .h100 import H100, ctas_per_sm, schedule_balance
from .specs import TritonSpec, kernel_fn, triton_specs


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



_ELT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8, "i8": 1, "i1": 1, "f64": 8}


def _shape_bytes(dims: str, dtype: str) -> int:
    return math.prod(int(x) for x in dims.split("x")) * _ELT_BYTES[dtype]


_ALLOC = re.compile(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<([\dx]+)x(\w+),[^>]*mutable>")
_LOAD = re.compile(r"= tt\.load .*: tensor<([\dx]+)x!tt\.ptr<(\w+)>")


def _dot_loops(lines: List[str]) -> List[Tuple[int, int]]:
    """(first, end) line spans of the innermost ``scf.for`` loops whose body has a dot."""
    spans = []
    for i, ln in enumerate(lines):
        if "scf.for" not in ln:
            continue
        indent = len(ln) - len(ln.lstrip())
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith("}") and len(lines[j]) - len(lines[j].lstrip()) <= indent):
            j += 1
        if any("tt.dot" in x or "warp_group_dot" in x for x in lines[i + 1:j]):
            spans.append((i, j))
    return [(a, b) for a, b in spans if not any(a < c and d <= b for c, d in spans if (c, d) != (a, b))]


def loop_inflight(ttgir: str) -> Optional[dict]:
    """Global-load bytes one CTA keeps in flight in its main loop, read from the compiled TTGIR.

    Every innermost ``scf.for`` whose body has a dot is a loop over key (or query) tiles. Its loads
    are either the software pipeliner's asynchronous copies, into multi-buffers ``ttg.local_alloc :
    () -> !ttg.memdesc<N x tile, mutable>`` emitted just before the loop (N buffers = N tiles in
    flight ahead of their use), or plain ``tt.load`` of a tensor in the loop body (issued and
    awaited within one trip: one tile in flight). The loops run one after another and reuse one
    another's buffers, so a CTA has in flight what one loop has: the main loop is the one with the
    most (the steady state: decode's whole key tiles, not the edge tiles around them).
    Returns {loops: [{async_buffers, loop_loads: [(shape, dtype, bytes)], inflight_bytes}], main_loop,
    and the main loop's async_buffers, loop_loads, inflight_bytes} or None (no loop).
    """
    lines = ttgir.splitlines()
    loops, prev_end = [], 0
    for start, end in _dot_loops(lines):
        buffers = [(m.group(1), m.group(2), _shape_bytes(m.group(1), m.group(2)))
                   for ln in lines[prev_end:start] for m in [_ALLOC.search(ln)] if m]
        loads = [(m.group(1), m.group(2), _shape_bytes(m.group(1), m.group(2)))
                 for ln in lines[start + 1:end] for m in [_LOAD.search(ln)] if m]
        loops.append(dict(async_buffers=buffers, loop_loads=loads, inflight_bytes=sum(b for *_, b in buffers + loads)))
        prev_end = end
    if not loops:
        return None
    main = max(range(len(loops)), key=lambda i: loops[i]["inflight_bytes"])
    return dict(loops[main], loops=loops, main_loop=main)


def tile_loads_without_cp_async(pipeline: Optional[dict]) -> List[str]:
    """The 2-D tiles (K, V, or Q/dO tiles in the backward) some dot loop loads with a plain register
    load instead of an asynchronous copy: "<loop>: <shape> <dtype>" each (1-D loads of positions or
    page ids are not tiles)."""
    return [f"loop {i}: {shape} {dtype}" for i, loop in enumerate((pipeline or {}).get("loops", []))
            for shape, dtype, _ in loop["loop_loads"] if "x" in shape]


def analyse_triton(spec: TritonSpec) -> dict:
    """Compile one spec and read what the compilers report (run with TRITON_INTERPRET unset)."""
    compiled = compile_sm90(kernel_fn(spec.kernel), spec.constexprs, spec.types, num_warps=spec.num_warps,
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
        pipeline=(pipe := loop_inflight(compiled.asm["ttgir"]) if spec.loop else None),
        plain_tile_loads=tile_loads_without_cp_async(pipe),
        smem_model=spec.smem_model,
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

