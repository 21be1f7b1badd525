"""The central exactness test: cached chunks + re-rotation + final-block prefill through the
paged cache == one forward pass of the whole prompt under the Block-Attention mask."""
import pytest
import torch

from ragattn.methods.block_attention import block_ids
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.methods.generate import paged_forward
from ragattn.methods.prompt import prompt_parts

CHUNKS = ["The Eiffel Tower is in Paris. It was completed in 1889 for the World's Fair.",
          "Mount Fuji is the highest mountain in Japan.",
          "The Amazon river flows through Brazil, Peru and Colombia, and it carries more water "
          "than any other river on Earth."]
QUESTION = "How high is Mount Fuji?"


@pytest.fixture(scope="module")
def store(smollm2):
    return ChunkStore(smollm2[0])


def _reference_logits(model, blocks, final, positions):
    """One sdpa forward of blocks + final with the Block-Attention mask at the scheme's positions."""
    lens = [len(b) for b in blocks]
    ids = torch.tensor([[t for b in blocks for t in b] + final])
    blk = block_ids(lens, len(final))
    if positions == "reordered":
        pos = torch.arange(ids.shape[1])
    else:
        pos = torch.cat([torch.arange(n) for n in lens] + [max(lens) + torch.arange(len(final))])
    n = ids.shape[1]
    allow = torch.ones(n, n, dtype=torch.bool).tril()
    allow &= (blk[:, None] == blk[None, :]) | (blk[:, None] == -1)
    mask = torch.zeros(n, n).masked_fill(~allow, float("-inf"))[None, None]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos[None], attention_mask=mask, use_cache=False)
    return out.logits[0, -len(final):].float()


def _cached_logits(model, store, blocks, final, positions, rerotate=True, zero_copy=False):
    """The final block's logits over the cached blocks: copied into a request cache (keys rotated
    on the way), or ``zero_copy`` on the store's own pages (RoPE in the kernel)."""
    keys = store.add(blocks)
    if zero_copy:
        with store.request(keys, positions=positions, extra_slots=len(final)) as req:
            pos = req.next_position + torch.arange(len(final))
            return paged_forward(model, torch.tensor([final]), pos, req.cache)
    req = store.assemble(keys, positions=positions, extra_slots=len(final), rerotate=rerotate)
    pos = req.next_position + torch.arange(len(final))
    return paged_forward(model, torch.tensor([final]), pos, req.cache)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("positions", ["reordered", "composite"])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_cached_equals_single_masked_pass(smollm2, store, positions, order):
    model, tok = smollm2
    head, chunk_ids, tail = prompt_parts(tok, [CHUNKS[i] for i in order], QUESTION)
    blocks = [head] + chunk_ids
    ref = _reference_logits(model, blocks, tail, positions)
    got = _cached_logits(model, store, blocks, tail, positions)
    assert _rel(got, ref) <= 1e-4, _rel(got, ref)
    # zero-copy (the store's pages, positions in the page table, RoPE in the kernel): the same
    # logits within fp32 rounding
    zc = _cached_logits(model, store, blocks, tail, positions, zero_copy=True)
    assert _rel(zc, ref) <= 1e-4 and _rel(zc, got) <= 1e-4, (_rel(zc, ref), _rel(zc, got))
    if positions == "reordered":
        # without re-rotation the keys sit at the wrong positions: the test must see it
        wrong = _cached_logits(model, store, blocks, tail, positions, rerotate=False)
        assert _rel(wrong, ref) > 1e-3
        # and the Block-Attention mask itself matters (vs plain causal over the same prompt)
        with torch.no_grad():
            ids = torch.tensor([[t for b in blocks for t in b] + tail])
            plain = model(input_ids=ids).logits[0, -len(tail):].float()
        assert _rel(plain, ref) > 1e-3


def test_methods_answer_and_baseline(smollm2, store):
    from ragattn.methods import block_attention, full_prefill, turborag

    model, tok = smollm2
    base = full_prefill(model, tok, CHUNKS, QUESTION, max_new_tokens=4)
    assert base.tokens and base.ttft_s > 0 and base.first_logits.shape == (model.config.vocab_size,)
    ba = block_attention.answer(model, tok, CHUNKS, QUESTION, max_new_tokens=4, store=store)
    tr = turborag.answer(model, tok, CHUNKS, QUESTION, positions="reordered", max_new_tokens=4, store=store)
    assert ba.tokens == tr.tokens and ba.prompt_len == base.prompt_len
    assert 1 <= len(ba.tokens) <= 4 and isinstance(ba.text, str)
    # greedy decode through the paged cache continues exactly like the single masked pass would
    head, chunk_ids, tail = prompt_parts(tok, CHUNKS, QUESTION)
    ref = _reference_logits(model, [head] + chunk_ids, tail + ba.tokens[:1], "reordered")
    assert int(ref[-1].argmax()) == (ba.tokens[1] if len(ba.tokens) > 1 else int(ref[-1].argmax()))
    with pytest.raises(ValueError, match="positions"):
        turborag.answer(model, tok, CHUNKS, QUESTION, positions="sideways", store=store)
    with pytest.raises(ChunkStoreError, match="empty retrieval"):
        block_attention.answer(model, tok, [], QUESTION, store=store)
    with pytest.raises(ValueError, match="empty retrieval"):
        full_prefill(model, tok, [], QUESTION)


def _greedy_reference(model, tok, store, chunks, question, n):
    """The hand-written greedy loop the methods used before generate(): paged_forward per token."""
    from ragattn.methods.generate import _eos_ids

    head, chunk_ids, tail = prompt_parts(tok, chunks, question)
    req = store.assemble(store.add([head] + chunk_ids), positions="reordered", extra_slots=len(tail) + n)
    nxt = req.next_position
    logits = paged_forward(model, torch.tensor([tail]), nxt + torch.arange(len(tail)), req.cache)
    out, nxt = [int(logits[-1].argmax())], nxt + len(tail)
    while len(out) < n and out[-1] not in _eos_ids(model, tok):
        lg = paged_forward(model, torch.tensor([[out[-1]]]), torch.tensor([nxt]), req.cache)
        out.append(int(lg[-1].argmax()))
        nxt += 1
    return out, logits[-1]


def test_generate_block_attention_from_store_equals_greedy_loop(smollm2, store):
    """model.generate() over the PagedCache (chunks assembled from the store) gives the greedy
    loop's tokens one for one, under inference_mode too; sampling and stop strings pass through."""
    from ragattn.methods import block_attention

    model, tok = smollm2
    ref, first = _greedy_reference(model, tok, store, CHUNKS, QUESTION, 12)
    with torch.inference_mode():
        got = block_attention.answer(model, tok, CHUNKS, QUESTION, max_new_tokens=12, store=store)
    assert got.tokens == ref
    torch.testing.assert_close(got.first_logits, first, rtol=1e-4, atol=1e-4)
    assert 0 < got.ttft_s <= got.total_s
    torch.manual_seed(0)
    a = block_attention.answer(model, tok, CHUNKS, QUESTION, max_new_tokens=6, store=store,
                               do_sample=True, temperature=0.8)
    torch.manual_seed(0)
    b = block_attention.answer(model, tok, CHUNKS, QUESTION, max_new_tokens=6, store=store,
                               do_sample=True, temperature=0.8)
    assert a.tokens == b.tokens and 1 <= len(a.tokens) <= 6
    word = tok.decode(ref[:3]).strip().split()[0] if tok.decode(ref[:3]).strip() else None
    if word:
        stopped = block_attention.answer(model, tok, CHUNKS, QUESTION, max_new_tokens=12, store=store,
                                         stop_strings=[word])
        assert len(stopped.tokens) < len(ref) and word in stopped.text
