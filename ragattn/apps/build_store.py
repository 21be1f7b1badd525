"""``python -m ragattn build-store``: precompute a corpus's chunk KV store, offline.

    python -m ragattn build-store --corpus DIR --out DIR [--neighbours N] [--shard i/n] [--batch B]
                                  [--model smollm2|CHECKPOINT] [--device cpu|cuda] [--no-progress]
                                  [--remote redis://HOST:PORT/DB] [--untuned]

For every passage of the corpus (rendered and tokenized as the demo and the eval prompt it): its
raw cache (the passage alone) and its fused cache (FusionRAG's offline stage: the passage
prefilled after the prompt head and the raw caches of its ``N`` most similar passages, MiniLM
cosine, default 10 capped by the corpus), both as safetensors files in ``--out`` (see
``ragattn.store``). Resumable: passages whose fused cache is already in ``--out`` are
skipped. Shardable: ``--shard i/n`` builds the passages ``i, i+n, i+2n, ...``, so ``n`` workers can
fill one directory at once (files are written atomically; the neighbour lists are the same
everywhere). ``--remote URL`` also fills a fleet's shared remote tier (a Redis/Valkey server,
:mod:`ragattn.store.remote_tier`; the HMAC key from the ``RAGATTN_REMOTE_SECRET`` environment
variable): every cache computed is published there, and a cache already on the server is fetched
(verified) instead of computed, so a build resumes from the server as from ``--out``.
TurboRAG and Block-Attention read the raw caches of the model with the shipped block-attention
adapter merged (``ragattn.hf.adapters``): those are built too (keyed by that model's weights, in the
same store), unless ``--untuned`` or the adapter does not fit ``--model``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _shard(text: str):
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard must look like i/n, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def parse_args(argv=None) -> argparse.Namespace:
    from ragattn.apps.cli import OneLineParser

    p = OneLineParser(prog="python -m ragattn build-store", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default=None, metavar="DIR", help="corpus folder (default: the shipped one)")
    p.add_argument("--out", required=True, metavar="DIR", help="store directory (created; shared by shards)")
    p.add_argument("--neighbours", type=int, default=10, metavar="N",
                   help="similar passages each fused cache has seen (default 10, capped by the corpus)")
    p.add_argument("--shard", type=_shard, default=(0, 1), metavar="i/n", help="build every n-th passage from i")
    p.add_argument("--batch", type=int, default=8, metavar="B", help="passages per forward (default 8)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default) or a local HF checkpoint folder")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--untuned", action="store_true",
                   help="skip the raw caches of the model with the shipped block-attention adapter "
                        "(TurboRAG / Block-Attention); by default they are built beside FusionRAG's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--remote", default=None, metavar="URL",
                   help="redis:// or rediss:// URL of the fleet's remote tier to fill too "
                        "(HMAC key: RAGATTN_REMOTE_SECRET)")
    args = p.parse_args(argv)
    if args.neighbours < 0:
        p.error("--neighbours must be >= 0")
    if args.batch < 1:
        p.error("--batch must be >= 1")
    return args


def run(args: argparse.Namespace, model_and_tokenizer=None, out=None) -> dict:
    """Build the store; returns a summary dict (also printed to ``out``, default the current
    ``sys.stdout``: read at call time, never bound when the module is imported)."""
    out = sys.stdout if out is None else out
    from tqdm import tqdm

    from ragattn.apps.corpus import load_corpus
    from ragattn.apps.demo import load_model
    from ragattn.methods import fusionrag
    from ragattn.store import ChunkStore, ChunkStoreError
    from ragattn.methods.prompt import prompt_parts
    from ragattn.methods.retrieval import SentenceEncoder

    from ragattn.apps.cli import parse_device, writable_dir

    device = parse_device(args.device)                  # before any work: the device and --out
    writable_dir(args.out, "--out")
    if args.remote and not os.environ.get("RAGATTN_REMOTE_SECRET"):
        raise ChunkStoreError("--remote needs the fleet's HMAC key in the RAGATTN_REMOTE_SECRET environment variable")
    corpus = load_corpus(args.corpus)
    model, tok = model_and_tokenizer or load_model(args.model, device, "build-store")
    head, chunks, _ = prompt_parts(tok, [p.render() for p in corpus.passages], "")
    emb = SentenceEncoder().encode([f"{p.title}. {p.text}" for p in corpus.passages])  # as the retriever
    nbrs = fusionrag.neighbours(emb, args.neighbours)
    i, n = args.shard
    which = list(range(i, len(chunks), n))
    store = ChunkStore(model, directory=args.out, remote=args.remote)
    t0 = time.perf_counter()
    bar = tqdm(total=len(which), desc=f"build-store {i}/{n}", unit="chunk", file=sys.stderr,
               disable=args.no_progress)
    built, skipped = fusionrag.fuse_chunks(model, store, head, chunks, nbrs, which, batch=args.batch,
                                           progress=bar.update)
    bar.update(skipped)
    bar.close()
    tuned = None if args.untuned else _block_tuned_store(model, args)
    if tuned is not None:   # the same passages' raw caches under the block-attention adapter's weights
        tuned.add([head] + [chunks[j] for j in which])
    secs = time.perf_counter() - t0
    summary = dict(passages=len(chunks), shard=f"{i}/{n}", built=built, skipped=skipped,
                   remote={k: v for k, v in store.stats.items() if k.startswith("remote_")} if args.remote else None,
                   neighbours=min(args.neighbours, len(chunks) - 1), seconds=round(secs, 2), out=str(args.out),
                   block_tuned=tuned is not None)
    print(f"build-store: {built} fused caches built, {skipped} already on disk, shard {i}/{n} of "
          f"{len(chunks)} passages, {summary['neighbours']} neighbours each"
          + (", and their raw caches for TurboRAG/Block-Attention under the block-attention adapter" if tuned else "")
          + f", {secs:.1f} s -> {args.out}", file=out)
    return summary


def _block_tuned_store(model, args):
    """The store of the model with the shipped block-attention adapter merged (same directory and
    remote tier: its chunks are keyed by its own weights), or None when the adapter does not fit the
    model (another checkpoint: a warning)."""
    from ragattn.hf.adapters import AdapterMismatch, tuned_model
    from ragattn.store import ChunkStore

    try:
        tuned = tuned_model(model, "block-attention")
    except AdapterMismatch as exc:
        print(f"warning: build-store: {exc}; no block-attention caches built", file=sys.stderr)
        return None
    return ChunkStore(tuned, directory=args.out, remote=args.remote)


def main(argv=None) -> int:
    """One ``error:`` line and exit status 2 for bad arguments, an unusable device, ``--out``,
    corpus or model, and chunk store errors (:func:`ragattn.apps.cli.run_command`)."""
    from ragattn.apps.cli import run_command

    def go():
        run(parse_args(argv))
        return 0

    return run_command(go, "python -m ragattn build-store")
