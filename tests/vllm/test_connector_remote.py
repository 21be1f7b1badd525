"""The vLLM connector reads chunks through the fleet's remote tier (kv_connector_extra_config
'remote'): the scheduler claims a chunk only the server holds and the worker's store serves it
bit-identical to the store that published it. Needs vllm (scripts/setup_vllm.sh), the redis client
and redis-server; skipped elsewhere."""
import pytest

pytest.importorskip("vllm")
pytest.importorskip("redis", reason="the remote tier needs the redis client (pip install 'ragattn[remote]')")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from ragattn.store import ChunkStore  # noqa: E402
from tests.redis_server import redis_server_or_skip  # noqa: E402
from tests.vllm.test_connector import BS, _config, _kv_cache_config, served  # noqa: E402,F401

SECRET = "fleet-secret-0123456789"


@pytest.fixture(scope="module")
def remote():
    s = redis_server_or_skip()
    yield s
    s.stop()


def test_connector_reads_chunks_through_the_remote_tier(served, remote, tmp_path):
    _, _, model, chunks = served
    publisher = ChunkStore(model, page_size=BS, memory_budget=1 << 24, remote=remote.url, remote_secret=SECRET)
    key = publisher.add(chunks[3:4])[0]        # chunk 3: in no directory, only on the server
    assert publisher.stats["remote_published"] == 1
    cfg = _config(served, remote=remote.url, remote_secret=SECRET)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert sched.scheduler._has_chunk(key)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, _kv_cache_config())
    for got, want in zip(worker.worker.store.kv(key), publisher.kv(key)):
        assert torch.equal(got, want)
    assert worker.worker.store.stats["remote_hits"] == 1
    plain = KVConnectorFactory.create_connector(_config(served), KVConnectorRole.SCHEDULER, _kv_cache_config())
    assert not plain.scheduler._has_chunk(key)
