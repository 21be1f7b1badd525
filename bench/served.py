"""RAG requests served by a live vLLM server: client-side time to first token and decode speed.

    python -m bench.served --vllm-python .venv-vllm/bin/python [--sizes 1536,3072]
        [--methods full,block_attention,...] [--backends cpu_attn,ragattn] [--repeats 3]
        [--max-tokens 32] [--threads 1] [--out docs/perf/cpu/served]
    python -m bench.served --dry-run      # prompts, request bodies and server commands; no server
    python -m bench.served --profile --methods block_attention --sizes 3072   # operator tables

Run it in the project's HF environment (``.venv``: it exports SmolLM2 and builds the chunk store
with the HF path, as tests/vllm/live/reference.py does, and draws the plot with matplotlib); the
servers run under ``--vllm-python`` (``.venv-vllm``), both at once, each with the ragattn
connector over that store and ``--max-model-len 4096``: ``cpu_attn`` is vLLM's own CPU attention,
``ragattn`` is ragattn's attention backend (``RAGATTN_VLLM_ATTENTION=1``). Their ``PYTHONPATH``
is this tree, so they serve this tree's code.

Requests: per size, one prompt of the shipped eval QA set (``ragattn/data/qa_eval``; the smaller
``qa`` set stops near 2.8K tokens) of at least that many tokens (``ragattn.apps.corpus.rag_prompts``),
streamed from ``/v1/completions`` (``stream: true``, greedy, ``ignore_eos``: every answer is
``--max-tokens`` long). A row is a (method, backend) pair: a method is the request's
``kv_transfer_params`` (:data:`METHODS`: ``full`` sends none, so the connector claims nothing and
the server prefills the whole prompt; ``block_attention`` sends the chunk spans, so the connector
writes the stored chunks' K/V and the server prefills only the question). Adding a method is one
entry of ``bench.served_methods.MEASURED``. Every row gets one warm-up request per size (which also brings its
chunks from disk into the worker's memory), then ``--repeats`` rounds, each round running every
(size, row) once in turn, so a change of the machine's load falls on every row alike; the 1-minute
load average is read at each request. Reported: median TTFT (send to the first streamed token),
median decode tokens/s (``(tokens - 1) / (last token - first token)``), both against the
``full``/``cpu_attn`` row of the same size, and the targets of the served benchmark (met or not).
Writes ``served.json``, ``served.md`` and ``served.png`` to ``--out``. ``--profile`` instead
profiles one answer per row (vLLM's torch profiler in the server's worker) and writes its operator
table; ``python -m bench.vllm_attention_step`` times the two backends' attention calls alone.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ragattn.methods import registry

from .provenance import project_commit, source_root
from .served_memory import format_memory, measure_memory, memory_target
from .served_methods import METHODS, RAGATTN_ONLY, RECOMPUTE_RATIO, label  # a method: its requests' kv_transfer_params

BASELINE = ("full", "cpu_attn")
MAX_MODEL_LEN = 4096
# A backend is the environment its server starts with (on top of the common one, server_env).
BACKENDS: Dict[str, Dict[str, str]] = {
    "cpu_attn": {"RAGATTN_VLLM_ATTENTION": "0"},
    "ragattn": {"RAGATTN_VLLM_ATTENTION": "1"},
}
TARGETS = ("ragattn backend full prefill: TTFT within 1.1x of vLLM's CPU backend at every size",
           "ragattn backend decode: tokens/s within 1.1x of vLLM's CPU backend at every size",
           "Block-Attention (each backend): TTFT >= 5x faster than vLLM's full prefill at the largest size",
           "TurboRAG composite (each backend): TTFT >= 5x faster than vLLM's full prefill at the largest size",
           f"CacheBlend and FusionRAG at {RECOMPUTE_RATIO:.0%} (ragattn backend): TTFT >= 2.5x faster than vLLM's "
           "full prefill at the largest size")


class ServedBenchError(RuntimeError):
    """A request the server refused or answered without tokens (message: the row and the reply)."""


@dataclasses.dataclass
class Prompt:
    """One request's prompt: ``tokens`` (int ids), ``spans`` (``[start, end)`` of the head and of
    every chunk; the tail, the question, is the final block), ``size`` (the tokens asked for)."""
    size: int
    question: str
    tokens: List[int]
    spans: List[List[int]]
    chunks: List[List[int]]      # head, then every chunk: what the store holds


def build_prompts(tokenizer, sizes: Sequence[int], corpus=None) -> List[Prompt]:
    """One :class:`Prompt` per size (of at least that many tokens), question ``i`` for size ``i``."""
    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus, rag_prompts

    corpus = load_corpus(EVAL_CORPUS) if corpus is None else corpus
    out = []
    for i, size in enumerate(sizes):
        question, texts = rag_prompts(tokenizer, i + 1, size, corpus)[i]
        p = rag_prompt(tokenizer, texts, question, size)
        if len(p.tokens) < size:
            raise ValueError(f"bench.served: the corpus holds only {len(p.tokens)} prompt tokens, --sizes asks {size}")
        out.append(p)
    return out


def rag_prompt(tokenizer, texts: Sequence[str], question: str, size: int = 0) -> Prompt:
    """The :class:`Prompt` of ``texts`` (passages) and ``question`` laid out as the methods lay
    them out (``ragattn.methods.prompt.prompt_parts``); ``size``: its ``size`` (0: its length)."""
    from ragattn.methods.prompt import prompt_parts

    head, ids, tail = prompt_parts(tokenizer, list(texts), question)
    spans, at = [], 0
    for part in [head] + ids:
        spans.append([at, at + len(part)])
        at += len(part)
    tokens = head + [t for c in ids for t in c] + tail
    return Prompt(size or len(tokens), question, tokens, spans, [head] + ids)


def completion_body(model: str, prompt: Sequence[int], max_tokens: int,
                    kv_transfer_params: Optional[dict] = None) -> dict:
    """The streamed, greedy ``/v1/completions`` request of a benchmark row: ``max_tokens`` tokens
    exactly (``ignore_eos``), the usage in the last event, ``kv_transfer_params`` when given."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": int(max_tokens), "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def stream_completion(url: str, body: dict, timeout: float = 900.0) -> dict:
    """POST ``body`` to ``url``/v1/completions and read the event stream: ``ttft_s`` (send to the
    first event with a token), ``decode_tok_s`` (tokens after the first over the time between the
    first and the last token event; None for a one-token answer), ``tokens``, ``total_s``, ``text``."""
    from ragattn.vllm.serve import StreamError, stream_events

    first = last = usage = None
    events, text = 0, []
    t0 = time.perf_counter()
    try:
        for msg in stream_events(url, body, timeout):
            if msg.get("choices"):
                now = time.perf_counter()
                first = now if first is None else first
                last, events = now, events + 1
                text.append(msg["choices"][0].get("text") or "")
            if msg.get("usage"):
                usage = msg["usage"]
    except StreamError as exc:
        raise ServedBenchError(f"bench.served: {exc}") from None
    except urllib.error.HTTPError as exc:
        raise ServedBenchError(f"bench.served: HTTP {exc.code}: {exc.read().decode(errors='replace')[:2000]}") from None
    total = time.perf_counter() - t0
    if first is None:
        raise ServedBenchError("bench.served: the stream ended without a token")
    tokens = int(usage["completion_tokens"]) if usage else events
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return {"ttft_s": first - t0, "decode_tok_s": decode, "tokens": tokens, "total_s": total, "text": "".join(text)}


def measure(urls: Dict[str, str], model: str, prompts: Sequence[Prompt], rows: Sequence[tuple],
            repeats: int = 3, max_tokens: int = 32, log: Callable[[str], None] = print) -> List[dict]:
    """Per (size, (method, backend)) of ``rows``: one warm-up request, then ``repeats`` rounds
    interleaving every (size, row); ``urls`` maps a backend to its server. Returns one dict per
    (size, row): medians, every sample, and the 1-minute load average at each request."""
    if repeats < 1:
        raise ValueError(f"bench.served: repeats must be >= 1, got {repeats}")
    samples: Dict[tuple, List[dict]] = {}

    def one(p: Prompt, method: str, backend: str) -> dict:
        body = completion_body(model, p.tokens, max_tokens, METHODS[method](p.spans))
        load = os.getloadavg()[0]
        try:
            got = stream_completion(urls[backend], body)
        except ServedBenchError as exc:
            raise ServedBenchError(f"{exc} (row {method}/{backend}, {len(p.tokens)}-token prompt)") from None
        got["loadavg"] = load
        return got

    for p in prompts:
        for method, backend in rows:
            w = one(p, method, backend)
            log(f"warm-up {len(p.tokens)} tokens {method}/{backend}: TTFT {w['ttft_s'] * 1e3:.0f} ms")
    for r in range(repeats):
        for p in prompts:
            for method, backend in rows:
                got = one(p, method, backend)
                samples.setdefault((p.size, method, backend), []).append(got)
                log(f"round {r + 1}/{repeats} {len(p.tokens)} tokens {method}/{backend}: TTFT "
                    f"{got['ttft_s'] * 1e3:.0f} ms, decode {got['decode_tok_s'] or 0:.1f} tok/s, "
                    f"load {got['loadavg']:.2f}")
    out = []
    for p in prompts:
        for method, backend in rows:
            s = samples[(p.size, method, backend)]
            decode = [x["decode_tok_s"] for x in s if x["decode_tok_s"] is not None]
            out.append({"size": p.size, "prompt_tokens": len(p.tokens), "chunks": len(p.spans) - 1,
                        "method": method, "backend": backend,
                        "ttft_ms": statistics.median(x["ttft_s"] * 1e3 for x in s),
                        "decode_tok_s": statistics.median(decode) if decode else None,
                        "loadavg": statistics.mean(x["loadavg"] for x in s),
                        "ttft_ms_all": [round(x["ttft_s"] * 1e3, 1) for x in s],
                        "decode_tok_s_all": [None if x["decode_tok_s"] is None else round(x["decode_tok_s"], 2)
                                             for x in s],
                        "tokens": [x["tokens"] for x in s]})
    add_ratios(out)
    return out


def add_ratios(rows: List[dict]) -> None:
    """``ttft_speedup`` (baseline TTFT / the row's) and ``decode_ratio`` (the row's tokens/s / the
    baseline's) against the ``full``/``cpu_attn`` row of the same size (None without one)."""
    base = {r["size"]: r for r in rows if (r["method"], r["backend"]) == BASELINE}
    for r in rows:
        b = base.get(r["size"])
        r["ttft_speedup"] = b["ttft_ms"] / r["ttft_ms"] if b else None
        r["decode_ratio"] = (r["decode_tok_s"] / b["decode_tok_s"]
                             if b and r["decode_tok_s"] and b["decode_tok_s"] else None)


def targets(rows: List[dict], memory: Sequence[dict] = ()) -> List[tuple]:
    """``(target, met: bool or None when its rows were not measured, evidence)`` per :data:`TARGETS`,
    and the memory target (:func:`bench.served_memory.memory_target`)."""
    def pick(method, backend):
        return [r for r in rows if r["method"] == method and r["backend"] == backend and r["ttft_speedup"]]

    out = []
    full_rag = pick("full", "ragattn")
    ev = ", ".join(f"{r['prompt_tokens']} tokens: {1 / r['ttft_speedup']:.2f}x" for r in full_rag)
    out.append((TARGETS[0], all(1 / r["ttft_speedup"] <= 1.1 for r in full_rag) if full_rag else None,
                f"TTFT ragattn / cpu_attn: {ev}"))
    dec = [r for r in full_rag if r["decode_ratio"]]
    ev = ", ".join(f"{r['prompt_tokens']} tokens: {r['decode_ratio']:.2f}x" for r in dec)
    out.append((TARGETS[1], all(r["decode_ratio"] >= 1 / 1.1 for r in dec) if dec else None,
                f"decode tokens/s ragattn / cpu_attn: {ev}"))
    largest = max((r["size"] for r in rows), default=None)
    for target, methods, bound in ((TARGETS[2], ("block_attention",), 5), (TARGETS[3], ("turborag_composite",), 5),
                                   (TARGETS[4], RAGATTN_ONLY, 2.5)):
        got = [r for m in methods for b in BACKENDS for r in pick(m, b) if r["size"] == largest]
        ev = ", ".join(f"{r['method']}/{r['backend']}: {r['ttft_speedup']:.1f}x" for r in got)
        out.append((target, all(r["ttft_speedup"] >= bound for r in got) if got else None,
                    f"speedup at {got[0]['prompt_tokens']} tokens: {ev}" if got else "no row of these methods"))
    out.append(memory_target(list(memory)))
    return out


def format_table(rows: List[dict]) -> str:
    def f(x, spec):
        return "-" if x is None else format(x, spec)

    lines = ["| prompt tokens (chunks) | method | backend | TTFT ms, median (range) | TTFT speedup vs full/cpu_attn | "
             "decode tok/s, median (range) | decode vs full/cpu_attn | load avg (1 min) |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        dec = [x for x in r["decode_tok_s_all"] if x is not None]
        dec_range = f" ({min(dec):.1f}-{max(dec):.1f})" if dec else ""
        lines.append(f"| {r['prompt_tokens']} ({r['chunks']}) | {r['method']} | {r['backend']} | {r['ttft_ms']:.0f} "
                     f"({min(r['ttft_ms_all']):.0f}-{max(r['ttft_ms_all']):.0f}) | "
                     f"{f(r['ttft_speedup'], '.2f')}x | {f(r['decode_tok_s'], '.1f')}{dec_range} | "
                     f"{f(r['decode_ratio'], '.2f')}x | {r['loadavg']:.2f} |")
    return "\n".join(lines)


def format_targets(rows: List[dict], memory: Sequence[dict] = ()) -> str:
    word = {True: "**met**", False: "**not met**", None: "not measured"}
    return "\n".join(f"- {t}: {word[met]} ({ev})" for t, met, ev in targets(rows, memory))


def plot(rows: List[dict], path: str, title: str) -> bool:
    """TTFT and decode tokens/s per row, grouped by prompt size; False where matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["prompt_tokens"] for r in rows})
    names = list(dict.fromkeys(f"{r['method']}/{r['backend']}" for r in rows))
    width = 0.8 / len(names)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttft_ms", "time to first token (ms, median)"),
                           (axes[1], "decode_tok_s", "decode tokens/s (median)")):
        for j, name in enumerate(names):
            vals = {r["prompt_tokens"]: r[key] for r in rows if f"{r['method']}/{r['backend']}" == name}
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(sizes))]
            ax.bar(xs, [vals.get(s) or 0 for s in sizes], width, label=name)
        ax.set_xticks(range(len(sizes)), [f"{s} tokens" for s in sizes])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    handles, labels = axes[0].get_legend_handles_labels()   # below the plots: over the bars it hid them
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(names)), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.06 * (1 + (len(names) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def default_vllm_python() -> Optional[str]:
    """``RAGATTN_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in this tree or the main checkout
    this worktree belongs to, else None."""
    env = os.environ.get("RAGATTN_VLLM_PYTHON")
    if env:
        return env
    for root in (source_root(), _main_checkout()):
        if root and os.path.isfile(os.path.join(root, ".venv-vllm", "bin", "python")):
            return os.path.join(root, ".venv-vllm", "bin", "python")
    return None


def _main_checkout() -> Optional[str]:
    try:
        common = subprocess.check_output(["git", "-C", source_root(), "rev-parse", "--git-common-dir"], text=True,
                                         stderr=subprocess.DEVNULL, timeout=30).strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return os.path.dirname(os.path.abspath(os.path.join(source_root(), common)))


def server_env(threads: int) -> Dict[str, str]:
    """Every server's environment: ``threads`` OpenMP threads, vLLM's core binding off (``auto``
    binds every server to all cores and sets its own thread count), this tree on the path."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONPATH": source_root(),
            "VLLM_CPU_KVCACHE_SPACE": "3"}   # GiB: 16 copies of a 1.5K-token prompt fit (the memory rows)


def build_store(model_dir: Path, prompts: Sequence[Prompt], chunk_dir: Path) -> dict:
    """The chunk store of every prompt's head and chunks, built by the HF path from the served
    folder (float32), as a user builds it for the served model; returns its stats."""
    import torch
    from transformers import AutoModelForCausalLM

    from ragattn.methods import ChunkStore

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    store = ChunkStore(model, chunk_dir)
    for p in prompts:
        store.add(p.chunks)
    return dict(store.stats)


def start_servers(python: str, model_dir: Path, chunk_dir: Path, backends: Sequence[str], workdir: Path,
                  threads: int, timeout_s: float, profile_dir: Optional[Path] = None) -> dict:
    """``{backend: LiveServer}``, started side by side (each waited for); on a failure the others
    are stopped and the error raised. ``profile_dir``: vLLM's torch profiler on, each server's
    output under ``profile_dir/<backend>``. vLLM's prefix cache is off: the rounds repeat each
    prompt, which would otherwise time vLLM's own hits instead of each method's compute."""
    from ragattn.vllm.serve import LiveServer, free_port, serve_command

    def start(backend):
        cmd = serve_command(model_dir, free_port(), chunk_dir=chunk_dir, python=python, max_model_len=MAX_MODEL_LEN,
                            shared_pages=backend == "ragattn", prefix_caching=False)
        if profile_dir is not None:
            cmd += ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_with_stack": False,
                                                     "torch_profiler_dir": str(profile_dir / backend)})]
        return LiveServer(cmd, workdir / f"server-{backend}.log", env={**server_env(threads), **BACKENDS[backend]},
                          timeout_s=timeout_s)

    with ThreadPoolExecutor(len(backends)) as pool:
        futures = {b: pool.submit(start, b) for b in backends}
    servers, errors = {}, []
    for b, fut in futures.items():
        try:
            servers[b] = fut.result()
        except Exception as exc:
            errors.append(exc)
    if errors:
        for s in servers.values():
            s.stop()
        raise errors[0]
    return servers


def profile(servers: dict, model: str, prompt: Prompt, rows: Sequence[tuple], max_tokens: int,
            profile_dir: Path, out: str, log: Callable[[str], None] = print) -> List[str]:
    """Per (method, backend) row: a warm-up answer, then one answer between vLLM's
    ``/start_profile`` and ``/stop_profile``; the worker's operator table (vLLM writes
    ``rank0.profiler_out.txt``) is copied to ``out/profile_<method>_<backend>.txt`` under a line
    giving the answer's timing. Returns the files written."""
    written = []
    for method, backend in rows:
        s = servers[backend]
        body = completion_body(model, prompt.tokens, max_tokens, METHODS[method](prompt.spans))
        stream_completion(s.url, body)
        table = profile_dir / backend / "rank0.profiler_out.txt"
        before = table.stat().st_mtime if table.exists() else 0.0
        for path in ("/start_profile", None, "/stop_profile"):
            if path is None:
                got = stream_completion(s.url, body)
                continue
            with urllib.request.urlopen(urllib.request.Request(s.url + path, data=b"", method="POST"),
                                        timeout=600) as r:
                r.read()
        deadline = time.monotonic() + 300
        while not (table.exists() and table.stat().st_mtime > before) and time.monotonic() < deadline:
            time.sleep(2)
        time.sleep(2)                         # (the table is written in one go; let it finish)
        dest = os.path.join(out, f"profile_{method}_{backend}.txt")
        head = (f"{method}/{backend}: one {got['tokens']}-token answer to a {len(prompt.tokens)}-token prompt, "
                f"TTFT {got['ttft_s'] * 1e3:.0f} ms, decode {got['decode_tok_s'] or 0:.1f} tok/s, load average "
                f"{os.getloadavg()[0]:.2f}; vLLM's torch profiler (worker), operators by self CPU time\n\n")
        with open(dest, "w") as f:
            f.write(head + "\n".join(table.read_text().splitlines()[:45]) + "\n")
        written.append(dest)
        log(f"profiled {method}/{backend}: {dest}")
    return written


def _parse(argv):
    from .__main__ import command_name

    p = argparse.ArgumentParser(prog=command_name("served"), description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="the vLLM environment's python (default: "
                   "RAGATTN_VLLM_PYTHON, else .venv-vllm/bin/python of this checkout)")
    p.add_argument("--sizes", default="1536,3072", help="prompt tokens (at least), comma-separated")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--backends", default="cpu_attn,ragattn", help=f"comma-separated, of {', '.join(BACKENDS)}")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up (medians reported)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (decode speed over them)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every server")
    p.add_argument("--memory-requests", default="1,16", help="after the timed rounds: KV memory of this many "
                   "concurrent Block-Attention requests over the same chunks, at the smallest size (bench."
                   "served_memory), comma-separated; empty: skipped")
    p.add_argument("--start-timeout", type=float, default=900, help="seconds a server may take to be ready")
    p.add_argument("--workdir", default=None, help="model folder, chunk store and server logs (default: a "
                   "temporary folder, removed at the end); an exported model found there is reused")
    p.add_argument("--out", default="bench_results/served")
    p.add_argument("--profile", action="store_true", help="instead of the timed rounds: one answer per row "
                   "at the largest size under vLLM's torch profiler, its operator table written to "
                   "OUT/profile_<method>_<backend>.txt")
    p.add_argument("--dry-run", action="store_true", help="build the prompts and print the requests and the "
                   "server commands; start nothing")
    a = p.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s.strip()]
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    a.memory_requests = [int(n) for n in a.memory_requests.split(",") if n.strip()]
    a.methods = [label(m) if registry.find(m) and label(m) in METHODS else m for m in a.methods]
    for what, got, known in (("--methods", a.methods, METHODS), ("--backends", a.backends, BACKENDS)):
        bad = [x for x in got if x not in known]
        if bad or not got:
            p.error(f"{what}: unknown or empty {bad or got}; choose from {', '.join(known)}")
    if not a.sizes or min(a.sizes) < 1 or a.repeats < 1 or a.max_tokens < 1 or a.threads < 1 or \
            min(a.memory_requests, default=1) < 1:
        p.error("--sizes, --repeats, --max-tokens, --threads and --memory-requests must be positive")
    a.vllm_python = a.vllm_python or default_vllm_python()
    if a.vllm_python is None and not a.dry_run:
        p.error("no vLLM environment: give --vllm-python (or set RAGATTN_VLLM_PYTHON)")
    return a


def run(a, argv_text: str) -> int:
    from transformers import AutoTokenizer

    from ragattn.vllm.checkpoint import export_smollm2

    rows = [(m, b) for m in a.methods for b in a.backends if b == "ragattn" or m not in RAGATTN_ONLY]
    if BASELINE not in rows and not a.profile:     # every timed row is compared with vLLM's full prefill
        rows.insert(0, BASELINE)
    backends = list(dict.fromkeys(b for _, b in rows))
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="ragattn-served-")
    workdir = Path(a.workdir or tmp.name)
    try:
        model_dir = export_smollm2(workdir / "model")
        prompts = build_prompts(AutoTokenizer.from_pretrained(str(model_dir)), a.sizes)
        longest = max(len(p.tokens) for p in prompts) + a.max_tokens
        if longest > MAX_MODEL_LEN:
            raise SystemExit(f"bench.served: a prompt and its answer take {longest} tokens, over the servers' "
                             f"--max-model-len {MAX_MODEL_LEN}")
        if a.dry_run:
            from ragattn.vllm.serve import serve_command

            for p in prompts:
                for method, backend in rows:
                    body = completion_body(str(model_dir), p.tokens, a.max_tokens, METHODS[method](p.spans))
                    print(json.dumps({"size": p.size, "prompt_tokens": len(p.tokens), "method": method,
                                      "backend": backend, "kv_transfer_params": body.get("kv_transfer_params")}))
            for b in backends:
                cmd = serve_command(model_dir, 0, chunk_dir=workdir / "kv", python=a.vllm_python or "PYTHON",
                                    max_model_len=MAX_MODEL_LEN, shared_pages=b == "ragattn", prefix_caching=False)
                env = {**server_env(a.threads), **BACKENDS[b]}
                print(f"{b}: " + " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(cmd))
            return 0
        commit = project_commit()     # the code that runs (read before the minutes of measuring)
        t0 = time.perf_counter()
        stats = build_store(model_dir, prompts, workdir / "kv")
        print(f"bench.served: chunk store built in {time.perf_counter() - t0:.0f} s ({stats})", file=sys.stderr)
        load_before = os.getloadavg()
        profile_dir = workdir / "profile" if a.profile else None
        servers = start_servers(a.vllm_python, model_dir, workdir / "kv", backends, workdir, a.threads,
                                a.start_timeout, profile_dir)
        if a.profile:
            try:
                os.makedirs(a.out, exist_ok=True)
                profile(servers, str(model_dir), prompts[-1], rows, a.max_tokens, profile_dir, a.out,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
            finally:
                for s in servers.values():
                    s.stop()
            return 0
        try:
            urls = {b: s.url for b, s in servers.items()}
            results = measure(urls, str(model_dir), prompts, rows, a.repeats, a.max_tokens,
                              log=lambda s: print(s, file=sys.stderr, flush=True))
            memory = measure_memory(servers, str(model_dir), model_dir, prompts[0], a.memory_requests,
                                    log=lambda s: print(s, file=sys.stderr, flush=True))
        finally:
            for s in servers.values():
                s.stop()
        vllm_version = subprocess.run([a.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                                      capture_output=True, text=True, timeout=300).stdout.strip() or "unknown"
        write_report(a, argv_text, results, memory=memory, meta=dict(
            commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            vllm=vllm_version, cpu=_cpu_name(), load_before=load_before, load_after=os.getloadavg(),
            store=stats, start_s={b: round(s.start_s, 1) for b, s in servers.items()}))
        return 0
    finally:
        if tmp is not None:
            tmp.cleanup()


def _cpu_name() -> str:
    from .provenance import device_name

    import torch

    return device_name(torch.device("cpu"))


def write_report(a, argv_text: str, rows: List[dict], meta: dict, memory: Sequence[dict] = ()) -> None:
    os.makedirs(a.out, exist_ok=True)
    load = lambda x: " / ".join(f"{v:.2f}" for v in x)   # noqa: E731
    header = (
        "# Served RAG requests: time to first token and decode speed (live vLLM server, CPU)\n\n"
        f"- command: `{argv_text}`\n"
        f"- commit {meta['commit']}, {meta['date']}; vLLM {meta['vllm']}; {meta['cpu']}\n"
        f"- SmolLM2-135M-Instruct, float32, eager, `--max-model-len {MAX_MODEL_LEN}`, the ragattn connector on "
        f"every server; `OMP_NUM_THREADS={a.threads}`, `VLLM_CPU_OMP_THREADS_BIND=nobind`; both servers up at once\n"
        f"- streamed `/v1/completions`, greedy, {a.max_tokens} tokens an answer (`ignore_eos`); medians of "
        f"{a.repeats} interleaved rounds after one warm-up request per row and size (Block-Attention's chunks then "
        "come from the worker's memory)\n"
        f"- load average (1 / 5 / 15 min): {load(meta['load_before'])} before the servers started, "
        f"{load(meta['load_after'])} after the last request; the table's column is the mean of the 1-minute "
        "figure at the row's requests\n\n")
    body = format_table(rows) + "\n\nTargets:\n\n" + format_targets(rows, memory) + "\n"
    if memory:
        body += ("\nKV memory of concurrent requests over the same chunks (vLLM's `/metrics` while all of them "
                 "decode; ragattn's server holds shared chunk pages and FusionRAG's recomputed rows in each "
                 "request's own blocks, vLLM's backend copies the chunks; held by the requests: the blocks in use "
                 "less other prompts' idle chunk pages, which the pool frees on demand):\n\n"
                 + format_memory(memory))
    title = f"SmolLM2 float32 served by vLLM {meta['vllm']} on the CPU, OMP_NUM_THREADS={a.threads}"
    drawn = plot(rows, os.path.join(a.out, "served.png"), title)
    body += "\n![TTFT and decode speed](served.png)\n" if drawn else \
        "\n(no plot: matplotlib is not installed in the environment that ran the benchmark)\n"
    with open(os.path.join(a.out, "served.md"), "w") as f:
        f.write(header + body)
    with open(os.path.join(a.out, "served.json"), "w") as f:
        json.dump({"meta": {**meta, "command": argv_text, "threads": a.threads, "max_tokens": a.max_tokens,
                            "repeats": a.repeats}, "rows": rows,
                   "memory": list(memory),
                   "targets": [dict(target=t, met=m, evidence=e) for t, m, e in targets(rows, memory)]}, f, indent=1)
    print(header + body)
    print(f"saved {a.out}/served.md, served.json" + (", served.png" if drawn else ""), file=sys.stderr)


def main(argv=None) -> int:
    args = _parse(argv)
    text = "python -m bench.served " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    return run(args, text.strip())


if __name__ == "__main__":
    sys.exit(main())
