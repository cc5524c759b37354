"""Nothing a backend sends is unbounded: an oversized body, SSE event, pile of events before the
first token, or header block is a clean 502 naming the backend, and the next candidate answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import openai
import pytest
from aiohttp import web

from gateway.relay.attempt import MAX_BODY_BYTES, MAX_HELD_BYTES
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Raw:
    """An upstream whose chat endpoint is one handler (what the fake upstream cannot send)."""

    name = "big"

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> "_Raw":
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handler)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
        return self


async def _huge_body(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    await resp.prepare(request)
    chunk = b" " * (1 << 20)
    try:
        for _ in range(MAX_BODY_BYTES // len(chunk) + 4):
            await resp.write(chunk)
    except (ConnectionError, asyncio.CancelledError):
        pass
    return resp


async def _sse(request: web.Request, events: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for ev in events:
            await resp.write(ev)
        await asyncio.sleep(5)
    except (ConnectionError, asyncio.CancelledError):
        pass
    return resp


async def _endless_event(request: web.Request) -> web.StreamResponse:
    return await _sse(request, [b'data: {"choices":[{"delta":{"content":"' + b"x" * (2 << 20)])


async def _role_chunks(request: web.Request) -> web.StreamResponse:
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    return await _sse(request, [role * 1000] * (MAX_HELD_BYTES // (len(role) * 1000) + 2))


async def _huge_headers(request: web.Request) -> web.StreamResponse:
    return web.Response(text="{}", headers={f"x-h{i}": "v" * 200 for i in range(400)})


@pytest.fixture
async def raw() -> AsyncIterator[Callable[[Handler], Awaitable[_Raw]]]:
    started: list[_Raw] = []

    async def make(handler: Handler) -> _Raw:
        r = await _Raw(handler).start()
        started.append(r)
        return r

    yield make
    for r in started:
        assert r.runner is not None
        await r.runner.cleanup()


@pytest.mark.parametrize(
    "handler,stream,what",
    [
        (_huge_body, False, "body exceeds"),
        (_huge_headers, False, "headers exceed"),
        (_endless_event, True, "SSE event exceeds"),
        (_role_chunks, True, "before its first token"),
    ],
    ids=["body", "headers", "sse-event", "held-before-first-token"],
)
async def test_an_oversized_answer_fails_over_with_a_502_naming_the_backend(raw, upstream, gateway, handler, stream, what):
    big = await raw(handler)
    good = await upstream("good")
    policy = simple_policy(good)
    policy["backends"] = {"big": {"url": big.url, "models": ["gpt-test"]}, **policy["backends"]}
    policy["models"]["gpt-test"]["backends"] = ["big", "good"]
    gw = await gateway(policy)
    client = gw.client()
    # Alone: a clean 502 that says which backend and which cap.
    solo = await gateway(simple_policy(good) | {"backends": {"big": {"url": big.url, "models": ["gpt-test"]}},
                                                "models": {"gpt-test": {"backends": ["big"]}}}, name="solo.yaml")
    with pytest.raises(openai.APIStatusError) as exc:
        if stream:
            async for _ in await solo.client().chat.completions.create(model="gpt-test", messages=MSG, stream=True):
                pass
        else:
            await solo.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert exc.value.status_code == 502 and "big" in exc.value.message and what in exc.value.message
    # With a fallback: the next candidate answers.
    r = await client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, stream=stream)
    assert r.headers["x-gateway-backend"] == "good"
