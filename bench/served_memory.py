"""KV memory of concurrent Block-Attention requests over the same chunks, on live servers
(``python -m bench.served --memory-requests 1,4,16``): vLLM's own KV cache usage (``/metrics``)
while every request decodes, on vLLM's backend (each request copies its chunks into its own
blocks) and on ragattn's with shared chunk pages (one copy of each chunk, read by all), against
the two bounds: one copy of the chunk pages plus each request's own pages, and a copy per request.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence

NEW_TOKENS = 16     # each request's answer (ignore_eos), the usage read after its 4th token


def block_bytes(model_dir: Path, block_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of one KV cache block over every layer (K and V)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * dtype_bytes * block_size


def measure_memory(servers: Dict[str, object], model: str, model_dir: Path, prompt, counts: Sequence[int],
                   log=print) -> List[dict]:
    """One row per (backend, count): ``count`` identical Block-Attention requests of ``prompt`` (a
    ``bench.served.Prompt``) at once; KV blocks in use while all decode, less those in use before."""
    rows = []
    end = prompt.spans[-1][1]
    for backend, server in servers.items():
        for n in counts:
            before, _, bs = server.kv_cache_blocks()
            body = {"model": model, "prompt": list(prompt.tokens), "max_tokens": NEW_TOKENS, "temperature": 0,
                    "ignore_eos": True, "kv_transfer_params": {"ragattn_spans": prompt.spans}}
            used, answers = server.kv_blocks_while_decoding([body] * n)
            if any(a != answers[0] for a in answers):
                raise RuntimeError(f"bench.served: {n} identical requests answered differently on {backend}")
            own = n * (-(-(len(prompt.tokens) + NEW_TOKENS) // bs) - end // bs)
            pages = sum(-(-(e - s) // bs) for s, e in prompt.spans)
            copies = n * -(-(len(prompt.tokens) + NEW_TOKENS) // bs)
            mib = block_bytes(model_dir, bs) / 2 ** 20
            row = dict(backend=backend, requests=n, prompt_tokens=len(prompt.tokens), blocks=used - before,
                       mib=round((used - before) * mib, 1), shared_bound_blocks=pages + own, copies_blocks=copies,
                       vs_shared_bound=round((used - before) / (pages + own), 2),
                       vs_copies=round((used - before) / copies, 2))
            log(f"bench.served: memory {backend} x{n}: {row['blocks']} blocks ({row['mib']} MiB), "
                f"{row['vs_shared_bound']}x chunks once + own pages, {row['vs_copies']}x a copy each")
            rows.append(row)
    return rows


def format_memory(rows: List[dict]) -> str:
    head = ("| backend | concurrent requests | prompt tokens | KV blocks in use | MiB | vs chunk pages once + own "
            "pages | vs a copy per request |\n|---|---:|---:|---:|---:|---:|---:|\n")
    return head + "".join(f"| {r['backend']} | {r['requests']} | {r['prompt_tokens']} | {r['blocks']} | {r['mib']} | "
                          f"{r['vs_shared_bound']}x | {r['vs_copies']}x |\n" for r in rows)


def memory_target(rows: List[dict]) -> tuple:
    """The served target: ragattn's backend (shared chunk pages), the most concurrent requests,
    at most 1.2x one copy of the chunk pages plus the requests' own pages."""
    mine = [r for r in rows if r["backend"] == "ragattn"]
    text = "shared chunk pages: concurrent requests over the same chunks hold <= 1.2x the chunk pages once plus their own"
    if not mine:
        return text, None, "not measured"
    top = max(mine, key=lambda r: r["requests"])
    return text, top["vs_shared_bound"] <= 1.2, f"{top['requests']} requests: {top['vs_shared_bound']}x"
