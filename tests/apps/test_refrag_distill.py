"""REFRAG's rag stage and its shipped weights: the distillation targets line up with the student's
rows (every chunk expanded = the teacher's own prompt, KL ~ 0), the stage leaves a plain decoder with
its LoRA merged, the shipped folder round-trips and is refused when damaged or for another k, and on
eval questions the shipped weights bring REFRAG's first token closer to full attention's than an
untrained projector does."""
import random
import shutil

import pytest
import torch

from ragattn.apps import refrag_distill as rd
from ragattn.apps.corpus import DEFAULT_CORPUS, load_corpus
from ragattn.apps.training_text import RagExample
from ragattn.hf import adapters
from ragattn.methods.refrag import train as rt

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def passages():
    return load_corpus(DEFAULT_CORPUS).passages     # test data (the recipe trains on FOLDOC)


@pytest.fixture
def rm16(smollm2):
    from ragattn.methods.refrag.model import RefragModel

    model, tok = smollm2
    torch.manual_seed(0)
    return RefragModel(model, tok, k=16)


def _example(passages, n, seed):
    rng = random.Random(seed)
    chosen = tuple(rng.sample(list(passages), n))
    return RagExample(chosen, f"What is {chosen[0].title}?")


def test_targets_line_up_with_the_students_answer_rows(rm16, passages):
    """Every chunk expanded, the student reads the teacher's prompt token for token: KL ~ 0 on every
    answer row. Compressed (untrained projector), it does not."""
    ex = _example(passages, 3, 1)
    full = rd.rag_sample(rm16, ex, 1.0, random.Random(0), max_answer=6)
    n = len(full.example.target)
    assert full.target.shape == (n, rm16.decoder.config.vocab_size) and 1 <= n <= 6
    assert bool(full.expand.all())
    with torch.no_grad():
        kl, student, target = rd._row_kl(rm16, [full])
    assert kl.shape == (n,) and float(kl.abs().max()) < 1e-4
    assert torch.equal(student.argmax(-1), torch.tensor(full.example.target))   # row i predicts answer[i]
    squeezed = rd.rag_sample(rm16, ex, 0.0, random.Random(0), max_answer=6)
    assert not squeezed.expand.any()
    with torch.no_grad():
        two = rd._row_kl(rm16, [squeezed, full])[0]                   # batched rows stay in sample order
    assert float(two[len(squeezed.target):].abs().max()) < 1e-4 and float(two[:len(squeezed.target)].mean()) > 0.05


def test_stage_merges_its_lora_and_ships_what_trained(rm16, passages, tmp_path, monkeypatch):
    from ragattn.apps.refrag_ship import ship
    from ragattn.methods.refrag.model import RefragModel
    from ragattn.store.fingerprint import model_fingerprint

    base = rm16.decoder
    before = model_fingerprint(base, cached=False)
    cfg = rt.TrainConfig(k=16, stages=("rag",), batch=1, eval_examples=1, rag_steps=2, rag_lr=1e-2,
                         rag_top_k=(2, 3), rag_answer_tokens=4, rag_expand=(0.0,), decoder_lora_rank=2,
                         encoder_layers=1, progress=False).validate()
    record = {"command": "test", "base_fingerprint": before, "stages": {}}
    import copy

    rm16.decoder = copy.deepcopy(base)          # the stage trains (and merges into) a copy
    res, lora = rd.run_rag(rm16, cfg, passages[:24], passages[24:])
    assert len(res.loss) == 2 and set(res.heldout_after) == {"kl_expand0", "first_kl_expand0", "first_agree_expand0"}
    assert type(rm16.decoder) is type(base) and lora is not None
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in lora["weights"])
    record["stages"]["rag"] = __import__("dataclasses").asdict(res)
    out = ship(rm16, cfg, lora, record, tmp_path / "refrag-k16")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors",
                                              "chunk_encoder.safetensors", "manifest.json"}

    adapters.tuned_model(base, "refrag")         # the real shipped weights merged first must not be reused
    monkeypatch.setattr(adapters, "WEIGHTS", tmp_path)
    fresh = RefragModel(base, rm16.tokenizer, k=16)
    manifest = fresh.load_shipped()
    assert manifest["k"] == 16 and fresh.trained and fresh.decoder is not base
    assert model_fingerprint(base, cached=False) == before                      # the given decoder untouched
    for a, b in zip(fresh.encoder.projector.parameters(), rm16.encoder.projector.parameters()):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float())            # shipped in bfloat16
    last = len(rm16.encoder.encoder.encoder.layer) - 1
    for (name, a), b in zip(fresh.encoder.encoder.encoder.layer[last].named_parameters(),
                            rm16.encoder.encoder.encoder.layer[last].parameters()):
        torch.testing.assert_close(a, b.to(torch.bfloat16).float(), msg=name)
    ids = torch.tensor([[1, 504, 3299, 28, 253, 1345]])
    with torch.no_grad():
        ref, got = rm16.decoder(input_ids=ids).logits, fresh.decoder(input_ids=ids).logits
    assert float((got - ref).abs().max()) < 0.05 * float(ref.abs().max())        # the LoRA, rounded to bf16
    fresh.k = 8
    with pytest.raises(ValueError, match="k = 16"):
        fresh.load_shipped()
    f = out / "chunk_encoder.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        RefragModel(base, rm16.tokenizer, k=16).load_shipped()


def test_init_continues_from_a_shipped_folder(rm16, passages, tmp_path):
    """``refrag-train --init DIR`` starts the rag stage from a shipped folder: its projector, encoder
    layer and LoRA load as shipped (bf16 values), a run of no step hands the same LoRA back, and the
    next ship's manifest chains to the folder. A folder trained otherwise, damaged or made on other
    decoder weights is refused by name."""
    import copy
    import dataclasses
    import json

    from safetensors.torch import load_file

    from ragattn.apps import refrag_train as rtrain
    from ragattn.apps.refrag_ship import ship
    from ragattn.methods.refrag.model import RefragModel
    from ragattn.store.fingerprint import model_fingerprint

    base = rm16.decoder
    fp = model_fingerprint(base, cached=False)
    cfg = rt.TrainConfig(k=16, stages=("rag",), batch=1, eval_examples=1, rag_steps=1, rag_lr=1e-2,
                         rag_top_k=(2, 3), rag_answer_tokens=3, rag_expand=(0.0,), decoder_lora_rank=2,
                         encoder_layers=1, progress=False).validate()
    rm16.decoder = copy.deepcopy(base)
    res, lora = rd.run_rag(rm16, cfg, passages[:24], passages[24:])
    first = ship(rm16, cfg, lora, {"command": "first", "base_fingerprint": fp,
                                   "stages": {"rag": dataclasses.asdict(res)}}, tmp_path / "first")

    again = RefragModel(copy.deepcopy(base), rm16.tokenizer, k=16)
    manifest = rtrain.init_manifest(first, cfg)
    record = {"command": "second", "base_fingerprint": fp, "stages": {}}
    init_lora = rtrain._load_init(again, first, manifest, record)
    shipped = load_file(first / "chunk_encoder.safetensors")
    for name, w in again.encoder.projector.state_dict().items():
        assert torch.equal(w, shipped[f"projector.{name}"].float()), name
    zero = dataclasses.replace(cfg, rag_steps=0)
    res2, lora2 = rd.run_rag(again, zero, passages[:24], passages[24:], init_lora)
    assert lora2["weights"].keys() == init_lora.keys()
    for name, w in lora2["weights"].items():
        assert torch.equal(w, init_lora[name]), name
    record["stages"]["rag"] = dataclasses.asdict(res2)
    second = json.loads((ship(again, zero, lora2, record, tmp_path / "second") / "manifest.json").read_text())
    assert second["steps"] == 1 and second["run_steps"] == 0
    assert second["init"]["command"] == "first" and second["init"]["files"] == manifest["files"]

    for bad, match in ((dataclasses.replace(cfg, decoder_lora_rank=4), "--decoder-lora-rank 4"),
                       (dataclasses.replace(cfg, encoder_layers=None), "--encoder-layers None"),
                       (dataclasses.replace(cfg, stages=("recon",)), "must include rag")):
        with pytest.raises(rt.TrainError, match=match):
            rtrain.init_manifest(first, bad)
    with pytest.raises(rt.TrainError, match="other decoder weights"):
        rtrain._load_init(again, first, manifest, {"base_fingerprint": "0" * 32})
    with pytest.raises(rt.TrainError, match="--init and --resume"):
        rtrain.train(cfg, rm=again, resume=True, init=first)
    f = first / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-1] + bytes([f.read_bytes()[-1] ^ 1]))
    with pytest.raises(rt.TrainError, match="sha256"):
        rtrain.init_manifest(first, cfg)


def test_shipped_weights_beat_the_untrained_projector(smollm2):
    """CI's check of the shipped weights on 4 eval questions (their own passages plus distractors,
    top-8 as the eval retrieves them): first-token KL against full prefill, shipped < untrained."""
    from ragattn.apps.corpus import EVAL_CORPUS
    from ragattn.apps.demo import kl_divergence
    from ragattn.methods.baseline import full_prefill
    from ragattn.methods.refrag.model import answer
    from ragattn.methods.retrieval import Retriever

    manifest = adapters.shipped_adapter("refrag")
    assert manifest["command"].startswith("python -m ragattn refrag-train")
    assert manifest["data"]["package"] == "dict-foldoc" and manifest["k"] == 16
    model, tok = smollm2
    tuned = adapters.tuned_model(model, "refrag")
    corpus = load_corpus(EVAL_CORPUS)
    retriever = Retriever([f"{p.title}. {p.text}" for p in corpus.passages])
    kls = {"shipped": [], "untrained": []}
    torch.manual_seed(0)
    for q in corpus.questions[:4]:
        chunks = [corpus.passages[i].render() for i in reversed(retriever.top_k(q.question, 8)[0])]
        ref = full_prefill(model, tok, chunks, q.question, max_new_tokens=1).first_logits
        for name, dec in (("shipped", tuned), ("untrained", model)):
            got = answer(dec, tok, chunks, q.question, max_new_tokens=1).first_logits
            kls[name].append(kl_divergence(ref.float(), got.float()))
    mean = {k: sum(v) / len(v) for k, v in kls.items()}
    assert mean["shipped"] < mean["untrained"], kls
