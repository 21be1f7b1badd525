"""The store tests' shared redis-server (tests/redis_server.py: 127.0.0.1 at a free port, no
persistence): one per session, emptied and without a memory limit for each test that asks for
``remote``."""
import pytest

from tests.redis_server import redis_server_or_skip


@pytest.fixture(scope="session")
def server():
    s = redis_server_or_skip()
    yield s
    s.stop()


@pytest.fixture
def remote(server):
    server.client().flushall()
    server.client().config_set("maxmemory", 0)
    return server
