"""Pipelined requests at the edge (web/edge.py), where one read holds a whole request and more:

- a head that begins in the read ending the request before it was never timed (held until the
  keep-alive timeout, 75 s, not the header timeout) nor measured against max_header_bytes (a
  19 KB head served with a 4096-byte limit): it is now, from that read;
- aiohttp drops every request parsed from a read its parser then refuses: a good request before a
  malformed one got no answer but the 400; it is answered first now, and the 400 is in the shape of
  the malformed head's API;
- an absolute-form target (`POST http://host/v1/messages`) got OpenAI's shape for what the edge
  refuses in its head: its path is read from it too.

And what must not change: requests pipelined in one write are all answered in order, and a
connection that sent whole requests (chunked ones, bodies holding blank lines) is kept idle past
the header timeout without a spurious 408."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from typing import Any

import orjson

from gateway.tenants.auth import hash_key

KEY = "sk-edge-pipelining-key"
CHAT = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]})
HEALTH = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
STATUS = re.compile(rb"HTTP/1\.[01] (\d{3}) ")


def _policy(up: Any, **server: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "server": server,
        "health": {"probe_interval_ms": 600_000},
        "backends": {"a": {"url": up.url, "models": ["gpt-test"]}},
        "models": {"gpt-test": {"backends": ["a"]}},
        "tenants": {"acme": {"key_sha256": [hash_key(KEY)]}},
    }


def _chat(body: bytes = CHAT, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def _talk(port: int, *writes: bytes, pause_s: float = 0.2, wait_s: float = 1.5, until: float = 6.0) -> tuple[bytes, float, bool]:
    """Send `writes` (`pause_s` apart) on one connection, then read until the server closes it,
    nothing came for `wait_s`, or `until` seconds passed: (what came, seconds to the end, closed)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        for i, w in enumerate(writes):
            if i:
                time.sleep(pause_s)
            s.sendall(w)
        t0, got = time.monotonic(), b""
        s.settimeout(wait_s)
        while time.monotonic() - t0 < until:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                return got, time.monotonic() - t0, False
            except ConnectionResetError:
                return got, time.monotonic() - t0, True
            if not chunk:
                return got, time.monotonic() - t0, True
            got += chunk
        return got, time.monotonic() - t0, False


def _bodies(got: bytes) -> list[dict[str, Any]]:
    """The JSON bodies of the answers in `got` (each with a Content-Length)."""
    out = []
    while got:
        head, _, rest = got.partition(b"\r\n\r\n")
        m = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
        assert m, head
        n = int(m.group(1))
        out.append(orjson.loads(rest[:n]))
        got = rest[n:]
    return out


# ---- a head behind a request in one read: timed and measured --------------------------------------


async def test_a_partial_head_pipelined_behind_a_request_gets_the_header_timeout(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=500, keepalive_timeout_ms=5000))
    partial = b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: 1\r\n"
    got, took, closed = await asyncio.to_thread(_talk, gw.port, HEALTH + partial, wait_s=3.0)
    assert closed and took < 2.0, f"a partial pipelined head held the connection {took:.1f} s (header timeout 0.5 s)"
    assert STATUS.findall(got) == [b"200", b"408"], got[-300:]
    assert _bodies(got)[1]["type"] == "error"  # the partial head's line: the Messages API's shape


async def test_a_partial_head_after_a_body_that_ends_in_its_read_gets_the_header_timeout(upstream, gateway):
    """The head of a request, then its body and the start of the next head in a later read."""
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=500, keepalive_timeout_ms=5000))
    whole = _chat()
    cut = whole.index(b"\r\n\r\n") + 4
    partial = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    got, took, closed = await asyncio.to_thread(_talk, gw.port, whole[:cut], whole[cut:] + partial, wait_s=3.0)
    assert closed and took < 2.0, took
    assert STATUS.findall(got) == [b"200", b"408"], got[-300:]


async def test_a_partial_head_behind_a_chunked_request_gets_the_header_timeout(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=500, keepalive_timeout_ms=5000))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunked = head + b"%x\r\n" % len(CHAT) + CHAT + b"\r\n0\r\n\r\n"
    got, took, closed = await asyncio.to_thread(_talk, gw.port, chunked + b"GET /heal", wait_s=3.0)
    assert closed and took < 2.0, took
    assert STATUS.findall(got) == [b"200", b"408"], got[-300:]


async def test_a_pipelined_head_counts_toward_max_header_bytes(upstream, gateway):
    """Whole (19 KB) or not yet whole (its blank line to come): over the 4096-byte limit behind a
    request in the same write, it is a 431 after that request's answer, then the close."""
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=2000, max_header_bytes=4096))
    lines = b"".join(b"X-H%04d: %s\r\n" % (i, b"v" * 180) for i in range(100))
    for big in (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines + b"\r\n",
                b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines):
        got, took, closed = await asyncio.to_thread(_talk, gw.port, HEALTH + big, wait_s=3.0)
        assert STATUS.findall(got) == [b"200", b"431"], (len(big), got[-300:])
        assert closed and took < 1.5, took
        assert b"HTTP/1.1 431 " in got and _bodies(got)[1] is not None
    assert _bodies(got)[1]["type"] == "error"  # the Messages API's shape for the second one


# ---- a malformed request behind good ones in one read ---------------------------------------------


async def test_good_requests_pipelined_before_a_malformed_one_are_answered_first(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up))
    bad = b"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}"
    got, _, closed = await asyncio.to_thread(_talk, gw.port, _chat() + HEALTH + _chat() + bad)
    assert STATUS.findall(got) == [b"200", b"200", b"200", b"400"], got[-400:]
    assert closed
    err = _bodies(got)[3]
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err  # the Messages API's
    assert up.stats.requests == 2


async def test_a_malformed_request_alone_is_answered_as_before(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up))
    for path, anthropic in ((b"/v1/chat/completions", False), (b"/v1/messages", True)):
        bad = b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}"
        got, _, closed = await asyncio.to_thread(_talk, gw.port, bad)
        assert STATUS.findall(got) == [b"400"] and closed, got
        err = _bodies(got)[0]
        assert (err["type"] == "error") if anthropic else (err["error"]["code"] == "malformed_request"), err


# ---- absolute-form targets ---------------------------------------------------------------------------


async def test_refusals_of_an_absolute_form_messages_request_are_in_anthropics_shape(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=500, max_header_bytes=4096))
    line = b"POST http://127.0.0.1/v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    cases = {
        "served (401)": line + b"Content-Length: 2\r\n\r\n{}",
        "two Content-Lengths (400)": line + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "too slow (408)": line + b"X-Slow: 1\r\n",
        "too big (431)": line + b"".join(b"X-H%04d: %s\r\n" % (i, b"v" * 180) for i in range(30)),
        "a query, https (400)": b"POST https://h:8443/v1/messages?beta=1 HTTP/1.1\r\nHost: h\r\n"
                                b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    }
    for name, data in cases.items():
        got, _, _ = await asyncio.to_thread(_talk, gw.port, data, wait_s=2.0)
        body = _bodies(got)[0]
        assert body.get("type") == "error" and "type" in body["error"], (name, got[:300])
    # Elsewhere (or no path at all), OpenAI's.
    got, _, _ = await asyncio.to_thread(_talk, gw.port, b"POST http://127.0.0.1 HTTP/1.1\r\nHost: x\r\n"
                                        b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}")
    assert _bodies(got)[0]["error"]["code"] == "malformed_request", got[:300]


# ---- what must not change -------------------------------------------------------------------------


async def test_whole_requests_pipelined_in_one_write_are_all_answered_and_the_connection_kept_idle(upstream, gateway):
    """GET, POST, a chunked POST, a POST whose body holds blank lines, one write: four answers in
    order; then the connection is idle past the header timeout with no 408 until the keep-alive
    timeout closes it."""
    up = await upstream("a")
    gw = await gateway(_policy(up, header_timeout_ms=300, keepalive_timeout_ms=2000))
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunked = head + b"%x\r\n" % len(CHAT) + CHAT + b"\r\n0\r\n\r\n"
    blank_lines = CHAT[:-1] + b"\r\n\r\n\r\n\r\n}"
    for write in (HEALTH + _chat() + chunked + _chat(blank_lines), chunked, _chat(blank_lines), HEALTH + chunked):
        got, took, closed = await asyncio.to_thread(_talk, gw.port, write, wait_s=4.0)
        statuses = STATUS.findall(got)
        assert statuses and set(statuses) == {b"200"}, got[-300:]
        assert closed and took >= 1.5, f"closed {took:.1f} s after its answers (keep-alive timeout 2 s): {statuses}"
