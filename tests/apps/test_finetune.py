"""Block fine-tuning: the varlen_attention training path equals a dense-mask forward, and a few
steps on a tiny random model reduce the answer loss."""
import random

import pytest
import torch

from ragattn.apps import finetune as ft


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float()


def _samples(rng, n):
    out = []
    for _ in range(n):
        r = lambda k: [rng.randrange(3, 97) for _ in range(k)]  # noqa: E731
        out.append(ft.make_sample(r(4), [r(rng.randint(5, 9)) for _ in range(3)], r(5), r(3)))
    return out


def test_sample_blocks_and_labels():
    s = ft.make_sample([1, 2], [[3, 4, 5], [6]], [7, 8], [9, 10])
    assert s.ids == list(range(1, 11))
    assert s.blocks == [0, 0, 1, 1, 1, 2, -1, -1, -1, -1]
    assert s.labels == [-100] * 8 + [9, 10]


def test_block_forward_matches_dense_mask():
    """Packed varlen forward == per-sample SDPA with the dense Block-Attention mask."""
    model = _tiny_llama()
    samples = _samples(random.Random(1), 2)
    ref = []
    for s in samples:
        blk = torch.tensor(s.blocks)
        t = len(s.ids)
        allow = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (
            (blk[:, None] == blk[None, :]) | (blk[:, None] == -1) | (blk[None, :] == -1))
        with torch.no_grad():
            ref.append(model(input_ids=torch.tensor([s.ids]), attention_mask=allow[None, None]).logits[0])
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([samples[0].ids])).logits[0]  # full causal, for contrast
    ft.use_block_attention(model)
    batch = ft.pack(samples, "cpu")
    batch.pop("labels")
    with torch.no_grad():
        got = model(**batch).logits[0]
    torch.testing.assert_close(got, torch.cat(ref), atol=1e-4, rtol=1e-4)
    n0 = len(samples[0].ids)
    assert (got[:n0] - plain).abs().max() > 1e-3  # the block mask changes the logits (test has teeth)


def test_training_steps_reduce_loss():
    model = _tiny_llama(seed=3)
    ft.use_block_attention(model)
    batch = ft.pack(_samples(random.Random(2), 3), "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = ft.eval_loss(model, batch)
    losses = [ft.train_step(model, opt, batch) for _ in range(4)]
    after = ft.eval_loss(model, batch)
    assert losses[0] == pytest.approx(before, rel=1e-4)
    assert after < before - 0.1, (before, losses, after)
    # gradients reached every layer's attention projections through varlen_attention's autograd
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_packed_without_blocks_is_per_sample_causal():
    """Packing alone (no block ids) keeps the samples independent and plainly causal."""
    model = _tiny_llama(seed=5)
    samples = _samples(random.Random(4), 2)
    with torch.no_grad():
        ref = torch.cat([model(input_ids=torch.tensor([s.ids])).logits[0] for s in samples])
    ft.use_block_attention(model)
    batch = ft.pack(samples, "cpu")
    batch.pop("labels")
    batch.pop("ragattn_block_ids")
    with torch.no_grad():
        got = model(**batch).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_cli_without_evaluation_or_steps(smollm2, capsys):
    """--eval-questions 0 used to crash packing an empty batch; negative counts are usage errors."""
    assert ft.main(["--steps", "0", "--eval-questions", "0", "--top-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "0 steps" in out and "held-fixed" not in out
    assert ft.main(["--eval-questions", "-1"]) == 2          # one error line, exit status 2
