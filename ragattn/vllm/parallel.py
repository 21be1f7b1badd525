"""Tensor and pipeline parallelism for the connector: which of the chunk store's KV heads and
layers a worker writes and reads, and the groups its workers agree through.

    heads = rank_kv_heads(vllm_config, store.num_kv_heads)   # range: this rank's KV heads of the store
    layers = stage_layers(kv_cache_names)                     # range: this stage's layers of the store
    group = tp_group()                                        # None with one rank
    why = recompute_refusal(vllm_config.parallel_config)      # why CacheBlend / FusionRAG cannot run, or None

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

Under ``--pipeline-parallel-size`` P vLLM gives each stage a contiguous run of the decoder layers
(``get_pp_indices``; the others are ``PPMissingLayer``) and registers only their KV caches with the
stage's workers' connector (``register_kv_caches``: ``model.layers.{i}.self_attn.attn`` for the
stage's ``i``); the scheduler's KV cache config is stage 0's (its layer names only; the block ids
are every stage's). Each stage's page writer writes its layers of the store (:func:`stage_layers`,
:class:`ragattn.vllm.pages.PageWriter` ``layers``). The stages cannot agree on a load before the
forward as the ranks do: a later stage receives its hidden rows from the one before it before its
connector's ``start_load_kv`` runs, so a collective over the pipeline group there waits on a
stage that waits on it. Instead no stage writes a load another way than the others would (under
pipeline parallelism a chunk that cannot be written into its shared pages fails the load rather
than falling back to copies), and a load that failed on any stage fails for the request:
the scheduler sees the union of the stages' failed blocks (vLLM recomputes them exactly on every
stage), drops the request's shared-page report (:meth:`RagattnWorkerMetadata.aggregate`) and tells
every worker to forget the request's shared entries before its next step
(``RagattnConnectorMetadata.dropped``). Selective recompute drives every decoder layer in one
worker, so CacheBlend and FusionRAG are refused per request under pipeline parallelism
(:func:`recompute_refusal`: answered by full attention, the reason in ``kv_transfer_params``).
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


def pp_group():
    """vLLM's pipeline-parallel ``GroupCoordinator`` when there is more than one stage, else None."""
    from vllm.distributed.parallel_state import get_pp_group, model_parallel_is_initialized
    if not model_parallel_is_initialized() or get_pp_group().world_size == 1:
        return None
    return get_pp_group()


def stage_layers(names: Sequence[str]) -> range:
    """The model layers a worker's KV caches ``names`` (vLLM's attention layer names,
    ``model.layers.{i}.self_attn.attn``) are: every layer without pipeline parallelism, a stage's
    run of them with it. ValueError when they are not one contiguous run (a name without one layer
    number, a layer missing or named twice)."""
    from ragattn.vllm.spans import layer_index
    if not names:
        raise ValueError("ragattn.vllm: the worker registered no KV caches")
    idx = sorted(layer_index(n) for n in names)
    if idx != list(range(idx[0], idx[0] + len(idx))):
        raise ValueError(f"ragattn.vllm: the worker's attention layers {idx} are not one contiguous run of the "
                         "model's layers (a pipeline stage holds one)")
    return range(idx[0], idx[-1] + 1)


def recompute_refusal(parallel_config: "ParallelConfig") -> str | None:
    """Why selective recompute (CacheBlend, FusionRAG) cannot run under this parallel layout, or
    None: under pipeline parallelism a stage holds some of the decoder layers, and the recompute
    runs every layer on the chosen rows in one worker before the forward."""
    pp = parallel_config.pipeline_parallel_size
    if pp == 1:
        return None
    return (f"it recomputes rows through every decoder layer in one worker, and under --pipeline-parallel-size {pp} "
            "each stage holds some of the layers")


# how a rank wrote a load's chunks (ragattn.vllm.connector_worker): not at all, into the request's own
# blocks, or into shared chunk pages
FAILED, COPY, SHARED = 0, 1, 2


def agree_loads(codes: Sequence[int], group) -> list[bool]:
    """For each load, whether every rank of a stage wrote it and wrote it the same way: ``codes[i]``
    is how this rank wrote load ``i`` (:data:`FAILED`, :data:`COPY`, :data:`SHARED`); True where
    the codes of all ranks are equal and not FAILED. ``group``: vLLM's tensor-parallel
    ``GroupCoordinator`` (its CPU group) or a ``torch.distributed`` process group; None (one rank):
    True where the code is not FAILED. Every rank calls it with as many codes (the scheduler's
    metadata is the same on every rank): one collective, which also orders the ranks' recomputes.
    Never over the pipeline group (see the module docstring)."""
    if group is None or not codes:
        return [c != FAILED for c in codes]
    import torch.distributed as dist

    t = torch.tensor(list(codes), dtype=torch.int64)
    both = torch.cat([t, -t])                # min over the ranks of the codes and of their negation (-max)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=getattr(group, "cpu_group", group))
    lo, hi = both[:len(t)], -both[len(t):]
    return ((lo == hi) & (lo != FAILED)).tolist()


__all__ = ["kv_head_share", "rank_kv_heads", "tp_group", "pp_group", "stage_layers",
           "recompute_refusal", "agree_loads", "FAILED", "COPY", "SHARED"]
