"""What a request costs against token quotas when its backend reports no usage (several
OpenAI-compatible servers send none, on whole answers or streams), or when it ends without an
answer after reaching a backend: never nothing (see tenants/quota.py `_tokens_used`).

The fake upstream always reports usage, so these tests serve a backend of their own that never does.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from tests.conftest import simple_policy
from tests.servers import Served

MSG = [{"role": "user", "content": "hi"}]
KEY = "sk-acme-" + secrets.token_hex(16)
ADMIN = "sk-admin-" + secrets.token_hex(16)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class NoUsage(Served):
    """A chat backend that reports no usage: whole answers without a `usage` block, streams that
    ignore `stream_options.include_usage`. Answers are `words` words ("x "); `metadata.sleep`
    (seconds) holds back a whole answer, or a stream's first content after its role chunk."""

    def __init__(self, words: int) -> None:
        self.name, self.host, self.port = "nousage", "127.0.0.1", 0
        self.words = words
        self.requests = 0
        self.app = web.Application()
        self.app.add_routes([web.post("/v1/chat/completions", self._chat), web.get("/v1/models", self._models)])

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "gpt-test", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.json()
        sleep = float((body.get("metadata") or {}).get("sleep", 0))
        head: dict[str, Any] = {"id": "c1", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            await asyncio.sleep(sleep)
            message = {"role": "assistant", "content": "x " * self.words}
            return web.json_response({**head, "object": "chat.completion",
                                      "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", "choices": [choice]}) + b"\n\n"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(chunk({"role": "assistant", "content": ""}))
        await asyncio.sleep(sleep)
        for _ in range(self.words):
            await resp.write(chunk({"content": "x "}))
        await resp.write(chunk({}, "stop") + b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def no_usage():
    started: list[NoUsage] = []

    async def make(words: int = 500) -> NoUsage:
        up = await NoUsage(words).start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.stop()


async def _gateway(gateway, up: NoUsage, quota: dict[str, Any]):
    policy = simple_policy(up, cache={"enabled": False})
    policy["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": quota}}
    policy["admin"] = {"key_sha256": [_digest(ADMIN)]}
    return await gateway(policy)


async def _use(gw) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            return (await r.json())["tenants"]["acme"]["use"]["tenant"]


async def _post(http: aiohttp.ClientSession, gw, **body: Any) -> int:
    async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                         json={"model": "gpt-test", "messages": MSG, **body}) as r:
        await r.read()
        return r.status


async def test_whole_answers_without_usage_are_charged_their_reservation(gateway, no_usage):
    """500-word answers, max_tokens 500, under tpm 2,000: each is charged what it reserved (the
    prompt estimate + 500), so the limit refuses the fourth, as it would on reported usage."""
    up = await no_usage(words=500)
    gw = await _gateway(gateway, up, {"tpm": 2000})
    async with aiohttp.ClientSession() as http:
        assert await _post(http, gw, max_tokens=500) == 200
        first = await _use(gw)
        assert 500 < first["tokens_60s"] < 600 and first["tokens_today"] == first["tokens_60s"]
        statuses = [await _post(http, gw, max_tokens=500) for _ in range(5)]
    assert statuses == [200, 200, 429, 429, 429]
    assert up.requests == 3  # nothing sent upstream for the refused ones
    assert (await _use(gw))["tokens_60s"] == 3 * first["tokens_60s"]


async def test_a_whole_float_max_tokens_reserves_what_it_says(gateway, no_usage):
    """`max_tokens: 300.0` passes validation as 300: the reservation (here the charge) is 300 and
    the prompt, not the 1,024 of default_max_tokens."""
    up = await no_usage(words=300)
    gw = await _gateway(gateway, up, {"tpm": 100_000})
    async with aiohttp.ClientSession() as http:
        assert await _post(http, gw, max_tokens=300.0) == 200
    assert 300 < (await _use(gw))["tokens_60s"] < 400


async def test_a_stream_without_usage_is_charged_its_prompt_and_what_it_delivered(gateway, no_usage):
    up = await no_usage(words=40)
    gw = await _gateway(gateway, up, {"tpm": 100_000})
    async with aiohttp.ClientSession() as http:
        assert await _post(http, gw, max_tokens=5000, stream=True) == 200
    tokens = (await _use(gw))["tokens_60s"]
    assert 40 < tokens < 200  # the prompt estimate and one per content chunk, not the 5,000 reserved


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_that_reached_the_backend_and_got_no_answer_is_charged_its_prompt(gateway, no_usage, stream):
    """The client leaves while the backend works on a whole answer, or before a stream's first
    token: the backend had the prompt, so the prompt estimate stays charged (not 0, not the 5,000
    reserved)."""
    up = await no_usage(words=40)
    gw = await _gateway(gateway, up, {"tpm": 100_000, "concurrency": 5})
    async with aiohttp.ClientSession() as http:
        task = asyncio.create_task(_post(http, gw, max_tokens=5000, stream=stream, metadata={"sleep": "2"}))
        deadline = time.monotonic() + 3
        while up.requests == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    deadline = time.monotonic() + 3
    while (use := await _use(gw))["inflight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert up.requests == 1 and use["inflight"] == 0
    assert 0 < use["tokens_60s"] < 200 and use["tokens_today"] == use["tokens_60s"]
