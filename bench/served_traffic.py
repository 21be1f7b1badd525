"""Sustained RAG traffic through a live vLLM server's chunk store: hit rate, TTFT and memory over time.

    python -m bench.served_traffic --vllm-python .venv-vllm/bin/python [--requests 120] [--passages 4]
        [--budget-fraction 0.25] [--zipf 1.1] [--tiers disk,remote] [--window 20] [--probe-every 4]
        [--threads 1] [--out docs/perf/cpu-served-traffic]
    python -m bench.served_traffic --dry-run      # the stream, request bodies and server commands; no server

The served twin of ``bench.traffic`` (which runs the same stream in process): the same Zipf stream of
Block-Attention requests (``--passages`` passages of the shipped eval corpus each, popularity
``--zipf``, a question drawn uniformly) goes over HTTP to vLLM serving SmolLM2 with the ragattn
connector, one server per tier in ``--tiers``, each with a chunk store whose host-memory budget
(``memory_budget``) is ``--budget-fraction`` of the corpus's chunk K/V, so the worker's store fills
and evicts: ``disk``, its directory (built offline from the exported checkpoint, as ``build-store``
does); ``remote``, a redis-server on 127.0.0.1 that the offline build published to (the server's
directory is empty). Beside it runs a ``warm`` server whose budget holds the whole corpus (every
chunk brought into memory before the stream): every ``--probe-every``-th request is sent to it
twice right after, once as full prefill (no ``kv_transfer_params``) and once as Block-Attention,
under the same load. vLLM's prefix cache is off on every server: the stream repeats passages, and
the rows measure the chunk store's tiers, not vLLM's own prefix hits.

Per request: the time to the first streamed token (one-token answers) and, from the tier server's
``/metrics`` (``vllm:ragattn_*_total``, read after each request), where its chunk spans came from:
the worker store's memory, its directory or the remote tier, or not reused (``chunks_missed``:
answered by full attention). Per window: hit shares, TTFT p50/p99 and the server's resident memory
(its process tree). The target, as in ``bench.traffic``: the reuse speed-up over the second half of
the stream stays within 20% of the warm one. Writes ``served_traffic.json``, ``.md`` and ``.png``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from .provenance import project_commit
from .traffic import (SECRET, TARGET_FRACTION, add_stream_arguments, check_stream_arguments, memory_budget,
                      start_redis, summary, windows, zipf_stream)

TIERS = ("disk", "remote")
MAX_MODEL_LEN = 4096
STORE_COUNTERS = ("chunks_hit", "chunks_missed", "store_disk_loads", "store_remote_hits", "load_seconds")


def read_counters(url: str) -> Dict[str, float]:
    """ragattn's counters in the server's ``/metrics`` (``vllm:ragattn_<key>_total``, summed over
    engines), for the keys of :data:`STORE_COUNTERS`."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = dict.fromkeys(STORE_COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"vllm:ragattn_(\w+)_total(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def sources(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, int]:
    """Where one request's chunk spans came from: the store's memory, its directory, the remote
    tier, or nowhere (``recompute``: not reused, computed by vLLM with full attention)."""
    d = {k: int(round(after[k] - before[k])) for k in STORE_COUNTERS if k != "load_seconds"}
    disk, remote = d["store_disk_loads"], d["store_remote_hits"]
    return dict(memory=max(d["chunks_hit"] - disk - remote, 0), disk=disk, remote=remote, recompute=d["chunks_missed"])


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` and its descendants (Linux ``/proc``; 0 elsewhere)."""
    total, todo, page = 0, [pid], os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError, IndexError):
            continue
    return total


def request_body(model: str, prompt, spans=None) -> dict:
    """A streamed one-token greedy request; Block-Attention's ``kv_transfer_params`` when ``spans``."""
    from .served import completion_body
    from .served_methods import METHODS

    return completion_body(model, prompt.tokens, 1, None if spans is None else METHODS["block_attention"](spans))


def build_requests(tok, stream: Sequence[Sequence[int]], q_of: Sequence[int], texts: List[str], questions: List[str]):
    """A :class:`bench.served.Prompt` per request of ``stream`` (passage indices) and ``q_of``."""
    from .served import rag_prompt

    return [rag_prompt(tok, [texts[j] for j in ids], questions[qi]) for ids, qi in zip(stream, q_of)]


def build_store(model_dir: Path, chunk_dir: Path, parts: List[List[int]], url: Optional[str]) -> dict:
    """Every distinct head and passage of the stream into ``chunk_dir`` (and the remote tier at
    ``url``), by the HF path from the served folder; returns its size."""
    import torch
    from transformers import AutoModelForCausalLM

    from ragattn.store import ChunkStore

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    store = ChunkStore(model, chunk_dir, remote=url, remote_secret=SECRET if url else None)
    t0 = time.perf_counter()
    keys = store.add(parts)
    tokens = sum(store.tokens(k).numel() for k in keys)
    return dict(chunks=len(keys), tokens=tokens, kv_bytes=tokens * store.row_bytes, row_bytes=store.row_bytes,
                page_rows=store.page_size, build_s=time.perf_counter() - t0)


def start_server(python: str, model_dir: Path, chunk_dir: Path, name: str, workdir: Path, threads: int,
                 timeout_s: float, options: dict):
    from ragattn.vllm.serve import LiveServer, free_port, serve_command

    from .served import server_env

    cmd = serve_command(model_dir, free_port(), chunk_dir=chunk_dir, python=python, max_model_len=MAX_MODEL_LEN,
                        prefix_caching=False, connector_options=options)
    env = {**server_env(threads), "RAGATTN_VLLM_ATTENTION": "0", "RAGATTN_REMOTE_SECRET": SECRET,
           "VLLM_CPU_KVCACHE_SPACE": "1"}      # GiB: one short request at a time
    return LiveServer(cmd, workdir / f"server-{name}.log", env=env, timeout_s=timeout_s)


def run_stream(tier: str, server, warm, model: str, prompts, every: int, log) -> List[dict]:
    """Every request of the stream through ``server`` (one row each, ``bench.traffic``'s fields);
    every ``every``-th also to ``warm`` as full prefill and as Block-Attention, right after."""
    from .served import stream_completion

    rows, t0 = [], time.perf_counter()
    counters = read_counters(server.url)
    for i, p in enumerate(prompts):
        got = stream_completion(server.url, request_body(model, p, p.spans))
        after = read_counters(server.url)
        src = sources(counters, after)
        counters = after
        row = dict(tier=tier, i=i, t_s=time.perf_counter() - t0, ttft_s=got["ttft_s"], prompt_len=len(p.tokens),
                   **{f"from_{k}": v for k, v in src.items()}, resident_bytes=0,
                   rss_bytes=tree_rss_bytes(server.proc.pid))
        if every and i % every == every // 2:
            full = stream_completion(warm.url, request_body(model, p))
            w = stream_completion(warm.url, request_body(model, p, p.spans))
            row.update(full_s=full["ttft_s"], warm_s=w["ttft_s"], agrees=full["text"] == got["text"],
                       warm_same=w["text"] == got["text"])
        rows.append(row)
        if (i + 1) % 10 == 0:
            log(f"bench.served_traffic: {tier}: {i + 1}/{len(prompts)} requests, "
                f"last TTFT {got['ttft_s'] * 1e3:.0f} ms")
    return rows


def run(a, argv_text: str) -> dict:
    from transformers import AutoTokenizer

    from ragattn.apps.corpus import EVAL_CORPUS, load_corpus
    from ragattn.vllm.checkpoint import export_smollm2

    from .served import stream_completion

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    corpus = load_corpus(a.corpus or EVAL_CORPUS)
    texts = [p.render() for p in corpus.passages][:a.max_passages or None]
    questions = [q.question for q in corpus.questions]
    stream = zipf_stream(len(texts), a.requests, a.passages, a.zipf, a.seed)
    q_of = np.random.default_rng(a.seed + 1).integers(0, len(questions), a.requests).tolist()
    tmp = None if a.workdir else tempfile.TemporaryDirectory(prefix="ragattn-served-traffic-")
    workdir = Path(a.workdir or tmp.name)
    redis = None
    try:
        model_dir = export_smollm2(workdir / "model")
        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = build_requests(tok, stream, q_of, texts, questions)
        from ragattn.methods.prompt import prompt_parts

        head, every_chunk, _ = prompt_parts(tok, texts, questions[0])
        parts = [head] + every_chunk                              # the corpus: its passages and the head
        if a.dry_run:
            for p in prompts[:3]:
                params = request_body(str(model_dir), p, p.spans)["kv_transfer_params"]
                print(json.dumps({"prompt_tokens": len(p.tokens), "spans": p.spans, "kv_transfer_params": params}))
            from ragattn.vllm.serve import serve_command

            for t in ("warm", *a.tiers):
                print(f"{t}: " + shlex.join(serve_command(model_dir, 0, chunk_dir=workdir / t, python=a.vllm_python
                                                          or "PYTHON", max_model_len=MAX_MODEL_LEN,
                                                          prefix_caching=False,
                                                          connector_options={"memory_budget": 1})))
            return {}
        commit = project_commit()
        url = None
        if "remote" in a.tiers:
            redis, url = start_redis()
            if redis is None:
                raise SystemExit(f"bench.served_traffic: --tiers remote needs a redis-server: {url}")
        built = build_store(model_dir, workdir / "kv", parts, url)
        log(f"bench.served_traffic: chunk store built: {built}")
        budget = memory_budget(built["kv_bytes"], a.budget_fraction, [len(c) for c in every_chunk], a.passages,
                               [len(head)], built["page_rows"], built["row_bytes"])
        meta = dict(commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                    load_before=list(os.getloadavg()), threads=a.threads, command=argv_text,
                    corpus_passages=len(texts), corpus_tokens=built["tokens"], corpus_kv_bytes=built["kv_bytes"],
                    memory_budget=budget, build_s=built["build_s"], skipped={},
                    model="SmolLM2-135M-Instruct float32 (vLLM, ragattn connector)")
        warm = start_server(a.vllm_python, model_dir, workdir / "kv", "warm", workdir, a.threads, a.start_timeout,
                            {"memory_budget": 4 * built["kv_bytes"]})
        tiers, start_s = {}, {}
        try:
            for p in prompts:                # every chunk of the stream into the warm server's memory
                stream_completion(warm.url, request_body(str(model_dir), p, p.spans))
            for tier in a.tiers:
                empty = workdir / f"empty-{tier}"
                empty.mkdir()
                opts = {"memory_budget": budget, **({"remote": url} if tier == "remote" else {})}
                server = start_server(a.vllm_python, model_dir, workdir / "kv" if tier == "disk" else empty, tier,
                                      workdir, a.threads, a.start_timeout, opts)
                start_s[tier] = round(server.start_s, 1)
                try:
                    rows = run_stream(tier, server, warm, str(model_dir), prompts, a.probe_every, log)
                finally:
                    server.stop()
                summ = summary(rows)
                tiers[tier] = dict(rows=rows, windows=windows(rows, a.window, summ["full_p50_ms"] / 1e3), **summ)
                log(f"bench.served_traffic: {tier}: sustained {summ['sustained_speedup']:.2f}x, warm "
                    f"{summ['warm_speedup']:.2f}x: {summ['ratio_to_warm']:.0%}")
        finally:
            warm.stop()
        meta.update(load_after=list(os.getloadavg()), start_s=start_s)
        result = dict(meta=meta, args={k: v for k, v in vars(a).items()}, tiers=tiers, target_fraction=TARGET_FRACTION)
        from .traffic_report import write_served_report

        write_served_report(a.out, result)
        return result
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
        if tmp is not None:
            tmp.cleanup()


def _parse(argv):
    from .served import default_vllm_python

    p = argparse.ArgumentParser(prog="python -m bench.served_traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", default=None, help="python of the vLLM environment (default: .venv-vllm's)")
    add_stream_arguments(p, 120, 20, TIERS,
                         "every N-th request is also answered by the warm server: full prefill and Block-Attention",
                         probe_every=4)     # a warm p50 of a dozen probes or more: the target's denominator
    p.add_argument("--threads", type=int, default=1, help="OpenMP threads of each server")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a server may take to start")
    p.add_argument("--out", default="docs/perf/cpu-served-traffic")
    p.add_argument("--workdir", default=None, help="keep the model, store and server logs here (default: a temporary "
                                                   "folder, removed)")
    p.add_argument("--dry-run", action="store_true", help="print the first requests and the server commands")
    a = p.parse_args(argv)
    check_stream_arguments(p, a, TIERS)
    if a.requests < 2 * a.probe_every:
        p.error("--requests must be at least twice --probe-every (the second half needs a probe)")
    a.vllm_python = a.vllm_python or default_vllm_python()
    if not a.dry_run and not a.vllm_python:
        p.error("--vllm-python: no vLLM environment found (bash scripts/setup_vllm.sh)")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))    # unwinds: servers, redis and the work folder go
    text = "python -m bench.served_traffic " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    run(a, text.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
