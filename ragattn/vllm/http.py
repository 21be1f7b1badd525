"""``kv_transfer_params`` checked at the HTTP front end (free of vLLM): a request whose
``kv_transfer_params`` the connector cannot use gets HTTP 400 naming the field, instead of being
answered without its cached chunks.

    vllm serve ... --middleware ragattn.vllm.http.KVTransferParamsCheck

vLLM passes ``kv_transfer_params`` through to the connector in the engine process, where a bad
value can only be logged; this ASGI middleware checks it in the API server, before the request
is queued: a JSON object with the keys ``ragattn_spans`` (a list of ``[start, end)`` int pairs
in prompt order, not overlapping, inside the prompt: its length is known here for token-id
prompts; text prompts are range-checked by the connector, which then computes the request
without cached chunks and logs why), ``ragattn_method`` (one of ``ragattn.vllm.spans.METHODS``)
and ``ragattn_ratio`` (CacheBlend and FusionRAG: a number in [0, 1]), each optional.
"""
from __future__ import annotations

import json

from ragattn.vllm.spans import KNOWN_PARAMS, SPANS_PARAM, ParamError, SpanError, check_spans, method_from_params

PATHS = ("/v1/completions", "/v1/chat/completions")
_NO_LIMIT = 1 << 62


def _prompt_len(body: dict) -> int:
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return len(p)
    return _NO_LIMIT


def check_request(body) -> tuple[str, str] | None:
    """``(field, message)`` for a request body whose ``kv_transfer_params`` is unusable, else None."""
    if not isinstance(body, dict) or body.get("kv_transfer_params") is None:
        return None
    params = body["kv_transfer_params"]
    if not isinstance(params, dict):
        return "kv_transfer_params", f"kv_transfer_params must be a JSON object, got {type(params).__name__}"
    unknown = sorted(set(params) - set(KNOWN_PARAMS))
    if unknown:
        return (f"kv_transfer_params.{unknown[0]}",
                f"kv_transfer_params has unknown key(s) {unknown}; the ragattn connector reads {list(KNOWN_PARAMS)}")
    try:
        method_from_params(params)
    except ParamError as exc:
        return exc.field, str(exc).removeprefix("ragattn.vllm: ")
    if SPANS_PARAM not in params:
        return None
    spans = params.get(SPANS_PARAM)
    field = f"kv_transfer_params.{SPANS_PARAM}"
    if not isinstance(spans, list):
        return field, f"{field} must be a list of [start, end) pairs of ints, got {type(spans).__name__}"
    try:
        check_spans(spans, _prompt_len(body))
    except SpanError as exc:
        return field, f"{field}: {str(exc).removeprefix('ragattn.vllm: ')}"
    return None


class KVTransferParamsCheck:
    """Pure ASGI middleware (vLLM's ``--middleware``): see the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in PATHS:
            return await self.app(scope, receive, send)
        messages, chunks, more = [], [], True
        while more:
            m = await receive()
            messages.append(m)
            if m["type"] != "http.request":
                break
            chunks.append(m.get("body", b""))
            more = m.get("more_body", False)
        try:
            problem = check_request(json.loads(b"".join(chunks) or b"null"))
        except ValueError:
            problem = None    # not JSON: vLLM's own validation answers it
        if problem is not None:
            field, message = problem
            body = json.dumps({"error": {"message": f"ragattn: {message}", "type": "BadRequestError",
                                         "param": field, "code": 400}}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


__all__ = ["KVTransferParamsCheck", "check_request", "PATHS"]
