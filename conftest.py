"""Test configuration.

* Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET=1 must be set before
  any ``@triton.jit`` function is created, i.e. before ``triton_kernels`` is imported.
* ``--device cuda`` (used by scripts/gpu_check.sh) runs the device-parametrised tests on CUDA
  tensors; the default is the CPU.
* ``RAGATTN_TEST_FAKE_CUDA=1`` makes CUDA look present (see below) to find the tests that assume
  the interpreter.
"""
import os
import sys

import torch

# RAGATTN_TEST_FAKE_CUDA=1: this process sees itself as a GPU machine's does (torch.cuda.is_available()
# is True, so TRITON_INTERPRET stays unset and the Triton kernels are compiled, not interpreted)
# without a GPU: a test that hands a Triton kernel CPU tensors then fails here as it does there.
# Tests that need real CUDA tensors skip (tests.helpers.cuda_usable); tests/tooling/test_gpu_check.py runs
# a set of them this way.
if os.environ.get("RAGATTN_TEST_FAKE_CUDA") == "1":
    os.environ.pop("TRITON_INTERPRET", None)
    _cuda_is_available = torch.cuda.is_available

    def _fake_is_available() -> bool:
        # torch's own code (compile, opcheck) would then use CUDA for real: it sees the truth
        caller = sys._getframe(1).f_code.co_filename
        return _cuda_is_available() if f"{os.sep}torch{os.sep}" in caller else True

    torch.cuda.is_available = _fake_is_available

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ragattn  # noqa: E402,F401


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        action="store",
        default="cpu",
        choices=("cpu", "cuda"),
        help="device for the device-parametrised tests (cuda needs a GPU)",
    )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device the op tests run on (``--device``)."""
    name = request.config.getoption("--device")
    if name == "cuda" and (not torch.cuda.is_available() or os.environ.get("RAGATTN_TEST_FAKE_CUDA") == "1"):
        pytest.skip("--device cuda given but no CUDA device is available")
    return torch.device(name)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed on failure so a run can be replayed (``RAGATTN_TEST_SEED=N``:
    every test that takes this fixture runs with seed N)."""
    s = int(os.environ.get("RAGATTN_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
