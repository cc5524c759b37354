"""One attempt: a request to one backend, until its answer reached the client or it failed.

`Attempt.send()` sends the request and reads the status (and a whole answer's body); a non-200
is a failover or a pass-back (`refuse`); a whole answer goes to the client with `deliver`, a
stream through the pump (pump.py). A failure before the first content byte raises AttemptFailed
(the relay may fail over); after it, Cut (the relay may continue the answer elsewhere, see
continuation.py, or ends it with an error event and no [DONE]).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, replace
from typing import Protocol

from ..config.policy import RoutingPolicy
from ..errors import GatewayError, RateLimited, Unavailable, UpstreamError, UpstreamRejected, UpstreamTimeout
from ..observe.metrics import BackendMetrics
from ..pipeline.call import Call, Finish, key_live, revoked
from ..routing.affinity import AffinityResult
from ..routing.backends import Backend
from ..routing.health import Kind
from ..tenants.auth import OPEN_TENANT
from ..upstream.client import UpstreamConnectError, UpstreamHTTPError, UpstreamMaybeSent, UpstreamResponse, UpstreamTooLarge
from ..web.sink import Sink
from ..wire.codec import NotAnAnswer, salted
from .context import RelayContext
from .continuation import Resume
from .refusal import context_length, request_too_large, retry_after

__all__ = [
    "Attempt", "AttemptFailed", "ClientGone", "Cut", "Lost", "Progress", "Requester", "MAX_BODY_BYTES",
    "MAX_HELD_BYTES", "client_write",
]

log = logging.getLogger("gateway.relay")

_DEFAULT_COOLDOWN_S = 1.0  # a 429/503 without Retry-After still pauses that backend briefly
_ERROR_SNIPPET = 300
# A whole answer's time per token allowed while a backend has streamed too little to measure its
# own (10 tokens a second: slower than serving stacks are kept running at).
_COLD_TOKEN_S = 0.1
# Nothing a backend sends is unbounded: past these, the attempt fails with a 502 naming the backend.
MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streamed answer (large embedding batches included)
MAX_HELD_BYTES = 1024 * 1024  # stream events held back before the first content token


class ClientGone(Exception):
    """The client disconnected; the upstream request is abandoned."""


class Cut(Exception):
    """A stream broke after content reached the client (nothing was written about it yet)."""

    def __init__(self, err: GatewayError, kind: Kind, *, live: bool = False) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind  # CUT_MID_STREAM, TOO_LARGE, ERROR_EVENT_MID_STREAM, CALLER_DEADLINE or KEY_REVOKED
        self.live = live  # a stall cut at a deadline from live data, short of the backend's idle_ms


class AttemptFailed(Exception):
    """A backend failed before anything reached the client: the next candidate may take over."""

    def __init__(self, err: GatewayError, kind: Kind, status: int | None = None) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind  # how the failure is accounted (health.OUTCOMES)
        self.status = status  # the upstream's HTTP status, when it answered one

    @property
    def label(self) -> str:
        return self.kind.label(self.status)


class Lost(Exception):
    """A hedged attempt whose rival reached the client first."""


@dataclass(slots=True)
class Progress:
    first_sent: bool = False  # a content event reached the client: no more failover
    owner: str | None = None  # the backend whose answer the client gets (first content, or whole body)
    rivals: list[asyncio.Task[bool | None]] | None = None  # hedged attempts: the owner cancels the others
    cut: Cut | None = None  # the owner's stream broke mid-answer: the relay continues or ends it


class Requester(Protocol):
    """What an attempt shares with its request's other attempts (relay.Relay)."""

    call: Call
    ctx: RelayContext
    sink: Sink
    progress: Progress


class Attempt:
    """One request to one backend. `live`: the rule for first-token and stall deadlines from live
    data while another backend could take over (None: the backend's fixed timeouts); `cold_s`: the
    first-token deadline while this backend has too few samples; `resume`: continue a broken stream."""

    __slots__ = ("call", "backend", "tracker", "ctx", "sink", "progress", "m", "live", "resume", "started", "now",
                 "first_deadline", "call_deadline", "leg", "client_wait_s", "sent", "sent_at", "headers_at")

    def __init__(self, req: Requester, backend: Backend, m: BackendMetrics, *, live: RoutingPolicy | None,
                 cold_s: float | None = None, resume: Resume | None = None) -> None:
        self.call, self.ctx, self.sink, self.progress = req.call, req.ctx, req.sink, req.progress
        self.backend, self.m, self.live, self.resume = backend, m, live, resume
        # Its upstream model's: another model's first tokens on the same backend set neither its
        # deadlines nor its prediction (a flood of a 5 ms model shrank a big one's deadline).
        self.tracker = backend.tracker_for(self.call.model)
        leg = self.call.endpoint.toward(backend.kind, backend.policy.endpoints)
        assert leg is not None, f"{backend.name!r} cannot answer {self.call.endpoint.name}: its pool should not hold it"
        self.leg = leg  # the codec toward this backend: the endpoint itself, or a translating leg
        self.started = time.perf_counter()
        self.client_wait_s = 0.0  # time its writes waited on a client slow to read: not the backend's
        self.sent = False  # its request went to the backend (which may be at work on the prompt)
        # Its own stamps: while hedged attempts race, the call's (Server-Timing, stages) are the
        # winner's, set as it claims the client; else each attempt sets the call's as it goes.
        self.sent_at = self.headers_at = 0.0
        self.now = now = asyncio.get_running_loop().time()
        self.call_deadline = now + self.call.remaining_s()
        first_s = backend.timeouts.first_token_ms / 1000
        if live is not None:  # a stuck backend is abandoned after ~2x its live P95, not a fixed timeout
            first_s = self.tracker.first_token_deadline_s(
                first_s, live.deadline_floor_ms / 1000, prompt_tokens=self.call.prompt_tokens,
                mult=live.deadline_p95_multiplier, cold_s=cold_s,
            )
        if not self.call.stream and self.call.endpoint.generates:
            first_s = self._whole_s(first_s)  # a whole answer's headers come with the whole answer
        self.first_deadline = min(now + first_s, self.call_deadline)

    def _whole_s(self, first_s: float) -> float:
        """How long a whole (non-streamed) answer may take to come, its headers coming with it:
        `total_ms` on the last candidate (no one to fail over to); else the longest of its first
        token's deadline, that plus the live inter-token allowance for each token the request
        allows (`_COLD_TOKEN_S` before the backend has streamed enough), and the multiplier x
        the live P95 of the backend's whole answers; at most `total_ms`. A request without a
        limit to a backend without history gets the first token's deadline alone: a silent
        backend is left as soon as a streamed request would leave it."""
        total_s = self.backend.timeouts.total_ms / 1000
        live = self.live
        if live is None:
            return total_s
        tracker, mult = self.tracker, live.deadline_p95_multiplier
        wait_s = max(first_s, tracker.whole_deadline_s(mult=mult))
        tokens = self.call.max_output_tokens()
        if tokens is not None:
            wait_s = max(wait_s, first_s + tokens * tracker.token_deadline_s(_COLD_TOKEN_S, mult=mult))
        return min(total_s, wait_s)

    async def send(self) -> tuple[UpstreamResponse, bytes]:
        """Send the request; the response (its status read) and, for a whole 200, its body.
        Raises Unauthorized, sending nothing, when the caller's virtual key stopped working since
        the request came (it waited in a queue, or this is a later attempt)."""
        call, backend, t = self.call, self.backend, self.backend.timeouts
        if not key_live(call):
            raise revoked()
        leg = self.leg
        upstream_model = backend.upstream_model(call.model)
        url = backend.urls[leg.upstream]
        # A model server's prefix cache is shared by every caller: salted per tenant namespace (a
        # launched model, or `cache_salt: true`), a caller cannot time another tenant's cached
        # prompt (open mode: one caller).
        tenant = call.tenant
        salt = tenant.cache_namespace if backend.salts and tenant not in (None, OPEN_TENANT) else None
        if self.resume is not None:  # the request in the backend's format, plus what was delivered
            request = salted(leg.upstream_request(call.body), salt)
            body = self.resume.body(request, upstream_model, leg.prefill, trim=leg.prefill_trims)
        else:
            translated = leg.upstream_body(call.body, upstream_model, salt)  # in the backend's API's format
            body = call.body_for(upstream_model, salt) if translated is None else translated
        headers = {**backend.headers, "X-Request-Id": call.request_id}
        for name, value in call.asked.betas:
            if name in backend.forwards:  # the backend's own (its `headers:`) first, then the client's
                mine = headers.get(name)
                headers[name] = value if mine is None else f"{mine}, {value}"
        resp: UpstreamResponse | None = None
        timer = asyncio.timeout_at(self.first_deadline)  # one timer per attempt, moved as the phases change
        self.sent_at = time.perf_counter()  # Server-Timing's stages (observe/observer.py)
        if self.progress.rivals is None:
            call.timing.sent_at = self.sent_at
        self.sent = True
        try:
            async with timer:
                resp = await self.ctx.pool.post(url, body, headers, connect_timeout_s=t.connect_ms / 1000)
                self.headers_at = time.perf_counter()
                if self.progress.rivals is None:
                    call.timing.headers_at = self.headers_at
                if resp.status == 200 and not call.stream:
                    if not resp.complete:  # else the body is here: no timer to move (a timer costs µs)
                        timer.reschedule(min(self.now + t.total_ms / 1000, self.call_deadline))
                    return resp, await resp.read(max_bytes=MAX_BODY_BYTES)
                return resp, b""
        except BaseException as exc:
            if resp is not None:
                resp.close()
            raise self._unsent(exc, resp is not None, url) from None

    def _unsent(self, exc: BaseException, answered: bool, url: object) -> BaseException:
        """What a failure to get an answer's head (or whole body) is, for the relay."""
        if isinstance(exc, TimeoutError):
            if self.call.deadline_passed():
                return self.caller_deadline()
            if not answered:
                return AttemptFailed(UpstreamTimeout(f"no response within {_ms(self.first_deadline - self.now)} ms"),
                                     Kind.TIMEOUT)
            return AttemptFailed(UpstreamTimeout("the answer did not complete in time"), Kind.TIMEOUT)
        if isinstance(exc, UpstreamConnectError):
            return self.failed(exc.summary, Kind.CONNECT, f"{url}: {exc}")
        if isinstance(exc, UpstreamTooLarge):
            return AttemptFailed(UpstreamError(f"backend {self.backend.name!r}: {exc}"), Kind.TOO_LARGE)
        if not isinstance(exc, (UpstreamHTTPError, OSError)):
            return exc  # cancelled, or a bug: not the backend's failure
        detail = f"{url}: {type(exc).__name__}: {exc}"
        if answered:
            return self.failed("connection lost while reading the answer", Kind.DISCONNECT, detail)
        if isinstance(exc, UpstreamMaybeSent):
            # The request left and may have been processed (and billed): an attempt, never resent.
            return self.failed(exc.summary, Kind.RESET_BEFORE_HEADERS, detail)
        return self.failed(exc.summary if isinstance(exc, UpstreamHTTPError) else "connect failed", Kind.CONNECT, detail)

    async def refuse(self, resp: UpstreamResponse) -> None:
        """Turn a non-200 answer into a failover (raise AttemptFailed) or a pass-back (UpstreamRejected)."""
        status, call, backend = resp.status, self.call, self.backend
        raw = b""
        try:
            async with asyncio.timeout_at(self.first_deadline):
                while len(raw) < 64 * 1024:  # enough to explain the error; never buffer a huge one
                    chunk = await resp.readany()
                    if not chunk:
                        break
                    raw += chunk
        except (TimeoutError, UpstreamHTTPError):
            pass
        snippet = raw[:_ERROR_SNIPPET].decode("utf-8", "replace")
        if request_too_large(status, raw):  # the request's own doing: passed back, nobody cooled down
            raise UpstreamRejected(status, raw, backend.name)
        if status in (429, 503, 529):  # 529: Anthropic's overloaded_error, usually without Retry-After
            asked = retry_after(resp.headers.get("Retry-After"))
            pause = asked if asked is not None else _DEFAULT_COOLDOWN_S
            # Per upstream model: a provider's 429 on one model leaves its other models alone.
            backend.health_for(call.model).cool_down(pause)
            log.info("request %s: backend %r model %r answered HTTP %s: cooling down for %gs",
                     call.request_id, backend.name, backend.upstream_model(call.model), status, pause)
            cls = RateLimited if status == 429 else Unavailable
            # A backend that asks for a pause is busy: it cools down (429 is not a failure, see health.OUTCOMES).
            raise AttemptFailed(cls(f"HTTP {status} (retry after {pause:g}s)", retry_after_s=asked), Kind.http(status), status)
        if status >= 500 or status in (401, 403, 404, 405, 408):
            # Our key, our model name, the path, or the backend itself is wrong: another backend may
            # do better. Whether it counts against this one's health: health.OUTCOMES.
            hint = self.leg.missing_hint if status == 404 else None
            summary = f"HTTP {status}" if hint is None else f"HTTP {status} on {self.leg.path} ({hint})"
            raise self.failed(summary, Kind.http(status), f"HTTP {status}: {snippet}", status)
        raise UpstreamRejected(status, raw, backend.name, context_length=context_length(status, raw))

    async def deliver(self, raw: bytes) -> Kind:
        """A whole answer: check it is one (a 200 with garbage fails over), then pass its bytes on
        (not to a caller whose virtual key stopped working meanwhile: Unauthorized)."""
        call = self.call
        if not key_live(call):
            raise revoked()
        try:
            whole = self.leg.whole(raw, call.cache.capture, call.body)
        except NotAnAnswer as exc:
            raise AttemptFailed(UpstreamError(str(exc)), Kind.MALFORMED) from None
        self.claim()
        if whole.record is not None and call.affinity is not None:
            await call.affinity.learn(whole.record, self.backend.name)  # before the client sees its ids
        call.cache.entry = whole.entry
        if whole.usage is not None:
            call.out.usage = whole.usage
        call.out.finish = Finish.OK
        if call.cache.land is not None:  # a flight's leader: its followers have it before its client does
            await call.cache.land()
        await client_write(self.sink.send(200, raw if whole.body is None else whole.body))
        return Kind.OK

    def claim(self) -> None:
        """Take the client for this backend (first content token, or a whole answer); raise Lost
        when a hedged rival already has it. Synchronous: check-and-set cannot interleave on one loop."""
        progress, name = self.progress, self.backend.name
        if progress.owner is not None and progress.owner != name:
            raise Lost()
        progress.owner = name
        self.call.out.backend = name
        self.sink.set_header("x-gateway-backend", name)
        if progress.rivals:
            me = asyncio.current_task()
            for task in progress.rivals:
                if task is not me:
                    task.cancel()  # the loser's upstream connection closes at once
            self._won_race()

    def _won_race(self) -> None:
        """This attempt answers first of hedged rivals: the call's stages are its own (the hedge's
        stamps are not the primary's: its delay showed as the gateway's own time), and a hedge
        that answers instead of an affinity hit's holder makes the hit a spill (base._started
        leaves a hedge's start alone)."""
        call, name = self.call, self.backend.name
        call.timing.sent_at, call.timing.headers_at = self.sent_at, self.headers_at
        d = call.out.affinity
        if d is not None and d.result is AffinityResult.HIT and d.backend != name:
            call.out.affinity = d = replace(d, result=AffinityResult.SPILL, backend=name,
                                            reason=f"{d.reason}; then a hedge on {name} answered first")
            self.sink.set_header("x-gateway-affinity", d.result.value)

    def observe_content(self, last: float, *, client: bool = True) -> float:
        """A content event arrived now: an inter-token gap since `last`, or (the first) a TTFT
        sample for the backend and, when `client`, for the call. Returns now, the next `last`."""
        now = time.perf_counter()
        m, tracker = self.m, self.tracker
        if last:
            m.inter_token.observe(now - last)
            tracker.observe_itl(now - last)
        else:
            call = self.call
            tracker.observe_ttft(now - self.started, prompt_tokens=call.prompt_tokens,
                                 tenant=None if call.tenant is None else call.tenant.name)
            if client:
                call.timing.ttft_s = now - call.timing.t0
                m.ttft.observe(call.timing.ttft_s)
        return now

    def failed(self, summary: str, kind: Kind, detail: str, status: int | None = None) -> AttemptFailed:
        """A failure before the first byte, told two ways: the client's message has `summary`, the
        kind of failure (`connect failed`, `HTTP 500`); the upstream's address, the OS error or its
        body (`detail`) go to the log only, with the request id, so a caller learns nothing about
        the network behind the gateway."""
        log.info("request %s: backend %r failed (%s): %s", self.call.request_id, self.backend.name, kind.label(status), detail)
        return AttemptFailed(UpstreamError(summary, upstream_status=status), kind, status)

    def caller_deadline(self) -> AttemptFailed:
        """The request's own deadline passed: the caller's choice, not the backend's failure."""
        err = UpstreamTimeout(
            f"the request's deadline of {self.call.timeout_ms()} ms (x-request-timeout-ms or server.request_timeout_ms) "
            f"passed before backend {self.backend.name!r} answered"
        )
        return AttemptFailed(err, Kind.CALLER_DEADLINE)


async def client_write(aw: Awaitable[None]) -> None:
    try:
        await aw
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        raise ClientGone() from None


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
