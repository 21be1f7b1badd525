"""``python -m bench``: run ragattn's micro-benchmarks, print a table, save JSON and markdown.

    python -m bench                         # CPU sizes on the CPU (or GPU sizes when CUDA is up)
    python -m bench --device cuda --sizes gpu --out docs/perf/h100
    python -m bench --only kv_cache         # one family (substring of the family, or case-name prefix)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from .provenance import device_name as _device_name
from .provenance import project_commit as _commit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", default=None, choices=("cpu", "gpu"), help="shape set (default: gpu on cuda, cpu on cpu)")
    parser.add_argument("--only", default=None, help="run only the cases of families containing this, or whose name starts with it")
    parser.add_argument("--out", default="bench_results", help="folder for results.json and results.md")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.device == "cpu" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors
    device = torch.device(args.device)
    size = args.sizes or ("gpu" if device.type == "cuda" else "cpu")

    from .harness import format_table, iter_cases, measure_case, measured_copy_bandwidth, measured_matmul_tflops

    from tqdm import tqdm

    peaks = {
        "copy_GBps": measured_copy_bandwidth(device),
        "matmul_TFLOPs": measured_matmul_tflops(device, torch.bfloat16),
    }
    rows = []
    bar = tqdm(desc="benchmarks", unit="case", file=sys.stderr)
    for mod_name, cases in iter_cases(device, size, args.only):
        bar.set_postfix_str(mod_name.rpartition(".bench_")[2])
        for case in cases:
            rows.extend(measure_case(case, device))
            bar.update(1)
        del cases  # free this family's inputs before the next one builds its own
        if device.type == "cuda":
            torch.cuda.empty_cache()
    bar.close()
    if not rows:
        print(f"no benchmark case matches --only {args.only!r}", file=sys.stderr)
        return 1

    meta = {
        "device": _device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "torch": torch.__version__,
        "sizes": size,
        "measured_peaks": peaks,
    }
    table = format_table(rows)
    header = (
        f"# ragattn benchmarks\n\n- device: {meta['device']}\n- date: {meta['date']}\n- commit: {meta['commit']}\n"
        f"- torch: {meta['torch']}\n- sizes: {size}\n"
        f"- measured peaks: copy {peaks['copy_GBps']:.1f} GB/s (read + write), "
        f"matmul {peaks['matmul_TFLOPs']:.2f} TFLOP/s ({'bf16' if device.type == 'cuda' else 'fp32'})\n\n"
        "`ragattn speedup` = baseline time / ragattn time; `% peak` is of the measured peak above (a case over "
        "100% raises instead of printing); `synced wall` = back-to-back calls between two device synchronisations "
        "(CUDA only, launch overhead included); `config` = the launch configuration of the ragattn call.\n\n"
    )
    print(header + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(header + table + "\n")
    print(f"\nsaved {args.out}/results.json and {args.out}/results.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
