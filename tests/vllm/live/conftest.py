"""Session fixtures of the live-server tests (run in .venv-vllm; skipped where vLLM is absent):
the HF reference (``reference.py`` in the project's HF environment) and two vLLM servers with the
ragattn connector, all three started side by side once for the whole session (``live``: vLLM's
CPU_ATTN backend; ``live_ragattn``: ragattn's attention backend, ``RAGATTN_VLLM_ATTENTION=1``),
the servers' logs attached to every failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ragattn.vllm.serve import LiveServer, free_port, serve_command

ROOT = Path(__file__).resolve().parents[3]
START_TIMEOUT_S = float(os.environ.get("RAGATTN_VLLM_START_TIMEOUT", "600"))
# the HF reference's answers (reference.py): minutes on an idle machine, far more on a loaded one
REFERENCE_TIMEOUT_S = float(os.environ.get("RAGATTN_VLLM_REFERENCE_TIMEOUT", "1800"))
TIMINGS: list[tuple[str, float]] = []


def hf_python() -> str:
    """The project's HF environment (``RAGATTN_HF_PYTHON``, else ``.venv``), else this one."""
    env = os.environ.get("RAGATTN_HF_PYTHON")
    if env:
        return env
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if venv.is_file() else sys.executable


def _reference_cmd(out: Path, *extra: str) -> list[str]:
    return [hf_python(), "-m", "tests.vllm.live.reference", str(out), *extra]


def _env():
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _server(model, chunk_dir, log, extra_env=None, shared_pages=False) -> LiveServer:
    """A server on ``model`` with the connector over ``chunk_dir``, started without waiting."""
    return LiveServer(serve_command(model, free_port(), chunk_dir=chunk_dir, shared_pages=shared_pages), log,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(extra_env or {})},
                      timeout_s=START_TIMEOUT_S, wait=False)


@pytest.fixture(scope="session")
def _servers(tmp_path_factory):
    """``(cpu_attn server, ragattn server, reference dict)``. The model folder is exported first;
    then the HF reference and both servers start side by side (each single-threaded: three
    processes on the CI's two cores, where one at a time left a core idle; once both servers are
    ready, the reference takes every core), and the fixture waits for all three."""
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("live")
    subprocess.run(_reference_cmd(out, "--export-only"), cwd=ROOT, env=_env(), check=True, timeout=600)
    (out / "kv").mkdir()
    t0 = time.monotonic()
    ref_log = open(out / "reference.log", "wb")
    ready = out / "servers-ready"   # from then on the reference runs on every core (the servers idle)
    ref_proc = subprocess.Popen(_reference_cmd(out, "--wide-after", str(ready)), cwd=ROOT, env=_env(), stdout=ref_log,
                                stderr=subprocess.STDOUT)
    servers: list[LiveServer] = []
    try:
        servers.append(_server(out / "model", out / "kv", out / "server.log"))
        servers.append(_server(out / "model", out / "kv", out / "server_ragattn.log", {"RAGATTN_VLLM_ATTENTION": "1"},
                               shared_pages=True))
        for name, server in zip(("vLLM server start (ready)", "vLLM server start, ragattn backend (ready)"), servers):
            TIMINGS.append((name, server.wait_ready().start_s))
        ready.touch()
        rc = ref_proc.wait(timeout=REFERENCE_TIMEOUT_S)
        TIMINGS.append(("HF reference (alongside the starts)", time.monotonic() - t0))
        if rc != 0:
            raise RuntimeError(f"the HF reference failed ({rc}):\n{(out / 'reference.log').read_text()[-5000:]}")
        ref = json.loads((out / "reference.json").read_text())
        yield servers[0], servers[1], ref
    finally:
        if ref_proc.poll() is None:
            ref_proc.kill()
            ref_proc.wait()
        ref_log.close()
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def live(_servers):
    """``(server, reference dict)``: vLLM's CPU_ATTN backend with the ragattn connector."""
    return _servers[0], _servers[2]


@pytest.fixture(scope="session")
def live_ragattn(_servers):
    """``(server, reference dict)``: the same model and chunk store, attention by ragattn's
    backend (the platform plugin under ``RAGATTN_VLLM_ATTENTION=1``), chunk pages shared by every
    Block-Attention and TurboRAG request (``shared_pages``)."""
    return _servers[1], _servers[2]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        TIMINGS.append((item.nodeid, call.duration))
    for name in ("live", "live_ragattn"):
        live_ = item.funcargs.get(name) if hasattr(item, "funcargs") else None
        if rep.failed and live_ is not None:
            rep.sections.append((f"vLLM server log of {name} (tail)", live_[0].log_tail()))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "live vLLM server timings")
        for name, s in TIMINGS:
            terminalreporter.write_line(f"{s:8.1f} s  {name}")
