"""Static H100 (sm_90) report: what the compiled kernels use, and a roofline model. No GPU needed.

    python -m ragattn.bench.sm90            # or: python -m bench.sm90, python -m ragattn bench sm90
    python -m ragattn.bench.sm90 --out DIR  # default ./sm90-static/ (docs/perf/sm90-static.md is the page)

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

Modules, by concern: ``h100`` (the H100's limits, the benchmarks' shapes, the occupancy and balance
models), ``specs`` (which Triton kernels at which configs), ``compile`` (compiling them for sm_90
and reading the compilers' figures), ``cuda`` (the CUDA kernels by nvcc), ``roofline``,
``bandwidth`` (Little's law) and ``report`` (the markdown/JSON report and the command line).
"""
from .bandwidth import (DRAM_LATENCY_NS, PROLOGUE_ROUND_TRIPS, TARGET_PCT, _row_trips_bytes, bandwidth_cases,
                        bytes_in_flight_needed, kv_cache_row_loops, launch_bandwidth)
from .compile import (analyse_triton, analyse_triton_all, compile_sm90, loop_inflight, parse_ptxas, ptxas_report,
                      triton_report_subprocess)
from .cuda import (VERIFY_DRAFT_SLICE_LEN, _file_constant, analyse_cuda, load16_runs, nvcc_version,
                   verify_draft_coverage, verify_draft_grid, verify_draft_slices)
from .h100 import (DEFAULT_OUT, DEVICE_NAME, H100, KV_CACHE_SHAPES, PAGED_BATCH, PAGED_CTX, PAGED_WINDOW, ROOT,
                   WINDOW_L, WINDOW_W, ctas_per_sm, schedule_balance)
from .report import build_report, main, to_markdown
from .roofline import roofline_cases
from .specs import TritonSpec, triton_specs
