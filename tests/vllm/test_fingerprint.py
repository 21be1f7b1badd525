"""The vLLM connector's model fingerprint from the checkpoint files (headers + streamed
bytes, no CPU copy of the weights) equals the HF path's model_fingerprint of the loaded model, for
llama / llama3-scaled / qwen2 checkpoints, tied embeddings, sharded files and a dtype conversion;
a changed weight changes it. Runs without vLLM (ragattn.vllm.fingerprint needs none)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from ragattn.store import model_fingerprint, weight_checksums  # noqa: E402
from ragattn.vllm.fingerprint import FingerprintUnavailable, StreamedChecksum, checkpoint_fingerprint  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402


def _hf_fingerprint(folder, dtype):
    from transformers import AutoModelForCausalLM

    return model_fingerprint(AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval(), cached=False)


@pytest.mark.parametrize("nbytes", [0, 7, 512, 1000, 4096 + 3, 70_001])
def test_streamed_checksum_equals_weight_checksums(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    want = weight_checksums([torch.frombuffer(bytearray(data), dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)])[0]
    for piece in (1, 100, 512, 4099):
        c = StreamedChecksum()
        for i in range(0, nbytes, piece):
            c.update(data[i:i + piece])
        assert c.digest() == want, piece


@pytest.mark.parametrize("case", ["llama-fp32", "llama3-bf16", "qwen2-tied", "llama-sharded", "bf16-served-fp32"])
def test_file_fingerprint_equals_hf_fingerprint(tmp_path, case):
    family = {"llama3-bf16": "llama3", "qwen2-tied": "qwen2"}.get(case, "llama")
    over = {"tie_word_embeddings": True} if case == "qwen2-tied" else {}
    model = tiny_causal_lm(family, seed=3, **over)
    stored = torch.bfloat16 if case in ("llama3-bf16", "bf16-served-fp32") else torch.float32
    served = torch.float32 if case == "bf16-served-fp32" else stored
    model.to(stored).save_pretrained(tmp_path / "m", max_shard_size="40KB" if case == "llama-sharded" else "5GB")
    if case == "llama-sharded":
        assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    want = _hf_fingerprint(tmp_path / "m", served)
    got, empty = checkpoint_fingerprint(tmp_path / "m", served, return_model=True)
    assert got == want
    assert all(p.device.type == "meta" for p in empty.parameters())  # no copy of the weights was made


def test_file_fingerprint_sees_a_changed_weight(tmp_path):
    model = tiny_causal_lm("llama", seed=4)
    model.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    model.save_pretrained(tmp_path / "b")
    fa, fb = checkpoint_fingerprint(tmp_path / "a", torch.float32), checkpoint_fingerprint(tmp_path / "b", torch.float32)
    assert fa != fb and fb == _hf_fingerprint(tmp_path / "b", torch.float32)


def test_missing_parameter_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_causal_lm("llama", seed=5).save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    t = load_file(f)
    t["renamed.weight"] = t.pop("model.norm.weight")
    save_file(t, f, metadata={"format": "pt"})
    with pytest.raises(FingerprintUnavailable, match="model.norm.weight is not in the checkpoint files"):
        checkpoint_fingerprint(tmp_path / "m", torch.float32)


def test_store_over_the_empty_model_serves_chunk_files(tmp_path):
    """The vLLM worker's chunk store (the empty model from the files, fingerprint and device given)
    accepts the chunk files the HF path wrote and writes them into pages bit for bit like the HF
    store; no parameter is materialised."""
    import ragattn.hf  # noqa: F401  (ChunkStore(hf_model): ragattn.hf describes HF models to the store)
    from ragattn.store import ChunkStore

    model = tiny_causal_lm("llama3", seed=6)
    model.save_pretrained(tmp_path / "m")
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(1, 211, (n,), generator=g).tolist() for n in (9, 14)]
    hf = ChunkStore(model, tmp_path / "kv", page_size=16, memory_budget=1 << 24)
    keys = hf.add(chunks)
    fp, empty = checkpoint_fingerprint(tmp_path / "m", torch.float32, return_model=True)
    store = ChunkStore(empty, tmp_path / "kv", page_size=16, read_only=True, memory_budget=1 << 24,
                       fingerprint=fp, device="cpu")
    assert store.fingerprint == hf.fingerprint and store.device.type == "cpu"
    assert [store.key(c) for c in chunks] == keys
    shape = (2 * 16, 2, 16)  # 32 rows, Hkv 2, head_dim 16
    want = [[torch.full(shape, float("nan")) for _ in range(2)] for _ in range(2)]
    got = [[torch.full(shape, float("nan")) for _ in range(2)] for _ in range(2)]
    rows = torch.randperm(32, generator=g)[:23]
    pos = torch.arange(23) + 100
    hf.gather_into_(keys, want[0], want[1], rows, pos)
    store.gather_into_(keys, got[0], got[1], rows, pos)
    for a, b in zip(want[0] + want[1], got[0] + got[1]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert all(p.device.type == "meta" for p in store.model.parameters())
