"""The HTTP edge: what a connection may cost before it is a request, and JSON for what the
HTTP parser refuses.

`EdgeRunner` is aiohttp's AppRunner with a guarded connection protocol (`gateway serve` uses it):

- **Header timeout** (`server.header_timeout_ms`): a request head (request line and headers) must
  be complete this long after the connection opens, or after its first byte on a keep-alive
  connection; else the connection gets a 408 and is closed (a connection that sent nothing is just
  closed). Idle keep-alive connections are closed after `server.keepalive_timeout_ms`.
- **Head size** (`server.max_header_bytes`): more bytes than this without a complete head is a 431.
  A head that begins in the read that ends the request before it (pipelined) is timed and measured
  from that read, and whole heads parsed behind another in one read are measured by their parts;
  a refusal behind requests still being answered is queued after them (their answers go out first).
- **A refused body is not read**: an answer given while the request's body is still arriving
  closes the connection (`Connection: close`) where that body has no bound (chunked) or is over
  `server.max_body_bytes` (a 401 before authentication, a 413); after any answer that closes, the
  rest is not read: a FIN, and the close `_LINGER_S` later (aiohttp read and dropped it for 10 s,
  gigabytes at wire speed). A body within the limit is read on, as before, to keep the connection.
- **Connections per client address** (`server.max_connections_per_client`, per process): one past
  the cap gets a 429 and is closed at once.
- **Plain routes without the router**: a request whose method and path (exactly as sent: no query
  string, no escapes) name a route without variables goes straight to its handler, skipping the
  router's resolve and a new match info per request (~4 us of the ~190 us a proxied request costs
  this process); anything else (a query string, an `Expect` header, an unknown path or method)
  goes through the app's router as before, with the same answers.
- **Loopback open mode serves this machine's programs**: with no keys on a loopback address, a
  request whose `Origin` or `Host` shows a browser acting for another site is a 403 (origin.py).
- **Shutdown**: once the port is closed (`Drain.closed`), an API request still arriving on a
  kept-alive connection is a 503 with `Connection: close`, sent nowhere (`_closing`).
- **One error shape per API**: malformed requests (duplicate Content-Length, Transfer-Encoding with
  Content-Length, bare CR/LF, oversized headers, bad chunk framing), a head too big or too slow,
  the answers aiohttp raises itself (417 for an unknown Expect, ...) and unhandled handler errors
  are answered in JSON, never aiohttp's text/plain: in the shape of the API the request line's
  path belongs to (`wire.endpoints.at_path`: Anthropic's for /v1/messages, OpenAI's elsewhere),
  read from the head's first bytes where the parser refused it (an origin-form or absolute-form
  target); OpenAI's where no request line came (a connection refused as it opens). Client mistakes
  are logged as one debug line, never a traceback. aiohttp drops every request parsed from a read
  its parser then refuses: those whole before the refused head are parsed again and answered
  first, then its 400 (`_recover`; where that is not cheap, only the 400, in the read's first
  line's shape).

Each connection reads the live policy when it opens, so a reload applies to new connections.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web
from aiohttp.http import HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.http_parser import HttpRequestParser
from aiohttp.streams import EMPTY_PAYLOAD, StreamReader
from aiohttp.web_protocol import _ErrInfo
from aiohttp.web_urldispatcher import UrlMappingMatchInfo

from ..config.policy import ServerPolicy
from ..errors import BadRequest, Forbidden, GatewayError, InternalError, PayloadTooLarge, RateLimited, Unauthorized, Unavailable
from ..wire.endpoints import at_path
from .body import RequestTimeout
from .http_call import api_key
from . import sink
from .drain import Drain
from .keys import DRAIN, LIVE, LOOPBACK

if TYPE_CHECKING:
    from ..config.reload import Live
from .origin import foreign

__all__ = ["CrossSiteRequest", "EdgeRunner", "GatewayTimeout", "HeadersTooLarge", "MalformedRequest", "TooManyConnections", "handler_args"]

log = logging.getLogger("gateway.edge")

_LINGER_S = 0.5  # after an answer on a connection being closed, what the client still sends is read this long


class MalformedRequest(BadRequest):
    code = "malformed_request"


class HeadersTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_fields_too_large"


class TooManyConnections(RateLimited):
    code = "too_many_connections"


class GatewayTimeout(GatewayError):
    status = 504
    type = "api_error"
    code = "timeout"


def handler_args(server: ServerPolicy) -> dict[str, Any]:
    """aiohttp connection settings every runner gets from the app (`web.Application(handler_args=)`):
    no decompression in the parser (body.read_body inflates under the limit) and the keep-alive
    timeout. EdgeRunner re-reads the keep-alive timeout from the live policy per connection."""
    return {"auto_decompress": False, "keepalive_timeout": server.keepalive_timeout_ms / 1000}


def _error_body(err: GatewayError, path: str | None) -> bytes:
    """`err` in the shape of the API `path` belongs to (OpenAI's without one)."""
    return err.to_body() if path is None else at_path(path).error_body(err)


# The head's first bytes kept to read its request line's path from (a path longer than this is
# no API's: it gets OpenAI's shape, as an unknown path does).
_LINE_BYTES = 1024


def _line_path(head: bytes) -> str | None:
    """The path of a request line at the start of `head` (no query string), or None."""
    line = head.lstrip(b"\r\n").split(b"\r\n", 1)[0].split(b"\n", 1)[0]
    parts = line.split(b" ")
    return _target_path(parts[1]) if len(parts) >= 2 else None


def _target_path(target: bytes) -> str | None:
    """The path of a request target without its query string: origin-form (`/v1/messages`), or
    absolute-form (`http://host/v1/messages`, which aiohttp routes by its path); else None."""
    if not target.startswith(b"/"):
        scheme, sep, rest = target.partition(b"://")
        if not sep or scheme.lower() not in (b"http", b"https"):
            return None
        cut = min((i for i in (rest.find(b"/"), rest.find(b"?"), rest.find(b"#")) if i >= 0), default=len(rest))
        target = rest[cut:] if rest[cut:cut + 1] == b"/" else b"/"
    return target.split(b"?", 1)[0].decode("latin-1")


def _head_size(message: RawRequestMessage) -> int:
    """The bytes of a parsed head, less any spaces around its header values."""
    return len(message.method) + len(message.path) + 14 + sum(len(k) + len(v) + 4 for k, v in message.raw_headers)


def _chunked_end(data: bytes) -> int:
    """Where a chunked body that ended in `data` ends: at the blank line after its last chunk (a
    head not yet whole has none), or, that blank line begun in the read before, after the CR and
    LF that end it here."""
    end = data.rfind(b"\r\n\r\n")
    return end + 4 if end >= 0 else len(data) - len(data.lstrip(b"\r\n"))


class _Refused(Exception):
    """A head refused (by the parser or by the edge's limits), queued as aiohttp queues what its
    parser refuses (an `_ErrInfo`): handle_error answers it in its turn, after the requests before
    it, as `err` in the shape of the API `path` belongs to, and the connection closes."""

    def __init__(self, err: GatewayError, path: str | None) -> None:
        super().__init__(err.message)
        self.err = err
        self.path = path


# The most pieces a read is parsed again in, to answer the requests before a head the parser
# refused (_Connection._recover): a piece is a head (a body is fed whole after it).
_RECOVER_PIECES = 64


def _canned(err: GatewayError, path: str | None = None) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, for where no request object
    exists (`path`: the request line's, when it came, for the error's shape)."""
    body = _error_body(err, path)
    head = [f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in err.headers().items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _parser_error(exc: BaseException | None, fallback: str | None) -> GatewayError:
    """The JSON error for a request the HTTP parser refused (its first line, bounded)."""
    detail = (exc.message if isinstance(exc, HttpProcessingError) else fallback) or "malformed request"
    first = str(detail).strip().splitlines()[0][:200] if str(detail).strip() else "malformed request"
    if isinstance(exc, LineTooLong) or "Too many headers" in first:
        return HeadersTooLarge(f"the request line or headers are too large: {first}")
    return MalformedRequest(f"malformed HTTP request: {first}")


class EdgeRunner(web.AppRunner):
    """An AppRunner whose connections are guarded as the module says (the app must be create_app's)."""

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # runs the app's startup, which builds the runtime
        app = self.app
        return _Server(base, lambda: app[LIVE].runtime.server, _Dispatch.of(app, base.request_handler))


def _closing(path: str) -> web.Response:
    """An API request still arriving on a kept-alive connection once shutdown closed the port
    (`Drain.closed`): a 503 in its endpoint's shape with `Connection: close` and `Retry-After`,
    before its body is read; nothing is sent upstream or counted in the drain. Other paths
    (/healthz, /readyz, /metrics, /admin) answer as ever."""
    err = Unavailable("this gateway process is shutting down; retry the request", retry_after_s=1)
    response = web.Response(status=err.status, body=at_path(path).error_body(err), content_type="application/json",
                            headers={**err.headers(), "Connection": "close"})
    response.force_close()  # the client's next request opens a connection to another process
    return response


class CrossSiteRequest(Forbidden):
    code = "cross_site_request"


def _cross_site(path: str, why: str) -> web.Response:
    """The answer to a browser's request that loopback open mode refuses (see origin.py)."""
    err = CrossSiteRequest(f"refused: {why}. This gateway runs without keys (loopback open mode) for programs on "
                           "this machine only; to serve browsers or other hosts, give its policy tenants (keys)")
    return web.Response(status=err.status, body=at_path(path).error_body(err), content_type="application/json")


class _Dispatch:
    """The app's request handler, with plain routes found by one dict lookup (see the module's
    docstring). The router is complete once the app started, so the table is built then."""

    __slots__ = ("_routes", "_app_handle", "_live", "_loopback", "_drain")

    def __init__(self, routes: dict[tuple[str, str], UrlMappingMatchInfo], app_handle: Callable[..., Any],
                 live: Live, loopback: bool, drain: Drain) -> None:
        self._routes = routes
        self._app_handle = app_handle
        self._live = live  # the runtime in force: a reload may add tenants (or remove them all), or change limits
        self._loopback = loopback  # loopback open mode: browsers' requests are refused (origin.py)
        self._drain = drain  # shutdown: once the port is closed, API requests are refused (_closing)

    @classmethod
    def of(cls, app: web.Application, app_handle: Callable[..., Any]) -> Callable[..., Any]:
        live, loopback, drain = app[LIVE], app[LOOPBACK], app[DRAIN]
        routes: dict[tuple[str, str], UrlMappingMatchInfo] = {}
        if app.middlewares or app._subapps:  # what the router path would add: not skipped then
            return cls(routes, app_handle, live, loopback, drain)
        for resource in app.router.resources():
            if not isinstance(resource, web.PlainResource):
                continue
            for route in resource:
                if route.method == hdrs.METH_ANY:
                    continue
                # The match info the router would make for it, made once: frozen, nothing changes it.
                info = UrlMappingMatchInfo({}, route)
                info.add_app(app)
                info.freeze()
                routes[(route.method, resource.canonical)] = info
        return cls(routes, app_handle, live, loopback, drain)

    def _unsent(self, request: web.Request) -> web.Response | None:
        """Before aiohttp's Expect handling answers 100 Continue (which invites the upload, then
        reads and drops what was refused): a request without a key (outside open mode) or with a
        body over the limit, refused with its body unsent."""
        rt = self._live.runtime
        err: GatewayError | None = None
        if (request.content_length or 0) > (limit := rt.server.max_body_bytes):
            err = PayloadTooLarge(f"the request body is {request.content_length} bytes; the limit is {limit}")
        elif not rt.tenants.open and api_key(request) is None:
            err = Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        if err is None:
            return None
        response = web.Response(status=err.status, body=at_path(request.path).error_body(err), content_type="application/json",
                                headers={**err.headers(), "Connection": "close"})
        response.force_close()  # and the body the client may still send is not read (finish_response)
        return response

    async def __call__(self, request: web.Request) -> web.StreamResponse:  # app._make_request made it
        if self._drain.closed and request.path.startswith("/v1/"):
            return _closing(request.path)
        if self._loopback and self._live.runtime.tenants.open and (why := foreign(request.headers)) is not None:
            return _cross_site(request.path, why)
        if request.headers.get(hdrs.EXPECT, "").lower() == "100-continue" and (refused := self._unsent(request)) is not None:
            return refused
        info = self._routes.get((request.method, request.raw_path))
        if info is None or hdrs.EXPECT in request.headers:  # the router, or its Expect handling
            return await self._app_handle(request)  # type: ignore[no-any-return]
        request._match_info = info
        return await info.handler(request)


class _Server(web.Server):
    """aiohttp's Server, making guarded connections and counting them per client address."""

    def __init__(self, base: web.Server, limits: Callable[[], ServerPolicy], handler: Callable[..., Any]) -> None:
        # The app's Server as AppRunner made it (request factory, every handler setting), rebuilt
        # as this class (aiohttp offers no hook for the protocol class), with `handler` in front.
        super().__init__(handler, request_factory=base.request_factory,
                         handler_cancellation=base.handler_cancellation, **base._kwargs)
        self.limits = limits
        self.per_address: Counter[str] = Counter()

    def __call__(self) -> web.RequestHandler:
        s = self.limits()
        kwargs = {**self._kwargs, "keepalive_timeout": s.keepalive_timeout_ms / 1000}
        return _Connection(self, s, loop=self._loop, **kwargs)


class _Connection(web.RequestHandler):
    """One client connection: aiohttp's protocol plus the head timer, head size and address cap."""

    __slots__ = ("_edge", "_limits", "_address", "_head_timer", "_head_bytes", "_head_tail", "_head_start",
                 "_last_payload", "_answered", "_queued", "_auto_decompress")

    def __init__(self, manager: _Server, limits: ServerPolicy, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = manager
        self._limits = limits
        self._address: str | None = None  # counted against the cap while open
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # bytes of the request head being received
        self._head_tail = b""  # its last 3 bytes
        self._head_start = b""  # its first bytes (up to _LINE_BYTES): the request line, for an error's shape
        self._last_payload: StreamReader | None = None  # the body of the last request parsed
        # Answers finished; fewer than _request_count (requests parsed): one is being answered, or
        # waits to be (aiohttp's own flags miss the moment between the two), so no other answer may go out.
        self._answered = 0
        self._queued = False  # a refusal waits behind the requests before it (_queue_refusal)
        self._auto_decompress = bool(kwargs.get("auto_decompress", True))  # the parser's (for _recover)

    # ---- life -----------------------------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, tuple) and peer else None
        cap = self._limits.max_connections_per_client
        if address is not None and cap:
            if self._edge.per_address[address] >= cap:
                log.debug("refused a connection from %s: it has %d open (server.max_connections_per_client)", address, cap)
                # No lingering: a refused connection must not hold its fd any longer than this.
                self._refuse(TooManyConnections(
                    f"too many connections from your address ({cap} open); close some or retry later", retry_after_s=1),
                    linger=False)
                return
            self._edge.per_address[address] += 1
            self._address = address
        self._arm_head_timer()  # a new connection has the header timeout to send its first head

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        if self._address is not None:
            counts = self._edge.per_address
            counts[self._address] -= 1
            if counts[self._address] <= 0:
                del counts[self._address]
            self._address = None
        super().connection_lost(exc)

    def _refuse(self, err: GatewayError, *, linger: bool = True, path: str | None = None) -> None:
        """Answer `err` and close: at once where no request is being answered, else after the
        requests before it (_queue_refusal).

        `linger`: half-close and drop what the client still sends for a moment before closing, so
        its kernel does not reset the connection (losing the answer) on bytes already in flight.
        `path`: the request line's, for the answer's shape."""
        transport = self.transport
        if transport is None:
            return
        if self._queued:  # one waits already: nothing more is read
            self._pause_reading_for_buffer()
            return
        if self._answered != self._request_count:
            self._queue_refusal(err, path)
            return
        transport.write(_canned(err, path))
        if linger and transport.can_write_eof():
            transport.write_eof()
            self._close = True  # data_received drops what still arrives
            self._loop.call_later(_LINGER_S, self.force_close)
        else:
            self.force_close()  # the transport flushes what was written, then closes

    def _queue_refusal(self, err: GatewayError, path: str | None, at: int | None = None) -> None:
        """Queue `err` as aiohttp queues a head its parser refused: answered after the requests
        queued before it (pipelined on this connection: their answers are not lost), then the
        connection closes (handle_error). `at`: the requests queued from this index on are dropped
        for it (the refused one and those after it). Nothing more is read or parsed meanwhile."""
        messages = self._messages
        if at is not None:
            while len(messages) > at:
                messages.pop()
                self._request_count -= 1
        messages.append((_ErrInfo(status=err.status, exc=_Refused(err, path), message=err.message), EMPTY_PAYLOAD))
        self._request_count += 1
        self._hold()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _hold(self) -> None:
        """A refusal is queued: nothing more is read or parsed (what arrives meanwhile is, for
        data_received, a head over the limit: _refuse drops it and pauses reading again)."""
        self._queued = True
        self._last_payload, self._head_bytes = None, self._limits.max_header_bytes
        self._disarm_head_timer()
        self._pause_reading_for_buffer()  # resumed by aiohttp only as its queue drains to the refusal

    def _stop_reading(self) -> None:
        """After an answer that closes the connection while its request's body is still arriving:
        aiohttp would read and drop that body for its lingering_time (10 s: gigabytes at wire
        speed, for a request refused before authentication). None of it is read: the answer is
        followed by a FIN, and aiohttp's wait for the body, shortened to _LINGER_S, lets the
        client read the answer before the close (and the reset the unread bytes bring)."""
        transport = self.transport
        if transport is None:
            return
        self._close = True  # data_received drops what still arrives
        self._lingering_time = min(self._lingering_time, _LINGER_S)
        try:
            transport.pause_reading()
        except (AttributeError, NotImplementedError, RuntimeError):  # no flow control: _close drops it
            pass
        if transport.can_write_eof():
            transport.write_eof()

    # ---- the request head -----------------------------------------------------------------------

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self._loop.call_later(self._limits.header_timeout_ms / 1000, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is None or self._force_close or self._close or self._queued:
            return
        if self._answered != self._request_count:
            self._arm_head_timer()  # a head pipelined behind a request being answered is judged after it
            return
        timeout_ms = self._limits.header_timeout_ms
        if self._head_bytes:
            log.debug("closed a connection from %s: no complete request head within %d ms", self._address, timeout_ms)
            self._refuse(RequestTimeout(f"the request head (line and headers) did not arrive within {timeout_ms} ms"),
                         path=_line_path(self._head_start))
        else:
            self.force_close()  # it sent nothing: nothing to answer

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close:
            return
        body = self._last_payload
        if data and (body is None or body.is_eof()):  # no body open: these bytes start or continue a request head
            # The head's bytes in this read: up to its blank line, which may straddle two reads.
            straddle = (self._head_tail + data[:3]).find(b"\r\n\r\n") if self._head_tail else -1
            if straddle >= 0:
                used = straddle + 4 - len(self._head_tail)
            else:
                end = data.find(b"\r\n\r\n")
                used = len(data) if end < 0 else end + 4
            limit = self._limits.max_header_bytes
            if self._head_bytes + used > limit:
                log.debug("closed a connection from %s: a request head over %d bytes", self._address, limit)
                self._refuse(HeadersTooLarge(f"the request head (line and headers) is over {limit} bytes"),
                             path=_line_path(self._started(data)))
                return
            count = self._request_count
            super().data_received(data)
            if self._request_count == count:  # the head goes on in the next read
                if not self._force_close:
                    self._head_start = self._started(data)
                    self._head_bytes += len(data)
                    self._head_tail = (self._head_tail + data[-3:])[-3:]
                    self._arm_head_timer()
                return
            message, last = self._messages[-1]
            # The common case: one head, and the rest of the read its body (or none), so nothing
            # follows it. (More heads, or a chunked body's framing, leave more bytes than its body.)
            if len(data) - used == last.total_bytes and isinstance(message, RawRequestMessage):
                self._last_payload = last
                self._head_bytes, self._head_tail, self._head_start = 0, b"", b""
                timer = self._head_timer
                if timer is not None:
                    timer.cancel()
                    self._head_timer = None
            else:
                self._heads(data, count, used, body)
            return
        fed = body.total_bytes if body is not None else 0  # of the open body: where it ends in this read
        count = self._request_count
        super().data_received(data)
        if self._request_count != count:  # heads completed after the body (or were refused)
            self._heads(data, count, -1, body)
        elif data and body is not None and body.is_eof():  # the body ended in this read
            self._after_body(data, body, fed)

    def _started(self, data: bytes) -> bytes:
        """The first bytes of the head being received, with `data` (not yet counted) read after
        what came of it before."""
        start = self._head_start if self._head_bytes else b""
        return start if len(start) >= _LINE_BYTES else (start + data[:_LINE_BYTES])[:_LINE_BYTES]

    def _heads(self, data: bytes, count: int, used: int, previous: StreamReader | None) -> None:
        """After a read in which heads completed, other than the common case (one head, and its
        body the rest of the read): more than one head (pipelined), a head after a body's end, a
        chunked body, a head the parser refused. `used`: the bytes of the first head in `data`
        when the read began in a head (else -1); `previous`: the body open before the read."""
        new = self._request_count - count
        messages = self._messages
        message, last = messages[-1]
        started = self._started(data) if used >= 0 else b""  # the first head's first bytes
        whole = used >= 0 and not self._head_bytes  # the read began at a request's first byte
        self._last_payload = last
        self._head_bytes, self._head_tail, self._head_start = 0, b"", b""
        self._disarm_head_timer()
        if not isinstance(message, RawRequestMessage):
            self._parser_refused(message, data, started, whole, previous)
            return
        # The heads not measured as they came (all but a first that began the read): by their parts.
        limit = self._limits.max_header_bytes
        for i in range(len(messages) - new + (used >= 0), len(messages)):
            head = messages[i][0]
            if isinstance(head, RawRequestMessage) and _head_size(head) > limit:
                log.debug("refused a request from %s: a pipelined request head over %d bytes", self._address, limit)
                self._queue_refusal(HeadersTooLarge(f"the request head (line and headers) is over {limit} bytes"),
                                    _target_path(head.path.encode("utf-8", "surrogateescape")), at=i)
                return
        if not last.is_eof():
            return  # the rest of the read is its body
        # Its body (or none) ended in this read: what follows it begins the next head.
        if message.chunked:
            self._partial_head(data, _chunked_end(data))
        elif used >= 0 and new == 1:
            self._partial_head(data, used + last.total_bytes)
        else:
            size = last.total_bytes
            # Its head's end (or a blank line in its body, later: what follows is then undercounted).
            end = data.rfind(b"\r\n\r\n", 0, len(data) - size)
            if end >= 0:
                self._partial_head(data, end + 4 + size)

    def _after_body(self, data: bytes, body: StreamReader, fed: int) -> None:
        """The body open before this read ended in it (`fed`: its bytes before): what follows it
        begins the next head."""
        if body._http_chunk_splits is not None:  # chunked
            self._partial_head(data, _chunked_end(data))
        else:
            self._partial_head(data, body.total_bytes - fed)

    def _partial_head(self, data: bytes, end: int) -> None:
        """`data[end:]`, after the last request whole in this read, begins the next head: it is
        timed and measured as a head that began a read is (else it was held until the keep-alive
        timeout, and a head pipelined in one write with a request was not measured)."""
        end = max(end, 0)
        size = len(data) - end
        if size <= 0:
            return
        start = data[end:end + _LINE_BYTES]
        limit = self._limits.max_header_bytes
        if size > limit:
            log.debug("closed a connection from %s: a request head over %d bytes", self._address, limit)
            self._refuse(HeadersTooLarge(f"the request head (line and headers) is over {limit} bytes"), path=_line_path(start))
            return
        self._head_bytes, self._head_start, self._head_tail = size, start, data[len(data) - min(size, 3):]
        self._arm_head_timer()

    def _parser_refused(self, info: Any, data: bytes, started: bytes, whole: bool, previous: StreamReader | None) -> None:
        """The parser refused a head (or a body's framing) in this read: aiohttp queued one 400 for
        it and dropped every request it parsed from the same read. Where the read began at a
        request's start, those before the refused head are parsed again and queued before it
        (_recover): they are answered first, and the 400 is in the shape of the refused head's API."""
        messages = self._messages
        path = _line_path(started) if started else None
        if whole and (found := self._recover(data)) is not None:
            requests, path = found
            if requests:
                entry = messages.pop()
                messages.extend(requests)
                messages.append(entry)
                self._request_count += len(requests)
        exc = getattr(info, "exc", None)
        err = _parser_error(exc, getattr(info, "message", None))
        messages[-1] = (_ErrInfo(status=err.status, exc=_Refused(err, path), message=err.message), EMPTY_PAYLOAD)
        if previous is not None and not previous.is_eof():
            # The parser refused bytes inside an open body (e.g. a bad chunk size): that body
            # never ends, so its reader fails now (a 400) and nothing lingers on it.
            self._lingering_time = 0.0
            why = _parser_error(exc, None).message
            previous.set_exception(web.RequestPayloadError(f"malformed body framing: {why}"))
        self._hold()  # the parser is done with this connection: it would refuse every read again

    def _recover(self, data: bytes) -> tuple[list[tuple[RawRequestMessage, StreamReader]], str | None] | None:
        """The requests whole in `data` (a read that began at a request's first byte) before the
        head the parser refused in it, parsed again by a parser of their own, with the path of the
        refused head's request line. Fed a head at a time (a piece ends at a blank line) and each
        Content-Length body whole, so a request parsed is kept when a later piece raises. None
        where that is not cheap to tell: a chunked or upgrade request, a body over read_bufsize
        (its reader would pause this connection's parser), more than _RECOVER_PIECES pieces."""
        parser = HttpRequestParser(self, self._loop, self._read_bufsize, max_line_size=self.max_line_size,
                                   max_field_size=self.max_field_size, max_headers=self.max_headers,
                                   payload_exception=web.RequestPayloadError, auto_decompress=self._auto_decompress)
        found: list[tuple[RawRequestMessage, StreamReader]] = []
        pos = 0
        for _ in range(_RECOVER_PIECES):
            end = data.find(b"\r\n\r\n", pos)
            end = len(data) if end < 0 else end + 4
            try:
                parsed, _, _ = parser.feed_data(data[pos:end])
            except HttpProcessingError:
                return found, _line_path(data[pos:pos + _LINE_BYTES])
            pos = end
            for message, payload in parsed:
                if not isinstance(message, RawRequestMessage) or message.chunked or message.upgrade:
                    return None
                size = int(message.headers.get(hdrs.CONTENT_LENGTH) or 0)
                if size > self._read_bufsize or pos + size > len(data):
                    return None
                if size:
                    try:
                        parser.feed_data(data[pos:pos + size])
                    except HttpProcessingError:
                        return None
                    pos += size
                if not payload.is_eof():
                    return None
                found.append((message, payload))
            if pos >= len(data):
                return None  # no error: not the read the connection's parser refused
        return None

    # ---- errors in the contract -----------------------------------------------------------------

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's answer to a request its parser refused, or whose handler raised: in the JSON
        shape. A client's mistake is a debug line; a handler's exception is a bug, logged in full."""
        if request.writer.output_size > 0:
            raise ConnectionError("the answer had begun; no error answer can follow it")
        err: GatewayError
        path: str | None = request.path
        if isinstance(exc, _Refused):  # a head refused (data_received, _queue_refusal): no request, its line's path
            err, path = exc.err, exc.path
            # aiohttp's stand-in request is HTTP/1.0: the answer is HTTP/1.1 (and says Connection:
            # close), as _canned's are and as the client spoke.
            request._version = HttpVersion11
            request._cache.pop("version", None)
            log.debug("refused a malformed request from %s: %s", request.remote, err.message)
        elif status >= 500 and status != 504:
            rid = os.urandom(12).hex()
            log.error("request %s: unhandled error answering %s %s", rid, request.method, request.path, exc_info=exc)
            err = InternalError(f"internal error in the gateway (request id {rid})")
        elif status == 504:
            err = GatewayTimeout("the gateway timed out answering the request")
        else:  # a head the parser refused that data_received did not see (aiohttp's stand-in has path "/")
            err, path = _parser_error(exc, message), None
            log.debug("refused a malformed request from %s: %s", request.remote, err.message)
        body = _error_body(err, path)
        resp = web.Response(body=body, status=err.status, content_type="application/json", headers=err.headers())
        resp.force_close()
        return resp

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and resp.content_type != "application/json":
            resp = _as_json(resp, request.path)
        content = request.content
        if not content.is_eof() and ((length := request.content_length) is None or length > self._limits.max_body_bytes):
            # Answered (a refusal: no key, 413, ...) while a body with no bound (chunked) or over
            # the limit is still arriving: the connection closes rather than read it (_stop_reading).
            resp.force_close()
        try:
            transport = self.transport
            if transport is None or not transport.get_write_buffer_size():
                return await super().finish_response(request, resp, start_time)
            # Answers already wait on this connection (a client that pipelines requests and reads
            # none of the answers): aiohttp's write of this one waits for the buffer to drain, with
            # no bound. 10 such connections held their answers and buffers until the client closed
            # (review helper's repro). Bounded as a stream's write is (sink.CLIENT_READ_S).
            try:
                async with asyncio.timeout(sink.CLIENT_READ_S):
                    return await super().finish_response(request, resp, start_time)
            except TimeoutError:
                log.info("closing a connection from %s: its client took none of its answers for %g s",
                         self._address, sink.CLIENT_READ_S)
                self.force_close()
                transport.abort()
                return resp, True
        finally:
            self._answered += 1
            if not content.at_eof():  # a body its handler did not read to its end
                _discard_unread(content)
                if not content.is_eof() and not resp.keep_alive:  # and more of it to come
                    self._stop_reading()

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A body the client framed wrongly or dropped, found while lingering: its doing, not a bug."""
        exc = kw.get("exc_info")
        if isinstance(exc, (web.RequestPayloadError, HttpProcessingError, ConnectionError)):
            log.debug("connection from %s closed: %s", self._address, exc)
            return
        super().log_exception(*args, **kw)


def _discard_unread(content: StreamReader) -> None:
    """Drop what arrived of a body its handler never read (a 401, an early 429, a 404): aiohttp
    discards only a body still arriving, and one that came with its head stayed buffered on the
    idle keep-alive connection (300 connections of 100 KiB 401s held 29 MiB for up to 75 s:
    review helper's repro)."""
    try:
        while content.read_nowait(-1):
            pass
    except Exception:  # noqa: BLE001 (a payload that failed: nothing of it is needed any more)
        pass


def _as_json(exc: web.HTTPException, path: str) -> web.Response:
    """An answer aiohttp itself raised (417 for an unknown Expect, 413 from request.read(), ...)
    in the JSON shape of the API `path` is under (Anthropic's for /v1/messages: it was OpenAI's),
    keeping the headers that belong to it."""
    err = GatewayError((exc.text or exc.reason or "").strip()[:200] or HTTPStatus(exc.status).phrase,
                       code=(exc.reason or "error").lower().replace(" ", "_"))
    err.status, err.type = exc.status, "invalid_request_error" if exc.status < 500 else "api_error"
    body = at_path(path).error_body(err)
    keep = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after", "location", "connection")}
    return web.Response(body=body, status=exc.status, content_type="application/json", headers=keep)
