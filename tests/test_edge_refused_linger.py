"""A request refused before its body is read (no key: 401; a declared Content-Length over
`server.max_body_bytes`: 413; a chunked body) is answered at once; the connection then closed
only after aiohttp's lingering_time (10 s), reading and dropping whatever the client sent at wire
speed: ~3.6 GiB in 3 s on one connection, before authentication (review helper's repro). The
answer now says `Connection: close`, the rest is not read, and the connection closes within a
short linger (edge._LINGER_S) after the answer, which still reaches the client first. A body
within the limit is still read on to keep the connection, and authenticated keep-alive is as before."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from typing import Any

import orjson
import pytest

from gateway.tenants.auth import hash_key

KEY = "sk-edge-linger-key"
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


def _head(framing: str, *, key: bool = False, expect: bool = False, path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + (f"Authorization: Bearer {KEY}\r\n" if key else "")
            + ("Expect: 100-continue\r\n" if expect else "") + framing + "\r\n").encode()


def _pump(port: int, head: bytes, seconds: float) -> tuple[bytes, int, float]:
    """Send `head`, read the answer, then send as fast as the server takes it for `seconds`:
    (the answer, the bytes sent after it, the seconds until a send failed or the time ran out)."""
    s = socket.create_connection(("127.0.0.1", port))
    try:
        s.sendall(head)
        s.settimeout(2.0)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += s.recv(65536)
        t0, sent, chunk = time.monotonic(), 0, b"x" * 65536
        s.settimeout(0.2)
        try:
            while time.monotonic() - t0 < seconds:
                try:
                    sent += s.send(chunk)
                except TimeoutError:
                    pass
        except OSError:
            pass
        return answer, sent, time.monotonic() - t0
    finally:
        s.close()


REFUSED = {
    "no key, Content-Length over the limit": ("Content-Length: 99999999999\r\n", False, False, 401),
    "no key, Expect, Content-Length over the limit": ("Content-Length: 99999999999\r\n", False, True, 413),
    "no key, Expect": ("Content-Length: 2000000\r\n", False, True, 401),
    "no key, chunked": ("Transfer-Encoding: chunked\r\n", False, False, 401),
    "a key, Content-Length over the limit": ("Content-Length: 99999999999\r\n", True, False, 413),
}


@pytest.mark.parametrize("name", list(REFUSED))
async def test_a_body_refused_before_it_is_read_is_not_read_after_the_answer(upstream, gateway, name):
    framing, key, expect, status = REFUSED[name]
    up = await upstream("a")
    gw = await gateway(_policy(up))
    answer, sent, took = await asyncio.to_thread(_pump, gw.port, _head(framing, key=key, expect=expect), 3.0)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
    assert re.search(rb"(?i)\r\nconnection: close\r\n", answer), answer[:400]
    # Only what the kernels' buffers take (a few MiB), not seconds of wire speed; closed within the linger.
    assert sent < 64 << 20, f"{sent >> 20} MiB read and dropped after a {status} in {took:.1f} s"
    assert took < 2.5, f"the connection stayed open {took:.1f} s after the {status}"
    assert up.stats.requests == 0


async def test_the_refusal_reaches_a_client_that_reads_it_then_a_clean_close(upstream, gateway):
    """A client that sends the head only (it would stream the body later) and waits: the whole
    JSON answer, then EOF within the linger (a FIN, not a reset: it sent nothing unread)."""
    up = await upstream("a")
    gw = await gateway(_policy(up))

    def run(path: str) -> tuple[bytes, float]:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            s.sendall(_head("Content-Length: 99999999999\r\n", path=path))
            t0, got = time.monotonic(), b""
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    return got, time.monotonic() - t0
                got += chunk

    for path, anthropic in (("/v1/chat/completions", False), ("/v1/messages", True)):
        got, took = await asyncio.to_thread(run, path)
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401 ") and b"connection: close" in head.lower(), head
        err = orjson.loads(body)
        assert (err["type"] == "error") if anthropic else (err["error"]["code"] == "invalid_api_key"), err
        assert took < 2.0, took


async def test_a_refused_body_within_the_limit_is_read_on_and_the_connection_kept(upstream, gateway):
    """No key, a 200 KiB body still arriving when the 401 goes out: it is within the limit, so
    the rest is read (as aiohttp did) and the connection serves the next request."""
    up = await upstream("a")
    gw = await gateway(_policy(up))
    size = 200 * 1024

    def run() -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            s.sendall(_head(f"Content-Length: {size}\r\n"))
            first = b""
            while b"\r\n\r\n" not in first:
                first += s.recv(65536)
            time.sleep(0.8)  # past the linger: the connection must still be open
            s.sendall(b" " * size)
            s.sendall(_head(f"Content-Length: {len(CHAT)}\r\n", key=True) + CHAT)
            second = b""
            while b'"chat.completion"' not in second:
                chunk = s.recv(65536)
                assert chunk, f"closed: {first[:100]!r} {second[:200]!r}"
                second += chunk
            return first, second

    first, second = await asyncio.to_thread(run)
    assert first.startswith(b"HTTP/1.1 401 ") and b"connection: close" not in first.lower(), first[:300]
    assert b"HTTP/1.1 200 " in second, second[:300]


async def test_authenticated_keep_alive_is_as_before(upstream, gateway):
    """Three requests, one after another on one connection, each answered and the connection kept;
    a 401 whose body came with its head keeps it too."""
    up = await upstream("a")
    gw = await gateway(_policy(up))

    def run() -> list[bytes]:
        answers = []
        with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
            for key in (True, False, True):
                s.sendall(_head(f"Content-Length: {len(CHAT)}\r\n", key=key) + CHAT)
                got = b""
                while True:
                    head, sep, rest = got.partition(b"\r\n\r\n")
                    if sep:
                        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
                        if len(rest) >= length:
                            break
                    chunk = s.recv(65536)
                    assert chunk, f"closed after {len(answers)} answers"
                    got += chunk
                answers.append(got)
        return answers

    answers = await asyncio.to_thread(run)
    assert [a.split(b" ")[1] for a in answers] == [b"200", b"401", b"200"], [a[:80] for a in answers]
    assert not any(b"connection: close" in a.lower() for a in answers)
    assert up.stats.requests == 2
