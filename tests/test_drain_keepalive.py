"""Shutdown and kept-alive connections: once the port is closed, a new API request on a
connection already open is refused (a 503 in its endpoint's shape, `Connection: close`), never
sent upstream nor counted in the drain; idle kept-alive connections are closed; the requests in
flight finish; /healthz and /readyz answer as before."""

from __future__ import annotations

import asyncio
import signal
import socket
from pathlib import Path
from typing import Any

import aiohttp

from gateway.web.keys import DRAIN
from tests.conftest import simple_policy
from tests.procs import serve


def _chat(content: str, **kw: Any) -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": content}], **kw}


def _closed(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def test_api_requests_after_the_port_closed_are_refused_in_each_endpoints_shape(upstream: Any, gateway: Any) -> None:
    up = await upstream("up")
    g = await gateway(simple_policy(up))
    drain = g.app[DRAIN]
    drain.draining = drain.closed = True
    async with aiohttp.ClientSession() as http:
        async with http.post(g.url + "/v1/chat/completions", json=_chat("late")) as r:
            body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "service_unavailable"
            assert r.headers["Connection"] == "close" and r.headers["Retry-After"] == "1"
        async with http.post(g.url + "/v1/messages", json={"model": "gpt-test", "max_tokens": 8,
                                                           "messages": [{"role": "user", "content": "late"}]}) as r:
            body = await r.json()
            assert r.status == 503 and body["type"] == "error", body  # Anthropic's shape
            assert r.headers["Connection"] == "close"
        async with http.get(g.url + "/healthz") as r:
            assert r.status == 200
        async with http.get(g.url + "/readyz") as r:
            assert r.status == 503 and (await r.json())["status"] == "draining"
    assert up.stats.requests == 0 and drain.inflight == 0


async def test_a_stream_in_flight_when_the_port_closes_still_finishes(upstream: Any, gateway: Any) -> None:
    up = await upstream("up", itl_ms=20, tokens=20)
    g = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(g.url + "/v1/chat/completions", json=_chat("long", stream=True)) as r:
            await r.content.readline()
            g.app[DRAIN].draining = g.app[DRAIN].closed = True
            rest = await asyncio.wait_for(r.read(), 10)
    assert r.status == 200 and rest.rstrip().endswith(b"data: [DONE]")


async def test_request_on_a_kept_alive_connection_after_sigterm_is_not_sent_upstream(upstream: Any, tmp_path: Path) -> None:
    up = await upstream("up", itl_ms=100, tokens=150)  # 15 s streams, cut at shutdown_timeout_ms
    policy = {"version": 1, "reload": {"watch": False},
              "backends": {"up": {"url": up.url, "models": ["m"]}},
              "server": {"drain_delay_ms": 0, "shutdown_timeout_ms": 2000}}
    async with serve(policy, tmp_path) as g:
        ka = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=aiohttp.ClientTimeout(total=10))
        st = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        try:
            async with ka.get(g.url + "/v1/models") as r:  # opens the kept-alive connection
                assert r.status == 200
                await r.read()
            async with st.post(g.url + "/v1/chat/completions", json={**_chat("long", stream=True), "model": "m"}) as s:
                await s.content.readline()
                g.signal(signal.SIGTERM)
                for _ in range(100):
                    if _closed(g.port):
                        break
                    await asyncio.sleep(0.05)
                assert _closed(g.port)
                status = None
                try:  # refused: a 503, or the idle connection was closed already
                    async with ka.post(g.url + "/v1/chat/completions", json={**_chat("late", stream=True), "model": "m"}) as r2:
                        status = r2.status
                        assert r2.headers.get("Connection") == "close"
                except aiohttp.ClientError:
                    pass
                assert status in (None, 503), status
                assert up.stats.requests == 1, up.stats.requests
        finally:
            await ka.close()
            await st.close()
