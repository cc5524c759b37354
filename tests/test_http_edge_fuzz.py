"""Fuzz of the HTTP edge over raw sockets (hypothesis): request lines, headers, framing, encodings
and how the bytes are split, against `gateway serve` in a process of its own.

For every input the gateway answers in OpenAI's JSON error shape (any status >= 400; never a 500)
or closes the connection cleanly, within a few seconds (short header and body timeouts); across the
whole run its RSS grows < 100 MB, it still answers /healthz, and its log holds no traceback."""

from __future__ import annotations

import asyncio
import gzip
import secrets
import time
import zlib
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gateway.tenants.auth import hash_key
from tests.procs import serve
from tests.rawhttp import Watch, exchange, get, json_error

KEY = "sk-fuzz-" + secrets.token_hex(16)
CHAT = b'{"model":"gpt-test","messages":[{"role":"user","content":"hi"}]}'
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _policy(up: Any) -> dict[str, Any]:
    return {
        "version": 1,
        # Short timeouts: an input that leaves a head or a body unfinished is settled within one.
        "server": {"max_body_bytes": 65536, "header_timeout_ms": 400, "body_timeout_ms": 400, "keepalive_timeout_ms": 1000},
        "health": {"probe_interval_ms": 600_000},
        "backends": {"a": {"url": up.url, "models": ["gpt-test"], "endpoints": ["chat", "completions", "responses"]}},
        "models": {"gpt-test": {"backends": ["a"]}},
        "tenants": {"acme": {"key_sha256": [hash_key(KEY)]}},
    }


def _small_bomb() -> bytes:
    return gzip.compress(b'{"model":"gpt-test","messages":[{"role":"user","content":"' + b"a" * (8 << 20) + b'"}]}', 9)


BOMB = _small_bomb()  # 8 MiB inflated from ~8 KB: over the 64 KiB limit

def _mostly(usual: list[str], odd: list[str]) -> st.SearchStrategy[str]:
    """The usual values most of the time (a request must get past the parser to reach the body
    reader), an odd one now and then."""
    return st.integers(min_value=0, max_value=9).flatmap(lambda n: st.sampled_from(odd if n == 0 else usual))


methods = _mostly(["POST"], ["GET", "DELETE", "PUT", "OPTIONS", "BREW", "P\x00ST", "GET GET", ""])
paths = _mostly(
    ["/v1/chat/completions", "/v1/chat/completions", "/v1/route/explain", "/v1/responses/resp_1/cancel"],
    ["/healthz", "/v1/models", "/nope", "*", "/%zz", "//..//..", "/v1/chat/completions?x=%00", "/" + "a" * 9000,
     "http://127.0.0.1/v1/chat/completions", "/v1/responses/../../admin/reload"],
)
versions = _mostly(["HTTP/1.1"], ["HTTP/1.0", "HTTP/2.0", "HTTP/1.1x", "", "http/1.1", "HTTP/0.9"])
odd_text = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0xFF), max_size=30)
header_pool = st.one_of(
    st.tuples(st.just("Content-Encoding"), st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x-gzip", "gzip, gzip", "GZIP", "", "compress"])),
    st.tuples(st.just("Transfer-Encoding"), st.sampled_from(["chunked", "gzip, chunked", "chunked, chunked", "identity", "xchunked", " chunked"])),
    st.tuples(st.just("Content-Length"), st.sampled_from(["0", "2", "-1", "1e3", "+5", "99999999999999999999", "5, 5", " 7", "0x10", ""])),
    st.tuples(st.just("Expect"), st.sampled_from(["100-continue", "100-continue", "100-maybe", ""])),
    st.tuples(st.just("Connection"), st.sampled_from(["close", "keep-alive", "upgrade", "Upgrade, HTTP2-Settings"])),
    st.tuples(st.just("Upgrade"), st.sampled_from(["websocket", "h2c", "x"])),
    st.tuples(st.just("x-request-timeout-ms"), st.sampled_from(["1", "50", "inf", "-1", "x"])),
    st.tuples(st.just("x-request-id"), st.sampled_from(["ok-1", "bad id", "\x01", "x" * 300])),
    st.tuples(st.just("Host"), st.sampled_from(["127.0.0.1", "", "a b", "x" * 300])),
    st.tuples(st.sampled_from(["X-Odd", "Bad Name", "X:Colon", "", "X\x00Nul", "Ü"]), odd_text),
    st.tuples(st.just("X-Big"), st.integers(min_value=1000, max_value=12000).map(lambda n: "v" * n)),
)
line_ends = _mostly(["\r\n"], ["\n", "\r", "\r\r\n"])


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A body and the Content-Encoding it is in (None: let the headers say whatever they say)."""
    kind = draw(st.sampled_from(["chat", "chat", "none", "garbage", "gzip", "gzip garbage", "gzip cut", "bomb", "deflate", "big"]))
    if kind == "chat":
        return CHAT, None
    if kind == "none":
        return b"", None
    if kind == "garbage":
        return draw(st.binary(max_size=200)), None
    if kind == "gzip":
        return gzip.compress(CHAT), "gzip"
    if kind == "gzip garbage":
        return b"\x1f\x8b\x08\x00" + draw(st.binary(max_size=100)), "gzip"
    if kind == "gzip cut":
        gz = gzip.compress(CHAT)
        return gz[: draw(st.integers(min_value=1, max_value=len(gz) - 1))], "gzip"
    if kind == "bomb":
        return BOMB, "gzip"
    if kind == "deflate":
        return zlib.compress(CHAT), "deflate"
    return b"x" * 100_000, None  # over the 64 KiB limit


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[list[bytes], float]:
    """The bytes of one hostile request, split into pieces, and the pause between pieces."""
    eol = draw(line_ends)
    method, path, version = draw(methods), draw(paths), draw(versions)
    body, encoding = draw(bodies())
    headers = [("Host", "127.0.0.1"), ("Content-Type", "application/json")]
    headers.append(("Authorization", draw(_mostly([f"Bearer {KEY}"], ["Bearer nope", "Basic x", "", f"Bearer {KEY} x"]))))
    if encoding is not None:
        headers.append(("Content-Encoding", encoding))
    framing = draw(_mostly(["length", "length", "chunked"], ["chunked garbage", "none", "short length", "long length"]))
    if framing == "length":
        headers.append(("Content-Length", str(len(body))))
    elif framing == "short length":
        headers.append(("Content-Length", str(max(0, len(body) - 3))))
    elif framing == "long length":
        headers.append(("Content-Length", str(len(body) + 5)))
    elif framing.startswith("chunked"):
        headers.append(("Transfer-Encoding", "chunked"))
        size = draw(st.integers(min_value=1, max_value=max(1, len(body) or 1)))
        parts = [body[i : i + size] for i in range(0, len(body), size)]
        body = b"".join(b"%x\r\n" % len(p) + p + b"\r\n" for p in parts) + b"0\r\n\r\n"
        if framing == "chunked garbage":
            cut = draw(st.integers(min_value=0, max_value=len(body)))
            body = body[:cut] + draw(st.sampled_from([b"zz\r\n", b"\r\n\r\n", b"-1\r\n", b"ffffffffffffffffff\r\n", b"5;x=\x00\r\n"])) + body[cut:]
    headers += draw(st.lists(header_pool, max_size=2))
    order = draw(st.permutations(headers))
    head = f"{method} {path} {version}".rstrip() + eol + "".join(f"{k}: {v}{eol}" for k, v in order) + eol
    data = head.encode("latin-1", "replace") + body
    cuts = sorted(draw(st.lists(st.integers(min_value=1, max_value=max(1, len(data) - 1)), max_size=2, unique=True)))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)]) if data[a:b]]
    return pieces, draw(st.sampled_from([0.0, 0.0, 0.02, 0.1]))


async def test_every_hostile_request_gets_a_json_error_or_a_clean_close(upstream, tmp_path):
    up = await upstream("a", tokens=2)
    async with serve(_policy(up), tmp_path) as gw:
        outcomes: dict[str, int] = {}

        @SETTINGS
        @given(case=raw_requests())
        def check(case: tuple[list[bytes], float]) -> None:
            pieces, pause = case
            a = exchange(gw.port, pieces[0], pieces[1:], timeout=5, pause_s=pause)
            # Settled well within the time: the header and body timeouts are 400 ms.
            assert a.status is not None or a.closed, f"no answer and not closed after {a.seconds:.1f} s: {b''.join(pieces)[:300]!r}"
            if a.status is None:
                interim = a.raw.replace(b"HTTP/1.1 100 Continue\r\n\r\n", b"")
                assert not interim, f"bytes that are no HTTP answer: {a.raw[:200]!r}"
                outcome = "closed"
            else:
                outcome = str(a.status)
                assert a.status != 500, (a.body[:300], b"".join(pieces)[:300])
                if a.status >= 400:
                    assert a.ctype.startswith("application/json"), (a.status, a.ctype, a.body[:200], b"".join(pieces)[:300])
                    assert json_error(a.body) is not None, (a.status, a.body[:300])
            event(outcome)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        def run() -> Watch:
            with Watch(gw.proc.pid) as w:
                check()
            return w

        t0 = time.monotonic()
        w = await asyncio.to_thread(run)
        elapsed = time.monotonic() - t0
        status, _ = await asyncio.to_thread(get, gw.port, "/healthz")
        assert gw.proc.returncode is None and status == 200
        log = gw.log.read_text()
    assert w.growth_mb < 100, f"RSS +{w.growth_mb:.0f} MB over {sum(outcomes.values())} hostile requests ({elapsed:.0f} s)"
    assert "Traceback" not in log, log[-3000:]
    assert len(outcomes) >= 3, outcomes  # the inputs reached several outcomes, not one refusal
