"""``python -m bench``: run ragattn's micro-benchmarks, print a table, save JSON and markdown.

    python -m bench                         # CPU sizes on the CPU (or GPU sizes when CUDA is up)
    python -m bench --device cuda --sizes gpu --out OUT
    python -m bench --only kv_cache         # one family (substring of the family, or case-name prefix)
    python -m bench --only decode,sparse_prefill --out OUT --resume   # several; skip what OUT holds

Every row is appended to ``OUT/results.jsonl`` as soon as it is measured; a case that fails
(building its inputs, a baseline, an impossible figure) is recorded there with its error and
skipped, and the others still run.
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


def command_name(sub: str = "") -> str:
    """How the user ran this (for ``usage:``): ``ragattn bench`` from the console script,
    ``python -m ragattn bench`` or ``python -m bench`` (a checkout); ``sub``: a subcommand."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    base, parent = os.path.basename(argv0), os.path.basename(os.path.dirname(argv0))
    if base == "ragattn":
        name = "ragattn bench"
    elif base == "__main__.py" and parent == "ragattn":
        name = "python -m ragattn bench"
    else:
        return "python -m bench" + ("." + sub if sub else "")
    return name + (" " + sub if sub else "")


def _read_jsonl(path: str) -> list:
    """The records of a results.jsonl (a torn last line, from a process killed mid-write, skipped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return records


class RowSink:
    """Appends every record to ``results.jsonl`` the moment it exists (flushed and fsynced), so a
    run cut by a time limit or killed keeps every row measured before the cut."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.path = path
        self.f = open(path, "a")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


def _error_record(spec, exc: BaseException, stage: str) -> dict:
    return {"family": spec.family, "key": spec.key, "error": f"{type(exc).__name__}: {str(exc)[:400]}",
            "stage": stage}


def _report(sink: RowSink, record: dict) -> None:
    sink.write(record)
    where = record.get("case", record["key"])
    print(f"bench: {record['family']}/{where} failed ({record['stage']}): {record['error']}", file=sys.stderr)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=command_name(), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--sizes", default=None, choices=("cpu", "gpu"), help="shape set (default: gpu on cuda, cpu on cpu)")
    parser.add_argument("--only", default=None,
                        help="run only the cases of families containing this, or whose name starts with it; "
                             "several, comma-separated")
    parser.add_argument("--out", default="bench_results",
                        help="folder for results.jsonl (every row appended as it is measured), results.json and "
                             "results.md (written at the end from results.jsonl)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the cases that results.jsonl in --out already holds a ragattn row of")
    parser.add_argument("--peaks", default=None,
                        help="JSON file of the measured peaks: read if it exists, else measured and written "
                             "(lets one-family-per-process runs measure them once)")
    args = parser.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if args.device == "cpu" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors
    device = torch.device(args.device)
    size = args.sizes or ("gpu" if device.type == "cuda" else "cpu")

    from .harness import format_table, iter_specs, load_peaks, matches, measure_case

    from tqdm import tqdm

    peaks = load_peaks(device, args.peaks)
    jsonl = os.path.join(args.out, "results.jsonl")
    done = {(r.get("family"), r.get("key")) for r in _read_jsonl(jsonl)
            if r.get("impl") == "ragattn" and "error" not in r} if args.resume else set()
    meta = {
        "device": _device_name(device),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "torch": torch.__version__,
        "sizes": size,
        "measured_peaks": peaks,
        "only": args.only,
        "argv": sys.argv[1:] if argv is None else list(argv),
    }
    sink = RowSink(jsonl)
    sink.write({"meta": meta})
    measured = failed = 0
    bar = tqdm(desc="benchmarks", unit="case", file=sys.stderr)
    for mod_name, specs in iter_specs(device, size, args.only):
        bar.set_postfix_str(mod_name.rpartition(".bench_")[2])
        for spec in specs:
            if (spec.family, spec.key) in done:
                continue
            built = []
            stage = "build"
            try:
                built = [c for c in spec.build_all() if matches(c, args.only)]
            except Exception as exc:  # one case's failure skips that case, not its family
                failed += 1
                _report(sink, _error_record(spec, exc, stage))
            for case in built:
                try:
                    rows = measure_case(case, device)
                except Exception as exc:
                    failed += 1
                    _report(sink, dict(_error_record(spec, exc, "measure"), case=case.name))
                else:
                    for row in rows:
                        row["key"] = spec.key
                        sink.write(row)
                    measured += 1
            del built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            bar.update(1)
    bar.close()
    sink.f.close()

    records = _read_jsonl(jsonl)
    latest = {}
    for r in records:  # the last row of each (case, impl) of every run in this folder
        if "meta" in r:
            continue
        latest[(r.get("family"), r.get("case", r.get("key")), r.get("impl", "error"))] = r
    rows = [r for r in latest.values() if "error" not in r]
    errors = [r for r in latest.values() if "error" in r
              and not any(o.get("key") == r.get("key") and o.get("family") == r.get("family") for o in rows)]
    if not rows and not errors:
        print(f"no benchmark case matches --only {args.only!r}", file=sys.stderr)
        return 1
    table = format_table(rows)
    header = (
        f"# ragattn benchmarks\n\n- device: {meta['device']}\n- date: {meta['date']}\n- commit: {meta['commit']}\n"
        f"- torch: {meta['torch']}\n- sizes: {size}\n"
        f"- measured peaks: copy {peaks['copy_GBps']:.1f} GB/s (read + write), "
        f"matmul {peaks['matmul_TFLOPs']:.2f} TFLOP/s ({'bf16' if device.type == 'cuda' else 'fp32'})\n\n"
        "`ragattn speedup` = baseline time / ragattn time; `% peak` is of the measured peak above (a case over "
        "100% raises instead of printing); `synced wall` = back-to-back calls between two device synchronisations "
        "(CUDA only, launch overhead included); `config` = the launch configuration of the ragattn call; "
        "`backend` = how a baseline ran (its options, and on CUDA the kernels the profiler saw it launch).\n\n"
    )
    failures = "" if not errors else "\n\n## Cases that failed\n\n" + "\n".join(
        f"- {e['family']}/{e.get('case', e['key'])} ({e.get('stage')}): {e['error']}" for e in errors)
    print(header + table + failures)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "errors": errors}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(header + table + failures + "\n")
    print(f"\n{measured} case(s) measured, {failed} failed; saved {args.out}/results.jsonl, results.json and "
          f"results.md", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
