"""/v1/responses answered by a backend that serves only chat completions (the local model's shape):
translated to chat and back, stateless parts only, with the official openai SDK as the client."""

from __future__ import annotations

import aiohttp
import openai
import pytest

WORDS = " ".join(f"w{i}" for i in range(5))


def _policy(*ups, **extra):
    p = {
        "backends": {u.name: {"url": u.url, "models": ["m"], "endpoints": ["chat", "completions"]} for u in ups},
        "reload": {"watch": False},
    }
    p.update(extra)
    return p


async def test_a_chat_only_backend_answers_the_responses_api(upstream, gateway):
    up = await upstream("local", tokens=5, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(up, cache={"enabled": False}))
    c = gw.client()
    r = await c.responses.create(model="m", input="Say something", instructions="Be brief.", max_output_tokens=32)
    assert r.status == "completed" and r.output_text.strip() == WORDS and r.usage.output_tokens > 0
    sent = up.stats.last_body  # a chat request went out
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."} and sent["max_tokens"] == 32
    assert up.stats.by_path.get("/v1/responses", 0) == 0
    events, text = [], ""
    stream = await c.responses.create(model="m", input="Say something", stream=True)
    async for ev in stream:
        events.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
    assert events[0] == "response.created" and events[-1] == "response.completed" and text.strip() == WORDS
    async with c.responses.stream(model="m", input="Say something") as s:
        final = await s.get_final_response()
    assert final.output_text.strip() == WORDS


async def test_state_it_cannot_hold_is_refused_and_cached_answers_replay(upstream, gateway):
    up = await upstream("local", tokens=3, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(up))
    c = gw.client()
    with pytest.raises(openai.NotFoundError):  # no backend holds it: pinning finds none, nothing is sent
        await c.responses.create(model="m", input="go on", previous_response_id="resp_abc")
    with pytest.raises(openai.BadRequestError, match="web_search"):
        await c.responses.create(model="m", input="look it up", tools=[{"type": "web_search"}])
    assert up.stats.requests == 0
    body = {"model": "m", "input": "Say something", "temperature": 0}
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(gw.url + "/v1/responses", json=body) as r:
                first = await r.json()
                cache = r.headers["x-gateway-cache"]
        assert cache == "hit" and up.stats.requests == 1 and first["output"][0]["content"][0]["text"].strip() == "w0 w1 w2"
        async with http.post(gw.url + "/v1/responses", json={**body, "stream": True}) as r:
            raw = await r.read()
            assert r.headers["x-gateway-cache"] == "hit" and b"response.completed" in raw


async def test_state_is_made_and_kept_only_where_the_api_is_native(upstream, gateway):
    """A conversation is made on a backend that speaks the Responses API, never on one reached
    through translation, and its turns go there even though a chat-only backend ranks first."""
    local = await upstream("local", tokens=3, endpoints=("chat", "completions", "models"))
    prov = await upstream("prov", tokens=3)
    gw = await gateway({
        "backends": {"local": {"url": local.url, "models": ["m"], "endpoints": ["chat", "completions"]},
                     "prov": {"url": prov.url, "models": ["m"]}},
        "models": {"m": {"backends": ["local", "prov"], "strategy": "ordered"}},
        "reload": {"watch": False}, "cache": {"enabled": False},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/conversations", json={}) as r:
            made = await r.json()
            assert r.status == 200 and r.headers["x-gateway-backend"] == "prov", made
    c = gw.client()
    raw = await c.responses.with_raw_response.create(model="m", input="hello", conversation=made["id"])
    assert raw.headers["x-gateway-backend"] == "prov"
    plain = await c.responses.with_raw_response.create(model="m", input="hello")
    assert plain.headers["x-gateway-backend"] == "local"  # a stateless request: the ranking's first, through chat


def _deep(n: int) -> dict:
    v: dict = {"type": "string"}
    for _ in range(n):
        v = {"type": "object", "properties": {"x": v}}
    return v


async def test_a_schema_nested_past_what_json_can_write_back_is_a_400_not_a_500(upstream, gateway):
    """orjson reads 1,024 levels and writes ~255: a tool's parameters (or text.format's schema)
    nested 140 objects deep passed the translation's check and failed encoding the chat body (a
    500 and a traceback; review helper's repro). Encoded in the check: a 400, nothing sent."""
    up = await upstream("local", tokens=3, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(up, cache={"enabled": False}))
    for body in ({"model": "m", "input": "hi", "tools": [{"type": "function", "name": "f", "parameters": _deep(140)}]},
                 {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "o", "schema": _deep(140)}}}):
        async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/responses", json=body) as r:
            out = await r.json()
            assert r.status == 400 and "nested too deeply" in out["error"]["message"], out
    assert up.stats.requests == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_metadata_nested_past_what_json_can_write_back_is_a_400_and_blames_no_backend(upstream, gateway, stream):
    """`metadata` is not sent to chat but echoed in the Response: nested 300 deep, every backend's
    answer could not be written, each was blamed in turn until ejected (a 502), or a stream was a
    500 (review helper's repro). The echoed fields are checked with the request: a 400, nothing sent."""
    from gateway.web.keys import LIVE

    a = await upstream("loc1", tokens=3, endpoints=("chat", "completions", "models"))
    b = await upstream("loc2", tokens=3, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(a, b, cache={"enabled": False}, models={"m": {"backends": ["loc1", "loc2"], "strategy": "ordered"}}))
    body = {"model": "m", "input": "hi", "metadata": {"k": _deep(300)}, "stream": stream}
    async with aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(gw.url + "/v1/responses", json=body) as r:
                out = await r.json()
                assert r.status == 400 and out["error"]["param"] == "metadata", out
    assert a.stats.requests + b.stats.requests == 0
    assert all(gw.app[LIVE].runtime.backends[n].health.state() == "healthy" for n in ("loc1", "loc2"))


async def test_long_instructions_stream_through_a_chat_backend(upstream, gateway):
    """The translation's start events repeat the request (its instructions, 600 KB here) and are
    held until the first output: they counted against the 1 MiB a backend may send before it, so
    the backend was blamed ("sent over 1048576 bytes"), tried twice and the client got a 502
    (review helper's repro). What is bounded is the backend's bytes."""
    up = await upstream("local", tokens=3, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(up, cache={"enabled": False}))
    body = {"model": "m", "input": "Summarise the document.", "instructions": "lorem ipsum " * 50_000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/responses", json=body) as r:
        raw = await r.read()
        assert r.status == 200 and b"response.completed" in raw, raw[:300]
    assert up.stats.requests == 1


async def test_a_cached_answer_replays_the_response_a_fresh_one_would_be(upstream, gateway):
    """One entry serves streamed and whole requests alike; a stream's Response echoed the
    request's settings and a whole one's did not, so a hit differed from a fresh answer in
    instructions, tools, temperature, max_output_tokens (review helper's repro). Both echo now."""
    up = await upstream("local", tokens=3, endpoints=("chat", "completions", "models"))
    gw = await gateway(_policy(up))
    body = {"model": "m", "input": "hi", "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 50,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]}
    keys = ("instructions", "tools", "temperature", "max_output_tokens")
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", json={**body, "stream": True}) as r:
            await r.read()
            assert r.headers["x-gateway-cache"] == "miss"  # stored from the stream
        async with http.post(gw.url + "/v1/responses", json=body) as r:
            hit = await r.json()
            assert r.headers["x-gateway-cache"] == "hit"
        async with http.post(gw.url + "/v1/responses", json=body, headers={"cache-control": "no-cache"}) as r:
            fresh = await r.json()
    assert {k: hit.get(k) for k in keys} == {k: fresh.get(k) for k in keys}
    assert fresh["instructions"] == "Be brief." and fresh["max_output_tokens"] == 50
