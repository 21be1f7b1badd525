"""The worker side of :class:`ragattn.vllm.connector.RagattnConnector`: the chunk store, the page
writer, the selective recompute and the worker's :class:`~ragattn.vllm.worker_state.WorkerState`
(which ragattn's attention backend reads through its metadata).

    worker = ConnectorWorker(settings, vllm_config)
    worker.register_kv_caches(kv_caches)          # the writer (layout probed), the recompute
    worker.start_load_kv(meta)                    # each RagattnConnectorMetadata load, before the forward
    worker.build_connector_worker_meta()          # RagattnWorkerMetadata for the scheduler
    worker.get_block_ids_with_load_errors(); worker.get_finished(finished_req_ids)
"""
from __future__ import annotations

import time

import torch

from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
import vllm.platforms as vllm_platforms

from ragattn.kv import SharedEntries
from ragattn.ops.page_table import num_pages, page_index, page_offset
from ragattn.store import ChunkStore, ChunkStoreError
from ragattn.vllm.backend import RagattnAttentionImpl
from ragattn.vllm.connector_config import (FP8_CACHE_DTYPES, RagattnConnectorMetadata, RagattnWorkerMetadata,
                                           RequestLoad, Settings)
from ragattn.vllm.gate import GateError, run_gate
from ragattn.vllm.pages import (BACKEND_KV_SPLIT, CPU_ATTN_ISA_KV_SPLIT, FP8_STORAGE, KV_SPLITS, NULL_BLOCK,
                                CacheLayoutError, PageWriter, head_views)
from ragattn.vllm.metrics import STORE_COUNTERS, RagattnStats
from ragattn.vllm.parallel import COPY, FAILED, SHARED, agree_loads, pp_group, rank_kv_heads, stage_layers, tp_group
from ragattn.vllm.recompute import Recomputed, Recomputer, RecomputeError, RecomputeRequest
from ragattn.vllm.spans import composite_positions, layer_index
from ragattn.vllm.worker_state import WorkerState

log = init_logger(f"vllm.{__name__}")   # vLLM's logger tree: its lines carry level and time


class RankDisagreement(RuntimeError):
    """Another tensor-parallel rank could not load a request's chunks, or loaded them another way."""


LOAD_ERRORS = (ChunkStoreError, OSError, RecomputeError, GateError)


class ConnectorWorker:
    """The connector's worker-side state: ``settings``, ``store`` (the chunk store, CPU), ``writer``
    and ``recomputer`` (at :meth:`register_kv_caches`), ``state`` (the worker's WorkerState),
    ``gate`` (the quality gate's :class:`~ragattn.vllm.gate.ServedVerdict`, None when off)."""

    def __init__(self, settings: Settings, vllm_config):
        self.settings, self.vllm_config = settings, vllm_config
        self.state = WorkerState()
        budget = settings.memory_budget
        # the store lives on the CPU (chunk K/V in host memory, staged to the caches' device) and
        # only serves chunk files (ragattn.vllm.store)
        self._store = ChunkStore(settings.chunk_model, settings.dir, page_size=settings.block_size, read_only=True,
                                 memory_budget=None if budget is None else int(budget), remote=settings.remote)
        self._writer: PageWriter | None = None
        self._recomputer: Recomputer | None = None
        self._group = None                                    # vLLM's tensor-parallel group (None: one rank)
        self._failed_blocks: set[int] = set()
        self._done: dict[str, list[int]] = {}
        self._written: dict[str, tuple[int, ...]] = {}   # chunk -> the shared pages holding it
        self._shared_done: dict[str, tuple[int, list[int]]] = {}
        self._failed_chunks: list[str] = []
        self._failed_requests: dict[str, list[int]] = {}
        self._stats = RagattnStats()                          # for /metrics (ragattn.vllm.metrics)
        self._store_seen = {k: 0 for k in STORE_COUNTERS}     # the store's counters already counted
        # the quality gate, once per model and store (kept under the chunk directory; GateError in mode "refuse")
        self.gate = self._run_gate()

    def _run_gate(self):
        """The quality gate's verdict (:func:`ragattn.vllm.gate.run_gate`); under tensor or pipeline
        parallelism the first stage's rank 0 runs it and hands its verdict (or its GateError) to
        the other ranks of its stage, then each of them to its later stages, so the gate runs once
        and every worker refuses the same methods."""
        s = self.settings
        tp, pp = tp_group(), pp_group()
        first_stage = pp is None or pp.rank_in_group == 0
        verdict = error = None
        if first_stage and (tp is None or tp.rank_in_group == 0):
            try:
                verdict, error = run_gate(s.dir, s.fingerprint, s.hf_path, self.vllm_config.model_config.dtype,
                                          s.gate_mode), None
            except GateError as exc:
                verdict, error = None, str(exc)
        for group, here in ((tp, first_stage), (pp, True)):
            if group is not None and here:
                verdict, error = group.broadcast_object((verdict, error) if group.rank_in_group == 0 else None, src=0)
        if error is not None:
            raise GateError(error)
        return verdict

    @property
    def store(self) -> ChunkStore:
        return self._store

    @property
    def writer(self) -> PageWriter | None:
        return self._writer

    def _attn_layers(self) -> dict:
        return get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)

    def _kv_split(self) -> str:
        """The cache layout of the attention backend (and, for CPU_ATTN, of its ISA); an unknown one
        is refused (CacheLayoutError at start-up) unless ``kv_split`` names it."""
        split = self.settings.kv_split
        if split is not None:
            return split
        layers = self._attn_layers().values()
        # a backend that declares its layout (ragattn's: RagattnAttentionBackend.kv_split); the probe checks it
        declared = {getattr(layer.get_attn_backend(), "kv_split", None) for layer in layers}
        if len(declared) == 1 and next(iter(declared)) in KV_SPLITS:
            return next(iter(declared))
        names = {layer.get_attn_backend().get_name() for layer in layers}
        name = next(iter(names)) if len(names) == 1 else None
        if name == "CPU_ATTN":
            isas = {getattr(layer, "isa", None) for layer in layers}
            isa = next(iter(isas)) if len(isas) == 1 else None
            if isa not in CPU_ATTN_ISA_KV_SPLIT:
                raise CacheLayoutError(f"ragattn.vllm: vLLM's CPU attention backend uses the ISA(s) {sorted(map(str, isas))}, "
                                       f"whose KV cache layout the writer does not know (known: "
                                       f"{sorted(CPU_ATTN_ISA_KV_SPLIT)})")
            return CPU_ATTN_ISA_KV_SPLIT[isa]
        if name not in BACKEND_KV_SPLIT:
            raise CacheLayoutError(f"ragattn.vllm: unsupported attention backend(s) {sorted(names)} (known cache "
                                   f"layouts: {sorted(BACKEND_KV_SPLIT) + ['CPU_ATTN']}); set kv_connector_extra_config "
                                   "'kv_split' if the backend stores K/V like one of them")
        return BACKEND_KV_SPLIT[name]

    def _fp8_scales(self, names: list[str], kv_caches: dict[str, torch.Tensor]):
        """Per layer ``(layer._k_scale, layer._v_scale)`` (the tensors themselves, read at each
        write) for the fp8 caches among ``kv_caches``, None for the others; None if none is fp8."""
        if not any(kv_caches[n].dtype in FP8_STORAGE for n in names):
            return None
        platform = vllm_platforms.current_platform   # (resolved here, not at import)
        if platform.fp8_dtype() != torch.float8_e4m3fn:
            raise CacheLayoutError(f"ragattn.vllm: this platform's fp8 KV cache type is {platform.fp8_dtype()}; "
                                   "the connector writes float8_e4m3fn caches only")
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase, names)
        out = []
        for n in names:
            if kv_caches[n].dtype not in FP8_STORAGE:
                out.append(None)
                continue
            layer = layers.get(n)
            kind = getattr(layer, "kv_cache_dtype", None)
            if kind not in FP8_CACHE_DTYPES or not hasattr(layer, "_k_scale"):
                raise CacheLayoutError(f"ragattn.vllm: layer {n}'s KV cache is {kv_caches[n].dtype} with kv_cache_dtype "
                                       f"{kind!r}; the connector writes fp8 caches of kv_cache_dtype "
                                       f"{' / '.join(FP8_CACHE_DTYPES)} (e4m3 with the layer's _k_scale/_v_scale) only")
            out.append((layer._k_scale, layer._v_scale))
        return out

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        names = sorted(kv_caches, key=layer_index)
        groups = None
        if self.settings.groups:
            grouped = [n for layers, _, _ in self.settings.groups for n in layers]
            if sorted(grouped) != sorted(names):
                raise CacheLayoutError(f"ragattn.vllm: the KV cache groups name layers {sorted(grouped)}, the worker's "
                                       f"caches are {sorted(names)}")
            pos = {n: i for i, n in enumerate(names)}   # (a stage's groups name its own layers)
            groups = [([pos[n] for n in layers], sliding, bs) for layers, sliding, bs in self.settings.groups]
        split = self._kv_split()
        # this rank's KV heads of the store (all of them without tensor parallelism)
        heads = rank_kv_heads(self.vllm_config, self._store.num_kv_heads)
        if len(heads) != self._store.num_kv_heads:
            log.info("ragattn.vllm: tensor parallel: this worker writes and reads KV heads %d..%d of the chunk "
                     "store's %d", heads.start, heads.stop - 1, self._store.num_kv_heads)
        # this stage's layers of the store (all of them without pipeline parallelism)
        try:
            layers = stage_layers(names)
        except ValueError as exc:
            raise CacheLayoutError(str(exc)) from None
        if len(layers) != self._store.num_layers:
            log.info("ragattn.vllm: pipeline parallel: this worker writes and reads layers %d..%d of the chunk "
                     "store's %d", layers.start, layers.stop - 1, self._store.num_layers)
        self._check_layout(names[0], kv_caches[names[0]], split, len(heads))
        self._writer = PageWriter(self._store, [kv_caches[n] for n in names], self.settings.block_size, split,
                                  groups=groups, scales=self._fp8_scales(names, kv_caches), heads=heads,
                                  layers=layers)
        if self.settings.shared:   # ragattn's backend reads the chunk pages with the model's RoPE
            self.state.rope = self._store.rope
        self._group = tp_group()
        self._recomputer = self._make_recomputer(names, kv_caches)

    def _make_recomputer(self, names: list[str], kv_caches: dict[str, torch.Tensor]):
        """The recompute over these caches where ragattn's backend serves them (one group), else None."""
        layers = self._attn_layers()
        impls = [getattr(layers.get(n), "impl", None) for n in names]
        if len(self.settings.groups) > 1 or not all(isinstance(i, RagattnAttentionImpl) for i in impls) \
                or self.settings.no_recompute:
            return None
        return Recomputer(self.vllm_config, names, [kv_caches[n] for n in names], impls[0].head_size,
                          impls[0].scale, self.state, tp_group())

    def _check_layout(self, name: str, kv: torch.Tensor, split: str, num_heads: int | None = None) -> None:
        """Start-up proof that ``split`` is where the backend keeps K and V: the backend's own cache
        write (``impl.do_kv_cache_update``) stores known K/V in a two-block copy of layer ``name``'s
        cache (its strides: a strided view of vLLM's shared buffer is probed as such) and the
        writer's views must read them back exactly; CacheLayoutError otherwise (a
        layout the writer does not know is refused before any chunk is written). Backends without
        that method (and fp8 caches) rest on the layout table alone. ``num_heads``: the KV heads
        this worker's caches hold (its tensor-parallel share; default the store's)."""
        layer = self._attn_layers().get(name)
        update = getattr(getattr(layer, "impl", None), "do_kv_cache_update", None)
        if update is None or kv.dtype in FP8_STORAGE or kv.dim() < 3 or kv.shape[0] < 2:
            return
        H, D, n = num_heads or self._store.num_kv_heads, self._store.head_dim, kv.shape[2]
        # two blocks in the cache's own strides: a view of vLLM's shared buffer (a block-outermost
        # layout) is not dense, and zeros_like would probe a contiguous copy instead of that layout
        scratch = torch.empty_strided((2, *kv.shape[1:]), kv.stride(), dtype=kv.dtype, device=kv.device).zero_()
        slots = torch.arange(max(0, n - 3), min(2 * n, n + 3))   # across the block boundary
        g = torch.Generator().manual_seed(0)
        key = torch.randn(len(slots), H, D, generator=g).to(kv.dtype).to(kv.device)
        value = torch.randn(len(slots), H, D, generator=g).to(kv.dtype).to(kv.device)
        try:
            with torch.inference_mode():
                update(layer, key, value, scratch, slots.to(kv.device))
        except Exception as exc:   # (a layer the engine has not set up: no ISA, no scales)
            log.warning("ragattn.vllm: cannot probe the KV cache layout of %s (%s); trusting the %r layout",
                        name, exc, split)
            return
        ks, vs = head_views(scratch, H, D, n, split)
        blk, off = page_index(slots, n), page_offset(slots, n)
        for h in range(H):
            if not (torch.equal(ks[h][blk, off, 0], key[:, h]) and torch.equal(vs[h][blk, off, 0], value[:, h])):
                backend = layer.get_attn_backend().get_name()
                raise CacheLayoutError(f"ragattn.vllm: the attention backend {backend} (ISA "
                                       f"{getattr(layer, 'isa', None)}) does not store K/V where the writer's "
                                       f"{split!r} layout puts them (start-up probe of {name}, head {h}): refused, "
                                       "nothing would be read back right")
        log.info("ragattn.vllm: KV cache layout %r checked against %s's own cache write", split,
                 layer.get_attn_backend().get_name())

    def _claimed_blocks(self, load: RequestLoad) -> set[int]:
        """The blocks a load writes (every group's, from vLLM's hit on; never a null block)."""
        out = set()
        for (_, sliding, bs), ids in zip(self.settings.groups or [([], False, self.settings.block_size)], load.block_ids):
            out |= {b for b in ids[page_index(load.skip, bs): num_pages(load.spans[-1][1], bs)]
                    if not (sliding and b == NULL_BLOCK)}
        return out

    def start_load_kv(self, meta: RagattnConnectorMetadata) -> None:
        """Writes every claimed request's chunks (all layers at once) before the forward, then runs
        the recomputes. A request whose chunks cannot all be loaded (unknown, foreign or corrupt
        file) is written not at all: its blocks are reported by :meth:`get_block_ids_with_load_errors`.
        Under tensor parallelism the ranks agree on every load between the two (:func:`agree_loads`):
        a load that failed, or was written another way, on any rank fails on every rank, so that the
        ranks' recomputes, which run the sharded layers' collectives, stay in lockstep. Pipeline
        stages cannot agree before the forward (:mod:`ragattn.vllm.parallel`): a stage never falls
        back to copies, and forgets the shared entries of the requests ``meta.dropped`` names
        (failed on another stage)."""
        assert isinstance(meta, RagattnConnectorMetadata)
        if meta.loads and self._writer is None:
            raise RuntimeError("ragattn.vllm: start_load_kv before register_kv_caches")
        for key in meta.evicted:
            self._written.pop(key, None)
        for req_id in meta.dropped:   # (failed on another pipeline stage: read from its own blocks now)
            self.state.requests.pop(req_id, None)
        written = []
        for load in meta.loads:
            self.state.requests.pop(load.req_id, None)
            written.append(self._timed(self._write, load))
        agreed = agree_loads([how if isinstance(how, int) else FAILED for how in written], self._group)
        for load, how, same in zip(meta.loads, written, agreed):
            if isinstance(how, Exception):
                self._fail(load, how)
            elif not same:
                self._fail(load, RankDisagreement("another tensor-parallel rank could not load its share of "
                                                  "these chunks, or loaded them another way"))
            else:
                result = self._timed(self._finish, load, how)
                if isinstance(result, Exception):
                    self._fail(load, result)

    def _timed(self, step, *args):
        """``step(*args)`` counted in ``load_seconds``; one of :data:`LOAD_ERRORS` is returned, not raised."""
        t0 = time.perf_counter()
        try:
            return step(*args)
        except LOAD_ERRORS as exc:
            return exc
        finally:
            self._stats.add("load_seconds", time.perf_counter() - t0)

    def _fail(self, load: RequestLoad, exc: Exception) -> None:
        """A load that failed: logged, counted and its blocks reported (vLLM computes them)."""
        self._stats.add("loads_failed", 1)
        failed = self._claimed_blocks(load)
        log.error("ragattn.vllm: request %s: cannot load its chunks (%s); blocks %s are reported "
                  "as failed loads", load.req_id, exc, sorted(failed))
        self._failed_blocks |= failed
        self._failed_requests[load.req_id] = sorted(failed)

    @staticmethod
    def _rotate_to(load: RequestLoad) -> torch.Tensor | None:
        return (torch.tensor(composite_positions(load.spans), dtype=torch.int64)
                if load.method.entry.positions == "composite" else None)

    def _write(self, load: RequestLoad) -> int:
        """One request's chunks into its pages: :data:`SHARED` (shared chunk pages) or :data:`COPY`
        (its own blocks); raises one of :data:`LOAD_ERRORS`."""
        if self.gate is not None and load.method.name in self.gate.refused:
            # (the scheduler claims none for it: only when it could not read the verdict)
            raise GateError(self.gate.refused[load.method.name])
        rotate_to = self._rotate_to(load)
        if load.chunk_blocks is not None and self._write_shared(load, rotate_to):
            return SHARED
        with torch.inference_mode():
            self._writer.write(load.keys, load.spans, load.block_ids, load.skip, rotate_to=rotate_to)
        return COPY

    def _write_shared(self, load: RequestLoad, rotate_to: torch.Tensor | None) -> bool:
        """Writes the chunks not in their shared pages yet (keys page-local) and copies the claim's
        last partial block into the request's own block. False (the copy path follows) if a chunk
        cannot be loaded: that chunk's pages are reported and never read."""
        bs = self.settings.block_size
        try:
            with torch.inference_mode():
                for key, blocks, (s, e) in zip(load.keys, load.chunk_blocks, load.spans):
                    if self._written.get(key) != tuple(blocks):
                        self._written.pop(key, None)
                        self._writer.write_chunk_pages(key, blocks, e - s)
                        self._written[key] = tuple(blocks)
                end = load.spans[-1][1]
                tail = end - page_offset(end, bs)
                if tail < end:
                    self._writer.write(load.keys, load.spans, load.block_ids, tail, rotate_to=rotate_to)
        except (ChunkStoreError, OSError) as exc:
            failed = [k for k in load.keys if k not in self._written]
            if self.settings.pipeline > 1:   # the other stages may have written it shared: fail it, never copy
                self._failed_chunks += failed
                raise
            log.warning("ragattn.vllm: request %s: chunk pages of %s not written (%s); copying its chunks instead",
                        load.req_id, failed, exc)
            self._failed_chunks += failed
            return False
        return True

    def _finish(self, load: RequestLoad, how: int) -> None:
        """After every rank wrote ``load`` the same way: its recompute (CacheBlend, FusionRAG) and,
        from shared pages, the entries ragattn's backend reads them through. RecomputeError: nothing
        registered (the load fails)."""
        if how == COPY:
            if load.method.recomputes:
                self._done[load.req_id] = self._recompute(load).positions
            return
        bs = self.settings.block_size
        tail = load.spans[-1][1] - page_offset(load.spans[-1][1], bs)
        if load.method.recomputes:
            done = self._recompute(load, shared=True)
            self._done[load.req_id] = done.positions
        else:
            done = Recomputed([], SharedEntries.build(load.spans, load.chunk_blocks, bs, self._rotate_to(load)))
        self.state.requests[load.req_id] = done.entries
        self._shared_done[load.req_id] = (done.held, list(load.block_ids[0][done.held:page_index(tail, bs)]))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id in finished_req_ids:
            self.state.requests.pop(req_id, None)
        return None, None

    def _recompute(self, load: RequestLoad, shared: bool = False) -> Recomputed:
        """CacheBlend / FusionRAG on the request's pages, or (``shared``) over its shared chunk
        pages (ragattn.vllm.recompute)."""
        if self._recomputer is None:
            why = self.settings.no_recompute or ("it needs ragattn's attention backend on one KV cache group "
                                                 "(RAGATTN_VLLM_ATTENTION=1)")
            raise RecomputeError(f"ragattn.vllm: {load.method.name} cannot run here: {why}")
        t0 = time.perf_counter()
        try:
            return self._recomputer.run(RecomputeRequest(load.method.name, load.method.ratio, load.prompt, load.spans,
                                                         load.block_ids[0], self.settings.groups[0][2]
                                                         if self.settings.groups else self.settings.block_size,
                                                         load.chunk_blocks if shared else None))
        finally:
            self._stats.add("recompute_seconds", time.perf_counter() - t0)

    def get_kv_connector_stats(self) -> RagattnStats | None:
        """The counters since the last call (load and recompute time, the store's tiers), or None."""
        for key, name in STORE_COUNTERS.items():
            now = self._store.stats.get(key, 0)
            self._stats.add(name, now - self._store_seen[key])
            self._store_seen[key] = now
        return self._stats.take()

    def build_connector_worker_meta(self) -> RagattnWorkerMetadata | None:
        if not (self._done or self._shared_done or self._failed_chunks or self._failed_requests):
            return None
        meta = RagattnWorkerMetadata(self._done, self._shared_done, self._failed_chunks, self._failed_requests)
        self._done, self._shared_done, self._failed_chunks, self._failed_requests = {}, {}, [], {}
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed


__all__ = ["ConnectorWorker"]
