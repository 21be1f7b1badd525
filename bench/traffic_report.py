"""``bench.traffic``'s report: ``traffic.json``, ``traffic.md`` (tables, target, where the cost goes)
and ``traffic.png`` (per tier over the stream: memory hit rate, TTFT p50/p99 against full
prefill and warm, resident K/V and process memory); ``bench.served_traffic``'s the same way
(``served_traffic.*``: the server's memory, no cost tables)."""
from __future__ import annotations

import json
import os
import sys


def _load(x) -> str:
    return " / ".join(f"{v:.2f}" for v in x)


def format_windows(tiers: dict) -> str:
    lines = ["| tier | requests | t (s) | memory hits | tier hits | TTFT p50 ms | TTFT p99 ms | speed-up p50 | "
             "resident K/V MiB | RSS MiB |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for tier, r in tiers.items():
        for w in r["windows"]:
            resident = f"{w['resident_mb']:.0f}" if w["resident_mb"] else "-"    # served: the worker's, unseen
            lines.append(f"| {tier} | {w['first']}-{w['last']} | {w['t_s']:.0f} | {w['memory_hit']:.0%} | "
                         f"{w['tier_hit']:.0%} | {w['p50_ms']:.0f} | {w['p99_ms']:.0f} | {w['speedup']:.2f}x | "
                         f"{resident} | {w['rss_mb']:.0f} |")
    return "\n".join(lines)


def format_costs(costs: dict) -> str:
    has_remote = any("remote_ms" in r for r in costs["rows"])
    head = "| chunk tokens | K/V bytes | recompute ms | disk ms |" + (" remote ms |" if has_remote else "")
    lines = [head, "|---:|---:|---:|---:|" + ("---:|" if has_remote else "")]
    for r in costs["rows"]:
        lines.append(f"| {r['tokens']} | {r['bytes']:,} | {r['recompute_ms']:.1f} | {r['disk_ms']:.1f} |"
                     + (f" {r['remote_ms']:.1f} |" if has_remote else ""))
    fit = costs["fit"]
    row = costs["row_bytes"]
    lines.append("")
    for name in ("recompute", "disk", "remote"):
        if name == "remote" and not has_remote:
            continue
        fixed, per = fit[name]
        unit = "token" if name == "recompute" else "token's bytes"
        per_token = per if name == "recompute" else per * row
        lines.append(f"- {name}: {fixed * 1e3:.2f} ms a chunk + {per_token * 1e6:.1f} us a {unit}")
    for tier, x in costs["crossover_tokens"].items():
        lines.append(f"- {tier} is cheaper than recomputing for chunks longer than {x:.0f} tokens"
                     if x != float("inf") else f"- recomputing is cheaper than {tier} at every length")
    if costs.get("breakdown"):
        lines += ["", f"Stages of one {costs['breakdown_tokens']}-token chunk (ms, medians of 3):", "",
                  "| stage | ms |", "|---|---:|"]
        lines += [f"| {k} | {v:.1f} |" for k, v in costs["breakdown"].items()]
    return "\n".join(lines)


def format_spent(tiers: dict) -> str:
    lines = ["| tier | chunks from memory / tier | s reading disk | s fetching remote | s prefilling chunks | "
             "s per tier chunk | TTFT total s |", "|---|---:|---:|---:|---:|---:|---:|"]
    for tier, r in tiers.items():
        rows = r["rows"]
        mem = sum(x["from_memory"] for x in rows)
        got = sum(x[f"from_{tier}"] for x in rows)
        spent = r["spent_s"]
        own = spent["recompute_s" if tier == "recompute" else f"{tier}_s"]
        lines.append(f"| {tier} | {mem} / {got} | {spent['disk_s']:.1f} | {spent['remote_s']:.1f} | "
                     f"{spent['recompute_s']:.1f} | {own / max(got, 1) * 1e3:.0f} ms | "
                     f"{sum(x['ttft_s'] for x in rows):.1f} |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tiers = result["tiers"]
    fig, ax = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for tier, r in tiers.items():
        w = r["windows"]
        x = [v["last"] + 1 for v in w]
        ax[0].plot(x, [v["memory_hit"] for v in w], marker="o", label=f"{tier}: memory hits")
        line, = ax[1].plot(x, [v["p50_ms"] for v in w], marker="o", label=f"{tier} p50")
        ax[1].plot(x, [v["p99_ms"] for v in w], ls="--", color=line.get_color(), label=f"{tier} p99")
        ax[1].axhline(r["full_p50_ms"], color=line.get_color(), ls="-", lw=3, alpha=0.4,
                      label=f"{tier}: full prefill p50 (probes, second half)")
        ax[1].axhline(r["warm_p50_ms"], color=line.get_color(), ls="-.", lw=1,
                      label=f"{tier}: warm p50 (probes, second half)")
        if any(v["resident_mb"] for v in w):
            ax[2].plot(x, [v["resident_mb"] for v in w], marker="o", label=f"{tier}: resident chunk K/V")
        ax[2].plot(x, [v["rss_mb"] for v in w], ls=":", color=line.get_color(), label=f"{tier}: process RSS")
    ax[2].axhline(result["meta"]["memory_budget"] / 2**20, color="k", ls="--", label="memory budget")
    ax[0].set_ylabel("share of chunks")
    ax[0].set_ylim(0, 1.05)
    ax[1].set_ylabel("TTFT ms (window)")
    ax[1].set_yscale("log")
    ax[2].set_ylabel("MiB")
    ax[2].set_yscale("log")
    ax[2].set_xlabel("requests")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    m = result["meta"]
    fig.suptitle(f"Sustained Block-Attention traffic, {m['model']}:\ncorpus K/V "
                 f"{m['corpus_kv_bytes'] / 2**20:.0f} MiB, budget {m['memory_budget'] / 2**20:.0f} MiB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(out: str, result: dict) -> None:
    os.makedirs(out, exist_ok=True)
    m, a = result["meta"], result["args"]
    frac = result["target_fraction"]
    head = (
        "# Sustained RAG traffic through the chunk store's tiers (in process, CPU)\n\n"
        f"- command: `{m['command']}`\n"
        f"- commit {m['commit']}, {m['date']}; torch {m['torch']}, {m['threads']} thread(s); loaded machine: "
        f"load average (1 / 5 / 15 min) {_load(m['load_before'])} before, {_load(m['load_after'])} after\n"
        f"- {m['model']}, Block-Attention (`registry.get('block-attention').answer`, one token: TTFT); "
        f"{a['requests']} requests of {a['passages']} passages drawn Zipf({a['zipf']}) from {m['corpus_passages']} "
        f"passages ({m['corpus_tokens']} tokens, {m['corpus_kv_bytes'] / 2**20:.0f} MiB of chunk K/V, built offline "
        f"in {m['build_s']:.0f} s); memory budget {m['memory_budget'] / 2**20:.0f} MiB "
        f"({m['corpus_kv_bytes'] / m['memory_budget']:.1f}x smaller than the corpus's K/V); each tier from a "
        "cold store over the same stream\n"
        + (f"- skipped: {m['skipped']}\n" if m["skipped"] else "") + "\n")
    body = (f"Target: the reuse speed-up over the second half of the stream (store filled and evicting) >= "
            f"{frac:.0%} of the warm one. Both against full prefill on the probes (every {a['probe_every']}-th "
            "request answered again by full prefill and from a warm store holding the whole corpus, right after, "
            "under the same load); first tokens: the stream's answer against full prefill's (base weights, not "
            "the Block-Attention adapter: a timing run) and against the warm store's (the same method).\n\n"
            + _probe_table(result, "first token = full's"))
    body += "\nPer window:\n\n" + format_windows(result["tiers"]) + "\n"
    body += ("\nWhere the time goes during the stream (ChunkStore.stats: seconds inside the disk read + verify + "
             "insert, the remote fetch + verify + insert, and the chunks' prefill):\n\n"
             + format_spent(result["tiers"]) + "\n")
    body += ("\nOne chunk from each source by length (`TierCosts.measure`: a fresh store each, mean of "
             f"{a['cost_chunks']} chunks; fitted lines and crossovers below):\n\n"
             + format_costs(result["costs"]) + "\n")
    _write(out, "traffic", result, head, body)


def _write(out: str, name: str, result: dict, head: str, body: str) -> None:
    """``name``.png (the plot), ``name``.md (``head``, ``body`` and the plot) and ``name``.json
    under ``out``; the tables printed."""
    drawn = plot(result, os.path.join(out, f"{name}.png"))
    body += f"\n![hit rate, TTFT and memory over the stream]({name}.png)\n" if drawn else \
        "\n(no plot: matplotlib is not installed)\n"
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(head + body)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    print(head + body)
    print(f"saved {out}/{name}.md, {name}.json" + (f", {name}.png" if drawn else ""), file=sys.stderr)


def _probe_table(result: dict, agree_column: str) -> str:
    """Per tier: the probes' full prefill and warm p50, the stream's second half, the target, and
    how many answers agree (``agree_column``: what the agreement column counts)."""
    out = ("| tier | probes | full prefill p50 ms | warm p50 ms | warm speed-up | TTFT p50 ms | TTFT p99 ms | "
           f"sustained speed-up | of warm | met | {agree_column} | = warm's |\n"
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|\n")
    for tier, r in result["tiers"].items():
        out += (f"| {tier} | {r['probes']} | {r['full_p50_ms']:.0f} | {r['warm_p50_ms']:.0f} | "
                f"{r['warm_speedup']:.2f}x | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
                f"{r['sustained_speedup']:.2f}x | {r['ratio_to_warm']:.0%} | {'yes' if r['met'] else 'no'} | "
                f"{r['first_token_agrees']}/{r['probes']} | {r['warm_same']}/{r['probes']} |\n")
    return out


def write_served_report(out: str, result: dict) -> None:
    """``bench.served_traffic``'s ``served_traffic.{md,json,png}`` under ``out``."""
    os.makedirs(out, exist_ok=True)
    m, a = result["meta"], result["args"]
    head = (
        "# Sustained RAG traffic through a live vLLM server's chunk store (CPU)\n\n"
        f"- command: `{m['command']}`\n"
        f"- commit {m['commit']}, {m['date']}; {m['threads']} OpenMP thread(s) a server; servers started in "
        f"{m['start_s']} s; load average (1 / 5 / 15 min) {_load(m['load_before'])} before, "
        f"{_load(m['load_after'])} after\n"
        f"- {m['model']}, Block-Attention requests over HTTP (one-token answers: TTFT from the client); "
        f"{a['requests']} requests of {a['passages']} passages drawn Zipf({a['zipf']}) from {m['corpus_passages']} "
        f"passages ({m['corpus_tokens']} tokens, {m['corpus_kv_bytes'] / 2**20:.0f} MiB of chunk K/V, built offline "
        f"in {m['build_s']:.0f} s); the worker's memory budget {m['memory_budget'] / 2**20:.0f} MiB "
        f"({m['corpus_kv_bytes'] / m['memory_budget']:.1f}x smaller than the corpus's K/V); a fresh server per "
        "tier over the same stream; vLLM's prefix cache off\n\n")
    body = (f"Target: the reuse speed-up over the second half of the stream >= {result['target_fraction']:.0%} of "
            f"the warm one, both against full prefill on the probes (every {a['probe_every']}-th request sent "
            "right after to a warm server holding the whole corpus in memory, as full prefill and as "
            "Block-Attention). Answers (one token): the stream's against the warm server's full prefill and "
            "Block-Attention.\n\n" + _probe_table(result, "answer = full's"))
    body += ("\nPer window (memory / tier hits: the share of chunk spans the worker's store served from memory "
             "and from the tier, from the server's `/metrics`; RSS: the server's process tree):\n\n"
             + format_windows(result["tiers"]) + "\n")
    _write(out, "served_traffic", result, head, body)
