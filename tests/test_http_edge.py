"""The HTTP edge over real sockets (web/edge.py, web/body.py): compressed bodies inflate under the limit and
only after authentication, big bodies are 413s before they are read, half-sent heads are closed
within the header timeout, one address cannot hold every connection, and whatever the HTTP parser
refuses is answered in OpenAI's JSON shape (or the connection closed), never a traceback.

The memory and event-loop checks run `gateway serve` in a process of its own (its RSS is then the
gateway's alone); the others serve the app on the test's loop through the same EdgeRunner, with the
raw-socket client in a thread."""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import struct
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from gateway.web.app import create_app
from gateway.tenants.auth import hash_key
from gateway.web.edge import EdgeRunner
from tests.procs import serve
from tests.rawhttp import Answer, Watch, exchange, get, json_error

KEY = "sk-edge-test-key"
CHAT = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]})


def _policy(up: Any, **server: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "server": server,
        "health": {"probe_interval_ms": 600_000},
        "backends": {"a": {"url": up.url, "models": ["gpt-test"]}},
        "models": {"gpt-test": {"backends": ["a"]}},
        "tenants": {"acme": {"key_sha256": [hash_key(KEY)]}},
    }


def _post(path: str, body: bytes, *, key: str | None = KEY, extra: str = "", length: bool = True) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    size = f"Content-Length: {len(body)}\r\n" if length else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}{extra}{size}\r\n").encode() + body


def _bomb(megabytes: int) -> bytes:
    """gzip of a chat body whose content is `megabytes` MiB of 'a' (~1 KB of gzip per MiB): one
    1 MiB block compressed after a full flush is the same bytes every time, so it is repeated."""
    pre, suf, chunk = b'{"model":"gpt-test","messages":[{"role":"user","content":"', b'"}]}', b"a" * (1 << 20)
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(pre) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(chunk) + c.flush(zlib.Z_FULL_FLUSH)
    last = c.compress(suf) + c.flush()
    crc = zlib.crc32(pre)
    for _ in range(megabytes):
        crc = zlib.crc32(chunk, crc)
    crc = zlib.crc32(suf, crc)
    size = len(pre) + megabytes * len(chunk) + len(suf)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first + block * megabytes + last + struct.pack("<II", crc, size & 0xFFFFFFFF)


def _json_answer(a: Answer, status: int) -> dict[str, Any]:
    assert a.status == status, (a.status, a.raw[:300])
    assert a.ctype.startswith("application/json"), (a.ctype, a.body[:200])
    err = json_error(a.body)
    assert err is not None, a.body[:300]
    return err


@pytest.fixture
async def edge_gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Factory: `await edge_gateway(policy)` serves create_app's app through EdgeRunner (as
    `gateway serve` does) on a free port; returns the port."""
    runners: list[EdgeRunner] = []

    async def make(policy: dict[str, Any]) -> int:
        path = tmp_path / f"edge-{len(runners)}.yaml"
        path.write_text(yaml.safe_dump(policy))
        runner = EdgeRunner(create_app(path), handler_cancellation=True, access_log=None)
        await runner.setup()
        from aiohttp import web

        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]

    yield make
    for runner in runners:
        await runner.cleanup()


# ---- 1. compressed bodies ---------------------------------------------------------------------------


async def test_a_gzip_bomb_costs_no_memory_and_no_loop_time_with_or_without_a_key(upstream, tmp_path):
    """~600 KB of gzip inflating to 600 MB: without a key a 401 before a byte is inflated, with one a
    413 once the inflated bytes pass max_body_bytes; RSS grows < 100 MB and /healthz, polled all
    along, answers within 200 ms."""
    up = await upstream("a")
    gz = _bomb(600)
    async with serve(_policy(up), tmp_path) as gw:

        def run() -> list[tuple[str, Answer, Watch]]:
            out = []
            for who, key in (("no key", None), ("tenant key", KEY)):
                extra = f"Content-Encoding: gzip\r\nContent-Length: {len(gz)}\r\n"
                head = _post("/v1/chat/completions", b"", key=key, extra=extra, length=False)
                with Watch(gw.proc.pid, gw.port) as w:
                    a = exchange(gw.port, head, (gz[i : i + (1 << 16)] for i in range(0, len(gz), 1 << 16)), timeout=30)
                out.append((who, a, w))
            return out

        results = await asyncio.to_thread(run)
        log = gw.log.read_text()
    for who, a, w in results:
        err = _json_answer(a, 401 if who == "no key" else 413)
        assert a.seconds <= 1.0, (who, a.seconds)
        assert w.growth_mb < 100, (who, f"RSS +{w.growth_mb:.0f} MB")
        assert w.slowest_s <= 0.2, (who, f"slowest /healthz {w.slowest_s * 1000:.0f} ms of {len(w.latencies)}")
        if who == "tenant key":
            assert err["code"] == "request_too_large" and "inflates" in err["message"], err
    assert "Traceback" not in log
    assert up.stats.requests == 0


async def test_gzip_and_deflate_bodies_are_inflated_and_other_encodings_are_415(upstream, edge_gateway):
    up = await upstream("a")
    port = await edge_gateway(_policy(up, max_body_bytes=4096))
    half = len(CHAT) // 2
    members = gzip.compress(CHAT[:half]) + gzip.compress(CHAT[half:])  # two gzip members: one body (RFC 1952)
    raw_deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    cases: list[tuple[str, bytes, str, int, str | None]] = [
        ("gzip", gzip.compress(CHAT), "gzip", 200, None),
        ("x-gzip", gzip.compress(CHAT), "x-gzip", 200, None),
        ("deflate (zlib)", zlib.compress(CHAT), "deflate", 200, None),
        ("deflate (raw)", raw_deflate.compress(CHAT) + raw_deflate.flush(), "deflate", 200, None),
        ("gzip members", members, "gzip", 200, None),
        ("identity", CHAT, "identity", 200, None),
        ("br", CHAT, "br", 415, "unsupported_content_encoding"),
        ("zstd", CHAT, "zstd", 415, "unsupported_content_encoding"),
        ("stacked", gzip.compress(gzip.compress(CHAT)), "gzip, gzip", 415, "unsupported_content_encoding"),
        ("malformed gzip", b"\x1f\x8b" + b"\0" * 8, "gzip", 400, "invalid_content_encoding"),
        ("cut gzip", gzip.compress(CHAT)[:-12], "gzip", 400, "invalid_content_encoding"),
        ("inflates past the limit", gzip.compress(b" " * 5000 + CHAT), "gzip", 413, "request_too_large"),
    ]

    def run() -> list[tuple[str, Answer, int, str | None]]:
        return [(name, exchange(port, _post("/v1/chat/completions", body, extra=f"Content-Encoding: {enc}\r\n")), status, code)
                for name, body, enc, status, code in cases]

    for name, a, status, code in await asyncio.to_thread(run):
        assert a.status == status, (name, a.status, a.body[:200])
        if code is not None:
            assert _json_answer(a, status)["code"] == code, name
    assert up.stats.requests == 6  # the inflatable ones reached the backend, nothing else


async def test_nothing_is_read_or_inflated_before_authentication(upstream, edge_gateway):
    """A malformed gzip body, a wrong key: a 401 (the body is never looked at), in JSON."""
    up = await upstream("a")
    port = await edge_gateway(_policy(up))
    bad_gz = b"\x1f\x8b" + b"\0" * 8
    answers = await asyncio.to_thread(lambda: [
        exchange(port, _post("/v1/chat/completions", bad_gz, key=None, extra="Content-Encoding: gzip\r\n")),
        exchange(port, _post("/v1/chat/completions", bad_gz, key="sk-wrong", extra="Content-Encoding: gzip\r\n")),
        exchange(port, _post("/v1/route/explain", bad_gz, key=None, extra="Content-Encoding: br\r\n")),
    ])
    for a in answers:
        assert _json_answer(a, 401)["type"] == "authentication_error"


# ---- 4. big bodies ----------------------------------------------------------------------------------


def _pieces(total: int, chunked: bool) -> Iterator[bytes]:
    piece = b"\0" * (1 << 18)
    left = total
    while left > 0:
        k = min(left, len(piece))
        yield (b"%x\r\n" % k + piece[:k] + b"\r\n") if chunked else piece[:k]
        left -= k
    if chunked:
        yield b"0\r\n\r\n"


async def test_a_200_mb_body_is_a_413_within_a_second_on_every_body_endpoint(upstream, tmp_path):
    up = await upstream("a")
    total = 200_000_000
    async with serve(_policy(up), tmp_path) as gw:

        def run() -> list[tuple[str, Answer, Watch]]:
            out = []
            for path in ("/v1/responses/resp_x/cancel", "/v1/chat/completions", "/v1/route/explain"):
                for chunked in (False, True):
                    framing = "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
                    head = _post(path, b"", extra=framing, length=False)
                    with Watch(gw.proc.pid) as w:
                        a = exchange(gw.port, head, _pieces(total, chunked), timeout=30)
                    out.append((f"{path} {'chunked' if chunked else 'Content-Length'}", a, w))
            return out

        results = await asyncio.to_thread(run)
        log = gw.log.read_text()
    for name, a, w in results:
        assert _json_answer(a, 413)["code"] == "request_too_large", name
        assert a.seconds <= 1.0, (name, f"{a.seconds:.2f} s, {a.sent / 1e6:.0f} MB sent")
        assert w.growth_mb < 100, (name, f"RSS +{w.growth_mb:.0f} MB")
    assert "Traceback" not in log
    assert up.stats.requests == 0


# ---- 6. slowloris -----------------------------------------------------------------------------------


async def test_half_sent_heads_get_a_408_and_are_closed_within_the_header_timeout(upstream, tmp_path):
    """30 connections from 127.0.0.2 sending a header line every 300 ms: each gets a 408 in JSON and
    is closed within the header timeout (1 s, plus slack), while 127.0.0.1 is answered meanwhile."""
    up = await upstream("a")
    async with serve(_policy(up, header_timeout_ms=1000, keepalive_timeout_ms=3000), tmp_path) as gw:

        def slow(i: int) -> Answer:
            lines = [b"X-Slow-%d: x\r\n" % n for n in range(40)]
            return exchange(gw.port, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n", lines, timeout=8, source="127.0.0.2",
                            pause_s=0.3, wait_close=True)

        def normal() -> list[int]:
            statuses = []
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                statuses.append(get(gw.port, "/healthz", timeout=5)[0])
                time.sleep(0.1)
            return statuses

        results: list[Answer] = []
        threads = [threading.Thread(target=lambda i=i: results.append(slow(i))) for i in range(30)]
        for t in threads:
            t.start()
        served = await asyncio.to_thread(normal)
        await asyncio.to_thread(lambda: [t.join(15) for t in threads])
        log = gw.log.read_text()
    assert len(results) == 30
    for a in results:
        assert a.closed, "a half-sent head was left open"
        assert a.seconds <= 2.5, f"closed after {a.seconds:.1f} s"
        assert _json_answer(a, 408)["code"] == "request_timeout"
    assert served and all(s == 200 for s in served), served
    assert "Traceback" not in log


async def test_a_silent_connection_is_closed_and_an_idle_keep_alive_one_after_its_timeout(upstream, edge_gateway):
    up = await upstream("a")
    port = await edge_gateway(_policy(up, header_timeout_ms=500, keepalive_timeout_ms=1500))

    def silent() -> tuple[float, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            t0 = time.monotonic()
            data = s.recv(100)  # nothing sent: closed without an answer
            return time.monotonic() - t0, data

    def idle() -> tuple[float, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            got = b""
            while b'"ok"' not in got:
                got += s.recv(4096)
            t0 = time.monotonic()
            data = s.recv(100)  # idle after an answer: kept past the header timeout, closed at the keep-alive one
            return time.monotonic() - t0, data

    (t_silent, d_silent), (t_idle, d_idle) = await asyncio.gather(asyncio.to_thread(silent), asyncio.to_thread(idle))
    assert d_silent == b"" and 0.3 <= t_silent <= 1.5, t_silent
    assert d_idle == b"" and 1.2 <= t_idle <= 2.5, t_idle


async def test_connections_past_the_per_address_cap_get_a_429_and_other_addresses_are_served(upstream, edge_gateway):
    up = await upstream("a")
    port = await edge_gateway(_policy(up, max_connections_per_client=3, header_timeout_ms=30_000))

    def run() -> tuple[Answer, int, Answer]:
        held = []
        for _ in range(3):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", port))
            held.append(s)
        time.sleep(0.1)
        # A client that waits for the server's word: the 429 arrives at once, then the close.
        over = exchange(port, b"", source="127.0.0.2", timeout=5, wait_close=True)
        other = get(port, "/healthz")[0]  # 127.0.0.1 is its own address
        held.pop().close()
        time.sleep(0.1)
        again = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", source="127.0.0.2", timeout=5)
        for s in held:
            s.close()
        return over, other, again

    over, other, again = await asyncio.to_thread(run)
    err = _json_answer(over, 429)
    assert err["code"] == "too_many_connections" and over.closed and over.headers.get("retry-after") == "1"
    assert other == 200
    assert again.status == 200, again.raw[:200]


# ---- 7. one error shape -----------------------------------------------------------------------------

_HEAD = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
MALFORMED: dict[str, tuple[bytes, int]] = {
    "two Content-Lengths": ((_HEAD + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{} ").encode(), 400),
    "Transfer-Encoding and Content-Length": ((_HEAD + "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").encode(), 400),
    "bare LF in a header": ((_HEAD + "X-Probe: a\nX-Other: b\r\nContent-Length: 2\r\n\r\n{}").encode(), 400),
    "bare CR in a header": ((_HEAD + "X-Probe: a\rX-Other: b\r\nContent-Length: 2\r\n\r\n{}").encode(), 400),
    "a NUL in a header": ((_HEAD + "X-Probe: a\0b\r\nContent-Length: 2\r\n\r\n{}").encode(), 400),
    "a header line of 9000 bytes": ((_HEAD + "X-Big: " + "b" * 9000 + "\r\nContent-Length: 2\r\n\r\n{}").encode(), 431),
    "200 headers": ((_HEAD + "".join(f"X-H{i}: v\r\n" for i in range(200)) + "Content-Length: 2\r\n\r\n{}").encode(), 431),
    "a head over max_header_bytes": ((_HEAD + "".join(f"X-H{i}: {'v' * 1000}\r\n" for i in range(40)) + "\r\n").encode(), 431),
    "a bad request line": (b"GET /a b c HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    "a bad chunk size": ((_HEAD + "Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n").encode(), 400),
    "a negative Content-Length": ((_HEAD + "Content-Length: -5\r\n\r\n{}").encode(), 400),
    "an unknown Expect": ((_HEAD + "Expect: 100-maybe\r\nContent-Length: 2\r\n\r\n{}").encode(), 417),
    "Content-Encoding: br": ((_HEAD + f"Authorization: Bearer {KEY}\r\nContent-Encoding: br\r\nContent-Length: 2\r\n\r\n{{}}").encode(), 415),
}


@pytest.mark.parametrize("name", list(MALFORMED))
async def test_malformed_requests_are_answered_in_json_without_a_traceback(upstream, edge_gateway, caplog, name):
    up = await upstream("a")
    port = await edge_gateway(_policy(up))
    data, status = MALFORMED[name]
    with caplog.at_level(logging.DEBUG):
        a = await asyncio.to_thread(exchange, port, data, (), timeout=5)
    err = _json_answer(a, status)
    assert "Traceback" not in err["message"]
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    assert up.stats.requests == 0


async def test_bad_chunk_framing_after_the_head_is_a_400_at_once(upstream, edge_gateway):
    """The head arrives, then a malformed chunk: the handler reading the body gets a 400 now (not
    after the body timeout), and nothing lingers on the connection."""
    up = await upstream("a")
    port = await edge_gateway(_policy(up))
    head = (_HEAD + f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    a = await asyncio.to_thread(exchange, port, head, [b"5\r\n{\"mod\r\n", b"zz\r\nnot a chunk\r\n"], timeout=10, pause_s=0.2)
    assert _json_answer(a, 400)["code"] == "malformed_request"
    assert a.seconds < 2.0
    assert up.stats.requests == 0


async def test_a_body_that_never_arrives_is_a_408_after_the_body_timeout(upstream, edge_gateway):
    up = await upstream("a")
    port = await edge_gateway(_policy(up, body_timeout_ms=500))
    head = (_HEAD + f"Authorization: Bearer {KEY}\r\nContent-Length: 100\r\n\r\n").encode()
    a = await asyncio.to_thread(exchange, port, head, [b"{"], timeout=5)
    assert _json_answer(a, 408)["code"] == "request_timeout"
    assert 0.4 <= a.seconds <= 2.0, a.seconds


async def test_the_head_size_counts_the_head_only_even_when_its_blank_line_straddles_two_reads(upstream, edge_gateway):
    """max_header_bytes 1024: a 900-byte head whose last CRLF comes with a 3000-byte body is fine
    (the body is not the head); 1100 bytes of head still unfinished is a 431, then a close."""
    up = await upstream("a")
    port = await edge_gateway(_policy(up, max_header_bytes=1024))
    body = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "x" * 3000}]})
    head = (_HEAD + f"Authorization: Bearer {KEY}\r\nX-Pad: {'p' * 750}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    assert 900 < len(head) < 1024
    for cut in (1, 2, 3, 4):  # the blank line split anywhere between two reads
        ok = await asyncio.to_thread(exchange, port, head[:-cut], [head[-cut:] + body], pause_s=0.1)
        assert ok.status == 200, (cut, ok.raw[:300])
    big = (_HEAD + f"X-Pad: {'p' * 1100}\r\n").encode()
    a = await asyncio.to_thread(exchange, port, big, (), wait_close=True, timeout=5)
    assert _json_answer(a, 431)["code"] == "request_header_fields_too_large" and a.closed


# ---- 5. plain routes without the router ----------------------------------------------------------


async def test_plain_routes_skip_the_router_and_answer_as_it_would(upstream, edge_gateway):
    """A plain route named exactly goes straight to its handler (edge._Dispatch); the same route
    reached through the router (a query string, an Expect header) answers the same, and what the
    table does not hold (another method, an unknown path) gets the router's answers."""
    import aiohttp

    up = await upstream("a", tokens=3)
    port = await edge_gateway(_policy(up))
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        answers = {}
        for name, path, expect in (("direct", "/v1/chat/completions", False), ("query", "/v1/chat/completions?trace=1", False),
                                   ("expect", "/v1/chat/completions", True)):
            async with http.post(base + path, data=CHAT, headers={**auth, "Content-Type": "application/json"}, expect100=expect) as r:
                answers[name] = (r.status, r.headers.get("x-gateway-backend"), (await r.json())["object"])
        assert set(answers.values()) == {(200, "a", "chat.completion")}, answers
        async with http.get(base + "/v1/chat/completions", headers=auth) as r:  # a method the table lacks: the catch-all
            assert r.status == 404 and json_error(await r.read()) is not None, r.status
        async with http.head(base + "/healthz") as r:
            assert r.status == 200 and await r.read() == b""
        async with http.get(base + "/healthz") as r, http.get(base + "/healthz?x=1") as q:
            assert (r.status, await r.json()) == (q.status, await q.json()) == (200, {"status": "ok"})
        async with http.get(base + "/v1/models", headers=auth) as r, http.get(base + "/v1/models?limit=1", headers=auth) as q:
            assert r.status == q.status == 200 and await r.json() == await q.json()
        async with http.post(base + "/v1/chat/completion", data=CHAT, headers=auth) as r:  # no such route
            assert r.status == 404 and json_error(await r.read()) is not None
    assert up.stats.requests == 3


async def test_the_dispatch_table_holds_the_plain_routes_only(upstream, tmp_path):
    """What the table holds: every method of every route without variables, none with."""
    from gateway.web.edge import _Dispatch

    up = await upstream("a")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(up)))
    runner = EdgeRunner(create_app(path), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        handler = runner.server.request_handler  # type: ignore[union-attr]
        assert isinstance(handler, _Dispatch)
        table = handler._routes
        assert {("POST", "/v1/chat/completions"), ("POST", "/v1/responses"), ("POST", "/v1/messages"),
                ("GET", "/healthz"), ("HEAD", "/healthz"), ("GET", "/metrics")} <= set(table)
        assert not any("{" in p for _, p in table) and all(m != "*" for m, _ in table)
        assert all(info.route.resource is not None and info.route.resource.canonical == p for (_, p), info in table.items())
    finally:
        await runner.cleanup()


def _status_line(port: int, head: bytes) -> bytes:
    """The first line the server answers a request head with (the body is never sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head)
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


async def test_expect_100_continue_is_not_sent_to_a_request_refused_anyway(upstream, gateway):
    # aiohttp's Expect handling answered 100 Continue before the key and the size were checked:
    # the client uploaded a body the gateway then read and dropped (review helper's repro).
    from tests.conftest import simple_policy

    up = await upstream("a")
    gw = await gateway(simple_policy(up, tenants={"acme": {"key_sha256": [hash_key("sk-acme")]}},
                                     server={"max_body_bytes": 65536}))
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    no_key = await asyncio.to_thread(_status_line, gw.port, head + b"Content-Length: 60000\r\n\r\n")
    too_big = await asyncio.to_thread(_status_line, gw.port, head + b"Authorization: Bearer sk-acme\r\nContent-Length: 900000000\r\n\r\n")
    messages = await asyncio.to_thread(_status_line, gw.port, head.replace(b"/v1/chat/completions", b"/v1/messages")
                                       + b"Content-Length: 60000\r\n\r\n")
    fine = await asyncio.to_thread(_status_line, gw.port, head + b"Authorization: Bearer sk-acme\r\nContent-Length: 100\r\n\r\n")
    assert no_key.startswith(b"HTTP/1.1 401") and b'"code":"invalid_api_key"' in no_key, no_key
    assert too_big.startswith(b"HTTP/1.1 413") and b"request_too_large" in too_big, too_big
    assert messages.startswith(b"HTTP/1.1 401") and b'"type":"error"' in messages  # in that API's shape
    assert fine.startswith(b"HTTP/1.1 100")  # a request that may be served is invited as before


# ---- hostile headers and bodies (review of the edge) -------------------------------------------------

CHAT = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]})


async def test_a_beta_header_that_is_not_ascii_is_a_400_and_no_backend_is_blamed(upstream, edge_gateway, caplog):
    """A byte that is not UTF-8 in `openai-beta` came through as a lone surrogate and raised as the
    request went upstream: a 500 with a traceback, counted as backend a's 500 (review helper's
    repro). It is the caller's 400, naming the header; nothing is sent."""
    up = await upstream("a")
    port = await edge_gateway(_policy(up))
    head = _post("/v1/chat/completions", CHAT, extra="openai-beta: q\r\n").replace(b"openai-beta: q", b"openai-beta: \xff")
    with caplog.at_level(logging.ERROR):
        a = await asyncio.to_thread(exchange, port, head)
        _, metrics = await asyncio.to_thread(get, port, "/metrics")
    err = _json_answer(a, 400)
    assert err["param"] == "openai-beta", err
    assert up.stats.requests == 0 and not [r for r in caplog.records if r.exc_info]
    assert 'code="500"' not in metrics.decode()


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                         ("/v1/messages/count_tokens", "anthropic")])
async def test_an_answer_aiohttp_makes_itself_is_in_the_apis_own_shape(upstream, edge_gateway, path, shape):
    """aiohttp's own 417 for an unknown Expect was turned into OpenAI's shape on every path; on
    /v1/messages the anthropic SDK then read no error type (review helper's repro)."""
    up = await upstream("a")
    port = await edge_gateway(_policy(up))
    a = await asyncio.to_thread(exchange, port, _post(path, CHAT, extra="Expect: 100-maybe\r\n"))
    assert a.status == 417 and a.ctype.startswith("application/json"), a.raw[:300]
    body = orjson.loads(a.body)
    if shape == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    else:
        assert body["error"]["type"] == "invalid_request_error" and "param" in body["error"], body


async def test_a_body_its_handler_never_read_is_not_held_by_the_idle_connection(upstream, tmp_path):
    """A body that came with its head and was never read (a 401 before authentication) stayed
    buffered on the keep-alive connection until its next request or the keep-alive timeout:
    300 connections of 100 KiB held 29 MiB (review helper's repro). It is dropped as the answer
    goes out; the connection stays open for the next request."""
    from aiohttp import web

    up = await upstream("a")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(up)))
    runner = EdgeRunner(create_app(path), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
    body = b"x" * 100 * 1024
    try:
        def run() -> list[socket.socket]:
            held = []
            for _ in range(40):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(_post("/v1/chat/completions", body, key=None))
                held.append(s)
            for s in held:
                s.settimeout(5)
                got = b""
                while b"\r\n\r\n" not in got:
                    got += s.recv(65536)
                assert b" 401 " in got.split(b"\r\n")[0], got[:100]
            return held

        held = await asyncio.to_thread(run)
        await asyncio.sleep(0.3)
        conns = list(runner.server._connections)  # type: ignore[union-attr]
        assert len(conns) == 40  # kept alive
        unread = sum(sum(len(b) for b in p._buffer) for c in conns if (p := getattr(c, "_last_payload", None)) is not None)
        for s in held:
            s.close()
        assert unread < 40 * 4096, f"{unread} bytes of unread bodies held by idle connections"
    finally:
        await runner.cleanup()


async def test_bodies_still_arriving_are_held_within_the_budget_and_each_tenants_share(upstream, edge_gateway):
    """Bodies are read after authentication, before any quota: a tenant of `concurrency: 1` held 64
    bodies of 1 MiB trickling in over 64 connections (1,024 x 4 MiB per address by default; review
    helper's repro). Past `server.body_read_budget_bytes`, a tenant holding more than its share is
    refused (503 overloaded) while another tenant's body is still read and answered."""
    up = await upstream("a")
    policy = _policy(up, body_read_budget_bytes=8 << 20)
    other = "sk-other-" + "x" * 16
    policy["tenants"]["acme"]["quota"] = {"concurrency": 1}
    policy["tenants"]["other"] = {"key_sha256": [hash_key(other)]}
    port = await edge_gateway(policy)
    size = 1 << 20
    head = _post("/v1/chat/completions", b"", extra=f"Content-Length: {size}\r\n", length=False)

    def flood() -> tuple[Answer, int]:
        held = []
        for _ in range(24):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(head + b"x" * (size - 1))  # all but the last byte: the body never completes
            held.append(s)
        time.sleep(1.0)
        # Another tenant's body, arriving in pieces too, is read and answered meanwhile.
        body = CHAT + b" " * (size - len(CHAT))
        answer = exchange(port, _post("/v1/chat/completions", b"", key=other, extra=f"Content-Length: {size}\r\n", length=False),
                          pieces=[body[i:i + 65536] for i in range(0, size, 65536)])
        refused = []
        for s in held:
            s.settimeout(0.2)
            try:
                got = s.recv(4096)
            except TimeoutError:
                got = b""
            refused.append(b" 503 " in got.split(b"\r\n")[0])
            s.close()
        return answer, sum(refused)

    answer, refused = await asyncio.to_thread(flood)
    assert answer.status == 200, answer.raw[:300]
    assert refused >= 24 - 9, refused  # at most its share of 8 MiB held, the rest refused
