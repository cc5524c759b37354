"""A lean keep-alive HTTP/1.1 client for the upstream hot path.

aiohttp's ClientSession builds a ClientRequest, a ClientResponse, timers, traces and a cookie pass
for every call; the relay needs none of that. This is one asyncio.Protocol per connection over the
llhttp parser (httptools), an idle pool per (scheme, host, port), and a response that hands its
body over as bytes as they arrive.
"""

from __future__ import annotations

import asyncio
import select
import ssl
from collections import deque
from collections.abc import Mapping

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

__all__ = [
    "UpstreamConnectError",
    "UpstreamConnectTimeout",
    "UpstreamDisconnected",
    "UpstreamHTTPError",
    "UpstreamHeadersTooLarge",
    "UpstreamMaybeSent",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResponse",
    "UpstreamTooLarge",
]

_HIGH_WATER = 1 << 20  # buffered body bytes at which we stop reading the socket until the consumer reads
MAX_HEADER_BYTES = 64 * 1024  # default cap on a response's head (status line, headers, interim responses)
MAX_HEADERS = 256  # default cap on the number of response header lines (LLM APIs send a few dozen)
# Bytes a chunk's framing may take (its size line, extensions and CRLF): far above any real one.
_CHUNK_FRAMING = 1024
_MAX_TARGETS = 256  # parsed URLs kept; the relay posts to a handful of fixed URLs
_METHODS = frozenset({"POST", "GET", "DELETE"})  # `method=`: the Responses API's by-id calls use GET and DELETE


class UpstreamHTTPError(Exception):
    """Base of every error this client raises.

    `summary`: the kind of failure in words a gateway's client may see; the message itself can name
    the upstream's host and port and the OS error, which belong in the log only."""

    summary = "request failed"


class UpstreamConnectError(UpstreamHTTPError, OSError):
    """The connection could not be opened (refused, unreachable, TLS failure, connect timeout)."""

    summary = "connect failed"


class UpstreamConnectTimeout(UpstreamConnectError):
    """The connection was not open within the connect timeout."""

    summary = "connect timed out"


class UpstreamDisconnected(UpstreamHTTPError, ConnectionError):
    """The connection was lost before the response was complete.

    Raised by UpstreamPool.post() only as its subclass UpstreamMaybeSent, or (plain) when the request
    provably never left: the connection was already closed when it was about to be written."""

    summary = "connection lost"


class UpstreamMaybeSent(UpstreamDisconnected):
    """post(): the request was written, then the connection died before the response headers.

    The upstream may have received, processed and billed it, so the pool never resends it: the
    caller must count it as an attempt (it is a failure of that backend, like a reset mid-answer).
    Only a request that provably never left (written to no socket, because the pooled connection
    was already closed) is resent, once, on a fresh connection."""

    summary = "connection lost after the request was sent"


class UpstreamProtocolError(UpstreamHTTPError):
    """The upstream sent something that is not a valid HTTP/1.x response."""

    summary = "invalid HTTP response"


class UpstreamTooLarge(UpstreamHTTPError):
    """The upstream sent more than a cap allows (`limit` bytes); the connection was aborted.

    Raised by UpstreamResponse.read(max_bytes=...) for a body, and as UpstreamHeadersTooLarge by
    post() for the response headers."""

    summary = "answer over the size limit"

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class UpstreamHeadersTooLarge(UpstreamTooLarge, UpstreamProtocolError):
    """post(): the response headers (status line and any interim responses included) exceed the
    pool's `max_header_bytes`, or their count exceeds `max_headers`."""

    summary = "response headers over the size limit"


class _NotSent(UpstreamDisconnected):
    """The connection was closed before the request was written to it: safe to send elsewhere."""


class _Conn(asyncio.Protocol):
    """One connection; its per-exchange state is reset by begin() for each request."""

    __slots__ = (
        "active", "body", "buffered", "chunks", "closed", "complete", "exc", "fd", "fed", "header_bytes",
        "header_lines", "headers_done", "idle_since", "info", "keep_alive", "key", "loop", "max_header_bytes",
        "max_headers", "parser", "paused", "raw_headers", "received", "registry", "status", "transport", "waiter",
    )  # fmt: skip

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        key: tuple[str, str, int],
        registry: set[_Conn],
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_headers: int = MAX_HEADERS,
    ) -> None:
        self.loop = loop
        self.key = key
        self.registry = registry
        self.max_header_bytes = max_header_bytes
        self.max_headers = max_headers
        self.transport: asyncio.Transport | None = None
        self.fd = -1  # the socket's descriptor, polled before an idle connection is reused
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.begin(active=False)

    def begin(self, *, active: bool) -> None:
        self.active = active
        self.info = False  # inside a 1xx interim response
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.status = 0
        # Bytes fed to the parser: while the headers are incomplete all of them count against the
        # head's cap (the parser buffers an unfinished header line); after, all but the body's
        # count against the framing's (chunk size lines, extensions and trailers, which the
        # parser also buffers: an endless trailer line would grow, at a quadratic cost, unseen).
        self.fed = 0
        self.received = 0  # body bytes, over the whole answer
        self.chunks = 0
        self.header_bytes = 0  # the size of the header lines parsed (interim responses' and trailers included)
        self.header_lines = 0  # this response's header lines (trailers included)
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.buffered = 0
        self.exc: UpstreamHTTPError | None = None

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.registry.add(self)

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:
            self.abort()  # bytes nobody asked for: this socket can't be trusted again
            return
        self.fed += len(data)
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # 101 is no answer to a POST
            if not self.complete:
                self.fail(UpstreamProtocolError(f"invalid HTTP response from upstream: {exc}"))
            self.abort()
            self.wake()
            return
        if not self.headers_done:
            if self.fed > self.max_header_bytes:  # e.g. one endless header line, never passed to on_header
                self._head_too_large()
                return
        elif self.fed - self.received > 2 * self.max_header_bytes + _CHUNK_FRAMING * self.chunks:
            self.fail(UpstreamProtocolError("response framing (chunk extensions, trailers) over the size limit"))
            self.abort()
            return
        self.wake()  # once per read, however many parser events it held
        if self.buffered > _HIGH_WATER and not self.paused and not self.complete and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> None:
        return None  # let the transport close; connection_lost decides what the EOF meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.registry.discard(self)
        if not self.active or self.complete or self.exc is not None:
            self.wake()
            return
        if self.headers_done and exc is None and self._eof_delimited():
            # An HTTP/1.0-style body ends with the connection; a reset ends it cut (below).
            self.complete = True
            self.keep_alive = False
            self.wake()
            return
        reason = f": {exc}" if exc else ""
        if self.headers_done:
            self.fail(UpstreamDisconnected(f"upstream closed the connection mid-body{reason}"))
        else:  # active: the request was written (an unwritten one never gets here, see _exchange)
            self.fail(UpstreamMaybeSent(f"upstream closed the connection before the response headers{reason}"))

    # -- httptools callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: stop parsing, keep the first, drop the socket
            raise UpstreamProtocolError("unsolicited bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.headers_done:  # a trailer is counted, not kept: the headers were handed over already
            self.raw_headers.append((name, value))
        self.header_lines += 1
        self.header_bytes += len(name) + len(value) + 4
        if self.header_bytes > self.max_header_bytes or self.header_lines > self.max_headers:
            self._head_too_large()
            raise self.exc  # type: ignore[misc]  # stops the parser; data_received keeps this error

    def _head_too_large(self) -> None:
        if self.header_lines > self.max_headers:
            msg, limit = f"response headers exceed {self.max_headers} lines", self.max_headers
        else:
            msg, limit = f"response headers exceed {self.max_header_bytes} bytes", self.max_header_bytes
        self.fail(UpstreamHeadersTooLarge(msg, limit))
        self.abort()

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # interim (100 Continue, 103 Early Hints): the real answer follows
            self.info = True
            self.raw_headers = []
            self.header_lines = 0
            return
        self.status = status
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        self.received += len(body)

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_message_complete(self) -> None:
        if self.info:
            self.info = False
            return
        self.complete = True

    # -- used by the pool and the response ----------------------------------------------------

    def _eof_delimited(self) -> bool:
        for name, value in self.raw_headers:
            low = name.lower()
            if low == b"content-length" or (low == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    def fail(self, exc: UpstreamHTTPError) -> None:
        if self.exc is None:
            self.exc = exc
        self.wake()

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Wait for the next parser event; a cancelled wait closes the connection."""
        fut = self.loop.create_future()
        self.waiter = fut
        try:
            await fut
        except BaseException:
            self.abort()  # never hand a half-read connection back to the pool
            raise
        finally:
            self.waiter = None

    def take(self) -> bytes:
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body = []
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def abort(self) -> None:
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.transport.abort()  # no flush, no linger: the upstream sees the disconnect now
        if self.active and not self.complete:
            self.fail(UpstreamDisconnected("the response was closed"))


class UpstreamResponse:
    """A response whose status line and headers are in; the body is read with read()/readany()."""

    __slots__ = ("_closed", "_conn", "_headers", "_pool", "_raw", "status")

    def __init__(self, pool: UpstreamPool, conn: _Conn) -> None:
        self.status = conn.status
        self._raw = conn.raw_headers  # begin() starts a new list: this one survives the connection's reuse
        self._conn: _Conn | None = conn
        self._pool = pool
        self._headers: CIMultiDictProxy[str] | None = None
        self._closed = False

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """Response headers, case-insensitive (decoded once, on first access)."""
        if self._headers is None:
            pairs = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self._raw]
            self._headers = CIMultiDictProxy(CIMultiDict(pairs))
        return self._headers

    def _live(self) -> _Conn | None:
        conn = self._conn
        if conn is None and self._closed:
            raise UpstreamDisconnected("the response was closed")
        return conn

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived (read() then returns without waiting)."""
        conn = self._live()
        return conn is None or (conn.complete and conn.exc is None)

    async def readany(self) -> bytes:
        """The body bytes that have arrived (waiting for some if none have); b"" at the end."""
        conn = self._live()
        if conn is None:
            return b""
        while True:
            if conn.body:
                return conn.take()
            if conn.exc is not None:
                raise conn.exc
            if conn.complete:
                return b""
            await conn.wait()

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (Content-Length, chunked, or until EOF).

        With `max_bytes`, a body longer than that raises UpstreamTooLarge as soon as the bytes that
        came pass it: reading stops and the connection is aborted (never pooled). None: no cap."""
        conn = self._live()
        if conn is None:
            return b""
        parts: list[bytes] = []
        size = 0
        while True:
            if conn.body:
                parts.append(conn.take())
                if max_bytes is not None:
                    size += len(parts[-1])
                    if size > max_bytes:
                        exc = UpstreamTooLarge(f"response body exceeds {max_bytes} bytes", max_bytes)
                        conn.fail(exc)
                        conn.abort()
                        raise exc
            if conn.exc is not None:
                raise conn.exc
            if conn.complete:
                return parts[0] if len(parts) == 1 else b"".join(parts)
            await conn.wait()

    def release(self) -> None:
        """Done with the response: a complete keep-alive connection goes back to the pool, any
        other is closed."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        # A request still being written (an answer that came early: a 401, a 413) would put the
        # rest of its body on the wire ahead of the next request: such a connection is closed.
        if conn.complete and conn.keep_alive and not conn.closed and conn.exc is None and _sent(conn):
            self._pool._put(conn)
        else:
            self._closed = not conn.complete  # reading a complete body after release gives b""
            conn.abort()

    def close(self) -> None:
        """Abandon the response: close the socket now."""
        conn, self._conn = self._conn, None
        self._closed = True
        if conn is not None:
            conn.abort()


def _sent(conn: _Conn) -> bool:
    """Whether the request's bytes have all left for the kernel."""
    return conn.transport is not None and conn.transport.get_write_buffer_size() == 0


def _readable(fd: int) -> bool:
    """Whether bytes or an EOF wait on `fd` that the loop has not read yet (urllib3's check before
    it reuses a connection). A busy loop reads a socket late: bytes an upstream sent to an idle
    connection would be parsed as the next request's answer, which may be another tenant's."""
    if fd < 0:
        return False
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class _Target:
    __slots__ = ("head", "host", "key", "port", "tls")

    def __init__(self, url: URL, method: str = "POST") -> None:
        if url.scheme not in ("http", "https") or not url.raw_host or url.port is None:
            raise ValueError(f"not an http(s) URL: {url}")
        self.host = url.raw_host
        self.port = url.port
        self.tls = url.scheme == "https"
        self.key = (url.scheme, self.host, self.port)
        self.head = f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections per (scheme, host, port); http and https.

    Nothing an upstream sends is held without bound: a response head (status line, header lines,
    interim 1xx responses) over `max_header_bytes`, or with more than `max_headers` header lines,
    fails post() with UpstreamHeadersTooLarge (an UpstreamProtocolError and an UpstreamTooLarge); a
    body read with read(max_bytes=N) stops at N; a body read with readany() holds at most ~1 MiB
    before the socket is paused until the consumer reads."""

    def __init__(
        self,
        *,
        max_idle_per_host: int = 256,
        idle_timeout_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_headers: int = MAX_HEADERS,
    ) -> None:
        if max_header_bytes <= 0 or max_headers <= 0:
            raise ValueError("max_header_bytes and max_headers must be positive")
        self._max_idle = max_idle_per_host
        self._idle_timeout_s = idle_timeout_s
        self._ssl = ssl_context
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._idle: dict[tuple[str, str, int], deque[_Conn]] = {}
        self._conns: set[_Conn] = set()  # every open connection, idle or busy, for close()
        self._targets: dict[object, _Target] = {}  # url (POST), or (method, url)

    async def post(
        self, url: URL | str, body: bytes, headers: Mapping[str, str], *, connect_timeout_s: float, method: str = "POST"
    ) -> UpstreamResponse:
        """POST `body` (or GET/DELETE with `method`); return once the status line and headers are in
        (bound it with asyncio.timeout).

        `headers` must not carry Host, Content-Length or Transfer-Encoding: those are ours.
        Raises UpstreamConnectError (nothing was sent), UpstreamMaybeSent (the request was written,
        then the connection died before the response headers: the upstream may have it, so it is
        never resent here), UpstreamProtocolError (UpstreamHeadersTooLarge included), or, rarely,
        a plain UpstreamDisconnected (a fresh connection closed before the request was written).
        A pooled connection found closed before the request was written to it (the write never
        happened, so the upstream cannot have seen it) is replaced by a fresh one, once."""
        key: object = url if method == "POST" else (method, url)
        target = self._targets.get(key)
        if target is None:
            if method not in _METHODS:
                raise ValueError(f"unsupported method {method!r}")
            target = _Target(url if isinstance(url, URL) else URL(url), method)
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()
            self._targets[key] = target
        lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        # Each line holds exactly one CR and one LF: anything more is an injection attempt.
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):
            raise ValueError("header names and values must not contain CR or LF")
        data = b"".join((f"{target.head}{lines}Content-Length: {len(body)}\r\n\r\n".encode(), body))
        conn = self._checkout(target.key)
        if conn is not None:
            try:
                return await self._exchange(conn, data)
            except _NotSent:
                pass  # closed while idle, before we wrote a byte to it: the request never left
        conn = await self._connect(target, connect_timeout_s)
        return await self._exchange(conn, data)

    async def close(self) -> None:
        """Close every connection, idle or busy."""
        for conn in list(self._conns):
            conn.abort()
        self._conns.clear()
        self._idle.clear()

    async def _exchange(self, conn: _Conn, data: bytes) -> UpstreamResponse:
        if conn.closed or conn.transport is None or conn.transport.is_closing():
            conn.abort()
            raise _NotSent("upstream closed the connection before the request was written")
        conn.begin(active=True)  # from here on a lost connection is UpstreamMaybeSent: see connection_lost
        try:
            conn.transport.write(data)
            while not conn.headers_done:
                if conn.exc is not None:
                    raise conn.exc
                await conn.wait()
        except BaseException:
            conn.abort()
            raise
        return UpstreamResponse(self, conn)

    def _checkout(self, key: tuple[str, str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        oldest_ok = self._now() - self._idle_timeout_s
        while idle:
            conn = idle.pop()  # most recently used first: least likely to have been closed
            if not conn.closed and conn.idle_since >= oldest_ok and not conn.transport.is_closing() and not _readable(conn.fd):  # type: ignore[union-attr]
                return conn
            conn.abort()
        return None

    def _put(self, conn: _Conn) -> None:
        conn.begin(active=False)
        now = conn.idle_since = self._now()
        idle = self._idle.get(conn.key)
        if idle is None:
            idle = self._idle[conn.key] = deque()
        while idle and (len(idle) >= self._max_idle or idle[0].idle_since < now - self._idle_timeout_s):
            idle.popleft().abort()
        idle.append(conn)

    async def _connect(self, target: _Target, timeout_s: float) -> _Conn:
        loop = asyncio.get_running_loop()
        ctx = None
        if target.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()  # loads the CA store: once, and only for https
            ctx = self._ssl
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, target.key, self._conns, self._max_header_bytes, self._max_headers),
                    target.host,
                    target.port,
                    ssl=ctx,
                    server_hostname=target.host if ctx is not None else None,
                )
        except TimeoutError:
            raise UpstreamConnectTimeout(f"connect to {target.host}:{target.port} timed out after {timeout_s:g}s") from None
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {target.host}:{target.port}: {exc}") from exc
        return conn

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
