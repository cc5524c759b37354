"""A hostile or careless caller of /v1/messages: every bad body is a clear Anthropic-shaped 400
(413 for a body over the limit), nothing reaches a backend, and the gateway keeps answering."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from gateway.tenants.auth import hash_key

KEY = "sk-test"
OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
DEEP = b"[" * 300 + b"]" * 300

BAD = [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    (orjson.dumps({**OK, "max_tokens": 0}), "max_tokens"),
    (orjson.dumps({**OK, "max_tokens": "8"}), "max_tokens"),
    (orjson.dumps({**OK, "messages": []}), "messages"),
    (orjson.dumps({**OK, "messages": [{"role": "robot", "content": "hi"}]}), "role"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}), "tool_use"),
    (orjson.dumps({**OK, "stream": "yes"}), "stream"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}), "document"),
    (orjson.dumps({**OK, "thinking": {"type": "enabled", "budget_tokens": 1024}}), "thinking"),
    # nesting orjson reads but cannot write back (its recursion limit): a 400 naming the field, not a 500
    (b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use",'
     b'"id":"t","name":"f","input":{"x":' + DEEP + b'}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}]}',
     "messages[1].content[0].input: nested too deeply"),
    (b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f","input_schema":{"x":' + DEEP + b'}}]}',
     "tools[0].input_schema: nested too deeply"),
    # Anthropic's tool pairing, which a lenient chat backend would not check
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                                      {"role": "user", "content": "never mind"}]}), "tool_use ids were found without tool_result"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]}),
     "tool_result block(s) for ids"),
    (orjson.dumps({**OK, "tool_choice": {"type": "any"}}), "tool_choice: 'any' needs tools"),
    (orjson.dumps({**OK, "tool_choice": {"type": "tool", "name": "f"}}), "tool_choice: 'tool' needs tools"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": []}]}), "messages[0].content: empty"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": ""}]}), "messages[0].content: empty"),
]


@pytest.mark.parametrize("raw,word", BAD, ids=[w.split(":")[0] for _, w in BAD])
async def test_bad_bodies_are_anthropic_400s_and_reach_no_backend(upstream, gateway, raw, word):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages", data=raw, headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
            body = await r.json(content_type=None)
            assert r.status == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert word.lower() in body["error"]["message"].lower(), body
        async with http.post(gw.url + "/v1/messages", json=OK, headers={"x-api-key": KEY}) as r:
            assert r.status == 200  # and the next caller is answered
    assert up.stats.requests == 1


async def test_a_body_over_the_limit_is_refused_unread_in_anthropics_shape(upstream, gateway):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "server": {"max_body_bytes": 4096}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    big = orjson.dumps({**OK, "messages": [{"role": "user", "content": "x" * 100_000}]})
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            async with http.post(gw.url + path, data=big, headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
                body = await r.json(content_type=None)
                assert r.status == 413 and body["type"] == "error", (path, body)
        async with http.post(gw.url + "/v1/messages", data=big, headers={"x-api-key": "wrong"}) as r:
            assert r.status == 401  # no key, nothing read
    assert up.stats.requests == 0
