"""Per-worker state of ragattn in one vLLM worker process, held in one object.

The connector's worker side (:class:`ragattn.vllm.connector_worker.ConnectorWorker`) owns a
:class:`WorkerState`; the attention backend's metadata builder finds it through vLLM's KV
transfer group (the worker's connector, :func:`worker_state`) and hands the step's part of it to
every layer in the attention metadata; ragattn's vLLM worker (:mod:`ragattn.vllm.platform`) binds
its model and batch order into it once both exist::

    state = WorkerState()                        # ConnectorWorker.__init__
    state.rope = store.rope                      # shared chunk pages: the model's RoPE
    state.bind(model, lambda: runner.input_batch.req_ids)   # the platform's worker
    state.requests[req_id] = entries             # a request read from shared chunk pages
    entries = state.batch_entries(num_rows)      # the metadata builder, once per step
    worker_state()                               # this process's connector's state, or None
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

from ragattn.kv import SharedEntries


class RecomputeError(RuntimeError):
    """A recompute that cannot run for one request (its pages not allocated, no model bound):
    the connector reports the request's claimed blocks as a failed load and vLLM computes them."""


@dataclass
class WorkerState:
    """``requests``: the requests served from shared chunk pages (their entries); ``batch_req_ids``:
    the request ids of the step being built, in batch order (the model runner's input batch);
    ``rope``: the served model's RoPE (``ragattn.store.model.Rope``) where chunk pages are shared;
    ``model``: the served model (the selective recompute runs it)."""
    requests: dict[str, SharedEntries] = field(default_factory=dict)
    batch_req_ids: Callable[[], Sequence[str]] | None = None
    rope: object = None
    model: torch.nn.Module | None = None

    def bind(self, model: torch.nn.Module, batch_req_ids: Callable[[], Sequence[str]]) -> None:
        """The worker's model and its batch order, once the model is loaded."""
        self.model, self.batch_req_ids = model, batch_req_ids

    def bound_model(self) -> torch.nn.Module:
        if self.model is None:
            raise RecomputeError("ragattn.vllm: no model is bound for recompute: CacheBlend and FusionRAG need "
                                 "vLLM's worker from ragattn's platform (RAGATTN_VLLM_ATTENTION=1)")
        return self.model

    def serves_shared_pages(self) -> bool:
        """Whether steps may hold requests that read shared chunk pages."""
        return self.batch_req_ids is not None and self.rope is not None

    def batch_entries(self, num_rows: int) -> list[SharedEntries | None] | None:
        """Each of the step's first ``num_rows`` batch rows' entries (None: a row that reads no chunk
        pages), or None when no row does."""
        found = [self.requests.get(r) for r in self.batch_req_ids()[:num_rows]]
        return found if any(found) else None


def worker_state() -> WorkerState | None:
    """The state of this worker process's connector (vLLM's KV transfer group), or None (no
    connector, or not ragattn's)."""
    if not has_kv_transfer_group():
        return None
    return getattr(get_kv_transfer_group(), "worker_state", None)


__all__ = ["WorkerState", "RecomputeError", "worker_state"]
