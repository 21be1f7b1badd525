"""The HF side of the live-server tests, run in the project's HF environment (``.venv``: the
transformers release ragattn's HF path is tested with) as a subprocess:

    python -m tests.vllm.live.reference OUT [--prompts 6] [--min-tokens 1024] [--new-tokens 16]
                                            [--skip 0] [--wide-after FILE] [--adapter block-attention]

writes ``OUT/model`` (the served checkpoint: :func:`ragattn.vllm.checkpoint.export_smollm2`),
``OUT/kv`` (a chunk store built by the HF path for that model) and ``OUT/reference.json``: per
prompt, its token ids, the chunk spans (``kv_transfer_params["ragattn_spans"]``) and the HF path's
greedy answers (float32) with full attention (``full_prefill``), with Block-Attention over the
store's chunks (``block_attention.answer``) and with TurboRAG's composite positions, CacheBlend and
FusionRAG (the rows they recompute too). The vLLM environment serves ``OUT/model`` and
``OUT/kv`` and compares (tests/vllm/live/test_served.py): the store crosses the two environments
as a user's would.

With ``--adapter NAME`` the served checkpoint is the tuned model (``export_smollm2(adapter=NAME)``:
the shipped adapter merged into the weights), the store is built by that model (its own
fingerprint: tuned and untuned chunks never mix) and each prompt records the tuned model's
``full`` and ``block_attention`` answers beside the untuned model's Block-Attention answer
(``untuned_block_attention``, so a test can show the tuned weights change an answer); the other
methods are not recorded (tests/vllm/live/test_tuned_served.py).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


RATIO = 0.15   # the recompute methods' ratio in the served tests


def methods_answers(model, tok, chunks, question, new_tokens, store) -> dict:
    """The HF path's greedy answers of the methods the server serves per request
    (``kv_transfer_params["ragattn_method"]``), by their served names."""
    from ragattn.methods import fusionrag, turborag

    return {"turborag-composite": turborag.answer(model, tok, chunks, question, positions="composite",
                                                  max_new_tokens=new_tokens, store=store),
            "cacheblend": fusionrag.cacheblend(model, tok, chunks, question, ratio=RATIO,
                                               max_new_tokens=new_tokens, store=store),
            "fusionrag": fusionrag.answer(model, tok, chunks, question, ratio=RATIO, max_new_tokens=new_tokens,
                                          store=store)}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--min-tokens", type=int, default=1024)
    ap.add_argument("--skip", type=int, default=0, help="leave out the shipped QA set's first N questions")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--spares", type=int, default=4, help="short prompts of chunks no other prompt has "
                    "(one file each to delete or corrupt)")
    ap.add_argument("--export-only", action="store_true", help="write OUT/model and stop")
    ap.add_argument("--adapter", help="serve and record the model tuned by this shipped adapter "
                    "(ragattn.hf.adapters), beside the untuned model's Block-Attention answers")
    ap.add_argument("--wide-after", type=Path, help="run on one thread until this file exists (the "
                    "live fixture writes it once its servers are ready), then on every core")
    a = ap.parse_args(argv)
    import transformers

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from ragattn.apps.corpus import rag_prompts
    from ragattn.methods import block_attention
    from ragattn.methods import ChunkStore
    from ragattn.methods import full_prefill
    from ragattn.methods.prompt import prompt_parts
    from ragattn.vllm.checkpoint import export_smollm2

    torch.set_num_threads(1)

    def widen():   # between two answers; the same tokens on 1 and 2 threads (checked on this CPU)
        if a.wide_after is not None and torch.get_num_threads() == 1 and a.wide_after.exists():
            torch.set_num_threads(os.cpu_count() or 1)

    out = Path(a.out)
    t0 = time.perf_counter()
    model_dir = export_smollm2(out / "model", adapter=a.adapter)
    if a.export_only:
        return
    base = None
    if a.adapter:   # the untuned model's Block-Attention answers (its chunks computed per request, no store)
        from ragattn.hf.models import load_smollm2

        base, _ = load_smollm2(dtype=torch.float32)
    # the HF model from the folder vLLM serves (as a user builds the store for a served model: the
    # GGUF-converted model in memory still carries its quantization_config, another fingerprint)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    store = ChunkStore(model, out / "kv")
    rows = []
    todo = rag_prompts(tok, a.skip + a.prompts, a.min_tokens)[a.skip:]
    spares = rag_prompts(tok, a.spares, 256)
    # chunks of their own (their files are deleted or corrupted by the tests)
    todo += [(q, [f"{c}(spare copy {i})\n" for c in chunks]) for i, (q, chunks) in enumerate(spares)]
    for question, chunks in todo:
        head, ids, tail = prompt_parts(tok, chunks, question)
        spans, at = [], 0
        for part in [head] + ids:
            spans.append([at, at + len(part)])
            at += len(part)
        widen()
        full = full_prefill(model, tok, chunks, question, max_new_tokens=a.new_tokens)
        widen()
        block = block_attention.answer(model, tok, chunks, question, max_new_tokens=a.new_tokens, store=store)
        row = {"question": question, "prompt": head + [t for c in ids for t in c] + tail, "spans": spans,
               "full": full.tokens, "full_text": full.text,
               "block_attention": block.tokens, "block_attention_text": block.text}
        widen()
        if base is not None:
            untuned = block_attention.answer(base, tok, chunks, question, max_new_tokens=a.new_tokens)
            row.update(untuned_block_attention=untuned.tokens, untuned_block_attention_text=untuned.text)
        else:
            for name, res in methods_answers(model, tok, chunks, question, a.new_tokens, store).items():
                row[name] = {"tokens": res.tokens, "text": res.text,
                             "recomputed": res.extra.get("recomputed_slots")}
        rows.append(row)
    ref = {"model": str(model_dir), "chunk_dir": str(out / "kv"), "transformers": transformers.__version__,
           "adapter": a.adapter,
           "fingerprint": store.fingerprint, "new_tokens": a.new_tokens, "prompts": rows[:a.prompts],
           "spares": rows[a.prompts:],
           "seconds": round(time.perf_counter() - t0, 1)}
    (out / "reference.json").write_text(json.dumps(ref))


if __name__ == "__main__":
    main()
