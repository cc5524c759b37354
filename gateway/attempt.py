"""One attempt: a request to one backend, until its answer reached the client or it failed.

A failure before the first content byte raises AttemptFailed (the relay may fail over); after it,
the stream raises Cut (the relay may continue the answer elsewhere, see continuation.py, or ends
it with an error event and no [DONE]). Stream events pass through as
the bytes the backend sent; events before the first content token are held back and released
with it, so a stream that stalls or fails early costs the client nothing but time.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field

import orjson

from .admission import Admission
from .backends import Backend
from .cache import SingleFlight
from .cache_entry import StreamAssembler, entry_from_response
from .call import CacheResult, Call, Finish
from .continuation import Mismatch, Resume
from .errors import GatewayError, RateLimited, Unavailable, UpstreamError, UpstreamRejected, UpstreamTimeout
from .health import Kind
from .metrics import BackendMetrics, Metrics
from .policy import RoutingPolicy
from .sink import Sink
from .upstream_http import (
    UpstreamConnectError,
    UpstreamHTTPError,
    UpstreamMaybeSent,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTooLarge,
)
from .wire import SSE_DONE, SSEDecoder, SSEEventTooLarge, event_data

__all__ = [
    "AttemptFailed", "ClientGone", "Cut", "Lost", "Progress", "RelayContext",
    "attempt", "caller_deadline", "claim", "client_write", "failed", "observe_content", "parse_event",
]

log = logging.getLogger("gateway.relay")

_AFTER_FINISH_S = 2.0  # how long to wait for a usage chunk or [DONE] after the finish reason
_DEFAULT_COOLDOWN_S = 1.0  # a 429/503 without Retry-After still pauses that backend briefly
_ERROR_SNIPPET = 300
# Nothing a backend sends is unbounded: past these, the attempt fails with a 502 naming the backend.
MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streamed answer (large embedding batches included)
MAX_HELD_BYTES = 1024 * 1024  # stream events held back before the first content token


class ClientGone(Exception):
    """The client disconnected; the upstream request is abandoned."""


class Cut(Exception):
    """A stream broke after content reached the client (nothing was written about it yet)."""

    def __init__(self, err: GatewayError, kind: str) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind  # cut_mid_stream, too_large, error_event_mid_stream or caller_deadline


class AttemptFailed(Exception):
    """A backend failed before anything reached the client: the next candidate may take over."""

    def __init__(self, err: GatewayError, kind: str, status: int | None = None) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = Kind(kind)  # a key of health.OUTCOMES: how the failure is accounted
        self.status = status  # the upstream's HTTP status, when it answered one

    @property
    def label(self) -> str:
        return self.kind.label(self.status)


@dataclass(slots=True)
class Progress:
    first_sent: bool = False  # a content event reached the client: no more failover
    owner: str | None = None  # the backend whose answer the client gets (first content, or whole body)
    rivals: list[asyncio.Task[bool]] | None = None  # hedged attempts: the owner cancels the others
    cut: Cut | None = None  # the owner's stream broke mid-answer: the relay continues or ends it


class Lost(Exception):
    """A hedged attempt whose rival reached the client first."""


@dataclass(slots=True)
class RelayContext:
    """What every request shares in one process (the upstream pool, metrics, single flight).
    Policy settings come with each request's Route instead, so a reload never changes them mid-request."""

    pool: UpstreamPool
    metrics: Metrics
    flight: SingleFlight = field(default_factory=SingleFlight)
    # The process-wide admission gate: it outlives reloads (they change its limits, not its queue).
    admission: Admission = field(default_factory=lambda: Admission(1024, 4096))
    # Relays going on for single-flight followers after their leader's client left (pipeline._lead):
    # a shutdown that runs out of time cancels them before the pool closes.
    carried: set[asyncio.Task[None]] = field(default_factory=set)

    async def cancel_carried(self) -> None:
        """Cancel the relays still going on for followers, and wait until they have ended."""
        tasks = list(self.carried)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def claim(progress: Progress, backend: Backend, call: Call, sink: Sink) -> None:
    """Take the client for `backend` (first content token, or a whole answer); raise Lost when a
    hedged rival already has it. Synchronous: check-and-set cannot interleave on one loop."""
    if progress.owner is not None and progress.owner != backend.name:
        raise Lost()
    progress.owner = backend.name
    call.backend = backend.name
    sink.set_header("x-gateway-backend", backend.name)
    if progress.rivals:
        me = asyncio.current_task()
        for task in progress.rivals:
            if task is not me:
                task.cancel()  # the loser's upstream connection closes at once


async def attempt(
    call: Call,
    backend: Backend,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    started: float,
    live_deadline: RoutingPolicy | None,
    *,
    cold_s: float | None = None,
    resume: Resume | None = None,
) -> str:
    """Send the request; returns the outcome kind (health.OUTCOMES) once the client has its whole
    answer ("ok"). Raises AttemptFailed to fail over, UpstreamRejected to pass a 4xx back, Cut when
    a stream broke after content reached the client, ClientGone when the client left.

    `live_deadline`: the rule for first-token and stall deadlines from live data while another
    backend could take over (None: the backend's fixed timeouts); `cold_s`: the first-token
    deadline while this backend has too few samples; `resume`: continue a broken stream."""
    loop = asyncio.get_running_loop()
    t = backend.timeouts
    now = loop.time()
    call_deadline = now + call.remaining_s()
    first_s = t.first_token_ms / 1000
    if live_deadline is not None:  # a stuck backend is abandoned after ~2x its live P95, not a fixed timeout
        rp = live_deadline
        first_s = backend.tracker.first_token_deadline_s(
            first_s, rp.deadline_floor_ms / 1000, prompt_tokens=call.prompt_tokens, mult=rp.deadline_p95_multiplier,
            cold_s=cold_s,
        )
    first_deadline = min(now + first_s, call_deadline)
    url = backend.urls[call.endpoint.name]
    upstream_model = backend.upstream_model(call.model)
    if resume is None:
        body = call.body_for(upstream_model)
    else:
        body = resume.body(call.body, upstream_model, call.endpoint.name)
    headers = {**backend.headers, "X-Request-Id": call.request_id}
    resp: UpstreamResponse | None = None
    raw = b""
    timer = asyncio.timeout_at(first_deadline)  # one timer per attempt, moved as the phases change
    call.sent_at = time.perf_counter()  # Server-Timing's stages (observe.py)
    try:
        async with timer:
            resp = await ctx.pool.post(url, body, headers, connect_timeout_s=t.connect_ms / 1000)
            call.headers_at = time.perf_counter()
            if resp.status == 200 and not call.stream:
                timer.reschedule(min(now + t.total_ms / 1000, call_deadline))
                raw = await resp.read(max_bytes=MAX_BODY_BYTES)
    except TimeoutError:
        if resp is not None:
            resp.close()
        if call.deadline_passed():
            raise caller_deadline(call, backend) from None
        if resp is None:
            raise AttemptFailed(UpstreamTimeout(f"no response within {_ms(first_deadline - now)} ms"), "timeout") from None
        raise AttemptFailed(UpstreamTimeout("the answer did not complete in time"), "timeout") from None
    except UpstreamConnectError as exc:
        raise failed(call, backend, exc.summary, "connect", f"{url}: {exc}") from None
    except UpstreamTooLarge as exc:
        if resp is not None:
            resp.close()
        raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "too_large") from None
    except (UpstreamHTTPError, OSError) as exc:
        detail = f"{url}: {type(exc).__name__}: {exc}"
        if resp is not None:
            resp.close()
            raise failed(call, backend, "connection lost while reading the answer", "disconnect", detail) from None
        if isinstance(exc, UpstreamMaybeSent):
            # The request left and may have been processed (and billed): an attempt, never resent.
            raise failed(call, backend, exc.summary, "reset_before_headers", detail) from None
        summary = exc.summary if isinstance(exc, UpstreamHTTPError) else "connect failed"
        raise failed(call, backend, summary, "connect", detail) from None
    kind = "failed"
    try:
        if resp.status != 200:
            await _refuse(resp, backend, call, first_deadline)
        if call.endpoint.name == "responses":
            from .responses_stream import answer  # imported here: that module builds on this one

            kind = await answer(call, backend, resp, raw, ctx, sink, progress, started, first_deadline, call_deadline)
        elif call.stream:
            idle_s = t.idle_ms / 1000
            if live_deadline is not None and call.transcript is not None:  # a stall can be rescued: notice it sooner
                rp = live_deadline
                idle_s = backend.tracker.idle_deadline_s(
                    idle_s, rp.idle_floor_ms / 1000, rp.cold_idle_ms / 1000, mult=rp.idle_p99_multiplier
                )
            kind = await _stream(call, backend, resp, ctx, sink, progress, started, first_deadline, call_deadline, idle_s, resume)
        else:
            await _deliver(call, backend, raw, sink, progress)
            kind = "ok"
        return kind
    finally:
        if kind == "ok":
            resp.release()
        else:
            resp.close()  # never leave a half-read or cancelled upstream on the pool


def failed(call: Call, backend: Backend, summary: str, kind: str, detail: str, status: int | None = None) -> AttemptFailed:
    """A failure before the first byte, told two ways: the client's message has `summary`, the
    kind of failure (`connect failed`, `HTTP 500`); the upstream's address, the OS error or its
    body (`detail`) go to the log only, with the request id, so a caller learns nothing about
    the network behind the gateway."""
    log.info("request %s: backend %r failed (%s): %s", call.request_id, backend.name, kind, detail)
    return AttemptFailed(UpstreamError(summary, upstream_status=status), kind, status)


def caller_deadline(call: Call, backend: Backend) -> AttemptFailed:
    """The request's own deadline passed: the caller's choice, not the backend's failure."""
    err = UpstreamTimeout(
        f"the request's deadline of {call.timeout_ms()} ms (x-request-timeout-ms or server.request_timeout_ms) "
        f"passed before backend {backend.name!r} answered"
    )
    return AttemptFailed(err, "caller_deadline")


# How providers word a prompt that does not fit (the OpenAI code, else the message).
_CONTEXT_LENGTH = re.compile(
    r"context[ _-]?length|context window|maximum context|prompt is too long|too many (input )?tokens", re.IGNORECASE
)


def _context_length(status: int, raw: bytes) -> bool:
    """Whether a 4xx says the prompt (plus max_tokens) exceeds the model's context window."""
    if status not in (400, 413, 422):
        return False
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return bool(_CONTEXT_LENGTH.search(raw[:2000].decode("utf-8", "replace")))
    if not isinstance(err, dict):
        return False
    if err.get("code") == "context_length_exceeded":
        return True
    return bool(_CONTEXT_LENGTH.search(str(err.get("message") or "")))


async def _refuse(resp: UpstreamResponse, backend: Backend, call: Call, deadline: float) -> None:
    """Turn a non-200 answer into a failover (raise AttemptFailed) or a pass-back (UpstreamRejected)."""
    status = resp.status
    raw = b""
    try:
        async with asyncio.timeout_at(deadline):
            while len(raw) < 64 * 1024:  # enough to explain the error; never buffer a huge one
                chunk = await resp.readany()
                if not chunk:
                    break
                raw += chunk
    except (TimeoutError, UpstreamHTTPError):
        pass
    snippet = raw[:_ERROR_SNIPPET].decode("utf-8", "replace")
    if status in (429, 503):
        retry_after = _retry_after(resp.headers.get("Retry-After"))
        pause = retry_after if retry_after is not None else _DEFAULT_COOLDOWN_S
        # Per upstream model: a provider's 429 on one model leaves its other models alone.
        backend.health_for(call.model).cool_down(pause)
        log.info("request %s: backend %r model %r answered HTTP %s: cooling down for %gs",
                 call.request_id, backend.name, backend.upstream_model(call.model), status, pause)
        cls = RateLimited if status == 429 else Unavailable
        err = cls(f"HTTP {status} (retry after {pause:g}s)", retry_after_s=retry_after)
        # A backend that asks for a pause is busy: it cools down (429 is not a failure, see health.OUTCOMES).
        raise AttemptFailed(err, Kind.http(status), status)
    if status >= 500 or status in (401, 403, 404, 405, 408):
        # Our key, our model name, the path, or the backend itself is wrong: another backend may
        # do better. Whether it counts against this one's health: health.OUTCOMES.
        raise failed(call, backend, f"HTTP {status}", Kind.http(status), f"HTTP {status}: {snippet}", status)
    raise UpstreamRejected(status, raw, backend.name, context_length=_context_length(status, raw))


async def _deliver(call: Call, backend: Backend, raw: bytes, sink: Sink, progress: Progress) -> None:
    """Check a whole answer is an answer (a 200 with garbage fails over), then pass its bytes on."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or ("choices" not in obj and "data" not in obj):
        raise AttemptFailed(UpstreamError("the backend answered 200 with a malformed body"), "malformed")
    claim(progress, backend, call, sink)
    if call.capture:
        call.entry = entry_from_response(raw, call.capture)
    usage = obj.get("usage")
    if isinstance(usage, dict):
        call.usage = usage
    call.finish = Finish.OK
    await client_write(sink.send(200, raw))


async def _stream(
    call: Call,
    backend: Backend,
    resp: UpstreamResponse,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    started: float,
    first_deadline: float,
    call_deadline: float,
    idle_s: float,
    resume: Resume | None,
) -> str:
    """Pass a stream through event by event, as bytes (a continuation's events are re-encoded, see
    continuation.py). Returns "ok" when it ended properly; raises Cut when it broke after content
    reached the client, AttemptFailed before."""
    loop = asyncio.get_running_loop()
    m = ctx.metrics.for_backend(backend.name)
    decoder = SSEDecoder()
    assembler = StreamAssembler(call.capture) if call.capture else None  # the answer, for the cache
    transcript = call.transcript
    held: list[bytes] = []  # events before the first content token, released with it
    held_bytes = 0
    first = finished = saw_done = False
    last_content = 0.0
    timer = asyncio.timeout_at(first_deadline)
    cut: str | None = None
    kind = "ok"
    try:
        async with timer:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    break
                out: list[bytes] = []
                for ev in decoder.feed(chunk):
                    data = event_data(ev)
                    if data is None:  # a comment: keep-alives mean nothing before the first token
                        if first:
                            out.append(ev)
                        continue
                    if data == b"[DONE]":
                        saw_done = True
                        break
                    obj = parse_event(data, m)
                    if obj is None:
                        continue
                    if "error" in obj:
                        e = obj["error"]
                        msg = e.get("message") if isinstance(e, dict) else e
                        if not first:
                            raise AttemptFailed(UpstreamError(f"error event before the first token: {msg}"), "error_event")
                        cut, kind = f"backend {backend.name!r} sent an error event mid-stream: {msg}", "error_event_mid_stream"
                        break
                    upstream_content = _has_content(obj)
                    if upstream_content:
                        # A continuation's first token is the backend's TTFT, not the client's.
                        last_content = observe_content(call, backend, m, started, last_content, client=resume is None)
                    if resume is not None:
                        ev, obj = _rewritten(resume, obj, ev)
                        if obj is None:
                            continue
                    content = upstream_content and (resume is None or _has_content(obj))
                    if any(isinstance(c, dict) and c.get("finish_reason") for c in obj.get("choices") or ()):
                        finished = True
                    if assembler is not None:
                        assembler.feed(obj)
                    usage = obj.get("usage")
                    if isinstance(usage, dict):
                        call.usage = usage
                        if call.strip_usage and not obj.get("choices"):
                            continue  # the usage chunk the gateway asked for, not the client
                    if content:
                        call.streamed_tokens += 1
                        if not first:
                            claim(progress, backend, call, sink)
                    if transcript is not None:
                        transcript.note(obj, backend.name)
                    if first:
                        out.append(ev)
                    else:
                        held.append(ev)
                        held_bytes += len(ev)
                        if held_bytes > MAX_HELD_BYTES and not (content or finished):
                            raise AttemptFailed(
                                UpstreamError(f"backend {backend.name!r} sent over {MAX_HELD_BYTES} bytes before its first token"),
                                "too_large",
                            )
                        if content or finished:
                            if not content:
                                claim(progress, backend, call, sink)  # an empty answer: its finish is its first byte
                            first = progress.first_sent = True
                            out, held = held, []
                if out:
                    await client_write(sink.write(b"".join(out)))
                if saw_done or cut is not None:
                    break
                if first:
                    timer.reschedule(min(loop.time() + (_AFTER_FINISH_S if finished else idle_s), call_deadline))
    except Mismatch as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "mismatch") from None
        raise  # cannot happen: text is only sent once the prefix matched
    except TimeoutError:
        if call.deadline_passed():
            if not first:
                raise caller_deadline(call, backend) from None
            cut, kind = f"the request's deadline of {call.timeout_ms()} ms passed mid-stream", "caller_deadline"
        elif not first:
            raise AttemptFailed(
                UpstreamTimeout(f"no first token within {_ms(first_deadline - loop.time() + (time.perf_counter() - started))} ms"),
                "first_token_timeout",
            ) from None
        else:
            cut, kind = None if finished else f"backend {backend.name!r} stalled for more than {_ms(idle_s)} ms mid-stream", "cut_mid_stream"
    except SSEEventTooLarge as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "too_large") from None
        cut, kind = f"backend {backend.name!r}: {exc}", "too_large"
    except UpstreamHTTPError as exc:
        if not first:
            detail = f"{type(exc).__name__}: {exc}"
            raise failed(call, backend, f"{exc.summary} before the first token", "disconnect", detail) from None
        cut, kind = None if finished else f"backend {backend.name!r} lost its connection mid-stream", "cut_mid_stream"
    else:
        if cut is None and not saw_done and not finished:
            if not first:
                raise AttemptFailed(UpstreamError("the stream ended before the first token"), "cut")
            cut, kind = f"backend {backend.name!r} ended its stream before its finish reason", "cut_mid_stream"
    if cut is not None:
        # Nothing is written about it here: the relay continues the answer elsewhere, or ends the
        # stream with an error event (never [DONE]: a cut stream must not look like a success).
        err: GatewayError = UpstreamTimeout(cut) if kind == "caller_deadline" else UpstreamError(cut)
        raise Cut(err, kind)
    if not saw_done:
        m.error("missing_done")  # completed by the gateway
    if assembler is not None:
        call.entry = assembler.entry()
    call.finish = Finish.OK
    await client_write(sink.write(SSE_DONE))
    await client_write(sink.end())
    return "ok"


def parse_event(data: bytes, m: BackendMetrics) -> dict | None:
    """One SSE event's JSON object; None (counted as malformed) when it is not one."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        m.malformed.inc()
        return None
    return obj


def observe_content(call: Call, backend: Backend, m: BackendMetrics, started: float, last: float, *, client: bool = True) -> float:
    """A content event arrived now: an inter-token gap since `last`, or (the first) a TTFT sample
    for the backend and, when `client`, for the call. Returns now, the next `last`."""
    now = time.perf_counter()
    if last:
        m.inter_token.observe(now - last)
        backend.tracker.observe_itl(now - last)
    else:
        backend.tracker.observe_ttft(now - started, prompt_tokens=call.prompt_tokens)
        if client:
            call.ttft_s = now - call.t0
            m.ttft.observe(call.ttft_s)
    return now


def _has_content(obj: dict) -> bool:
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("tool_calls") or delta.get("function_call") or delta.get("refusal"):
                return True
        elif choice.get("text"):
            return True
    return False


def _rewritten(resume: Resume, obj: dict, ev: bytes) -> tuple[bytes, dict | None]:
    """A continuation's event as the client gets it (None: dropped)."""
    out = resume.rewrite(obj)
    if out is None:
        return ev, None
    return b"data: " + orjson.dumps(out) + b"\n\n", out


async def client_write(aw: object) -> None:
    try:
        await aw  # type: ignore[misc]
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        raise ClientGone() from None


def _retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return None  # an HTTP date: rare from LLM APIs; fall back to the default pause


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
