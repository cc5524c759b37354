"""POST /v1/messages/count_tokens checks its body as /v1/messages does: every bad body is an
Anthropic-shaped 400 (never a 500, never a 200), nothing reaches a backend; a feature only a
translating backend lacks is refused for a chat backend's model and counted for a native one."""

from __future__ import annotations

import aiohttp
import anthropic
import orjson
import pytest

from gateway.tenants.auth import hash_key
from tests.fake_anthropic import FakeAnthropic

KEY = "sk-test"
HI = [{"role": "user", "content": "hi"}]
OK = {"model": "m", "messages": HI}
DEEP = "[" * 300 + "]" * 300  # orjson reads this, but refuses to write it back

BAD = [
    (orjson.dumps({**OK, "messages": [5]}), "messages[0]"),
    (orjson.dumps({**OK, "system": [5]}), "system[0]"),
    (orjson.dumps({**OK, "stop_sequences": 5}), "stop_sequences"),
    (orjson.dumps({**OK, "tool_choice": {"type": 5}}), "tool_choice"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": 5}]}), "content"),
    (orjson.dumps({**OK, "messages": [{"role": "robot", "content": "hi"}]}), "role"),
    (orjson.dumps({**OK, "tools": [5]}), "tools"),
    (orjson.dumps({"messages": HI}), "model"),
    (orjson.dumps({**OK, "messages": []}), "messages"),
    (orjson.dumps({**OK, "max_tokens": 5}), "max_tokens"),
    (orjson.dumps({**OK, "thinking": {"type": "enabled", "budget_tokens": 1024}}), "thinking"),  # chat has no thinking
    (b'{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use","id":"t",'
     b'"name":"f","input":{"x":' + DEEP.encode() + b'}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}]}',
     "nested too deeply"),
]


@pytest.mark.parametrize("raw,word", BAD, ids=[w for _, w in BAD])
async def test_bad_count_tokens_bodies_are_anthropic_400s(upstream, gateway, raw, word):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages/count_tokens", data=raw,
                             headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
            body = await r.json(content_type=None)
            assert r.status == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        assert word.lower() in body["error"]["message"].lower(), body
        async with http.post(gw.url + "/v1/messages/count_tokens", json=OK, headers={"x-api-key": KEY}) as r:
            assert r.status == 200 and (await r.json())["input_tokens"] >= 1  # and the next caller is answered
    assert up.stats.requests == 0


async def test_the_sdk_sees_a_bad_count_as_a_bad_request(upstream, gateway):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10) as c:
        with pytest.raises(anthropic.BadRequestError) as exc:
            await c.messages.count_tokens(model="m", messages=[5])  # type: ignore[list-item]
        assert exc.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


async def test_a_native_model_counts_what_only_translation_refuses(monkeypatch, gateway):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-up")
    fake = FakeAnthropic("an", key="sk-ant-up", words=3, model="claude-fake-1")
    await fake.start()
    try:
        gw = await gateway({"backends": {"an": {"url": fake.url, "kind": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY",
                                                "models": {"a": "claude-fake-1"}}},
                            "reload": {"watch": False}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        async with aiohttp.ClientSession() as http:
            body = {"model": "a", "messages": HI, "thinking": {"type": "enabled", "budget_tokens": 1024}}
            async with http.post(gw.url + "/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY}) as r:
                assert r.status == 200, await r.text()
            async with http.post(gw.url + "/v1/messages/count_tokens", json={"model": "a", "messages": [5]},
                                 headers={"x-api-key": KEY}) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
            deep = b'{"model":"a","messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f","input_schema":{"x":' + DEEP.encode() + b'}}]}'
            async with http.post(gw.url + "/v1/messages/count_tokens", data=deep,
                                 headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
                body = await r.json()  # no translation to catch it: the estimate's own encoding does
                assert r.status == 400 and "nested too deeply" in body["error"]["message"], body
    finally:
        await fake.stop()
