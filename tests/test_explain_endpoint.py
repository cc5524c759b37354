"""/v1/route/explain reads the body as the endpoint `?endpoint=` names: an embeddings body and a
Responses one look alike (`input`, no `messages`), and a Messages body has `messages` like chat's.
Without the parameter it guesses as before; a name that is no endpoint is a 400 naming it."""

from __future__ import annotations

import hashlib
import secrets

import aiohttp
import orjson
import pytest

KEY = "sk-acme-" + secrets.token_hex(16)


def _policy(small, big) -> dict:
    return {
        "version": 1, "cache": {"enabled": False},
        "backends": {"small": {"url": small.url, "models": ["tiny"], "endpoints": ["chat", "embeddings", "responses"]},
                     "big": {"url": big.url, "models": ["large"], "endpoints": ["chat", "embeddings", "responses"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "tenants": {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}},
    }


async def _explain(gw, body: dict, query: str = "") -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain" + query, data=orjson.dumps(body),
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as r:
            return r.status, orjson.loads(await r.read())


@pytest.mark.parametrize(("query", "body", "endpoint"), [
    ("", {"model": "auto", "input": "hello there"}, "responses"),  # the guess, as before
    ("?endpoint=embeddings", {"model": "auto", "input": "hello there"}, "embeddings"),
    ("?endpoint=responses", {"model": "auto", "input": "hello there"}, "responses"),
    ("", {"model": "auto", "messages": [{"role": "user", "content": "hi"}]}, "chat"),
    ("?endpoint=messages", {"model": "auto", "max_tokens": 16, "system": "Be brief.",
                            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "messages"),
])
async def test_explain_reads_the_body_as_the_named_endpoint(upstream, gateway, query, body, endpoint):
    gw = await gateway(_policy(await upstream("small"), await upstream("big")))
    status, why = await _explain(gw, body, query)
    assert status == 200, why
    assert why["endpoint"] == endpoint, why


async def test_an_unknown_endpoint_is_a_400_naming_the_parameter_and_the_choices(upstream, gateway):
    gw = await gateway(_policy(await upstream("small"), await upstream("big")))
    status, why = await _explain(gw, {"model": "auto", "input": "hi"}, "?endpoint=" + "x" * 5000)
    assert status == 400, why
    err = why["error"]
    assert err["param"] == "endpoint" and err["type"] == "invalid_request_error", err
    assert "embeddings" in err["message"] and "messages" in err["message"] and len(err["message"]) < 300, err
