"""The CUDA kernels (``csrc/**/*_kernels.cu``) compiled for sm_90a by nvcc and ptxas, and the
verify_draft launch grids mirrored from the kernels (modelled SM coverage)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

from .h100 import H100, ROOT, ctas_per_sm
from .compile import parse_ptxas


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
    (statistics; a second pass with eta > 0) over every (position, slice) of every row, the draw's totals
    over (row, slice) of the one drawn position per row (``draw``; its find is then one CTA per row over the
    crossing slice); with eta > 0 on sm_90 phase 1 is instead one cluster of min(8, slices) CTAs per
    position (``rapid``; the launcher's default cluster)."""
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

