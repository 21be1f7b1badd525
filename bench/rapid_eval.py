"""RAPID evaluation on a long context (CPU measurement, H100 model): ``python -m ragattn.bench.rapid_eval``.

SmolLM2-135M-Instruct is both target (reads the whole >= 4K-token context of
:func:`ragattn.apps.long_qa.build_long_qa`) and RAG drafter (reads the MiniLM-retrieved chunks, up to
``--budget`` tokens). Per question, from one prefill of each cache (the context prefix is prefilled
once for all questions; every run starts from an O(1) rollback of the caches):

* ``lc``: the target decodes alone, one token per forward (same paged cache and attention path);
* ``rag``: the target model decodes alone on the retrieval context (the drafter's cache);
* ``sd``: speculative decoding with the RAG drafter, ``eta = 0`` (output = the target's);
* ``rapid``: ``eta = --eta`` (greedy decoding of RAPID's retrieval-augmented target ``p_hat``).

Greedy throughout. Reported: exact match against gold, acceptance (accepted / drafted), tokens
per target step, decode tokens/s (prefills excluded, as in the paper), and the CPU cost of one
verification forward of ``gamma + 1`` rows against one decode step at the same context.
``--h100`` prints only the modelled H100 figure (bytes and FLOPs; nothing is measured).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

# Llama-3-8B shape (hf.models.LLAMA_SHAPES["llama3-8b"]) and H100 SXM datasheet peaks
H100_BW = 3.35e12          # HBM3 bytes/s
H100_BF16 = 989e12         # dense bf16 tensor-core FLOP/s


def modelled_h100(rows: int = 11, contexts=(32768, 131072), attn_eff: float = 0.5) -> str:
    """One verification forward of ``rows`` query rows vs one decode step, Llama-3-8B bf16, batch 1,
    from bytes and FLOPs (modelled, not measured)."""
    from ragattn.hf.models import LLAMA_SHAPES

    s = LLAMA_SHAPES["llama3-8b"]
    layers, hq, hkv, hidden = s["num_hidden_layers"], s["num_attention_heads"], s["num_key_value_heads"], s["hidden_size"]
    d = hidden // hq
    inter, vocab = s["intermediate_size"], s["vocab_size"]
    params = layers * (2 * hidden * hidden + 2 * hidden * hkv * d + 3 * hidden * inter) + 2 * vocab * hidden
    w_bytes = 2 * params
    kv_per_tok = 2 * layers * hkv * d * 2
    group = hq // hkv
    lines = [f"modelled H100 (Llama-3-8B shape, {params / 1e9:.2f} B params bf16 = {w_bytes / 1e9:.2f} GB, "
             f"KV {kv_per_tok} B/token; HBM {H100_BW / 1e12:.2f} TB/s, bf16 {H100_BF16 / 1e12:.0f} TFLOP/s)", "",
             "| context | step | bytes GB | FLOP G | roofline ms | pessimistic ms | ratio roofline | ratio pessimistic |",
             "|---|---|---|---|---|---|---|---|"]
    for L in contexts:
        kv = kv_per_tok * L
        res = {}
        for name, r in (("decode (1 row)", 1), (f"verify ({rows} rows)", rows)):
            # weights and the context KV are read once per forward: paged_attention stacks the
            # r rows x GQA group (r * 4) into one M tile, so each KV tile is loaded once for all
            byts = w_bytes + kv + r * kv_per_tok + r * vocab * 4
            lin = 2 * params * r
            att = 4 * L * hq * d * layers * r
            m_tile = min(128, max(16, 1 << (r * group - 1).bit_length()))
            att_padded = att * m_tile / (r * group)          # the tile's padded rows cost too
            roof = max(byts / H100_BW, (lin + att) / H100_BF16) * 1e3
            pess = (byts / H100_BW + lin / H100_BF16 + att_padded / (attn_eff * H100_BF16)) * 1e3
            res[name] = (byts, lin + att, roof, pess)
        (b1, f1, r1, p1), (b2, f2, r2, p2) = res.values()
        for name, (b, f, r, p) in res.items():
            ratio = f"{r / r1:.3f}x | {p / p1:.3f}x" if b == b2 and f == f2 else "1 | 1"
            lines.append(f"| {L // 1024}K | {name} | {b / 1e9:.2f} | {f / 1e9:.1f} | {r:.2f} | {p:.2f} | {ratio} |")
    lines += ["", f"roofline: max(bytes / HBM, FLOPs / peak); pessimistic: bytes / HBM + FLOPs / peak with "
              f"attention at {attn_eff:.0%} of peak on padded M tiles (no overlap of memory and compute)."]
    return "\n".join(lines)


def report(agg, modes, step_cost, lqa, prefix, questions, args) -> str:
    lc_tps = agg["lc"]["tokens"] / agg["lc"]["decode_s"]
    lines = [f"context {lqa.tokens} tokens ({len(lqa.passages)} passages, prompt {len(prefix)}+ tokens), "
             f"{len(questions)} questions, drafter budget {args.budget} tokens (chunks of {args.chunk_tokens}), "
             f"greedy, max {args.max_new_tokens} new tokens, eta {args.eta} for rapid", "",
             "| method | EM | acceptance | tokens / target step | decode tok/s | vs lc |",
             "|---|---|---|---|---|---|"]
    for m in modes:
        a = agg[m]
        tps = a["tokens"] / a["decode_s"]
        acc = f"{a['accepted'] / a['drafted']:.3f}" if a["drafted"] else "-"
        lines.append(f"| {m} | {a['em']}/{a['n']} | {acc} | {a['tokens'] / a['rounds']:.2f} | {tps:.2f} | "
                     f"{tps / lc_tps:.2f}x |")
    lines += ["", "CPU cost of one target forward of r rows at this context (best of 3):", "",
              "| rows | ms | vs 1 row |", "|---|---|---|"]
    for r, s in step_cost.items():
        lines.append(f"| {r} | {s * 1e3:.0f} | {s / step_cost[1]:.2f}x |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ragattn.bench.rapid_eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-tokens", type=int, default=4096, help="long-context size (default 4096)")
    p.add_argument("--limit", type=int, default=12, help="questions (default 12; 0 = all)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--budget", type=int, default=512, help="drafter retrieval budget in tokens (default 512)")
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--eta", type=float, default=10.0, help="RAPID's eta (default 10, the README's LLaMA self-spec)")
    p.add_argument("--gammas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--json", default=None, help="also write the raw results here")
    p.add_argument("--partial", default=None, help="rewrite the table here after every question")
    p.add_argument("--h100", action="store_true", help="print the modelled H100 figure only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.h100:
        print(modelled_h100())
        return 0
    from ragattn.apps.corpus import exact_match
    from ragattn.hf.models import load_smollm2
    from ragattn.apps.long_qa import build_long_qa
    from ragattn.methods import rapid
    from ragattn.methods.generate import _eos_ids
    from ragattn.methods.prompt import prompt_parts

    torch.manual_seed(0)
    model, tok = load_smollm2()
    eos = _eos_ids(model, tok)
    lqa = build_long_qa(tok, args.min_tokens)
    questions = lqa.questions[: args.limit] if args.limit else lqa.questions
    head, body, _ = prompt_parts(tok, [lqa.context], "?")
    prefix = head + body[0]
    extra = 256 + args.max_new_tokens + max(args.gammas) + 2
    cache = rapid.new_cache(model, len(prefix) + extra)
    t0 = time.perf_counter()
    rapid.prefill(model, prefix, cache)
    prefix_s = time.perf_counter() - t0
    print(f"context {lqa.tokens} tokens ({len(lqa.passages)} passages), prompt prefix {len(prefix)}, "
          f"{len(questions)} questions; prefix prefill {prefix_s:.1f} s", file=sys.stderr)

    modes = ["lc", "rag"] + [f"{m}-g{g}" for m in ("sd", "rapid") for g in args.gammas]
    agg = {m: dict(em=0, tokens=0, decode_s=0.0, rounds=0, drafted=0, accepted=0, n=0) for m in modes}
    step_cost = {}
    records = []
    for qi, q in enumerate(questions):
        retrieval = rapid.build_retrieval_context(tok, lqa.context, q.question, budget_tokens=args.budget,
                                                  chunk_tokens=args.chunk_tokens)
        target_ids, draft_ids = rapid.prompts(tok, lqa.context, q.question, retrieval)
        assert target_ids[: len(prefix)] == prefix
        dec = rapid.RapidDecoder(model, target_ids, draft_ids, options=rapid.RapidOptions(gamma=max(args.gammas)),
                                 max_new_tokens=args.max_new_tokens, eos_ids=eos, target_cache=cache)
        dec.prefill(target_cached=len(prefix))
        if qi == 0:  # warm-up, then the CPU cost of one forward of r rows at this context
            rapid.decode_autoregressive(model, dec.t_cache, dec.t_len, dec.last, 2)
            for r in [1] + [g + 1 for g in args.gammas]:
                ts = []
                for _ in range(3):
                    dec.reset()
                    t1 = time.perf_counter()
                    rapid.forward_rows(model, torch.tensor(target_ids[-1:] * r), dec.t_cache, dec.t_len, r)
                    ts.append(time.perf_counter() - t1)
                step_cost[r] = min(ts)
        rec = dict(id=q.id, question=q.question, answers=list(q.answers), retrieved_tokens=retrieval.tokens,
                   target_prompt=len(target_ids), draft_prompt=len(draft_ids), runs={})
        for mode in modes:
            dec.reset()
            t1 = time.perf_counter()
            if mode == "lc":
                toks, _, _ = rapid.decode_autoregressive(model, dec.t_cache, dec.t_len, dec.last,
                                                         args.max_new_tokens, eos_ids=eos)
                st = dict(rounds=len(toks), drafted=0, accepted=0)
            elif mode == "rag":
                toks, _, _ = rapid.decode_autoregressive(model, dec.d_cache, dec.d_len, dec.pending[0],
                                                         args.max_new_tokens, eos_ids=eos)
                st = dict(rounds=len(toks), drafted=0, accepted=0)
            else:
                kind, g = mode.split("-g")
                dec.opt = rapid.RapidOptions(gamma=int(g), eta=0.0 if kind == "sd" else args.eta)
                toks = dec.run()
                st = dict(rounds=dec.stats.rounds, drafted=dec.stats.drafted, accepted=dec.stats.accepted)
            dt = time.perf_counter() - t1
            text = tok.decode(toks, skip_special_tokens=True).strip()
            em = exact_match(text, q.answers)
            a = agg[mode]
            a["em"] += em
            a["tokens"] += len(toks)
            a["decode_s"] += dt
            a["n"] += 1
            for k in ("rounds", "drafted", "accepted"):
                a[k] += st[k]
            rec["runs"][mode] = dict(text=text, em=em, tokens=len(toks), decode_s=dt, **st)
        records.append(rec)
        done = questions[: qi + 1]
        table = report(agg, modes, step_cost, lqa, prefix, done, args)
        if args.partial:
            with open(args.partial, "w") as f:
                f.write(table + "\n")
        print(f"[{qi + 1}/{len(questions)}] {q.id}: lc={rec['runs']['lc']['text']!r} "
              f"rapid={rec['runs'][modes[-1]]['text']!r}", file=sys.stderr)

    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), context_tokens=lqa.tokens, prefix_prefill_s=prefix_s,
                           step_cost_s=step_cost, aggregate=agg, questions=records), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
