"""Benchmarks of the chunk store's request path: what every cached method pays before
its final-block prefill, with every chunk already in memory.

  add_hit          ``store.add(chunks)`` of chunks already stored (token checks and key hashes)
  assemble         ``store.assemble(keys)``: a fresh paged request cache, one ``copy_kv_`` per
                   pool slab (one here) gathering and re-rotating the chunks' K/V
  add_assemble     both, as ``ragattn.methods`` call them
  request          ``store.request(keys, extra_slots=64)`` and its release: a zero-copy request
                   (page table of the chunks' pool pages + private pages; no K/V moved)

cpu: SmolLM2-135M's KV shape (30 layers x 3 KV heads x 64 dims, fp32), 16 chunks of 34..46
tokens, on a random model of that shape (the model never runs on this path).
gpu: 32 layers x 8 KV heads x 128 dims, bf16, 16 chunks of about 512 tokens.
``bytes`` = K and V rows read from the pool + written to the request (all layers).
"""
from __future__ import annotations

import torch

from .harness import Case, lazy, small_dtype

FAMILIES = ("chunk_store",)


def cases(device: torch.device, size: str):
    """The cases, not built yet (they share one set of inputs, made when measured)."""
    return [lazy("chunk_store", "", _build, device, size)]


def _build(device: torch.device, size: str):
    from ragattn.hf.models import random_llama
    from ragattn.store import ChunkStore

    if size == "gpu":
        L, Hkv, D, n_lo, n_hi, dtype = 32, 8, 128, 480, 544, torch.bfloat16
    else:
        L, Hkv, D, n_lo, n_hi, dtype = 30, 3, 64, 34, 47, small_dtype(device)
    # a thin model with that KV shape (hidden 16 x heads, no GQA): it never runs here, only its config does
    cfg = dict(hidden_size=16 * Hkv, intermediate_size=64, num_hidden_layers=L, num_attention_heads=Hkv,
               num_key_value_heads=Hkv, head_dim=D, vocab_size=1000, max_position_embeddings=32768,
               rope_theta=100000.0)
    model = random_llama(cfg, dtype=dtype, seed=0).to(device)
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(n_lo, n_hi, (16,), generator=gen).tolist()
    chunks = [torch.randint(10, 1000, (n,), generator=gen).tolist() for n in lens]
    store = ChunkStore(model)
    keys = store.add(chunks)
    moved = 2 * 2 * L * sum(lens) * Hkv * D * dtype.itemsize   # K+V, read + written
    params = dict(chunks=len(chunks), tokens=sum(lens), layers=L, kv_heads=Hkv, head_dim=D,
                  dtype=str(dtype).replace("torch.", ""))
    return [
        Case("chunk_store", "add_hit", lambda: store.add(chunks), params=params),
        Case("chunk_store", "assemble", lambda: store.assemble(keys, extra_slots=64), bytes=moved,
             params=params),
        Case("chunk_store", "add_assemble", lambda: store.assemble(store.add(chunks), extra_slots=64),
             bytes=moved, params=params),
        Case("chunk_store", "request", lambda: store.request(keys, extra_slots=64).release(), params=params),
    ]
