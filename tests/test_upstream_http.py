"""UpstreamPool over real loopback sockets: an aiohttp server for well-behaved upstreams, a raw
asyncio server for the misbehaving ones (drops, hangs, stale keep-alive, HTTP/1.0 bodies)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

pytest.importorskip("httptools")

from gateway.upstream.client import UpstreamConnectError, UpstreamDisconnected, UpstreamHeadersTooLarge, UpstreamMaybeSent, UpstreamPool, UpstreamProtocolError, UpstreamResponse, UpstreamTooLarge
from gateway.wire.openai_wire import SSEDecoder, SSEEventTooLarge

BIG = bytes(range(256)) * 8192  # 2 MiB


class Web:
    """An aiohttp upstream that records the peer of every request (one peer = one connection)."""

    def __init__(self) -> None:
        self.peers: list[tuple[str, int]] = []
        self.first_chunk_seen = asyncio.Event()
        self.url = ""
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/echo", self.echo)
        app.router.add_post("/big", self.big)
        app.router.add_post("/close", self.close)
        app.router.add_post("/status/{code}", self.status)
        app.router.add_post("/stream", self.stream)
        app.router.add_post("/slow", self.slow)
        self.runner = web.AppRunner(app, access_log=None)

    async def echo(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        body = await request.read()
        return web.Response(body=body, headers={"X-Seen-Type": request.headers.get("Content-Type", "")})

    async def big(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.query.get("chunked"):
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(BIG), 100_000):
                await resp.write(BIG[i : i + 100_000])
            await resp.write_eof()
            return resp
        return web.Response(body=BIG)

    async def close(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        await request.read()
        return web.Response(body=b"bye", headers={"Connection": "close"})

    async def status(self, request: web.Request) -> web.Response:
        code = int(request.match_info["code"])
        return web.Response(status=code, body=b'{"error": "nope"}', headers={"Retry-After": "3"})

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.wait_for(self.first_chunk_seen.wait(), 5)  # the next byte waits for the client's proof
        for i in range(2, 5):
            await asyncio.sleep(0.01)
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def slow(self, request: web.Request) -> web.Response:
        self.peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        await asyncio.sleep(0.05)
        return web.Response(body=await request.read())


@pytest.fixture
async def srv() -> AsyncIterator[Web]:
    s = Web()
    await s.runner.setup()
    site = web.TCPSite(s.runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    s.url = f"http://127.0.0.1:{port}"
    yield s
    await s.runner.cleanup()


@pytest.fixture
async def pool() -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool()
    yield p
    await p.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@contextlib.asynccontextmanager
async def served(handler: Handler) -> AsyncIterator[tuple[UpstreamPool, str]]:
    """A raw server running `handler`, its URL and a pool (closed after)."""
    server, url = await raw_server(handler)
    pool = UpstreamPool()
    async with server:
        try:
            yield pool, url
        finally:
            await pool.close()


@contextlib.asynccontextmanager
async def answered(handler: Handler) -> AsyncIterator[tuple[UpstreamPool, UpstreamResponse]]:
    """served(), and the pool's response to one POST."""
    async with served(handler) as (pool, url):
        yield pool, await pool.post(url, b"{}", H, connect_timeout_s=1)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (headers + Content-Length body); b"" when the client closed."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
H = {"Content-Type": "application/json"}


async def test_content_length_body_and_headers(srv: Web, pool: UpstreamPool) -> None:
    resp = await pool.post(srv.url + "/echo", b'{"a": 1}', H, connect_timeout_s=1)
    assert resp.status == 200
    assert resp.headers["x-seen-type"] == "application/json"
    assert resp.headers["Content-Length"] == "8"
    assert await resp.read() == b'{"a": 1}'
    resp.release()


async def test_keep_alive_reuses_one_connection(srv: Web, pool: UpstreamPool) -> None:
    for i in range(20):
        resp = await pool.post(srv.url + "/echo", b"%d" % i, H, connect_timeout_s=1)
        assert await resp.read() == b"%d" % i
        resp.release()
    assert len(set(srv.peers)) == 1


async def test_connection_close_is_not_reused(srv: Web, pool: UpstreamPool) -> None:
    for _ in range(3):
        resp = await pool.post(srv.url + "/close", b"x", H, connect_timeout_s=1)
        assert await resp.read() == b"bye"
        resp.release()
    assert len(set(srv.peers)) == 3


async def test_error_statuses_carry_their_bodies(srv: Web, pool: UpstreamPool) -> None:
    for code in (400, 429, 500, 503):
        resp = await pool.post(srv.url + f"/status/{code}", b"", H, connect_timeout_s=1)
        assert resp.status == code
        assert resp.headers.get("retry-after") == "3"
        assert await resp.read() == b'{"error": "nope"}'
        resp.release()


async def test_large_bodies_content_length_and_chunked(srv: Web, pool: UpstreamPool) -> None:
    for path in ("/big", "/big?chunked=1"):
        resp = await pool.post(srv.url + path, BIG, H, connect_timeout_s=1)
        assert await resp.read() == BIG
        resp.release()


async def test_slow_consumer_gets_every_byte(srv: Web, pool: UpstreamPool) -> None:
    resp = await pool.post(srv.url + "/big?chunked=1", b"", H, connect_timeout_s=1)
    await asyncio.sleep(0.1)  # let the buffer pass the high-water mark: reading pauses, nothing is lost
    assert resp._conn is not None and resp._conn.paused
    got = bytearray()
    while chunk := await resp.readany():
        got += chunk
    assert bytes(got) == BIG
    resp.release()


async def test_readany_streams_chunks_as_they_arrive(srv: Web, pool: UpstreamPool) -> None:
    resp = await pool.post(srv.url + "/stream", b"{}", H, connect_timeout_s=1)
    assert resp.headers["Transfer-Encoding"] == "chunked"
    assert await asyncio.wait_for(resp.readany(), 2) == b"data: 1\n\n"  # before the server wrote the rest
    srv.first_chunk_seen.set()
    rest = b""
    while chunk := await resp.readany():
        rest += chunk
    assert rest == b"data: 2\n\ndata: 3\n\ndata: 4\n\n"
    assert await resp.readany() == b""
    resp.release()
    resp = await pool.post(srv.url + "/echo", b"again", H, connect_timeout_s=1)  # the stream's socket is reusable
    assert await resp.read() == b"again"
    resp.release()


async def test_concurrent_requests_open_many_connections(srv: Web, pool: UpstreamPool) -> None:
    async def one(i: int) -> bytes:
        resp = await pool.post(srv.url + "/slow", b"%d" % i, H, connect_timeout_s=1)
        try:
            return await resp.read()
        finally:
            resp.release()

    assert await asyncio.gather(*(one(i) for i in range(40))) == [b"%d" % i for i in range(40)]
    assert len(set(srv.peers)) == 40
    await asyncio.gather(*(one(i) for i in range(40)))
    assert len(set(srv.peers)) == 40  # the second wave reused the pooled connections


async def test_drop_mid_body_raises() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async with answered(handler) as (pool, resp):
        with pytest.raises(UpstreamDisconnected, match="mid-body"):
            await resp.read()
        resp.close()


async def test_drop_mid_chunked_stream_raises_after_the_bytes_that_came() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.close()

    async with answered(handler) as (pool, resp):
        assert await resp.readany() == b"data: 1\n\n"
        with pytest.raises(UpstreamDisconnected):
            await resp.readany()
        resp.close()


async def test_eof_delimited_body_is_complete() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end")
        await writer.drain()
        writer.close()

    async with answered(handler) as (pool, resp):
        assert await resp.read() == b"until the end"
        resp.release()


async def test_interim_response_is_skipped_and_extra_bytes_drop_the_socket() -> None:
    conns = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while await read_request(reader):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra")
            await writer.drain()
        writer.close()

    async with served(handler) as (pool, url):
        for _ in range(2):
            resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
            assert (resp.status, await resp.read()) == (200, b"ok")
            resp.release()
        assert conns == 2  # a socket that sent a second, unasked-for response is not reused


async def test_garbage_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async with served(handler) as (pool, url):
        with pytest.raises(UpstreamProtocolError):
            await pool.post(url, b"{}", H, connect_timeout_s=1)


async def test_timeout_on_a_silent_upstream_closes_the_socket() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # returns when the client closes
        gone.set()

    async with served(handler) as (pool, url):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await pool.post(url, b"{}", H, connect_timeout_s=1)
        await asyncio.wait_for(gone.wait(), 1)


async def test_cancelling_a_stream_read_closes_the_socket() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await writer.drain()
        await reader.read()
        gone.set()

    async with served(handler) as (pool, url):
        resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert await resp.readany() == b"abc"
        task = asyncio.create_task(resp.readany())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(gone.wait(), 1)
        with pytest.raises(UpstreamDisconnected):
            await resp.readany()
        resp.release()  # a half-read connection is closed, never pooled
        assert not pool._idle.get(("http", "127.0.0.1", int(url.rsplit(":", 1)[1])))


async def test_a_request_written_then_dropped_is_never_resent() -> None:
    """A pooled connection that dies after the request went out, before any response byte: the
    upstream may have logged (and billed) it, so the caller hears so and nothing is sent again."""
    conns = requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns, requests
        conns += 1
        while await read_request(reader):
            requests += 1
            if conns == 1 and requests == 2:
                break  # the second request on the first socket: read, never answered
            writer.write(OK)  # keep-alive by default
            await writer.drain()
        writer.close()

    async with served(handler) as (pool, url):
        resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert await resp.read() == b"ok"
        resp.release()  # pooled, and still open when the next post takes it
        with pytest.raises(UpstreamMaybeSent, match="before the response headers") as info:
            await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert isinstance(info.value, UpstreamDisconnected)
        assert (conns, requests) == (1, 2)  # not resent on a fresh socket
        resp = await pool.post(url, b"{}", H, connect_timeout_s=1)  # the next request gets a fresh one
        assert await resp.read() == b"ok"
        resp.release()
        assert (conns, requests) == (2, 3)


async def test_a_pooled_connection_closed_before_the_write_is_replaced_and_sent_once() -> None:
    conns = requests = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns, requests
        conns += 1
        while await read_request(reader):
            requests += 1
            writer.write(OK)
            await writer.drain()
            if conns == 1:
                break  # the first socket is closed by the upstream while idle
        writer.close()

    server, url = await raw_server(handler)
    key = ("http", "127.0.0.1", int(url.rsplit(":", 1)[1]))
    pool = UpstreamPool()
    async with server:
        for _ in range(2):
            resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
            assert await resp.read() == b"ok"
            resp.release()
            await asyncio.sleep(0.01)  # the first socket's close is seen while it is idle
        assert (conns, requests) == (2, 2)
        # Closing but not yet closed (the transport's connection_lost is still to run): not written to.
        idle = pool._idle[key][-1]
        idle.transport.close()  # type: ignore[union-attr]
        resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert await resp.read() == b"ok"
        resp.release()
        assert (conns, requests) == (3, 3)  # every request sent exactly once
        await pool.close()


async def test_a_fresh_connection_that_drops_is_not_retried() -> None:
    conns = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await read_request(reader)
        writer.close()

    async with served(handler) as (pool, url):
        with pytest.raises(UpstreamDisconnected, match="before the response headers"):
            await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert conns == 1


async def test_connect_refused_is_a_connect_error(pool: UpstreamPool) -> None:
    server, url = await raw_server(lambda r, w: asyncio.sleep(0))
    server.close()
    await server.wait_closed()
    with pytest.raises(UpstreamConnectError) as info:
        await pool.post(url, b"{}", H, connect_timeout_s=1)
    assert isinstance(info.value, OSError)


async def test_header_injection_is_refused(srv: Web, pool: UpstreamPool) -> None:
    with pytest.raises(ValueError):
        await pool.post(srv.url + "/echo", b"", {"X-A": "1\r\nX-B: 2"}, connect_timeout_s=1)


async def endless(writer: asyncio.StreamWriter, head: bytes, piece: bytes, gone: asyncio.Event) -> None:
    """Write `head`, then `piece` forever, until the client goes away."""
    try:
        writer.write(head)
        while True:
            writer.write(piece)
            await writer.drain()
    except (ConnectionError, OSError):
        gone.set()


@pytest.mark.parametrize("piece", [b"a" * 100, b"a" * 16384], ids=["dribbled", "bulk"])
async def test_an_endless_response_header_fails_at_the_cap(piece: bytes) -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await endless(writer, b"HTTP/1.1 200 OK\r\nX-Junk: ", piece, gone)

    async with served(handler) as (pool, url):
        with pytest.raises(UpstreamProtocolError, match="response headers exceed 65536 bytes") as info:
            async with asyncio.timeout(5):
                await pool.post(url, b"{}", H, connect_timeout_s=1)
        assert isinstance(info.value, UpstreamHeadersTooLarge) and isinstance(info.value, UpstreamTooLarge)
        assert info.value.limit == 65536
        await asyncio.wait_for(gone.wait(), 2)  # the socket was dropped, not left reading


async def test_too_many_header_lines_and_a_big_head_in_one_read_fail() -> None:
    heads = {
        "/lines": b"HTTP/1.1 200 OK\r\n" + b"X-N: 1\r\n" * 20 + b"Content-Length: 2\r\n\r\nok",
        "/bytes": b"HTTP/1.1 200 OK\r\nX-Big: " + b"b" * 3000 + b"\r\nContent-Length: 2\r\n\r\nok",
        "/fine": b"HTTP/1.1 200 OK\r\n" + b"X-N: 1\r\n" * 8 + b"Content-Length: 200000\r\n\r\n" + b"z" * 200_000,
    }

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        req = await read_request(reader)
        writer.write(heads[req.split(b" ")[1].decode()])  # all in one write
        await writer.drain()
        writer.close()

    server, url = await raw_server(handler)
    pool = UpstreamPool(max_header_bytes=1024, max_headers=16)
    async with server:
        with pytest.raises(UpstreamHeadersTooLarge, match="response headers exceed 16 lines"):
            await pool.post(url + "/lines", b"{}", H, connect_timeout_s=1)
        with pytest.raises(UpstreamHeadersTooLarge, match="response headers exceed 1024 bytes"):
            await pool.post(url + "/bytes", b"{}", H, connect_timeout_s=1)
        resp = await pool.post(url + "/fine", b"{}", H, connect_timeout_s=1)  # body bytes don't count
        assert await resp.read() == b"z" * 200_000
        resp.release()
        await pool.close()


async def test_read_stops_at_max_bytes(srv: Web, pool: UpstreamPool) -> None:
    for path in ("/big", "/big?chunked=1"):
        resp = await pool.post(srv.url + path, b"", H, connect_timeout_s=1)
        assert await resp.read(max_bytes=len(BIG)) == BIG  # exactly at the cap: fine
        resp.release()
        resp = await pool.post(srv.url + path, b"", H, connect_timeout_s=1)
        with pytest.raises(UpstreamTooLarge, match=f"response body exceeds {len(BIG) - 1} bytes") as info:
            await resp.read(max_bytes=len(BIG) - 1)
        assert info.value.limit == len(BIG) - 1
        conn = resp._conn
        resp.release()
        assert conn is not None and (conn.closed or conn.transport.is_closing())  # type: ignore[union-attr]
    resp = await pool.post(srv.url + "/echo", b"after", H, connect_timeout_s=1)
    assert await resp.read(max_bytes=5) == b"after"
    resp.release()


async def test_an_endless_body_stops_at_max_bytes_and_drops_the_socket() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await endless(writer, b"HTTP/1.0 200 OK\r\n\r\n", b"x" * 65536, gone)

    async with answered(handler) as (pool, resp):
        with pytest.raises(UpstreamTooLarge):
            async with asyncio.timeout(5):
                await resp.read(max_bytes=1 << 20)
        await asyncio.wait_for(gone.wait(), 2)
        with pytest.raises(UpstreamTooLarge):  # the response stays failed
            await resp.readany()
        resp.release()


async def test_an_endless_trailer_fails_at_the_framing_cap_and_drops_the_socket() -> None:
    # The parser buffers an unfinished trailer line (as it does a header line): without a cap an
    # upstream would grow it without bound, at a quadratic cost on the event loop.
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\nX-Trailer: "
        await endless(writer, head, b"a" * 16384, gone)

    async with answered(handler) as (pool, resp):
        with pytest.raises(UpstreamProtocolError, match="framing"):
            async with asyncio.timeout(5):
                await resp.read(max_bytes=1 << 20)
        await asyncio.wait_for(gone.wait(), 2)
        resp.release()


async def test_many_small_chunks_and_trailers_within_the_cap_are_read_whole() -> None:
    # The framing's cap grows with the chunks: 20,000 one-byte chunks (6 bytes of framing each)
    # are an answer, not an attack. Trailers are read and dropped: they are not response headers.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1;e=x\r\nz\r\n" * 20_000)
            writer.write(b"0\r\nRetry-After: 9\r\nX-Trailer: " + b"t" * 1000 + b"\r\n\r\n")
            await writer.drain()
        writer.close()

    async with served(handler) as (pool, url):
        for _ in range(2):
            resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
            assert await resp.read() == b"z" * 20_000
            assert "Retry-After" not in resp.headers and "X-Trailer" not in resp.headers
            resp.release()
        assert sum(len(d) for d in pool._idle.values()) == 1  # the connection was reused


async def test_a_reset_cuts_a_body_that_ends_with_the_connection() -> None:
    # Only a clean close ends an HTTP/1.0-style body; a reset says it was cut.
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"choices":[{"message":{"content":"the answer is 4')
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # a close with SO_LINGER 0: a RST, not a FIN

    async with answered(handler) as (pool, resp):
        with pytest.raises(UpstreamDisconnected, match="mid-body"):
            await resp.read(max_bytes=1 << 20)
        resp.release()


async def test_an_answer_that_came_before_the_request_was_written_closes_the_connection() -> None:
    # An upstream that answers (a 401, a 413) before it read the body, and keeps the connection:
    # reused, the rest of that body would go ahead of the next request, another tenant's, and
    # the upstream would read it as that request.
    conns: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.append(b"")
        if len(conns) == 1:
            await reader.readuntil(b"\r\n\r\n")  # the head only
            writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\nno")
            await writer.drain()
            await asyncio.sleep(0.3)  # not reading the body
            conns[0] = await reader.read(64)  # what this upstream would take for the next request
            writer.close()
            return
        while body := await read_request(reader):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body.split(b"\r\n\r\n", 1)[1]), body.split(b"\r\n\r\n", 1)[1]))
            await writer.drain()
        writer.close()

    async with served(handler) as (pool, url):
        secret = b'{"content":"tenant A ' + b"x" * (24 << 20) + b'"}'  # past what the sockets buffer
        resp = await pool.post(url, secret, H, connect_timeout_s=1)
        assert (resp.status, await resp.read()) == (401, b"no")
        resp.release()
        resp = await pool.post(url, b'{"tenant": "B"}', H, connect_timeout_s=1)
        assert (resp.status, await resp.read()) == (200, b'{"tenant": "B"}')
        resp.release()
        assert len(conns) == 2  # B went on a connection of its own
        await asyncio.sleep(0.4)
        assert b"POST" not in conns[0]  # the first connection never carried B's request


async def test_bytes_that_came_to_an_idle_connection_drop_it_even_when_the_loop_read_them_late() -> None:
    # The upstream (a thread: it runs while the loop is busy) sends a second, unasked-for answer
    # while the connection is idle and the loop is busy until after the next request is due:
    # polled before reuse, the connection is dropped, and the next request does not read that
    # answer as its own.
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(5)
    conns = 0

    def request(c: socket.socket) -> bool:
        buf = b""
        while b"\r\n\r\n" not in buf or not buf.endswith(b"{}"):
            got = c.recv(4096)
            if not got:
                return False
            buf += got
        return True

    def serve() -> None:
        nonlocal conns
        for leftover in (True, False):
            with contextlib.suppress(OSError):
                c, _ = lsock.accept()
                conns += 1
                with c:
                    c.settimeout(5)
                    request(c)
                    if leftover:
                        c.sendall(OK)
                        time.sleep(0.02)
                        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nLEFTOVER")
                        if not request(c):  # the client dropped this connection, as it should
                            continue
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nown")
                    time.sleep(0.1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{lsock.getsockname()[1]}"
    pool = UpstreamPool()
    try:
        async with asyncio.timeout(5):
            resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
            assert await resp.read() == b"ok"
            time.sleep(0.1)  # a busy loop: the leftover answer waits in the socket, unread
            resp.release()
            resp = await pool.post(url, b"{}", H, connect_timeout_s=1)
            assert await resp.read() == b"own"
            resp.release()
        assert conns == 2
    finally:
        await pool.close()
        lsock.close()
        thread.join(2)


async def test_an_endless_sse_event_fails_at_the_decoders_cap() -> None:
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        first = b"data: 1\n\ndata: "
        await endless(writer, head + b"%x\r\n%s\r\n" % (len(first), first), b"400\r\n" + b"x" * 1024 + b"\r\n", gone)

    async with answered(handler) as (pool, resp):
        decoder = SSEDecoder(max_event_bytes=256 * 1024)
        events: list[bytes] = []
        with pytest.raises(SSEEventTooLarge, match="an SSE event exceeds 262144 bytes") as info:
            async with asyncio.timeout(5):
                while chunk := await resp.readany():
                    events += decoder.feed(chunk)
        assert info.value.limit == 256 * 1024 and isinstance(info.value, ValueError)
        assert events == [b"data: 1\n\n"]
        resp.close()
        await asyncio.wait_for(gone.wait(), 2)


def test_sse_event_cap_counts_whole_events_too() -> None:
    d = SSEDecoder(max_event_bytes=100)
    assert d.feed(b"data: " + b"x" * 94 + b"\n\n") == [b"data: " + b"x" * 94 + b"\n\n"]  # 100: at the cap
    with pytest.raises(SSEEventTooLarge):
        d.feed(b"data: " + b"x" * 95 + b"\n\n")  # terminated in the same read, still too big
    assert SSEDecoder().max_event_bytes == 1 << 20


def test_sse_decoder_is_split_invariant() -> None:
    """However the reads split a stream (CRLF halves and terminators across reads included), the
    events and the pending tail are those of feeding it whole."""
    rnd = random.Random(9)
    for _ in range(2000):
        stream = b""
        for i in range(rnd.randint(0, 6)):
            nl, nl2 = rnd.choice([b"\n", b"\r\n"]), rnd.choice([b"\n", b"\r\n"])
            stream += rnd.choice([b"", b"event: e" + nl, b": c" + nl]) + b"data: {\"a\":%d}" % i + rnd.choice([b"", b"x" * 40]) + nl + nl2
        stream += rnd.choice([b"", b"data: tail", b"data: x\r", b"data: y\n", b"data: z\r\n"])
        whole = SSEDecoder()
        expected = whole.feed(stream)
        d, got, i = SSEDecoder(), [], 0
        while i < len(stream):
            n = rnd.choice([1, 2, 3, 7, 50])
            got += d.feed(stream[i : i + n])
            i += n
        assert got == expected, stream
        assert d.pending == whole.pending, stream


def test_an_event_dribbled_in_tiny_reads_costs_linear_time() -> None:
    """A backend can send one event a few bytes per read: holding it must not copy it per read."""
    event = b"data: " + b"x" * ((1 << 20) - 16)
    d = SSEDecoder()
    t0 = time.perf_counter()
    for i in range(0, len(event), 64):
        assert d.feed(event[i : i + 64]) == []
    assert d.feed(b"\n\n") == [event + b"\n\n"]
    assert time.perf_counter() - t0 < 1.0  # copying the held bytes per read took ~10 s here


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI")
    d = tmp_path_factory.mktemp("tls")
    key, crt = d / "k.pem", d / "c.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return key, crt


async def test_https_with_a_verified_self_signed_cert(srv: Web, cert: tuple[Path, Path]) -> None:
    key, crt = cert
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(crt, key)
    site = web.TCPSite(srv.runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/echo"  # type: ignore[union-attr]
    pool = UpstreamPool(ssl_context=ssl.create_default_context(cafile=str(crt)))
    for i in range(3):
        resp = await pool.post(url, b"secret %d" % i, H, connect_timeout_s=2)
        assert await resp.read() == b"secret %d" % i
        resp.release()
    assert len(set(srv.peers)) == 1
    await pool.close()
    with pytest.raises(UpstreamConnectError):  # the default context does not trust it
        await UpstreamPool().post(url, b"", H, connect_timeout_s=2)


def test_the_same_behaviour_on_uvloop() -> None:
    """The gateway serves on uvloop, whose transports are not asyncio's: run the scenarios there too."""
    uvloop = pytest.importorskip("uvloop")

    async def with_server(test: Callable[[Web, UpstreamPool], Awaitable[None]]) -> None:
        s = Web()
        await s.runner.setup()
        site = web.TCPSite(s.runner, "127.0.0.1", 0)
        await site.start()
        s.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        p = UpstreamPool()
        try:
            await test(s, p)
        finally:
            await p.close()
            await s.runner.cleanup()

    served = (
        test_keep_alive_reuses_one_connection,
        test_connection_close_is_not_reused,
        test_large_bodies_content_length_and_chunked,
        test_slow_consumer_gets_every_byte,
        test_readany_streams_chunks_as_they_arrive,
        test_concurrent_requests_open_many_connections,
        test_read_stops_at_max_bytes,
    )
    raw = (
        test_drop_mid_body_raises,
        test_drop_mid_chunked_stream_raises_after_the_bytes_that_came,
        test_eof_delimited_body_is_complete,
        test_garbage_is_a_protocol_error,
        test_interim_response_is_skipped_and_extra_bytes_drop_the_socket,
        test_timeout_on_a_silent_upstream_closes_the_socket,
        test_cancelling_a_stream_read_closes_the_socket,
        test_a_request_written_then_dropped_is_never_resent,
        test_a_pooled_connection_closed_before_the_write_is_replaced_and_sent_once,
        test_a_fresh_connection_that_drops_is_not_retried,
        test_too_many_header_lines_and_a_big_head_in_one_read_fail,
        test_an_endless_body_stops_at_max_bytes_and_drops_the_socket,
        test_an_endless_sse_event_fails_at_the_decoders_cap,
        test_an_endless_trailer_fails_at_the_framing_cap_and_drops_the_socket,
        test_many_small_chunks_and_trailers_within_the_cap_are_read_whole,
        test_a_reset_cuts_a_body_that_ends_with_the_connection,
        test_an_answer_that_came_before_the_request_was_written_closes_the_connection,
        test_bytes_that_came_to_an_idle_connection_drop_it_even_when_the_loop_read_them_late,
    )

    async def main() -> None:
        for test in served:
            await with_server(test)
        for t in raw:
            await t()
        for piece in (b"a" * 100, b"a" * 16384):
            await test_an_endless_response_header_fails_at_the_cap(piece)

    uvloop.run(main())
