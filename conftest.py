"""Test configuration.

* Without CUDA, Triton kernels run in the interpreter: TRITON_INTERPRET=1 must be set before
  any ``@triton.jit`` function is created, i.e. before ``triton_kernels`` is imported.
* ``--device cuda`` (used by scripts/gpu_check.sh) runs the device-parametrised tests on CUDA
  tensors; the default is the CPU.
"""
import os

import torch

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
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("--device cuda given but no CUDA device is available")
    return torch.device(name)


@pytest.fixture
def seed() -> int:
    """A fresh seed per test, printed on failure so a run can be replayed."""
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    print(f"seed={s}")
    return s
