"""`vllm --help` in .venv-vllm (docs/vllm.md): PyPI's vllm is a CUDA build whose platform detection
finds no device on a machine without a GPU ("Failed to infer device type"); VLLM_TARGET_DEVICE=cpu
selects vLLM's CPU platform, and the CLI then builds every subcommand's parser (serve's
--kv-transfer-config included). Skipped where vLLM is not installed."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")


def test_vllm_help_on_the_cpu_platform(tmp_path):
    exe = Path(sys.executable).with_name("vllm")
    if not exe.exists():
        pytest.skip(f"no vllm console script beside {sys.executable}")
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(exe), "--help"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "serve" in proc.stdout and "Launch a local OpenAI-compatible API server" in proc.stdout
