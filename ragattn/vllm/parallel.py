"""Tensor parallelism for the connector: which of the chunk store's KV heads a worker writes and
reads, and the group its ranks agree through.

    heads = rank_kv_heads(vllm_config, store.num_kv_heads)   # range: this rank's KV heads of the store
    group = tp_group()                                        # None with one rank
    check_parallel(vllm_config.parallel_config)               # refuses pipeline parallelism by name

Under ``--tensor-parallel-size`` T vLLM splits every attention layer's KV heads over the ranks
(``QKVParallelLinear``): with ``Hkv >= T`` rank ``r`` holds heads ``[r * Hkv/T, (r+1) * Hkv/T)``;
with fewer heads than ranks each head is replicated on ``T / Hkv`` consecutive ranks (rank ``r``
holds head ``r // (T / Hkv)``). The chunk store holds every head; each rank's page writer writes
its share (:class:`ragattn.vllm.pages.PageWriter` ``heads``). The rank, the world size and the
per-rank head count come from vLLM's parallel state and model config.

Selective recompute runs the served (sharded) decoder layers on every rank in lockstep, so every
rank must recompute the same rows: the per-token scores it ranks (FusionRAG's attention, CacheBlend's
K/V deviation, sums over the heads) are summed over the ranks (``tp_group``) before the choice
(:func:`ragattn.methods.selection.top_rows`). For the same reason the ranks agree on every load
before any recompute runs (:func:`agree_loads`): a load that failed on one rank (a remote-tier
timeout, a file removed between the ranks' reads) or was written another way there fails on all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from vllm.config import ParallelConfig, VllmConfig


def kv_head_share(num_kv_heads: int, tp_size: int, tp_rank: int, local_heads: int) -> range:
    """The store's KV heads rank ``tp_rank`` of ``tp_size`` holds, ``local_heads`` of them (vLLM's
    ``ModelConfig.get_num_kv_heads``): vLLM's ``QKVParallelLinear`` rule (heads split over the
    ranks, or each head replicated on ``tp_size / num_kv_heads`` ranks). ValueError when the
    heads and ranks do not divide one another or ``local_heads`` is not the share."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"ragattn.vllm: tensor parallel rank {tp_rank} is outside [0, {tp_size})")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"ragattn.vllm: {num_kv_heads} KV heads cannot be shared by --tensor-parallel-size "
                         f"{tp_size} (one must divide the other)")
    replicas = max(1, tp_size // num_kv_heads)   # ranks holding the same heads
    share = max(1, num_kv_heads // tp_size)
    if local_heads != share:
        raise ValueError(f"ragattn.vllm: a rank of --tensor-parallel-size {tp_size} holds {share} of the chunk "
                         f"store's {num_kv_heads} KV heads, vLLM's model config says {local_heads}")
    first = (tp_rank // replicas) * share
    return range(first, first + share)


def rank_kv_heads(vllm_config: "VllmConfig", num_kv_heads: int) -> range:
    """This worker's share of the chunk store's ``num_kv_heads`` KV heads (all of them with one
    rank), from vLLM's tensor-parallel rank and world size and its model config's per-rank count."""
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    if tp_size == 1:
        return range(num_kv_heads)
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    if get_tensor_model_parallel_world_size() != tp_size:
        raise RuntimeError(f"ragattn.vllm: vLLM's tensor parallel group has {get_tensor_model_parallel_world_size()} "
                           f"ranks, its config {tp_size}")
    local = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    return kv_head_share(num_kv_heads, tp_size, get_tensor_model_parallel_rank(), local)


def tp_group():
    """vLLM's tensor-parallel ``GroupCoordinator`` when there is more than one rank, else None."""
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.distributed.parallel_state import get_tp_group, model_parallel_is_initialized
    if not model_parallel_is_initialized() or get_tensor_model_parallel_world_size() == 1:
        return None
    return get_tp_group()


# how a rank wrote a load's chunks (ragattn.vllm.connector_worker): not at all, into the request's own
# blocks, or into shared chunk pages
FAILED, COPY, SHARED = 0, 1, 2


def agree_loads(codes: Sequence[int], group) -> list[bool]:
    """For each load, whether every rank wrote it and wrote it the same way: ``codes[i]`` is how
    this rank wrote load ``i`` (:data:`FAILED`, :data:`COPY`, :data:`SHARED`); True where the
    codes of all ranks are equal and not FAILED. ``group``: vLLM's tensor-parallel
    ``GroupCoordinator`` (its CPU group) or a ``torch.distributed`` process group; None (one rank):
    True where the code is not FAILED. Every rank calls it with as many codes (the scheduler's
    metadata is the same on every rank): one collective, which also orders the ranks' recomputes."""
    if group is None or not codes:
        return [c != FAILED for c in codes]
    import torch.distributed as dist

    t = torch.tensor(list(codes), dtype=torch.int64)
    both = torch.cat([t, -t])                # min over the ranks of the codes and of their negation (-max)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=getattr(group, "cpu_group", group))
    lo, hi = both[:len(t)], -both[len(t):]
    return ((lo == hi) & (lo != FAILED)).tolist()


def check_parallel(parallel_config: "ParallelConfig") -> None:
    """Refuses pipeline parallelism by name (NotImplementedError): a stage holds some of the
    layers, and the page writer and the recompute write and run all of them in one worker."""
    pp = parallel_config.pipeline_parallel_size
    if pp != 1:
        raise NotImplementedError(f"ragattn.vllm: --pipeline-parallel-size {pp} is not supported by the ragattn "
                                  "connector (each pipeline stage holds some of the layers; the connector writes and "
                                  "recomputes every layer in one worker); use --tensor-parallel-size instead")


__all__ = ["kv_head_share", "rank_kv_heads", "tp_group", "agree_loads", "check_parallel", "FAILED", "COPY",
           "SHARED"]
