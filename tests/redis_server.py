"""A real redis-server for the remote tier's tests (tests/store, tests/vllm): 127.0.0.1 at a free
port, no persistence; ``redis_server_or_skip`` skips, naming the binary, where it is not installed
(scripts/setup_redis.sh installs it)."""
import os
import shutil
import socket
import subprocess
import time

import pytest

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on 127.0.0.1:port without persistence; stop/start keep the port."""

    def __init__(self):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen([SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()

    def client(self):
        import redis

        return redis.Redis(port=self.port)


def redis_server_or_skip() -> RedisServer:
    """A fresh server; without the binary the test skips, or fails under RAGATTN_REQUIRE_REDIS=1
    (.ci/run: CI must run these tests against a live server, never skip them)."""
    if SERVER is None:
        why = "redis-server is not installed (scripts/setup_redis.sh installs it from the system packages)"
        if os.environ.get("RAGATTN_REQUIRE_REDIS") == "1":
            pytest.fail(why + " and RAGATTN_REQUIRE_REDIS=1")
        pytest.skip(why)
    return RedisServer()
