"""KV memory of concurrent Block-Attention and FusionRAG requests over the same chunks, on live
servers (``python -m bench.served --memory-requests 1,4,16``): vLLM's own KV cache usage
(``/metrics``) while every request decodes, on vLLM's backend (each request copies its chunks into
its own blocks; Block-Attention only) and on ragattn's with shared chunk pages (one copy of each
chunk, read by all; FusionRAG's recomputed rows held in each request's own blocks), against the
two bounds: one copy of the chunk pages plus each request's own pages (FusionRAG: with the blocks
of its recomputed rows), and a copy per request.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

from .served_methods import METHODS as PARAMS, RAGATTN_ONLY, RECOMPUTE_RATIO, label

NEW_TOKENS = 16     # each request's answer (ignore_eos), the usage read after its 4th token
METHODS = tuple(label(m) for m in ("block-attention", "fusionrag"))   # FusionRAG: ragattn's server only


def block_bytes(model_dir: Path, block_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV cache block over every layer (K and V)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * dtype_bytes * block_size


def held_by_requests(used: int, before: int, pages: int) -> int:
    """KV blocks the requests hold: ``used`` while they decode, less the idle chunk pages of other
    prompts (those of ``before`` beyond the prompt's own ``pages``, which stay counted once)."""
    return used - max(0, before - pages)


def measure_memory(servers: Dict[str, object], model: str, model_dir: Path, prompt, counts: Sequence[int],
                   log=print, methods: Sequence[str] = METHODS) -> List[dict]:
    """One row per (backend, method, count): ``count`` identical requests of ``prompt`` (a
    ``bench.served.Prompt``) at once; KV blocks in use while all of them decode, and before. On the
    shared-pages server the blocks in use before are chunk pages the pool keeps idle (freed on
    demand, least recently used): those beyond ``prompt``'s own chunk pages belong to other prompts
    and are not the requests' (``held``: the blocks in use less those), the prompt's are counted
    once (its timed rounds left them held)."""
    from ragattn.methods.selection import budget

    rows = []
    end = prompt.spans[-1][1]
    for backend, server in servers.items():
        for method in methods:
            if method in RAGATTN_ONLY and backend != "ragattn":
                continue
            for n in counts:
                before, _, bs = server.kv_cache_blocks()
                body = {"model": model, "prompt": list(prompt.tokens), "max_tokens": NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True, "kv_transfer_params": PARAMS[method](prompt.spans)}
                used, answers = server.kv_blocks_while_decoding([body] * n)
                if any(a != answers[0] for a in answers):
                    raise RuntimeError(f"bench.served: {n} identical requests answered differently on {backend}")
                own = n * (-(-(len(prompt.tokens) + NEW_TOKENS) // bs) - end // bs)
                if method == "fusionrag":   # the blocks of each request's recomputed rows
                    own += n * -(-budget(RECOMPUTE_RATIO, end - prompt.spans[0][1]) // bs)
                pages = sum(-(-(e - s) // bs) for s, e in prompt.spans)
                copies = n * -(-(len(prompt.tokens) + NEW_TOKENS) // bs)
                held = held_by_requests(used, before, pages)
                mib = block_bytes(model_dir, bs) / 2 ** 20
                row = dict(backend=backend, method=method, requests=n, prompt_tokens=len(prompt.tokens), blocks=used,
                           blocks_before=before, held_blocks=held, block_tokens=bs, mib=round(held * mib, 1),
                           shared_bound_blocks=pages + own, copies_blocks=copies,
                           vs_shared_bound=round(held / (pages + own), 2), vs_copies=round(held / copies, 2))
                log(f"bench.served: memory {backend} {method} x{n}: {used} blocks in use, {held} held by the "
                    f"requests ({row['mib']} MiB), {row['vs_shared_bound']}x chunks once + own pages, "
                    f"{row['vs_copies']}x a copy each")
                rows.append(row)
    return rows


def format_memory(rows: List[dict]) -> str:
    head = ("| backend | method | concurrent requests | prompt tokens | KV blocks in use (before) | held by the "
            "requests | MiB held | vs chunk pages once + own pages | vs a copy per request |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(f"| {r['backend']} | {r.get('method', 'block_attention')} | {r['requests']} | "
                          f"{r['prompt_tokens']} | {r['blocks']} ({r.get('blocks_before', '-')}) | "
                          f"{r.get('held_blocks', r['blocks'])} | {r['mib']} | {r['vs_shared_bound']}x | "
                          f"{r['vs_copies']}x |\n" for r in rows)


def memory_target(rows: List[dict]) -> tuple:
    """The served target: ragattn's backend (shared chunk pages), the most concurrent requests of
    each method, at most 1.2x one copy of the chunk pages plus the requests' own pages."""
    mine = [r for r in rows if r["backend"] == "ragattn"]
    text = "shared chunk pages: concurrent requests over the same chunks hold <= 1.2x the chunk pages once plus their own"
    if not mine:
        return text, None, "not measured"
    tops = []
    for method in dict.fromkeys(r.get("method", "block_attention") for r in mine):
        of = [r for r in mine if r.get("method", "block_attention") == method]
        tops.append((method, max(of, key=lambda r: r["requests"])))
    met = all(top["vs_shared_bound"] <= 1.2 for _, top in tops)
    return text, met, ", ".join(f"{m}, {top['requests']} requests: {top['vs_shared_bound']}x" for m, top in tops)
