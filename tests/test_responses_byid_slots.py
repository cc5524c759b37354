"""By-id calls of the Responses API (GET /v1/responses/{id}, with `?stream=true` too) hold one of
their backend's slots while they are relayed, as the main relay's attempts do: a backend's
`max_concurrency` bounds them, they wait in its queue (then are refused as a completion would be),
and a slot goes back when the answer is relayed or its client leaves mid-stream.

Found by a review helper: six concurrent by-id GETs reached a backend whose max_concurrency was
2, all six at once, counted nowhere (its slots and inflight gauge said 0)."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web

from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE
from tests.servers import serve_app

KEY = "sk-alice"
RID = "resp_slots_1"


class _Upstream:
    """A backend that holds each by-id GET `hold_s` (a stream: events every 50 ms for `hold_s`,
    or until the gateway hangs up) and counts how many it serves at once."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.live = self.peak = self.served = self.chats = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def by_id(self, request: web.Request) -> web.StreamResponse:
        self.live += 1
        self.peak = max(self.peak, self.live)
        try:
            rid = request.match_info["id"]
            if request.query.get("stream") != "true":
                await asyncio.sleep(self.hold_s)
                return web.json_response({"id": rid, "object": "response", "status": "completed", "output": []})
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            n, end = 0, asyncio.get_running_loop().time() + self.hold_s
            while asyncio.get_running_loop().time() < end:
                await out.write(b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":%d}\n\n' % n)
                n += 1
                await asyncio.sleep(0.05)
            await out.write(b'event: response.completed\ndata: {"type":"response.completed","sequence_number":%d}\n\n' % n)
            await out.write_eof()
            return out
        finally:
            self.live -= 1
            self.served += 1

    async def chat(self, request: web.Request) -> web.Response:
        self.chats += 1
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})

    async def start(self) -> str:
        async def models(_: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

        app = web.Application()
        app.router.add_get("/v1/responses/{id}", self.by_id)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", self.chat)
        self.runner, self.port = await serve_app(app)
        return f"http://127.0.0.1:{self.port}/v1"


async def _gateway(gateway, up: _Upstream, max_concurrency: int, first_token_ms: int = 30_000):
    url = await up.start()
    gw = await gateway({
        "backends": {"a": {"url": url, "models": ["m"], "max_concurrency": max_concurrency,
                           "timeouts": {"first_token_ms": first_token_ms}}},
        "models": {"m": {"backends": ["a"], "strategy": "ordered"}},
        "cache": {"enabled": False}, "reload": {"watch": False},
        "tenants": {"alice": {"key_sha256": [hash_key(KEY)]}},
    })
    rt = gw.app[LIVE].runtime
    await rt.affinity.record([RID], "a", rt.tenants.authenticate(KEY).cache_namespace)
    return gw, rt.backends["a"]


async def _get(http: aiohttp.ClientSession, gw, stream: bool) -> tuple[int, bytes]:
    q = "?stream=true" if stream else ""
    async with http.get(gw.url + f"/v1/responses/{RID}{q}", headers={"Authorization": f"Bearer {KEY}"}) as r:
        return r.status, await r.read()


async def _six_at_once(gateway, stream: bool) -> None:
    up = _Upstream(hold_s=0.3)
    try:
        gw, backend = await _gateway(gateway, up, max_concurrency=2)
        async with aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(_get(http, gw, stream) for _ in range(6)))
        assert [s for s, _ in results] == [200] * 6, results
        if stream:
            assert all(b"response.completed" in body for _, body in results)
        assert up.served == 6
        assert up.peak <= 2, f"the backend served {up.peak} by-id calls at once (max_concurrency 2)"
        assert backend.slots.used == 0
    finally:
        if up.runner is not None:
            await up.runner.cleanup()


async def test_concurrent_by_id_gets_are_bounded_by_max_concurrency(gateway):
    await _six_at_once(gateway, stream=False)


async def test_concurrent_by_id_streams_are_bounded_by_max_concurrency(gateway):
    await _six_at_once(gateway, stream=True)


async def test_a_stream_whose_client_leaves_gives_its_slot_back(gateway):
    """The only slot is held by a replay that would last a minute; its client reads one event and
    hangs up: the slot comes back, and the next call gets through at once."""
    up = _Upstream(hold_s=60.0)
    try:
        gw, backend = await _gateway(gateway, up, max_concurrency=1)
        async with aiohttp.ClientSession() as http:
            r = await http.get(gw.url + f"/v1/responses/{RID}?stream=true", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status == 200
            assert b"response.in_progress" in await r.content.readline()
            assert backend.slots.used == 1
            r.close()  # the client leaves mid-stream
        up.hold_s = 0.0
        async with aiohttp.ClientSession() as http:
            status, body = await asyncio.wait_for(_get(http, gw, stream=False), 5)
        assert status == 200, body
        for _ in range(100):  # the gateway's end of the replay unwinds on its own loop turns
            if backend.slots.used == 0 and up.live == 0:
                break
            await asyncio.sleep(0.02)
        assert (backend.slots.used, up.live, up.peak) == (0, 0, 1)
    finally:
        if up.runner is not None:
            await up.runner.cleanup()


async def test_a_by_id_call_to_a_full_backend_is_refused_as_a_completion_is(gateway):
    """The only slot stays held; a by-id call waits in the queue up to the backend's first_token_ms
    (the main relay's bound), then gets the main relay's refusal: 503 `backends_busy` with a
    Retry-After (a chat completion sent then gets the same), the backend never called for it."""
    up = _Upstream(hold_s=60.0)
    try:
        gw, backend = await _gateway(gateway, up, max_concurrency=1, first_token_ms=300)
        async with aiohttp.ClientSession() as http:
            r = await http.get(gw.url + f"/v1/responses/{RID}?stream=true", headers={"Authorization": f"Bearer {KEY}"})
            assert r.status == 200
            await r.content.readline()
            h = {"Authorization": f"Bearer {KEY}"}

            async def answer(method: str, path: str, **kw):
                async with http.request(method, gw.url + path, headers=h, **kw) as resp:
                    return resp.status, (await resp.json())["error"]["code"], resp.headers.get("Retry-After") is not None

            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            by_id, completion = await asyncio.gather(answer("GET", f"/v1/responses/{RID}"),
                                                     answer("POST", "/v1/chat/completions", json=chat))
            r.close()
        assert by_id == completion == (503, "backends_busy", True), (by_id, completion)
        assert (up.served, up.peak, up.chats) == (0, 1, 0)
    finally:
        if up.runner is not None:
            await up.runner.cleanup()
