"""The chunk store's tiers measured: per chunk, the time to serve it from memory, from the disk
tier, from the remote tier (a redis-server started here on 127.0.0.1, loopback) and to recompute
it, and its bytes; plus the Llama-3-8B KV shape's modelled figures.

    python -m ragattn.bench.remote_tier [--model tiny|smollm2] [--chunks 8] [--tokens 256]
    python -m ragattn.bench.remote_tier --ttft [--passages 16] [--repeats 3]

``--ttft``: SmolLM2's time to first token of a cached Block-Attention answer (the demo's corpus,
the first question's prompt with ``--passages`` passages) whose chunks come from each tier: a
warm store's memory, a fresh store over the disk tier, a fresh store over the remote tier, and
no store (every chunk prefilled), medians of ``--repeats`` (each from a fresh store).

``tiny``: a random 2-layer model (seconds); ``smollm2``: SmolLM2-135M (the demo's model) on the
CPU. Llama-3-8B (32 layers x 8 KV heads x 128, bf16: 128 KiB a token) is modelled: its bytes per
chunk over the remote throughput measured here, against its prefill at 2 x 8e9 FLOP a token on
an H100 at 400 TFLOP/s (a modelled figure, not a measurement). Needs redis-server on the PATH
(scripts/setup_redis.sh) and the redis client.
"""
from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

import torch

SECRET = "bench-secret-0123456789"   # the HMAC key of the throwaway server (16 bytes at least)

LLAMA3_8B_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
LLAMA3_8B_FLOP_PER_TOKEN = 2 * 8.0e9
H100_FLOPS = 400e12


def _server():
    exe = shutil.which("redis-server") or shutil.which("valkey-server")
    if exe is None:
        raise SystemExit("bench.remote_tier: redis-server is not installed (scripts/setup_redis.sh)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def _model(name):
    if name == "smollm2":
        from ragattn.apps.demo import load_model

        return load_model("smollm2", torch.device("cpu"), "bench.remote_tier")[0]
    from ragattn.hf.models import random_llama

    return random_llama(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096),
                        dtype=torch.float32, seed=0).eval()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run(model_name="tiny", n_chunks=8, tokens=256) -> list[tuple]:
    from ragattn.store import ChunkStore

    model = _model(model_name)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    chunks = [torch.randint(10, vocab, (tokens,), generator=g).tolist() for _ in range(n_chunks)]
    proc, url = _server()
    secret = SECRET
    try:
        with tempfile.TemporaryDirectory() as d:
            writer = ChunkStore(model, d, remote=url, remote_secret=secret)
            recompute = _timed(lambda: writer.add(chunks))          # computed, written, published
            memory = _timed(lambda: writer.add(chunks))
            disk = ChunkStore(model, d, read_only=True)
            from_disk = _timed(lambda: disk.add(chunks))
            remote = ChunkStore(model, remote=url, remote_secret=secret)
            from_remote = _timed(lambda: remote.add(chunks))
            assert remote.stats["computed"] == 0 and remote.stats["remote_hits"] == n_chunks
            plain = ChunkStore(model)
            compute = _timed(lambda: plain.add(chunks))
            nbytes = writer.row_bytes * tokens
    finally:
        proc.kill()
        proc.wait()
    per = 1e3 / n_chunks
    rows = [("memory hit", memory * per, nbytes), ("disk tier", from_disk * per, nbytes),
            ("remote tier", from_remote * per, nbytes), ("recompute", compute * per, nbytes),
            ("compute + write + publish", recompute * per, nbytes)]
    rate = nbytes * n_chunks / from_remote           # bytes/s fetched, loopback
    llama = LLAMA3_8B_BYTES_PER_TOKEN * tokens
    rows += [("Llama-3-8B remote (modelled)", llama / rate * 1e3, llama),
             ("Llama-3-8B recompute H100 (modelled)", LLAMA3_8B_FLOP_PER_TOKEN * tokens / H100_FLOPS * 1e3, llama)]
    return rows


def ttft(n_passages=16, repeats=3) -> list[tuple]:
    """(source, median TTFT ms, prompt tokens) of a cached Block-Attention answer per chunk source."""
    import statistics

    from ragattn.apps.corpus import load_corpus
    from ragattn.methods.cached_answer import cached_answer
    from ragattn.store import ChunkStore

    from ragattn.hf.models import load_smollm2

    model, tok = load_smollm2(dtype=torch.float32)
    corpus = load_corpus()
    texts = [p.render() for p in corpus.passages[:n_passages]]
    question = corpus.questions[0].question

    def answer(store):
        return cached_answer(model, tok, texts, question, positions="reordered", method="block_attention",
                             max_new_tokens=1, store=store)

    proc, url = _server()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            warm = ChunkStore(model, d, remote=url, remote_secret=SECRET)
            first = answer(warm)                       # computes, writes and publishes every chunk
            sources = [("memory (warm store)", lambda: warm), ("disk tier (fresh store)",
                                                               lambda: ChunkStore(model, d, read_only=True)),
                       ("remote tier (fresh store)", lambda: ChunkStore(model, remote=url, remote_secret=SECRET)),
                       ("recompute (no store)", lambda: ChunkStore(model))]
            for name, make in sources:
                times = []
                for _ in range(repeats):
                    store = make()
                    a = answer(store)
                    assert a.tokens == first.tokens, (name, a.tokens, first.tokens)
                    times.append(a.ttft_s * 1e3)
                rows.append((name, statistics.median(times), first.prompt_len))
    finally:
        proc.kill()
        proc.wait()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m ragattn.bench.remote_tier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--ttft", action="store_true", help="SmolLM2's TTFT of a cached answer per chunk source")
    p.add_argument("--passages", type=int, default=16, help="--ttft: retrieved passages in the prompt")
    p.add_argument("--repeats", type=int, default=3, help="--ttft: runs per source (median)")
    a = p.parse_args(argv)
    if a.ttft:
        rows = ttft(a.passages, a.repeats)
        print(f"| chunks from (SmolLM2, Block-Attention, {rows[0][2]}-token prompt) | TTFT ms (median of {a.repeats}) |")
        print("|---|---:|")
        for name, ms, _ in rows:
            print(f"| {name} | {ms:.0f} |")
        return
    rows = run(a.model, a.chunks, a.tokens)
    print(f"| {a.model}, {a.chunks} chunks of {a.tokens} tokens | ms per chunk | bytes per chunk |")
    print("|---|---:|---:|")
    for name, ms, b in rows:
        print(f"| {name} | {ms:.2f} | {b:,} |")


if __name__ == "__main__":
    main()
