"""1,000 slow or idle client connections do not delay a normal request.

Idle sockets (nothing sent), half-sent headers, half-sent bodies, and slowloris connections that
trickle one header line at a time are opened from a worker thread with plain blocking sockets, so
the event loop that serves the gateway carries only the gateway's side of them. A normal request's
latency is compared before and while they are open.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import secrets
import socket
import statistics
import threading
import time
from typing import Any

import aiohttp

from gateway.tenants.auth import hash_key

KEY = "sk-acme-" + secrets.token_hex(16)
ADMIN_KEY = "sk-admin-" + secrets.token_hex(16)
N_CONNECTIONS = 1000
N_SAMPLES = 20
MAX_ADDED_P50_S = 0.050  # generous: shared CI machines are noisy


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == resource.RLIM_INFINITY or soft >= needed, f"need {needed} file descriptors, the limit is {soft}"


class SlowClients:
    """Connections opened and fed from one worker thread; `close()` ends them all."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.socks: list[socket.socket] = []
        self.trickling: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.socks.append(s)
        return s

    def open(self, n: int) -> None:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAuthorization: Bearer {KEY}\r\n"
        for i in range(n):
            s = self._connect()
            kind = i % 10
            if kind < 4:
                pass  # idle: connected, nothing sent
            elif kind < 7:
                s.sendall(head.encode())  # headers begun, never finished
            elif kind < 9:
                # headers complete, 10 of the 1,000 announced body bytes
                s.sendall((head + "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n").encode() + b'{"model": ')
            else:
                s.sendall(head.encode())
                self.trickling.append(s)  # slowloris: one more header line every 200 ms
        self._thread = threading.Thread(target=self._trickle, daemon=True)
        self._thread.start()

    def _trickle(self) -> None:
        i = 0
        while not self._stop.wait(0.2):
            i += 1
            for s in self.trickling:
                with contextlib.suppress(OSError):
                    s.sendall(f"X-Slow-{i}: {i}\r\n".encode())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        self.socks.clear()


async def _latencies(gw: Any, n: int) -> list[float]:
    """n sequential non-streamed requests on one keep-alive connection, as a normal client sends them."""
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
    out = []
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                payload = await r.json()
            out.append(time.perf_counter() - t0)
            assert r.status == 200, payload
            assert payload["choices"][0]["message"]["content"] == "w0 w1 "
    return out


async def _open_server_side_connections(gw: Any) -> int | None:
    server = getattr(gw.runner, "server", None)
    conns = getattr(server, "connections", None)
    return None if conns is None else len(conns)


async def test_a_thousand_slow_or_idle_connections_do_not_delay_a_normal_request(upstream, gateway):
    _raise_fd_limit(2 * N_CONNECTIONS + 1024)  # both ends live in this process
    up = await upstream("a", tokens=2)
    gw = await gateway(
        {
            "version": 1,
            "health": {"probe_interval_ms": 600_000},
            "cache": {"enabled": False},
            "backends": {"a": {"url": up.url, "models": ["gpt-test"]}},
            "models": {"gpt-test": {"backends": ["a"]}},
            "tenants": {"acme": {"key_sha256": [hash_key(KEY)]}},
            "admin": {"key_sha256": [hash_key(ADMIN_KEY)]},
        }
    )
    await _latencies(gw, 5)  # warm-up: connections, code paths
    before = await _latencies(gw, N_SAMPLES)

    slow = SlowClients(gw.port)
    t_open = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.to_thread(slow.open, N_CONNECTIONS), timeout=30)
        open_s = time.perf_counter() - t_open
        # Let the gateway accept every one of them before measuring.
        end = time.monotonic() + 5
        accepted = await _open_server_side_connections(gw)
        while accepted is not None and accepted < N_CONNECTIONS and time.monotonic() < end:
            await asyncio.sleep(0.05)
            accepted = max(accepted, await _open_server_side_connections(gw) or 0)
        await asyncio.sleep(0.3)  # a few slowloris rounds
        during = await _latencies(gw, N_SAMPLES)
        still_open = sum(1 for s in slow.socks if s.fileno() != -1)
    finally:
        await asyncio.to_thread(slow.close)

    p50_before, p50_during = statistics.median(before), statistics.median(during)
    report = (
        f"p50 before {p50_before * 1000:.2f} ms, with {N_CONNECTIONS} slow connections {p50_during * 1000:.2f} ms "
        f"(max {max(during) * 1000:.2f} ms); opened in {open_s:.2f} s, gateway side {accepted}"
    )
    print(report)
    assert still_open == N_CONNECTIONS
    if accepted is not None:
        assert accepted >= 0.9 * N_CONNECTIONS, report  # the gateway really held them (at the peak)
    assert p50_during - p50_before < MAX_ADDED_P50_S, report

    # Afterwards the gateway serves as before, and nothing is left in flight.
    await _latencies(gw, 3)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert (await r.json())["backends"]["a"]["inflight"] == 0


async def test_a_client_that_pipelines_requests_and_reads_no_answer_is_let_go(upstream, gateway, monkeypatch):
    """Requests sent back to back on one connection whose client reads none of the answers: once
    its buffer was full, aiohttp's write of each next answer waited with no bound, and the
    connection held its answers and buffers until the client closed (10 connections still held
    at 45 s; review helper's repro). Bounded as a stream's write is (CLIENT_READ_S, 1 s here)."""
    import orjson

    from gateway.web import sink as web_sink
    from tests.conftest import simple_policy

    monkeypatch.setattr(web_sink, "CLIENT_READ_S", 1.0)
    key = "sk-acme-" + secrets.token_hex(16)
    up = await upstream("a", tokens=2000)  # ~11 KB answers: each under the size a sink bounds itself
    gw = await gateway(simple_policy(up, tenants={"acme": {"key_sha256": [hash_key(key)]}}, cache={"enabled": False}))
    raw = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]})
    one = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           + f"Authorization: Bearer {key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, ("127.0.0.1", gw.port))
        await loop.sock_sendall(s, one * 800)

        def held() -> int:
            return len([p for p in gw.runner.server.connections if p.transport])

        async with asyncio.timeout(10):  # answers pile up on it
            while not (held() and up.stats.requests >= 100):
                await asyncio.sleep(0.05)
        async with asyncio.timeout(8):  # then the gateway lets it go
            while held():
                await asyncio.sleep(0.1)
        assert up.stats.requests < 800
    finally:
        s.close()
