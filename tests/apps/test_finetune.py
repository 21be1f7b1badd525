"""Block fine-tuning by distillation: the student's packed block-mask forward equals a dense-mask
reference under both position schemes, the teacher is the model's own greedy full-attention answer
with the adapter off, a few steps reduce the KL, and the command checkpoints, resumes and ships."""
import gzip
import hashlib
import json
import random

import pytest
import torch

from ragattn.apps import block_distill as bd
from ragattn.apps import finetune as ft
from ragattn.apps.training_text import Passage, RagExample
from ragattn.hf.registration import use_ragattn

peft = pytest.importorskip("peft")

V = 97


def _tiny_llama(seed=0, init=0.02):
    """``init``: the weights' std (HF's initializer_range); larger gives sharper attention, so that
    the block mask moves the distributions further."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=2, initializer_range=init)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).float().eval()


def _lora(model, seed=1, scale=0.3):
    """The tiny model with a LoRA adapter whose B is not zero (so that it changes the outputs)."""
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                    target_modules=list(ft.LORA_TARGETS)))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return pm


class _WordTokenizer:
    """Whitespace words -> ids 3..V-1 (no chat template: prompt_parts' plain layout)."""
    chat_template = None
    eos_token_id, unk_token_id = 2, 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + int(hashlib.md5(w.encode()).hexdigest(), 16) % (V - 3) for w in text.split()]}

    def convert_tokens_to_ids(self, token):
        return self.unk_token_id


def _example(rng, k):
    words = "alpha beta gamma delta river stone cloud engine ledger signal".split()
    ps = tuple(Passage(id=str(i), title=f"T{i}", text=" ".join(rng.choice(words) for _ in range(rng.randint(4, 11))))
               for i in range(k))
    return RagExample(ps, f"What is {ps[0].title} ?")


def test_scheme_positions():
    assert bd.scheme_positions([2, 3], 2, "reordered") == [0, 1, 2, 3, 4, 5, 6]
    assert bd.scheme_positions([2, 3, 1], 2, "composite") == [0, 1, 0, 1, 2, 0, 3, 4]
    with pytest.raises(ValueError, match="scheme"):
        bd.scheme_positions([2], 1, "sorted")


def _dense_reference(model, s: bd.DistillSample) -> torch.Tensor:
    """log-probs at ``s.rows``: one dense-mask forward (causal by index, same block or global)."""
    blk = torch.tensor(s.blocks)
    t = len(s.ids)
    allow = torch.tril(torch.ones(t, t, dtype=torch.bool)) & (
        (blk[:, None] == blk[None, :]) | (blk[:, None] == -1))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([s.ids]), position_ids=torch.tensor([s.positions]),
                       attention_mask=allow[None, None]).logits[0]
    return logits[s.rows].float().log_softmax(-1)


@pytest.mark.parametrize("scheme", bd.SCHEMES)
def test_student_equals_dense_block_mask(scheme):
    rng = random.Random(2)
    pm = _lora(_tiny_llama(seed=4))
    tok = _WordTokenizer()
    samples = [bd.distill_sample(pm, tok, _example(rng, k), scheme, max_answer=4) for k in (3, 1, 4)]
    merged = _lora(_tiny_llama(seed=4)).merge_and_unload()       # the same weights, adapter merged
    ref = torch.cat([_dense_reference(merged, s) for s in samples])
    with use_ragattn(pm.get_base_model()), torch.no_grad():
        got = bd.student_logprobs(pm, bd.pack_samples(samples, "cpu"))
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    # teeth: the same rows under full attention differ (the mask and positions matter)
    full = torch.cat([s.target for s in samples])
    assert (got - full).abs().max() > 1e-2


def test_teacher_is_greedy_full_attention_without_the_adapter():
    rng = random.Random(6)
    pm = _lora(_tiny_llama(seed=7))
    tok = _WordTokenizer()
    s = bd.distill_sample(pm, tok, _example(rng, 3), "composite", max_answer=5)
    base = _tiny_llama(seed=7)                                     # no adapter at all
    n_answer = len(s.rows) - s.first                               # rows: the tail but its first token, the answer
    prompt = s.ids[: len(s.ids) - n_answer]
    with torch.no_grad():
        gen = base.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=2,
                            pad_token_id=0)[0, len(prompt):].tolist()
        full = base(input_ids=torch.tensor([s.ids])).logits[0, s.rows].float().log_softmax(-1)
    assert s.ids[len(prompt):] == gen[: n_answer]
    torch.testing.assert_close(s.target, full, atol=1e-4, rtol=1e-4)
    assert len(s.target) == len(s.rows) and 0 <= s.first < len(s.rows)
    assert s.rows[s.first] == len(prompt) - 1                      # the row that predicts the answer


def test_distillation_steps_reduce_kl():
    rng = random.Random(8)
    pm = _lora(_tiny_llama(seed=9, init=0.2), scale=0.0)   # B = 0: the student starts as the base model
    tok = _WordTokenizer()
    samples = [bd.distill_sample(pm, tok, _example(rng, k), s, max_answer=4)
               for k, s in ((4, "reordered"), (5, "composite"), (3, "reordered"))]
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    with use_ragattn(pm.get_base_model()):
        before = bd.agreement(pm, samples)
        for _ in range(8):
            loss = bd.distill_loss(pm, samples)
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = bd.agreement(pm, samples)
    assert before["kl"] > 0.01
    assert after["kl"] < 0.5 * before["kl"], (before, after)
    assert after["first_kl"] < before["first_kl"]


def _dictd(path, n=30, seed=0):
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone cloud market engine ledger signal buffer kernel".split()
    lines = []
    for i in range(n):
        lines += [f"Entry{i:02d}", "", "   " + " ".join(rng.choice(words) for _ in range(30)) + ".", ""]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("argv, needle", [
    (["--schemes", "sorted"], "--schemes"),
    (["--top-k", "5,2"], "--top-k"),
    (["--steps", "0"], "--steps"),
    (["--lr", "nan"], "--lr"),
])
def test_cli_errors(tmp_path, capsys, argv, needle):
    assert ft.main(["--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]


def test_cli_text_errors_are_one_line(tmp_path, capsys, smollm2):
    assert ft.main(["--out", str(tmp_path / "run"), "--text", str(tmp_path / "none.dict.dz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing" in err[0]
    small = _dictd(tmp_path / "t.dict.dz", n=20)
    assert ft.main(["--out", str(tmp_path / "run"), "--text", str(small), "--top-k", "2,9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "held-out split" in err[0]


def test_cli_trains_checkpoints_resumes_and_ships(tmp_path, capsys, smollm2):
    text = _dictd(tmp_path / "t.dict.dz", n=400)                  # ~8 held out (2%)
    out = tmp_path / "run"
    common = ["--out", str(out), "--text", str(text), "--batch", "1", "--held", "1", "--top-k", "2,3",
              "--answer-tokens", "3", "--checkpoint-every", "1", "--eval-every", "1", "--rank", "2"]
    assert ft.main(common + ["--steps", "1"]) == 0
    first = json.loads((out / "adapter" / "manifest.json").read_text())
    with open(out / "history.jsonl", "a") as f:       # a step logged after the checkpoint, then stopped
        f.write(json.dumps(dict(step=2, loss=9.0)) + "\n")
    assert ft.main(common + ["--steps", "2"]) == 0
    assert "resumed from" in capsys.readouterr().err
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2] and history[1]["loss"] != 9.0   # each step once
    m = json.loads((out / "adapter" / "manifest.json").read_text())
    assert m["steps"] == 2 and first["steps"] == 1 and m["commit"] == first["commit"]
    assert m["data"]["sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    weights = out / "adapter" / "adapter_model.safetensors"
    assert m["files"] == {weights.name: hashlib.sha256(weights.read_bytes()).hexdigest()}
    assert m["base_fingerprint"] and m["architecture"]["model_type"] == "llama"
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(weights).values()} == {torch.bfloat16}
    assert (out / "loss.png").stat().st_size > 1000
    assert set(m["held_out_after"]) == {"reordered", "composite"}


def test_cli_init_continues_an_adapter(tmp_path, capsys, smollm2):
    """--init starts from an earlier run's adapter (its held-out KL, not the untuned model's, is the
    new run's step 0) and the manifest records the chain with the steps of both runs."""
    text = _dictd(tmp_path / "t.dict.dz", n=400)
    common = ["--text", str(text), "--batch", "1", "--held", "1", "--top-k", "2,3", "--answer-tokens", "3",
              "--checkpoint-every", "1", "--eval-every", "1", "--lr", "3e-3"]
    assert ft.main(["--out", str(tmp_path / "a"), "--rank", "2", "--steps", "2"] + common) == 0
    first = json.loads((tmp_path / "a" / "adapter" / "manifest.json").read_text())
    hist_a = [json.loads(line) for line in (tmp_path / "a" / "history.jsonl").read_text().splitlines()]
    assert ft.main(["--out", str(tmp_path / "b"), "--init", str(tmp_path / "a" / "adapter"), "--steps", "1"]
                   + common) == 0
    m = json.loads((tmp_path / "b" / "adapter" / "manifest.json").read_text())
    assert m["rank"] == 2 and m["run_steps"] == 1 and m["steps"] == 3
    assert m["init"]["steps"] == 2 and m["init"]["commit"] == first["commit"]
    assert m["init"]["sha256"] == first["files"]["adapter_model.safetensors"]
    untuned, trained = first["held_out_before"], first["held_out_after"]
    start = m["held_out_before"]
    for s in ("reordered", "composite"):      # the same held-out prompts (same seed), the adapter loaded
        assert start[s]["kl"] != untuned[s]["kl"]
        assert abs(start[s]["kl"] - trained[s]["kl"]) < 0.1 * abs(untuned[s]["kl"] - trained[s]["kl"]) + 1e-4
    assert hist_a[-1]["step"] == 2


@pytest.mark.parametrize("extra, needle", [
    (["--init", "/nonexistent/adapter"], "manifest.json is missing"),
    (["--init", "SHIPPED", "--rank", "8"], "--rank 8"),
])
def test_cli_init_errors(tmp_path, capsys, extra, needle):
    from ragattn.hf.adapters import adapter_dir

    extra = [str(adapter_dir("block-attention")) if a == "SHIPPED" else a for a in extra]
    assert ft.main(["--out", str(tmp_path / "run"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and needle in err[0]
