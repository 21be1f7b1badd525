"""Sustained RAG traffic through the chunk store's tiers: hit rate, TTFT and memory over time.

    python -m bench.traffic [--requests 150] [--passages 4] [--budget-fraction 0.25] [--zipf 1.1]
        [--tiers disk,remote,recompute] [--window 25] [--probe-every 8] [--threads 1]
        [--out docs/perf/cpu-traffic]
    python -m bench.traffic --dry-run      # a tiny random model, a dozen requests: seconds

In process, on the HF path: SmolLM2-135M-Instruct (float32, CPU) answers Block-Attention requests
(``ragattn.methods.registry``, ``m.answer``, one token: the TTFT) over the shipped QA corpus
(``ragattn/data/qa``, 36 passages; ``--corpus ragattn/data/qa_eval`` for the 103 of the eval set).
Each request is ``--passages`` distinct passages drawn by a Zipf law of exponent ``--zipf`` over a
fixed random ranking of the corpus (popular passages recur, as in real traffic) and a question drawn
uniformly. The corpus's chunk K/V is first built offline into a
directory and a redis-server on 127.0.0.1 (``python -m ragattn build-store`` does the same); then,
per tier in ``--tiers``, the same stream runs from a cold store whose memory budget is
``--budget-fraction`` of the corpus's chunk K/V, so it fills and then evicts, and a miss is served
by that tier: ``disk`` (the directory), ``remote`` (the redis-server, no directory), ``recompute``
(no tier: evicted chunks prefilled again). ``remote`` is skipped, saying so, without redis-server.

Baselines, interleaved with the stream so that they see the same load (this machine is shared):
every ``--probe-every``-th request is answered again by full prefill (``full-prefill``, the same
tokens) and from a warm store (every chunk of the corpus in memory). Per window of ``--window``
requests: the share of chunks served by memory and by the tier, TTFT p50/p99, the store's resident
K/V bytes and the process's resident memory. The target: the reuse speed-up (full prefill p50 /
TTFT p50) over the second half of the stream, after the store has filled and evicted, stays within
20% of the warm speed-up (full prefill p50 / warm p50) of the same half's probes. Also measured:
what a chunk costs from each source by length (``TierCosts.measure``),
and the seconds spent per source during the stream (``ChunkStore.stats``). Writes
``traffic.json``, ``traffic.md`` and ``traffic.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .provenance import project_commit
from .traffic_report import write_report

TIERS = ("disk", "remote", "recompute")
SECRET = "bench-traffic-secret-0123456789"
TARGET_FRACTION = 0.8     # sustained speed-up >= 80% of the warm one


def zipf_stream(n_items: int, n_requests: int, per_request: int, exponent: float, seed: int) -> List[List[int]]:
    """``n_requests`` lists of ``per_request`` distinct item indices in ``[0, n_items)``, each
    drawn with probability ``~ 1 / rank ** exponent`` over a seeded random ranking of the items."""
    if not 1 <= per_request <= n_items:
        raise ValueError(f"bench.traffic: --passages must be in [1, {n_items}], got {per_request}")
    rng = np.random.default_rng(seed)
    ranking = rng.permutation(n_items)
    p = 1.0 / np.arange(1, n_items + 1) ** exponent
    p /= p.sum()
    return [ranking[rng.choice(n_items, per_request, replace=False, p=p)].tolist() for _ in range(n_requests)]


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else float("nan")


def memory_budget(corpus_bytes: int, fraction: float, chunk_lens: Sequence[int], passages: int,
                  extra_lens: Sequence[int], page_rows: int, row_bytes: int) -> int:
    """The store's memory budget: ``fraction`` of the corpus's chunk K/V, but at least one request:
    its ``passages`` longest chunks and ``extra_lens`` (the head, the question's own rows), each
    rounded up to pages of ``page_rows`` rows of ``row_bytes``."""
    from ragattn.ops.page_table import num_pages

    widest = sorted(chunk_lens, reverse=True)[:passages] + list(extra_lens)
    floor = sum(num_pages(n, page_rows) for n in widest) * page_rows * row_bytes
    return max(int(corpus_bytes * fraction), floor)


def add_stream_arguments(p: argparse.ArgumentParser, requests: int, window: int, tiers: Sequence[str],
                         probe_help: str, probe_every: int = 8) -> None:
    """The stream's options (bench.traffic and bench.served_traffic): its requests, their passages
    and popularity, the memory budget, the tiers, the windows, the probes, the corpus."""
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--passages", type=int, default=4, help="passages a request")
    p.add_argument("--budget-fraction", type=float, default=0.25, help="memory budget / the corpus's chunk K/V")
    p.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of passage popularity")
    p.add_argument("--tiers", default=",".join(tiers), help=f"comma-separated, of {', '.join(tiers)}")
    p.add_argument("--window", type=int, default=window, help="requests per reported window")
    p.add_argument("--probe-every", type=int, default=probe_every, help=probe_help + " (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", default=None, help="a corpus folder (default: the shipped eval set)")
    p.add_argument("--max-passages", type=int, default=0, help="use the corpus's first N passages (0: all)")


def check_stream_arguments(p: argparse.ArgumentParser, a, tiers: Sequence[str]) -> None:
    """``--tiers`` parsed into a list of known tiers and ``--budget-fraction`` in (0, 1], or ``p.error``."""
    a.tiers = [t.strip() for t in a.tiers.split(",") if t.strip()]
    bad = [t for t in a.tiers if t not in tiers]
    if bad or not a.tiers:
        p.error(f"--tiers: unknown {bad}; choose among {', '.join(tiers)}")
    if not 0 < a.budget_fraction <= 1:
        p.error("--budget-fraction must be in (0, 1]")


def rss_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def load_model(tiny: bool):
    """(model, tokenizer): SmolLM2-135M-Instruct, or with ``tiny`` a 2-layer random Llama over
    SmolLM2's tokenizer (the dry run: timings mean nothing, every path runs)."""
    from ragattn.hf.models import load_smollm2, random_llama

    model, tok = load_smollm2(dtype=torch.float32)
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=4096)
        model = random_llama(shape, dtype=torch.float32, seed=0).eval()
    return model, tok


def start_redis():
    """``(process, url)`` of a redis-server on 127.0.0.1 at a free port without persistence, or
    ``(None, reason)`` when it is not installed."""
    from .remote_tier import _server

    if shutil.which("redis-server") is None and shutil.which("valkey-server") is None:
        return None, "redis-server is not installed (scripts/setup_redis.sh)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return None, "the redis client is not installed (pip install 'ragattn[remote]')"
    return _server()


def _sources(before: dict, after: dict, n_chunks: int) -> Dict[str, int]:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("loaded", "remote_hits", "computed", "recomputed")}
    tier = {"disk": d["loaded"], "remote": d["remote_hits"], "recompute": d["computed"] + d["recomputed"]}
    return {"memory": n_chunks - sum(tier.values()), **tier}


def run_stream(model, tok, method, texts, questions, stream, q_of, store, tier: str, probe, every: int
               ) -> List[dict]:
    """Answer every request of ``stream`` through ``store``; one row per request. Every ``every``-th
    request is also answered by ``probe(chunks, question)`` -> ``(full prefill Answer, warm
    Answer)`` right after, under the same load: its row gets ``full_s`` and ``warm_s``."""
    rows, t0 = [], time.perf_counter()
    for i, (ids, qi) in enumerate(zip(stream, q_of)):
        before = dict(store.stats)
        chunks = [texts[j] for j in ids]
        a = method.answer(model, tok, chunks, questions[qi], max_new_tokens=1, store=store)
        src = _sources(before, store.stats, len(ids) + 1)      # the passages and the prompt's head
        row = dict(tier=tier, i=i, t_s=time.perf_counter() - t0, ttft_s=a.ttft_s, prompt_len=a.prompt_len,
                   **{f"from_{k}": v for k, v in src.items()}, resident_bytes=store.num_rows * store.row_bytes,
                   pool_bytes=store.pool_bytes, rss_bytes=rss_bytes(), load1=os.getloadavg()[0])
        if every and i % every == every // 2:
            f, w = probe(chunks, questions[qi])
            row.update(full_s=f.ttft_s, warm_s=w.ttft_s, agrees=f.tokens == a.tokens, warm_same=w.tokens == a.tokens)
        rows.append(row)
    return rows


def make_probe(model, tok, method, full, warm_store):
    """``probe(chunks, question)`` for :func:`run_stream`: full prefill's answer and the answer
    from ``warm_store`` (every chunk of the corpus in memory; checked)."""
    def probe(chunks, question):
        f = full.answer(model, tok, chunks, question, max_new_tokens=1)
        before = dict(warm_store.stats)
        w = method.answer(model, tok, chunks, question, max_new_tokens=1, store=warm_store)
        got = _sources(before, warm_store.stats, len(chunks) + 1)
        if got["memory"] != len(chunks) + 1:
            raise RuntimeError(f"bench.traffic: the warm store missed chunks: {got}")
        return f, w
    return probe


def summary(rows: List[dict]) -> dict:
    """Over the second half of a stream (the store filled and evicting), against the probes of
    that half: full prefill p50 / TTFT p50 (sustained) and full prefill p50 / warm p50 (warm)."""
    late = rows[len(rows) // 2:]
    probed = [r for r in late if "full_s" in r]
    if not probed:
        raise ValueError("bench.traffic: no probe in the second half of the stream: lower --probe-every")
    full_p50 = statistics.median(r["full_s"] for r in probed)
    warm_p50 = statistics.median(r["warm_s"] for r in probed)
    ttft_p50 = statistics.median(r["ttft_s"] for r in late)
    return dict(probes=len(probed), full_p50_ms=full_p50 * 1e3, warm_p50_ms=warm_p50 * 1e3,
                ttft_p50_ms=ttft_p50 * 1e3, ttft_p99_ms=percentile([r["ttft_s"] for r in late], 99) * 1e3,
                sustained_speedup=full_p50 / ttft_p50, warm_speedup=full_p50 / warm_p50,
                ratio_to_warm=warm_p50 / ttft_p50, met=warm_p50 / ttft_p50 >= TARGET_FRACTION,
                first_token_agrees=sum(r["agrees"] for r in probed), warm_same=sum(r["warm_same"] for r in probed))


def windows(rows: List[dict], size: int, full_p50: float) -> List[dict]:
    out = []
    for w in range(0, len(rows), size):
        part = rows[w:w + size]
        chunks = sum(r["from_memory"] + r["from_disk"] + r["from_remote"] + r["from_recompute"] for r in part)
        ttft = [r["ttft_s"] for r in part]
        p50 = percentile(ttft, 50)
        out.append(dict(tier=part[0]["tier"], first=part[0]["i"], last=part[-1]["i"], t_s=part[-1]["t_s"],
                        memory_hit=sum(r["from_memory"] for r in part) / chunks,
                        tier_hit=sum(r[f"from_{part[0]['tier']}"] for r in part) / chunks,
                        p50_ms=p50 * 1e3, p99_ms=percentile(ttft, 99) * 1e3, speedup=full_p50 / p50,
                        resident_mb=part[-1]["resident_bytes"] / 2**20, rss_mb=part[-1]["rss_bytes"] / 2**20))
    return out


def tier_costs(model, url, lengths: Sequence[int], chunks: int) -> dict:
    """Per source and length, ms per chunk (``TierCosts`` samples) and the fitted lines."""
    from ragattn.store import ChunkStore, TierCosts
    from ragattn.store.cost import measure_samples

    samples = measure_samples(model, lengths, chunks, remote=url, remote_secret=SECRET if url else None)
    fit = TierCosts.fit(samples)
    row = ChunkStore(model, memory_budget=1 << 24).row_bytes
    table = []
    for k, n in enumerate(lengths):
        r = dict(tokens=int(n), bytes=int(n) * row, recompute_ms=samples["recompute"][k][1] * 1e3,
                 disk_ms=samples["disk"][k][1] * 1e3)
        if "remote" in samples:
            r["remote_ms"] = samples["remote"][k][1] * 1e3
        table.append(r)
    cross = {t: fit.crossover_tokens(t, row) for t in ("disk", "remote") if t in samples}
    return dict(rows=table, fit=dict(disk=fit.disk, remote=fit.remote, recompute=fit.recompute),
                crossover_tokens=cross, row_bytes=row)


def breakdown(model, url, tokens: int, repeats: int = 3) -> dict:
    """Milliseconds of each stage of bringing one ``tokens``-token chunk into memory, medians of
    ``repeats``: from disk (read the file: safetensors; verify: the tensors' sha256 and the key;
    the rest of the load: insert into the pool), from the remote tier (get: the manifest and the
    parts over loopback; check: the value's HMAC; decode: safetensors, with no second checksum (the
    HMAC covers it); the rest) and recomputing (the prefill alone; the rest)."""
    import hmac as _hmac

    from safetensors import safe_open
    from safetensors.torch import load as st_load

    from ragattn.store import ChunkStore
    from ragattn.store.disk_tier import _tensor_digest
    from ragattn.store.remote_tier import parse_manifest

    g = torch.Generator().manual_seed(7)
    out: Dict[str, List[float]] = {}

    def note(name, s):
        out.setdefault(name, []).append(s * 1e3)

    with tempfile.TemporaryDirectory() as d:
        for r in range(repeats):
            w = ChunkStore(model, d, remote=url, remote_secret=SECRET if url else None)
            warm, chunk = (torch.randint(1, w.vocab_size or 1000, (tokens,), generator=g) for _ in range(2))
            w.add([warm])                      # each store's first call (connection, kernels) is not timed

            def timed(store, what):
                before = store.stats[what]
                key = store.add([chunk])[0]
                return key, store.stats[what] - before

            key, s = timed(w, "recompute_s")
            note("recompute: total", s)
            path = w.directory / f"{key}.safetensors"
            t0 = time.perf_counter()
            with safe_open(str(path), framework="pt") as f:
                ts = [f.get_tensor(n) for n in ("k", "v", "tokens")]
            t1 = time.perf_counter()
            _tensor_digest(*ts)
            note("disk: read file", t1 - t0)
            note("disk: sha256 of the tensors", time.perf_counter() - t1)
            fresh = ChunkStore(model, d, read_only=True)
            fresh.add([warm])
            note("disk: total", timed(fresh, "disk_s")[1])
            if url:
                rt = w._loader.remote
                t0 = time.perf_counter()
                m = parse_manifest(rt.client.get(rt.manifest_key(key)))
                value = b"".join(rt.client.mget([rt.part_key(key, m.nonce, i) for i in range(m.parts)]))
                t1 = time.perf_counter()
                _hmac.compare_digest(rt._mac(key, value), m.mac)
                t2 = time.perf_counter()
                st_load(value)
                t3 = time.perf_counter()
                note("remote: get over loopback", t1 - t0)
                note("remote: HMAC of the value", t2 - t1)
                note("remote: decode (safetensors)", t3 - t2)
                fresh = ChunkStore(model, remote=url, remote_secret=SECRET)
                fresh.add([warm])
                note("remote: total", timed(fresh, "remote_s")[1])
    return {k: statistics.median(v) for k, v in out.items()}


def run(a, argv_text: str) -> dict:
    from ragattn.apps.corpus import load_corpus
    from ragattn.methods import registry
    from ragattn.methods.prompt import prompt_parts
    from ragattn.store import ChunkStore

    torch.set_num_threads(a.threads)
    model, tok = load_model(a.dry_run)
    corpus = load_corpus(a.corpus)
    texts = [p.render() for p in corpus.passages][:a.max_passages or None]
    questions = [q.question for q in corpus.questions]
    method, full = registry.get("block-attention"), registry.get("full-prefill")
    stream = zipf_stream(len(texts), a.requests, a.passages, a.zipf, a.seed)
    q_of = np.random.default_rng(a.seed + 1).integers(0, len(questions), a.requests).tolist()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(commit=project_commit(), date=now,
                load_before=list(os.getloadavg()), torch=torch.__version__, threads=a.threads, command=argv_text)
    redis, url = start_redis() if "remote" in a.tiers else (None, None)
    skipped = {}
    if redis is None and "remote" in a.tiers:
        skipped["remote"] = url
        print(f"bench.traffic: the remote tier is skipped: {url}", file=sys.stderr)
        url = None
    work = tempfile.mkdtemp(prefix="ragattn-traffic-")
    try:
        built = ChunkStore(model, os.path.join(work, "kv"), remote=url, remote_secret=SECRET if url else None)
        t0 = time.perf_counter()
        head, chunk_ids, _ = prompt_parts(tok, texts, questions[0])
        keys = built.add([head, *chunk_ids])          # the offline build (build-store): every chunk, the head
        build_s = time.perf_counter() - t0
        corpus_tokens = sum(built.tokens(k).numel() for k in keys)
        corpus_bytes = corpus_tokens * built.row_bytes
        # a zero-copy request's question has pages of its own: 256 rows cover the eval set's questions
        budget = memory_budget(corpus_bytes, a.budget_fraction, [len(c) for c in chunk_ids], a.passages,
                               [len(head), 256], built.page_size, built.row_bytes)
        del built
        warm_store = ChunkStore(model, os.path.join(work, "kv"), read_only=True, memory_budget=2 * corpus_bytes)
        warm_store.add([head, *chunk_ids])
        probe = make_probe(model, tok, method, full, warm_store)
        tiers = {}
        for tier in [t for t in a.tiers if t not in skipped]:
            opts = dict(memory_budget=budget)
            if tier == "disk":
                opts.update(directory=os.path.join(work, "kv"), read_only=True)
            elif tier == "remote":
                opts.update(remote=url, remote_secret=SECRET)
            store = ChunkStore(model, **opts)
            rows = run_stream(model, tok, method, texts, questions, stream, q_of, store, tier, probe, a.probe_every)
            summ = summary(rows)
            spent = {k: store.stats.get(k, 0) for k in ("disk_s", "remote_s", "recompute_s")}
            tiers[tier] = dict(rows=rows, windows=windows(rows, a.window, summ["full_p50_ms"] / 1e3), **summ,
                               stats=dict(store.stats), spent_s=spent)
            print(f"bench.traffic: {tier}: sustained {summ['sustained_speedup']:.2f}x, warm "
                  f"{summ['warm_speedup']:.2f}x: {summ['ratio_to_warm']:.0%}", file=sys.stderr)
        costs = tier_costs(model, url, a.cost_lengths, a.cost_chunks)
        costs["breakdown"] = breakdown(model, url, a.cost_lengths[len(a.cost_lengths) // 2])
        costs["breakdown_tokens"] = a.cost_lengths[len(a.cost_lengths) // 2]
    finally:
        if redis is not None:
            redis.kill()
            redis.wait()
        shutil.rmtree(work, ignore_errors=True)
    meta.update(load_after=list(os.getloadavg()), corpus_passages=len(texts), corpus_tokens=corpus_tokens,
                corpus_kv_bytes=corpus_bytes, memory_budget=budget, build_s=build_s, skipped=skipped,
                model="random 2-layer (dry run)" if a.dry_run else "SmolLM2-135M-Instruct float32")
    result = dict(meta=meta, args=vars(a), tiers=tiers, costs=costs, target_fraction=TARGET_FRACTION)
    write_report(a.out, result)
    return result


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stream_arguments(p, 150, 25, TIERS, "every N-th request is also answered by full prefill and from a warm store")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cost-lengths", default="32,128,512", help="chunk lengths of the per-source cost table")
    p.add_argument("--cost-chunks", type=int, default=3, help="chunks per length in the cost table")
    p.add_argument("--out", default="docs/perf/cpu-traffic")
    p.add_argument("--dry-run", action="store_true", help="a tiny random model and a dozen requests (seconds)")
    a = p.parse_args(argv)
    check_stream_arguments(p, a, TIERS)
    a.cost_lengths = [int(x) for x in a.cost_lengths.split(",")]
    if a.dry_run:
        a.requests, a.window, a.probe_every, a.max_passages = min(a.requests, 12), min(a.window, 4), 4, 10
        a.cost_lengths, a.cost_chunks = [8, 32], 1
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = _parse(argv)
    # a TERM (timeout, kill) unwinds through run()'s cleanup: the redis-server and the work directory go
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    text = "python -m bench.traffic " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    run(a, text.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
