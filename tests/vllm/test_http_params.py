"""``kv_transfer_params`` checked at the HTTP front end (ragattn.vllm.http, free of vLLM): the
field each bad value is named by, and an ASGI round trip (400 answered, good bodies passed on
intact)."""
import asyncio
import json

import pytest

from ragattn.vllm.http import KVTransferParamsCheck, check_request

PROMPT = list(range(100))


@pytest.mark.parametrize("params, field", [
    ({"ragattn_spans": [[0, 101]]}, "kv_transfer_params.ragattn_spans"),
    ({"ragattn_spans": [[0, 10], [9, 20]]}, "kv_transfer_params.ragattn_spans"),
    ({"ragattn_spans": [[0, True]]}, "kv_transfer_params.ragattn_spans"),
    ({"ragattn_spans": [[3, 3]]}, "kv_transfer_params.ragattn_spans"),
    ({"ragattn_spans": {"0": 10}}, "kv_transfer_params.ragattn_spans"),
    ({"spans": [[0, 10]]}, "kv_transfer_params.spans"),
    ("[[0, 10]]", "kv_transfer_params"),
    ({"ragattn_spans": [[0, 10]], "ragattn_method": "blend"}, "kv_transfer_params.ragattn_method"),
    ({"ragattn_method": "cacheblend", "ragattn_ratio": 2}, "kv_transfer_params.ragattn_ratio"),
    ({"ragattn_method": "cacheblend", "ragattn_ratio": 10 ** 400}, "kv_transfer_params.ragattn_ratio"),
    ({"ragattn_method": "fusionrag", "ragattn_ratio": -10 ** 400}, "kv_transfer_params.ragattn_ratio"),
    ({"ragattn_method": "turborag-composite", "ragattn_ratio": 0.5}, "kv_transfer_params.ragattn_ratio"),
])
def test_bad_params_name_the_field(params, field):
    got = check_request({"prompt": PROMPT, "kv_transfer_params": params})
    assert got is not None and got[0] == field and field.split(".")[-1] in got[1]


@pytest.mark.parametrize("body", [
    {"prompt": PROMPT},
    {"prompt": PROMPT, "kv_transfer_params": None},
    {"prompt": PROMPT, "kv_transfer_params": {"ragattn_spans": [[0, 10], [10, 99]]}},
    {"prompt": "text", "kv_transfer_params": {"ragattn_spans": [[0, 10 ** 6]]}},   # range: the connector's
    {"prompt": PROMPT, "kv_transfer_params": {"ragattn_spans": [[0, 10]], "ragattn_method": "fusionrag",
                                              "ragattn_ratio": 0.2}},
    {"prompt": PROMPT, "kv_transfer_params": {"ragattn_method": "turborag-composite"}},   # spans from a separator
])
def test_good_params_pass(body):
    assert check_request(body) is None


def _call(body: bytes, path="/v1/completions"):
    seen = {}

    async def app(scope, receive, send):
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m["body"], m.get("more_body", False)
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    sent = []
    parts = [body[:7], body[7:]]

    async def receive():
        b = parts.pop(0)
        return {"type": "http.request", "body": b, "more_body": bool(parts)}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "method": "POST", "path": path}
    asyncio.run(KVTransferParamsCheck(app)(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen


def test_asgi_round_trip():
    bad = json.dumps({"prompt": PROMPT, "kv_transfer_params": {"ragattn_spans": [[0, 500]]}}).encode()
    status, body, seen = _call(bad)
    assert status == 400 and json.loads(body)["error"]["param"] == "kv_transfer_params.ragattn_spans" and not seen
    good = json.dumps({"prompt": PROMPT, "kv_transfer_params": {"ragattn_spans": [[0, 50]]}}).encode()
    status, body, seen = _call(good)
    assert status == 200 and body == b"ok" and seen["body"] == good
