"""A client that reads its stream slowly, or not at all, holds neither its backend's slot nor its
admission place (cache/stage.py `_produce`): the relay reads on at the backend's pace into a
backlog of the client's own (bounded: 8 MiB, and the process's stream budget), gives the slot
back when the backend's answer ends, and the rest goes out at the client's pace.

Before, only a cacheable flight's leader was decoupled: a client that stopped reading an
uncached stream held the slot 60 s a write (web/sink.py CLIENT_READ_S), and until its deadline
if it read a trickle; every other request for that backend queued, was shed or timed out,
though the backend had finished long before (review helper's repro).
"""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import orjson
import pytest

from gateway.web.keys import LIVE, RELAY
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


async def _stalled_reader(port: int, body: bytes) -> socket.socket:
    """A streamed request from a socket with a small receive buffer; its headers read, nothing more."""
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the gateway's writes back up soon
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    await loop.sock_sendall(s, head + body)
    got = b""
    while b"\r\n\r\n" not in got:
        got += await loop.sock_recv(s, 1)  # one byte at a time: the body stays in the socket
    return s


async def _read_all(s: socket.socket, timeout_s: float) -> bytes:
    """The rest of a chunked response (until its last chunk, or the connection's end)."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout_s):
        while not got.endswith(b"\r\n0\r\n\r\n"):
            chunk = await loop.sock_recv(s, 1 << 16)
            if not chunk:
                break
            got += chunk
    return bytes(got)


async def _one_slot(upstream, gateway, tokens: int):
    """A backend of one slot answering `tokens` tokens at once, and a gateway in front of it."""
    a = await upstream("a", tokens=tokens, itl_ms=0)
    p = simple_policy(a)
    p["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(p)
    return a, gw, gw.app[LIVE].runtime.backends["a"]


async def _until(cond, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.01)


async def _short_answer(url: str) -> tuple[int, float]:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", headers={"x-request-timeout-ms": "3000"},
                             json={"model": "gpt-test", "messages": MSG, "max_tokens": 2}) as r:
            await r.read()
            return r.status, time.monotonic() - t0


# Uncached (a sampled request: decoupled by the cache stage's _produce), and cached (a flight's
# leader: its TeeSink, which falls behind the same way).
KINDS = pytest.mark.parametrize("temperature", [0.7, 0], ids=["uncached", "flight_leader"])


@KINDS
async def test_a_client_that_stops_reading_gives_its_slot_back_when_the_answer_ends(upstream, gateway, temperature):
    """20,000 tokens (~3 MB: within the 8 MiB a client may fall behind): the backend answers at
    once; its slot is free while the client has read almost nothing, another caller is answered,
    and the client then reads the whole stream, [DONE] included."""
    a, gw, backend = await _one_slot(upstream, gateway, 20_000)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True, "temperature": temperature})
    s = await _stalled_reader(gw.port, body)
    try:
        await _until(lambda: a.stats.requests == 1 and backend.slots.used == 0 and a.stats.active == 0, 10)
        assert gw.app[RELAY].flight.budget.used > 100_000  # the rest waits in its backlog, counted
        status, waited = await _short_answer(gw.url)
        assert status == 200 and waited < 2.5
        got = await _read_all(s, 30)
    finally:
        s.close()
    assert b"w19999 " in got and b"data: [DONE]" in got and b'"error"' not in got
    await _until(lambda: gw.app[RELAY].flight.budget.used == 0, 5)


@KINDS
async def test_a_client_too_far_behind_is_cut_off_and_its_slot_given_back(upstream, gateway, temperature):
    """200,000 tokens (~30 MB): the client falls 8 MiB behind, its stream is cut off (the upstream
    call stops, the slot is free) and what it reads ends with an error event, no [DONE]. (A
    flight's leader cut off that way used to lose its error event: its writer was cancelled.)"""
    a, gw, backend = await _one_slot(upstream, gateway, 200_000)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True, "temperature": temperature})
    s = await _stalled_reader(gw.port, body)
    try:
        await _until(lambda: a.stats.requests == 1 and backend.slots.used == 0, 10)
        status, waited = await _short_answer(gw.url)
        assert status == 200 and waited < 2.5
        got = await _read_all(s, 30)
    finally:
        s.close()
    assert b"fell too far behind" in got and b"data: [DONE]" not in got
    assert b"w199999 " not in got
    await _until(lambda: gw.app[RELAY].flight.budget.used == 0, 5)


async def test_a_client_that_reads_a_trickle_is_cut_at_its_deadline_without_holding_the_slot(upstream, gateway):
    a = await upstream("a", tokens=20_000, itl_ms=0)
    p = simple_policy(a, cache={"enabled": False})
    p["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(p)
    backend = gw.app[LIVE].runtime.backends["a"]
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True, "temperature": 0.7})
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", gw.port))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"x-request-timeout-ms: 2000\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    await loop.sock_sendall(s, head + body)
    try:
        await _until(lambda: a.stats.requests == 1 and backend.slots.used == 0, 10)
        await asyncio.sleep(2.5)  # past its deadline, having read nothing
        got = await _read_all(s, 30)
    finally:
        s.close()
    assert b"deadline" in got and b"data: [DONE]" not in got


async def _read_whole(s: socket.socket, timeout_s: float) -> bytes:
    """A whole (Content-Length) response's head and body."""
    loop = asyncio.get_running_loop()
    got = bytearray()
    async with asyncio.timeout(timeout_s):
        while True:
            head_end = got.find(b"\r\n\r\n")
            if head_end >= 0:
                length = next(int(line.split(b":")[1]) for line in bytes(got[:head_end]).split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                if len(got) >= head_end + 4 + length:
                    return bytes(got)
            chunk = await loop.sock_recv(s, 1 << 16)
            if not chunk:
                return bytes(got)
            got += chunk


@KINDS
async def test_a_whole_answer_to_a_client_that_stops_reading_holds_no_slot(upstream, gateway, temperature):
    """A whole answer of 1,500,000 tokens (~13 MB, past the sockets' buffers) to a client that reads
    its headers and stops: it was written inside its attempt, so the backend's slot stayed held
    while the write waited on the client (up to 60 s). Now the relay returns first (the slot is
    given back) and the answer is written after, at the client's pace, whole."""
    a, gw, backend = await _one_slot(upstream, gateway, 1_500_000)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "temperature": temperature})
    loop = asyncio.get_running_loop()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    try:
        await loop.sock_connect(s, ("127.0.0.1", gw.port))
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{gw.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        await loop.sock_sendall(s, head + body)
        first = await loop.sock_recv(s, 1)  # the answer has begun: the write waits on this client now
        await _until(lambda: a.stats.requests == 1 and backend.slots.used == 0, 10)
        status, waited = await _short_answer(gw.url)
        assert status == 200 and waited < 2.5
        got = first + await _read_whole(s, 30)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 200") and b"w1499999 " in got, got[:200]
