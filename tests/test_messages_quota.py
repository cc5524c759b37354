"""What a request to a `kind: anthropic` backend costs against token quotas when the answer ends
before its usage is final, or comes without usage: never less than what was delivered, never
nothing (tenants/quota.py `_tokens_used`). Real sockets: the gateway and tests/fake_anthropic.py."""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE
from tests.fake_anthropic import FakeAnthropic

KEY = "sk-acme-" + secrets.token_hex(8)
MSG = [{"role": "user", "content": "hi"}]


class NoUsage(FakeAnthropic):
    """Whole Messages without a `usage` object (an Anthropic-compatible server that sends none)."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._answer(request)
        if isinstance(resp, web.Response) and resp.body and resp.content_type == "application/json":
            obj = orjson.loads(resp.body)  # type: ignore[arg-type]
            obj.pop("usage", None)
            return web.json_response(obj)
        return resp


@pytest.fixture
async def anthropic(monkeypatch):
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-up")
    started: list[FakeAnthropic] = []

    async def make(cls: type[FakeAnthropic] = FakeAnthropic, **behaviour: Any) -> FakeAnthropic:
        fake = cls("an", key="sk-ant-up", model="claude-fake-1", **behaviour)
        await fake.start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


async def _gateway(gateway, fake: FakeAnthropic, quota: dict[str, Any]):
    return await gateway({
        "backends": {"an": {"url": fake.url, "kind": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY",
                            "models": {"a": "claude-fake-1"}}},
        "cache": {"enabled": False},
        "tenants": {"acme": {"key_sha256": [hash_key(KEY)], "quota": quota}},
    })


async def _tokens(gw) -> int:
    await gw.app[LIVE].runtime.quota.drain()
    return (await gw.app[LIVE].runtime.quota.usage("acme"))[""].window_tokens


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
async def test_a_stream_cut_before_its_final_usage_is_charged_what_it_delivered(gateway, anthropic, path):
    # message_start says 1 output token; the count comes with message_delta, which a stream cut
    # after 390 words never sends. Taken as final, the first said 390 deltas cost 2 tokens.
    fake = await anthropic(words=400, cut_after=390)
    gw = await _gateway(gateway, fake, {"tpm": 100_000})
    body = {"model": "a", "max_tokens": 4000, "stream": True, "messages": MSG}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
            raw = await r.read()
    assert raw.count(b"w389") == 1 and b"w390" not in raw  # every delivered word, then the cut
    assert 390 <= await _tokens(gw) < 600


async def test_a_whole_message_without_usage_is_charged_its_reservation(gateway, anthropic):
    # Read as zeros, a Message without usage cost nothing: every request passed the limit.
    fake = await anthropic(NoUsage, words=300)
    gw = await _gateway(gateway, fake, {"tpm": 1000})
    statuses = []
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(gw.url + "/v1/messages", json={"model": "a", "max_tokens": 900, "messages": MSG},
                                 headers={"x-api-key": KEY}) as r:
                await r.read()
                statuses.append(r.status)
    assert statuses == [200, 429, 429]
    assert 900 <= await _tokens(gw) <= 1000  # the reservation: the prompt estimate and max_tokens
    assert fake.stats.requests == 1


async def test_a_chat_request_without_a_limit_is_bounded_by_the_tpm_on_its_way_to_an_anthropic_backend(gateway, anthropic):
    # The translation sends a max_tokens of its own (4096) when the request sets none, which the
    # backend accepts: that is its ceiling, and a tpm share below it is written (before, 3,000
    # completion tokens came back under a tpm of 300; review helper's repro).
    fake = await anthropic(words=3000)
    gw = await _gateway(gateway, fake, {"tpm": 300})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "a", "messages": MSG},
                             headers={"authorization": f"Bearer {KEY}"}) as r:
            body = await r.json()
    assert r.status == 200 and fake.stats.last_body["max_tokens"] == 300, fake.stats.last_body
    assert body["usage"]["completion_tokens"] <= 300 and body["choices"][0]["finish_reason"] == "length"
    gw = await _gateway(gateway, fake, {"tpm": 100_000})  # a share above what the translation sends: its 4096 stands
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "a", "messages": MSG},
                             headers={"authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
    assert fake.stats.last_body["max_tokens"] == 4096


BIG = "lorem ipsum dolor sit amet " * 15_000  # ~405,000 characters: ~100,000 tokens


@pytest.mark.parametrize("extra", [{"thinking": {"type": "enabled", "budget_tokens": 1024}}, {"top_k": 5}])
@pytest.mark.parametrize("where", ["system", "blocks", "tool_result", "document"])
async def test_a_prompt_chat_cannot_express_is_estimated_from_all_its_text(gateway, anthropic, extra, where):
    """On a route that classifies, the prompt estimate is the classifier's view of the body; for a
    body chat cannot express (thinking, top_k, ...) that view kept only string-content turns: a
    100,000-token prompt was reserved and charged 3 tokens, and tpm let three through where it
    refuses the second (review helper's repro). Its view now holds all its text. (A backend that
    reports no usage: what is charged is the estimate.)"""
    fake = await anthropic(NoUsage)
    be = {"url": fake.url, "kind": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY", "models": {"a": "claude-fake-1"}}
    gw = await gateway({
        "backends": {"an": be, "an2": dict(be)}, "models": {"a": {"simple": ["an"], "complex": ["an2"]}},
        "cache": {"enabled": False},
        "tenants": {"acme": {"key_sha256": [hash_key(KEY)], "quota": {"tpm": 5_000}}},
    })
    turns: list[dict[str, Any]] = {
        "system": [{"role": "user", "content": "hi"}],
        "blocks": [{"role": "user", "content": [{"type": "text", "text": BIG}]}],
        "tool_result": [
            {"role": "user", "content": "look it up"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get", "input": {"q": "x"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": BIG}]}]},
        ],
        "document": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": BIG}},
            {"type": "text", "text": "summarise it"}]}],
    }[where]
    body: dict[str, Any] = {"model": "a", "max_tokens": 100, "messages": turns, **extra}
    if where == "system":
        body["system"] = BIG
    if where == "tool_result":
        body["tools"] = [{"name": "get", "description": "look up", "input_schema": {"type": "object"}}]
    statuses = []
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
                await r.read()
                statuses.append(r.status)
    assert statuses == [200, 429], statuses  # the first is capped at the tpm; the second is refused
    assert await _tokens(gw) > 90_000
