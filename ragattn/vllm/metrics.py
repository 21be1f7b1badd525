"""ragattn's counters in vLLM's ``/metrics``, through vLLM's KV connector stats (vLLM's classes):

    stats = RagattnStats(); stats.add("chunks_hit", 3)          # scheduler and worker, per step
    connector.get_kv_connector_stats()                          # -> RagattnStats or None (taken, reset)
    RagattnConnector.build_kv_connector_stats(data)             # vLLM's logger: the payload back
    RagattnConnector.build_prom_metrics(...)                    # -> RagattnPromMetrics (the API server)

vLLM gathers each step's stats from the workers (``KVConnectorOutput.kv_connector_stats``) and the
scheduler (``get_kv_connector_stats``), aggregates them and sends the payload (``to_dict``) to the
front end, whose Prometheus logger calls :meth:`RagattnPromMetrics.observe`; each key of
:data:`COUNTERS` is a counter ``vllm:ragattn_<key>_total`` (per engine, vLLM's labels). The
scheduler counts what the responses say (``ragattn.vllm.spans.report_params``), the worker the
time it spends loading and recomputing and its chunk store's tiers.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

# stats key -> what the counter vllm:ragattn_<key>_total counts
COUNTERS = {
    "requests_method": "requests that carried chunks, answered by the method they asked for",
    "requests_full_attention": "requests that carried chunks, answered by full attention (nothing reused)",
    "requests_gate_refused": "requests that asked for a method the quality gate refused (full attention)",
    "gate_refused_methods": "methods the quality gate refused on this model at start-up (counted once)",
    "chunks_hit": "chunk spans reused from the chunk store",
    "chunks_missed": "chunk spans not reused (not in the store, a gap, the prompt's end)",
    "tokens_reused": "prompt tokens whose K/V came from the chunk store",
    "tokens_recomputed": "chunk tokens recomputed by CacheBlend / FusionRAG",
    "tokens_exact": "prompt tokens of requests with chunks computed by vLLM with full attention",
    "prefix_cache_tokens": "reused tokens found in vLLM's prefix cache (pages of the same computation)",
    "loads_failed": "requests whose chunks could not be loaded (recomputed exactly by vLLM)",
    "load_seconds": "seconds the worker spent on loads (chunk K/V into vLLM's pages, recompute included)",
    "recompute_seconds": "seconds the worker spent recomputing CacheBlend / FusionRAG rows",
    "store_disk_loads": "chunks the worker's store read from its directory",
    "store_remote_hits": "chunks the worker's store read from the remote tier",
    "store_evictions": "chunks the worker's store evicted from host memory",
    "store_bad_files": "chunk files found truncated or corrupt",
}
# the worker's chunk store counters (ChunkStore.stats) exported, as deltas
STORE_COUNTERS = {"loaded": "store_disk_loads", "remote_hits": "store_remote_hits", "evicted": "store_evictions",
                  "bad_files": "store_bad_files"}


@dataclass
class RagattnStats(KVConnectorStats):
    """Counter increments since the last time vLLM took them (``data``: key of :data:`COUNTERS`
    -> amount); sums under aggregation."""

    def add(self, key: str, amount: float) -> None:
        if key not in COUNTERS:
            raise KeyError(f"ragattn.vllm: no counter {key!r} (known: {sorted(COUNTERS)})")
        if amount:
            self.data[key] = self.data.get(key, 0) + amount

    def reset(self):
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "RagattnStats":
        for key, amount in other.data.items():
            self.add(key, amount)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data

    def take(self) -> "RagattnStats | None":
        """These increments (a new object), this one reset; None when there are none."""
        if self.is_empty():
            return None
        out = RagattnStats(dict(self.data))
        self.reset()
        return out


class RagattnPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per key of :data:`COUNTERS`, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {key: create_metric_per_engine(self._counter_cls(name=f"vllm:ragattn_{key}", documentation=doc,
                                                                          labelnames=labelnames),
                                                        per_engine_labelvalues)
                          for key, doc in COUNTERS.items()}

    def observe(self, transfer_stats_data: dict, engine_idx: int = 0):
        for key, amount in transfer_stats_data.items():
            if key in self._counters and amount > 0:
                self._counters[key][engine_idx].inc(amount)


__all__ = ["COUNTERS", "STORE_COUNTERS", "RagattnStats", "RagattnPromMetrics"]
