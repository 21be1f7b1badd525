"""The servable export of SmolLM2 (ragattn.vllm.checkpoint, free of vLLM): the folder loads as a plain
HF checkpoint without the GGUF quantization key, and with ``adapter="block-attention"`` it is the tuned
model (the shipped LoRA merged in), so vLLM serves the fine-tuned weights like any checkpoint."""
import json

import pytest
import torch

from ragattn.hf import adapters
from ragattn.vllm.checkpoint import export_smollm2

pytest.importorskip("peft")


def test_tuned_export_is_the_tuned_model(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM

    model, _ = smollm2
    out = export_smollm2(tmp_path / "tuned", adapter="block-attention")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["ragattn_adapter"] == "block-attention"
    assert export_smollm2(out, adapter="block-attention") == out                 # complete: kept
    assert (out / ".ragattn-export").read_text() == "torch.float32 block-attention"
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3299, 28, 253, 1345, 30, 2]])
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        tuned = adapters.tuned_model(model)(input_ids=ids).logits
        base = model(input_ids=ids).logits
    torch.testing.assert_close(got, tuned, rtol=1e-5, atol=1e-4)
    assert float((got - base).abs().max()) > 1e-2                                # not the base weights
    with pytest.raises(adapters.AdapterError, match="unknown adapter"):
        export_smollm2(tmp_path / "other", adapter="no-such-adapter")
