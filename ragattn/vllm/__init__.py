"""ragattn inside vLLM 0.33: Block-Attention / TurboRAG chunk KV reuse through a KV connector.

    vllm serve <model> --kv-transfer-config '{"kv_connector": "RagattnConnector",
        "kv_connector_module_path": "ragattn.vllm.connector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"chunk_dir": "kv/"}}'

* :mod:`ragattn.vllm.connector`: the connector (imports vLLM; install ``ragattn[vllm]``).
* :mod:`ragattn.vllm.spans`: chunk spans of a prompt and the claim (scheduler side, no vLLM).
* :mod:`ragattn.vllm.pages`: chunk K/V into vLLM's paged caches (worker side, no vLLM).
* :mod:`ragattn.vllm.store`: the served model's fingerprint and the chunk directory check.
* :mod:`ragattn.vllm.fingerprint`: that fingerprint from the checkpoint files (no copy of the weights).
* :mod:`ragattn.vllm.serve`: a vLLM server as a child process (its command, start, stop; no vLLM).
* :func:`ragattn.ops.verify_draft_vllm`: ``verify_draft`` on vLLM's rejection-sampler layout.

Importing this package does not import vLLM (nor does ``import ragattn``). See docs/vllm.md.
"""
from ragattn.vllm.spans import (SPANS_PARAM, Claim, SpanError, plan_claim, separator_salt, span_salt, spans_from_params,
                                spans_from_separator)

__all__ = ["SPANS_PARAM", "Claim", "SpanError", "plan_claim", "separator_salt", "span_salt", "spans_from_params", "spans_from_separator"]
