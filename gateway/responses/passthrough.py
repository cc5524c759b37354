"""One by-id request of the Responses API (api.py) on its way upstream: sent as it came
to the backend holding the id, answered as it comes back (status, JSON or event stream).

Like every API request it is a Call: counted in flight for a graceful shutdown and observed when
it ends (http_call.accounted: stage histograms, access log, tracing), each upstream request taken
from the tenant's request limits (quota.reserve_request) and reported to its backend's health
(relay/report.py: a timeout, a lost connection or a 5xx count against the backend as a whole; an answer
counts for it; no latency sample: these calls are not completions).

Each upstream request also holds one of its backend's slots (`max_concurrency`) until its answer is
relayed or its client left, as the relay's attempts do (relay/base.py): in the caller's band and
tenant's turn, waiting in the backend's queue as a completion would, and refused as one would be
when none comes (503 `backends_busy`, 503 `overloaded` when shed, 504 at the deadline). A replay
of a background response's events can last minutes: uncounted, any caller could hold a backend
protected by its max_concurrency with as many as it liked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web
from yarl import URL

from ..admission.gate import BANDS, Ticket
from ..admission.stage import refuse_late, slot_refusal, wait_for_slot
from ..config.runtime import Runtime
from ..errors import AllBackendsFailed, GatewayError, UpstreamError, UpstreamRejected, UpstreamTimeout
from ..pipeline.call import CLIENT_CLOSED, Call, Finish, Timing, key_live, revoked
from ..relay.attempt import MAX_BODY_BYTES
from ..relay.report import report
from ..routing.backends import Backend
from ..routing.health import Kind
from ..tenants.auth import Tenant
from ..tenants.priority import band_for
from ..tenants.quota import Hold, QuotaExceeded
from ..upstream.client import UpstreamHTTPError, UpstreamMaybeSent, UpstreamResponse, UpstreamTooLarge
from ..web.http_call import api_key, error_response, request_id
from ..web.keys import METRICS, OBSERVER, RELAY
from ..web.sink import CLIENT_READ_S, client_bounded
from ..wire.codec import Endpoint
from .wire import error_event, last_sequence_number

__all__ = ["BY_ID", "Found", "Read", "Passthrough"]

log = logging.getLogger("gateway.responses")

_PASS_HEADERS = ("Content-Type", "Retry-After")
# A by-id call's cost in its backend's queue (in tokens, as the fair queue counts): the base a
# completion pays (pipeline/intake.py), with no prompt or answer of its own.
_COST = 256

Found = Callable[[Backend, UpstreamResponse], Awaitable[None]]  # a 200 from that backend, before its release
Read = Callable[[Backend, bytes], Awaitable[None]]  # the body of a 200 JSON answer from that backend, before its release


class _ById(Endpoint):
    """The by-id paths, as a Call's endpoint (the access log's and the span's name for them)."""

    streams = classifies = cacheable = False

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path = name, path


BY_ID = {"response": _ById("responses_by_id", "/responses"), "conversation": _ById("conversations", "/conversations")}


class Passthrough:
    """One by-id request: its Call, its tenant's request leases, its upstream calls."""

    __slots__ = ("request", "rt", "call", "headers", "tenant", "hold", "ticket")

    def __init__(self, request: web.Request, rt: Runtime, kind: str) -> None:
        self.request, self.rt = request, rt
        now = time.monotonic()
        self.call = Call(request_id(request), BY_ID[kind], b"", api_key(request),
                         now + rt.server.request_timeout_ms / 1000, timing=Timing(t0_monotonic=now))
        self.headers = {"x-request-id": self.call.request_id}
        self.tenant: Tenant | None = None
        self.hold: Hold | None = None
        self.ticket = Ticket(cost=_COST)  # its place in a backend's queue (the caller's, once known)

    async def authenticate(self) -> Tenant:
        await self.rt.tenants.catch_up(self.call.api_key)
        tenant = self.tenant = self.rt.tenants.authenticate(self.call.api_key)
        self.call.tenant = tenant
        if self.request.app[RELAY].admission.enabled:  # off: one first come, first served queue, as the relay's
            # The band x-priority asks for, held to the tenant's ceiling (a value that names no
            # band is ignored: these calls never refused one), else the tenant's default.
            asked = self.request.headers.get("x-priority")
            band = band_for(asked if asked in BANDS else None, tenant)
            self.ticket = Ticket(band, tenant.name, _COST, self.rt.tenants.weight(tenant.name))
        return tenant

    async def take(self) -> None:
        """One more upstream request: the last one's lease goes back, a new one is taken."""
        quota, tenant = self.rt.quota, self.tenant
        if quota is None or tenant is None:
            return
        quota.release(self.hold)
        self.hold = None
        try:
            self.hold = await quota.reserve_request(tenant, self.rt.server.request_timeout_ms / 1000, self.headers.__setitem__)
        except QuotaExceeded as err:
            metrics = self.request.app[METRICS]
            metrics.quota_rejections.labels(self.rt.tenants.metric_label(tenant.name), err.limit).inc()
            raise

    def done(self) -> None:
        """The call ended, however: its request lease goes back, and it is counted once
        (gateway_requests_total, durations: Observer.count, as the pipeline counts its requests).
        Ended without an answer: its client left before any (499, aiohttp cancelled the
        handler), or a bug (aiohttp answers 500)."""
        if self.rt.quota is not None:
            self.rt.quota.release(self.hold)
        out = self.call.out
        if out.finish is None:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                out.status, out.finish = CLIENT_CLOSED, Finish.CLIENT_DISCONNECT
            else:
                out.status, out.finish = 500, Finish.ERROR
        self.request.app[OBSERVER].count(self.call, self.rt)

    def answered(self, out: web.StreamResponse) -> web.StreamResponse:
        """The backend's answer, as it said it (a relayed stream may have been cut)."""
        self.call.out.status = out.status
        if self.call.out.finish is None:
            self.call.out.finish = Finish.OK
        return out

    def failed(self, err: GatewayError) -> web.Response:
        call = self.call
        call.out.status, call.out.error, call.out.finish = err.status, err.message, Finish.ERROR
        return error_response(err, self.headers)

    async def send(
        self, backend: Backend, method: str, path: str, body: bytes, *, last: bool = True, on_found: Found | None = None,
        on_read: Read | None = None,
    ) -> web.StreamResponse | None:
        """The backend's answer for the client; None when it answered 404 and it is not the `last`
        to ask. `on_found` runs on a 200 before anything of it is released (a GatewayError it
        raises is the answer instead); `on_read` on the body of a 200 that is not a stream,
        before it is released. One of the backend's slots is held throughout, a stream's whole
        replay included (a GatewayError when none comes: `_slot`)."""
        slots, band = backend.slots, self.ticket.band  # the same object and band give it back, across a reload too
        await self._slot(backend)
        m = self.request.app[METRICS].for_backend(backend.name)
        m.inflight.inc()
        try:
            return await self._send(backend, method, path, body, last, on_found, on_read)
        finally:  # answered, failed, or cancelled (its client left): the slot goes to the next waiter
            slots.release(band)
            m.inflight.dec()

    async def _slot(self, backend: Backend) -> None:
        """Take one of the backend's slots, waiting in its queue as the relay does when every
        candidate is full (relay/core.py `_queued`): refused at once when admission is on and the
        predicted wait would use up the deadline (503 `overloaded`), else queued up to the
        backend's first_token_ms or the deadline, whichever comes first, and refused in the relay's
        words when no slot came (503 `backends_busy`; 504 at the deadline): never sent."""
        ticket, call = self.ticket, self.call
        if backend.slots.try_acquire(ticket.band):
            return
        relay, metrics = self.request.app[RELAY], self.request.app[METRICS]
        remaining, first_s = call.remaining_s(), backend.timeouts.first_token_ms / 1000
        if relay.admission.enabled:
            refuse_late(backend, ticket, remaining, metrics)
        if await wait_for_slot(backend, min(remaining, first_s), ticket, ticket.band, metrics, self._waited):
            return
        err = slot_refusal(remaining <= first_s, call.timeout_ms(), ticket.band, metrics)
        raise AllBackendsFailed([(backend.name, err)], deadline_hit=call.remaining_s() <= 0)

    def _waited(self, seconds: float) -> None:
        """`seconds` in a backend's queue, however the wait ended: the request's queue stage."""
        call = self.call
        call.timing.queue_ms += seconds * 1000
        self.request.app[METRICS].queue_wait.labels(self.ticket.band).observe(seconds)
        self.headers["x-gateway-queue-ms"] = f"{call.timing.queue_ms:.1f}"

    async def _send(
        self, backend: Backend, method: str, path: str, body: bytes, last: bool, on_found: Found | None,
        on_read: Read | None,
    ) -> web.StreamResponse | None:
        """send(), once it holds a slot."""
        call, t = self.call, backend.timeouts
        self.headers["x-gateway-backend"] = call.out.backend = backend.name
        call.out.attempts.append(backend.name)
        qs = self.request.rel_url.raw_query_string
        url = URL(backend.base_url + path + (f"?{qs}" if qs else ""), encoded=True)
        up_headers = {**backend.headers, "X-Request-Id": call.request_id}
        if not body:
            up_headers.pop("Content-Type", None)
        resp: UpstreamResponse | None = None
        call.timing.sent_at = time.perf_counter()
        try:
            async with asyncio.timeout(t.first_token_ms / 1000):
                resp = await self.request.app[RELAY].pool.post(url, body, up_headers, connect_timeout_s=t.connect_ms / 1000,
                                                               method=method)
            call.timing.headers_at = time.perf_counter()
            if resp.status >= 500:
                self._report(backend, Kind.http(resp.status), resp.status)
            elif resp.status != 429:
                self._report(backend, Kind.OK)  # it answered: a 404 is an answer too
            if resp.status == 404 and not last:
                return None
            if on_found is not None and resp.status == 200:
                await on_found(backend, resp)
            read = None if on_read is None or resp.status != 200 else (lambda data: on_read(backend, data))
            return await self._relayed(resp, t.total_ms / 1000, t.idle_ms / 1000, read, backend.name)
        except TimeoutError:
            self._report(backend, Kind.TIMEOUT)
            err: GatewayError = UpstreamTimeout(f"backend {backend.name!r} did not answer {method} {path} in time")
        except UpstreamHTTPError as exc:
            self._report(backend, _lost(exc, answered=resp is not None))
            # The client learns the kind of failure; the address and the OS error stay in the log.
            log.info("request %s: backend %r failed on %s %s: %s: %s", call.request_id, backend.name, method, url,
                     type(exc).__name__, exc)
            err = UpstreamError(f"backend {backend.name!r} failed on {method} {path}: {exc.summary}")
        finally:
            if resp is not None:
                resp.close()  # a no-op after release()
        return self.failed(err)

    async def _relayed(
        self, resp: UpstreamResponse, total_s: float, idle_s: float, on_read: Callable[[bytes], Awaitable[None]] | None,
        backend: str,
    ) -> web.StreamResponse:
        out_headers = {**self.headers, **{k: resp.headers[k] for k in _PASS_HEADERS if k in resp.headers}}
        if "text/event-stream" not in resp.headers.get("Content-Type", ""):
            async with asyncio.timeout(total_s):
                data = await resp.read(max_bytes=MAX_BODY_BYTES)
            resp.release()
            if on_read is not None:
                await on_read(data)
            if resp.status >= 500:  # the backend's own failure: its words go to the log only, as the relay's do
                log.info("request %s: backend %r answered HTTP %d: %r", self.call.request_id, backend, resp.status, data[:500])
                data = UpstreamError(f"backend {backend!r} answered HTTP {resp.status}", upstream_status=resp.status).to_body()
                out_headers["Content-Type"] = "application/json"
            elif resp.status >= 400:
                # In OpenAI's error shape whatever the backend wrote ("404: Not Found" as text: the
                # SDK showed an empty message; review helper's repro); an error object as it is.
                data = UpstreamRejected(resp.status, data, backend).to_body()
                out_headers["Content-Type"] = "application/json"
            return web.Response(status=resp.status, body=data, headers=out_headers)
        return await self._stream(resp, out_headers, idle_s)

    async def _stream(self, resp: UpstreamResponse, headers: dict[str, str], idle_s: float) -> web.StreamResponse:
        """An event stream (a background response's events, replayed by its backend), as bytes."""
        out = web.StreamResponse(status=resp.status, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await out.prepare(self.request)
        # The events go on whole (the pieces read split them anywhere): an error event can follow
        # the last one, numbered after it. `partial`: what came of the next event so far.
        seq, partial, sent_partial = -1, b"", False
        try:
            # The request's deadline bounds the whole replay, and a client that takes none of it
            # for CLIENT_READ_S is gone: a replay ran 14 s past a 1 s deadline (its concurrency
            # lease expired under it), and one that nobody read held its upstream call for good.
            async with asyncio.timeout(max(0.0, self.call.remaining_s())):
                while True:
                    async with asyncio.timeout(idle_s):
                        chunk = await resp.readany()
                    if not chunk:
                        break
                    if not key_live(self.call):
                        # Revoked mid-replay: it stops, as the relay's streams do (it went on to the
                        # end), with an error event after the last whole event the client got.
                        end = b"\n\n" if sent_partial else b""
                        await client_bounded(out.write(end + error_event(revoked(), seq + 1)), CLIENT_READ_S)
                        self.call.out.finish, self.call.out.error = Finish.ERROR, revoked().message
                        return out
                    whole, partial, seq = _whole_events(partial, chunk, seq)
                    sent_partial = False
                    if len(partial) > _PARTIAL_MAX:  # an event this big goes on as it comes
                        whole, partial, sent_partial = whole + partial, b"", True
                    if whole:
                        await client_bounded(out.write(whole), CLIENT_READ_S)
                if partial:
                    await client_bounded(out.write(partial), CLIENT_READ_S)
        except (TimeoutError, UpstreamHTTPError) as exc:
            # Cut: the client sees the stream stop without response.completed, which is the truth.
            log.warning("request %s: replayed stream from a backend cut: %s", self.call.request_id, exc or "its deadline passed")
            self.call.out.finish = Finish.CUT
            return out
        except ConnectionError:  # reset, or lost (or stopped reading) while a write waited on it
            self.call.out.finish = Finish.CLIENT_DISCONNECT
            if self.request.transport is not None:
                self.request.transport.close()  # nothing more is written to it, its end included
            return out
        except asyncio.CancelledError:  # its client left after the 200 went out: a 200 cut short, not a 499
            self.call.out.finish = Finish.CLIENT_DISCONNECT
            raise
        await out.write_eof()
        return out

    def _report(self, backend: Backend, kind: Kind, status: int | None = None) -> None:
        metrics = self.request.app[METRICS]
        seconds = time.perf_counter() - self.call.timing.sent_at
        report(self.call, backend, metrics, metrics.for_backend(backend.name), kind, seconds, status=status, sample=False)


_PARTIAL_MAX = 1 << 16  # of an event still arriving, what is kept to find its end


def _whole_events(partial: bytes, chunk: bytes, seq: int) -> tuple[bytes, bytes, int]:
    """After `chunk` of an event stream: its whole events (with what came before of the first),
    the start of the next one, and the last whole event's sequence number (else `seq`)."""
    data = partial + chunk if partial else chunk
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data, seq
    n = last_sequence_number(data[:cut])
    return data[: cut + 2], data[cut + 2:], seq if n is None else n


def _lost(exc: UpstreamHTTPError, *, answered: bool) -> Kind:
    """How a by-id call's connection failed, as the relay's attempts say it (relay/attempt.py)."""
    if isinstance(exc, UpstreamTooLarge):  # past our cap: what was asked for (a long listing), not the backend's fault
        return Kind.TOO_LARGE
    if answered:
        return Kind.DISCONNECT
    return Kind.RESET_BEFORE_HEADERS if isinstance(exc, UpstreamMaybeSent) else Kind.CONNECT
