"""One attempt: a request to one backend, until its answer reached the client or it failed.

A failure before the first content byte raises AttemptFailed (the relay may fail over); after it,
the client gets an error event and the stream ends without [DONE]. Stream events pass through as
the bytes the backend sent; events before the first content token are held back and released
with it, so a stream that stalls or fails early costs the client nothing but time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

from .admission import Admission
from .backends import Backend
from .cache import SingleFlight
from .cache_entry import StreamAssembler, entry_from_response
from .call import Call
from .errors import GatewayError, RateLimited, Unavailable, UpstreamError, UpstreamRejected, UpstreamTimeout
from .metrics import Metrics
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

__all__ = ["AttemptFailed", "ClientGone", "Lost", "Progress", "RelayContext", "attempt", "claim", "client_write"]

_AFTER_FINISH_S = 2.0  # how long to wait for a usage chunk or [DONE] after the finish reason
_DEFAULT_COOLDOWN_S = 1.0  # a 429/503 without Retry-After still pauses that backend briefly
_ERROR_SNIPPET = 300
# Nothing a backend sends is unbounded: past these, the attempt fails with a 502 naming the backend.
MAX_BODY_BYTES = 64 * 1024 * 1024  # a non-streamed answer (large embedding batches included)
MAX_HELD_BYTES = 1024 * 1024  # stream events held back before the first content token


class ClientGone(Exception):
    """The client disconnected; the upstream request is abandoned."""


class AttemptFailed(Exception):
    """A backend failed before anything reached the client: the next candidate may take over."""

    def __init__(self, err: GatewayError, kind: str) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind  # a key of health.OUTCOMES: how the failure is accounted


@dataclass(slots=True)
class Progress:
    first_sent: bool = False  # a content event reached the client: no more failover
    owner: str | None = None  # the backend whose answer the client gets (first content, or whole body)
    rivals: list[asyncio.Task[bool]] | None = None  # hedged attempts: the owner cancels the others


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
) -> str:
    """Send the request; returns the outcome kind (health.OUTCOMES) once the client has its answer:
    "ok", or a mid-stream failure the client got as an error event. Raises AttemptFailed to fail
    over, UpstreamRejected to pass a 4xx back, ClientGone when the client left."""
    loop = asyncio.get_running_loop()
    t = backend.timeouts
    now = loop.time()
    call_deadline = now + call.remaining_s()
    first_s = t.first_token_ms / 1000
    if live_deadline is not None:  # a stuck backend is abandoned after ~2x its live P95, not a fixed timeout
        rp = live_deadline
        first_s = backend.tracker.first_token_deadline_s(
            first_s, rp.deadline_floor_ms / 1000, prompt_tokens=call.prompt_tokens, mult=rp.deadline_p95_multiplier
        )
    first_deadline = min(now + first_s, call_deadline)
    url = backend.urls[call.endpoint.name]
    body = call.body_for(backend.upstream_model(call.model))
    headers = {**backend.headers, "X-Request-Id": call.request_id}
    resp: UpstreamResponse | None = None
    raw = b""
    timer = asyncio.timeout_at(first_deadline)  # one timer per attempt, moved as the phases change
    try:
        async with timer:
            resp = await ctx.pool.post(url, body, headers, connect_timeout_s=t.connect_ms / 1000)
            if resp.status == 200 and not call.stream:
                timer.reschedule(min(now + t.total_ms / 1000, call_deadline))
                raw = await resp.read(max_bytes=MAX_BODY_BYTES)
    except TimeoutError:
        if resp is not None:
            resp.close()
        if call.deadline_passed():
            raise _caller_deadline(call, backend) from None
        if resp is None:
            raise AttemptFailed(UpstreamTimeout(f"no response within {_ms(first_deadline - now)} ms"), "timeout") from None
        raise AttemptFailed(UpstreamTimeout("the answer did not complete in time"), "timeout") from None
    except UpstreamConnectError as exc:
        raise AttemptFailed(UpstreamError(f"cannot connect to {url}: {exc}"), "connect") from None
    except UpstreamTooLarge as exc:
        if resp is not None:
            resp.close()
        raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "too_large") from None
    except (UpstreamHTTPError, OSError) as exc:
        if resp is not None:
            resp.close()
            raise AttemptFailed(UpstreamError(f"connection lost while reading the answer: {exc}"), "disconnect") from None
        if isinstance(exc, UpstreamMaybeSent):
            # The request left and may have been processed (and billed): an attempt, never resent.
            raise AttemptFailed(UpstreamError(f"connection lost after the request was sent: {exc}"), "reset_before_headers") from None
        raise AttemptFailed(UpstreamError(f"request failed: {type(exc).__name__}: {exc}"), "connect") from None
    kind = "failed"
    try:
        if resp.status != 200:
            await _refuse(resp, backend, first_deadline)
        if call.endpoint.name == "responses":
            from .responses_stream import answer  # imported here: that module builds on this one

            kind = await answer(call, backend, resp, raw, ctx, sink, progress, started, first_deadline, call_deadline)
        elif call.stream:
            kind = await _stream(call, backend, resp, ctx, sink, progress, started, first_deadline, call_deadline)
        else:
            await _deliver(call, backend, raw, sink, progress)
            kind = "ok"
        return kind
    finally:
        if kind == "ok":
            resp.release()
        else:
            resp.close()  # never leave a half-read or cancelled upstream on the pool


def _caller_deadline(call: Call, backend: Backend) -> AttemptFailed:
    """The request's own deadline passed: the caller's choice, not the backend's failure."""
    err = UpstreamTimeout(
        f"the request's deadline of {call.timeout_ms()} ms (x-request-timeout-ms or server.request_timeout_ms) "
        f"passed before backend {backend.name!r} answered"
    )
    return AttemptFailed(err, "caller_deadline")


async def _refuse(resp: UpstreamResponse, backend: Backend, deadline: float) -> None:
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
        backend.health.cool_down(retry_after if retry_after is not None else _DEFAULT_COOLDOWN_S)
        cls = RateLimited if status == 429 else Unavailable
        err = cls(f"HTTP {status} (retry after {retry_after or _DEFAULT_COOLDOWN_S:g}s)", retry_after_s=retry_after)
        # A backend that asks for a pause is busy: it cools down (429 is not a failure, see health.OUTCOMES).
        raise AttemptFailed(err, f"http_{status}")
    if status >= 500 or status in (401, 403, 404, 405, 408):
        # Our key, our model name, the path, or the backend itself is wrong: another backend may
        # do better. Whether it counts against this one's health: health.OUTCOMES.
        raise AttemptFailed(UpstreamError(f"HTTP {status}: {snippet}"), f"http_{status}")
    raise UpstreamRejected(status, raw, backend.name)


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
    call.finish = "ok"
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
) -> str:
    """Pass a stream through event by event, as bytes. Returns the outcome kind: "ok" when it
    ended properly, else how it failed after the first token (the client got an error event)."""
    loop = asyncio.get_running_loop()
    m = ctx.metrics.for_backend(backend.name)
    idle_s = backend.timeouts.idle_ms / 1000
    itl_hist = m.inter_token
    decoder = SSEDecoder()
    assembler = StreamAssembler(call.capture) if call.capture else None  # the answer, for the cache
    held: list[bytes] = []  # events before the first content token, released with it
    held_bytes = 0
    first = finished = saw_done = error_event = False
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
                    try:
                        obj = orjson.loads(data)
                    except orjson.JSONDecodeError:
                        obj = None
                    if not isinstance(obj, dict):
                        m.malformed.inc()
                        continue
                    if "error" in obj:
                        if not first:
                            msg = obj["error"].get("message") if isinstance(obj["error"], dict) else obj["error"]
                            raise AttemptFailed(UpstreamError(f"error event before the first token: {msg}"), "error_event")
                        out.append(ev)
                        error_event = True
                        break
                    if assembler is not None:
                        assembler.feed(obj)
                    content = False
                    for choice in obj.get("choices") or ():
                        if not isinstance(choice, dict):
                            continue
                        delta = choice.get("delta")
                        if isinstance(delta, dict):
                            if delta.get("content") or delta.get("tool_calls") or delta.get("function_call") or delta.get("refusal"):
                                content = True
                        elif choice.get("text"):
                            content = True
                        if choice.get("finish_reason"):
                            finished = True
                    usage = obj.get("usage")
                    if isinstance(usage, dict):
                        call.usage = usage
                        if call.strip_usage and not obj.get("choices"):
                            continue  # the usage chunk the gateway asked for, not the client
                    if content:
                        call.streamed_tokens += 1
                        now = time.perf_counter()
                        if last_content:
                            itl_hist.observe(now - last_content)
                            backend.tracker.observe_itl(now - last_content)
                        else:
                            claim(progress, backend, call, sink)
                            call.ttft_s = now - call.t0
                            backend.tracker.observe_ttft(now - started, prompt_tokens=call.prompt_tokens)
                            m.ttft.observe(call.ttft_s)
                        last_content = now
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
                if saw_done or error_event:
                    break
                if first:
                    timer.reschedule(min(loop.time() + (_AFTER_FINISH_S if finished else idle_s), call_deadline))
    except TimeoutError:
        if call.deadline_passed():
            if not first:
                raise _caller_deadline(call, backend) from None
            cut, kind = f"the request's deadline of {call.timeout_ms()} ms passed mid-stream", "caller_deadline"
        elif not first:
            raise AttemptFailed(
                UpstreamTimeout(f"no first token within {_ms(first_deadline - loop.time() + (time.perf_counter() - started))} ms"),
                "first_token_timeout",
            ) from None
        else:
            cut, kind = None if finished else f"the stream stalled for more than {backend.timeouts.idle_ms} ms", "cut_mid_stream"
    except SSEEventTooLarge as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "too_large") from None
        cut, kind = f"backend {backend.name!r}: {exc}", "too_large"
    except UpstreamHTTPError as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"connection lost before the first token: {exc}"), "disconnect") from None
        cut, kind = None if finished else "the backend's connection was lost mid-stream", "cut_mid_stream"
    else:
        if error_event:
            call.finish = "error"
            await client_write(sink.end())
            return "error_event_mid_stream"
        if not saw_done and not finished:
            if not first:
                raise AttemptFailed(UpstreamError("the stream ended before the first token"), "cut")
            cut, kind = "the backend's stream ended before its finish reason", "cut_mid_stream"
    if cut is not None:
        # A cut stream is never presented as a success: an error event, and no [DONE].
        call.finish = "cut"
        err: GatewayError = UpstreamTimeout(cut) if kind == "caller_deadline" else UpstreamError(cut)
        await client_write(sink.fail(err))
        return kind
    if not saw_done:
        m.error("missing_done")  # completed by the gateway
    if assembler is not None:
        call.entry = assembler.entry()
    call.finish = "ok"
    await client_write(sink.write(SSE_DONE))
    await client_write(sink.end())
    return "ok"


async def client_write(aw: object) -> None:
    try:
        await aw  # type: ignore[misc]
    except ConnectionResetError:
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
