"""The upstream call: failover before the first byte, stream passthrough, TTFT stamps.

The relay *reports* outcomes (to each backend's tracker and health); it does not decide ejection.
Nothing is retried once a content byte reached the client. Until then, a stream's events are held
back under the first-token deadline, so a backend that stalls or fails before its first token costs
the client nothing but time: the next candidate takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from .backends import Backend
from .call import Call
from .errors import (
    AllBackendsFailed,
    GatewayError,
    RateLimited,
    Unavailable,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
)
from .metrics import Metrics
from .policy import ServerPolicy
from .sink import Sink
from .upstream_http import UpstreamConnectError, UpstreamHTTPError, UpstreamPool, UpstreamResponse
from .wire import SSE_DONE, SSE_HEARTBEAT, SSEDecoder, event_data

__all__ = ["relay", "ClientGone"]

_AFTER_FINISH_S = 2.0  # how long to wait for a usage chunk or [DONE] after the finish reason
_DEFAULT_COOLDOWN_S = 1.0  # a 429/503 without Retry-After still pauses that backend briefly
_ERROR_SNIPPET = 300


class ClientGone(Exception):
    """The client disconnected; the upstream request is abandoned."""


class _AttemptFailed(Exception):
    """A backend failed before anything reached the client: the next candidate may take over."""

    def __init__(self, err: GatewayError, kind: str, *, counts_against_health: bool = True) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind
        self.counts_against_health = counts_against_health


@dataclass(slots=True)
class _Progress:
    first_sent: bool = False  # a content event reached the client: no more failover


@dataclass(slots=True)
class RelayContext:
    pool: UpstreamPool
    metrics: Metrics
    server: ServerPolicy


def _order(candidates: Sequence[Backend]) -> list[Backend]:
    """Healthy backends in policy order, then the ejected ones as a last resort."""
    healthy = [b for b in candidates if b.health.healthy]
    return healthy + [b for b in candidates if not b.health.healthy]


async def relay(call: Call, candidates: Sequence[Backend], ctx: RelayContext, sink: Sink) -> None:
    """Answer `call` from the first candidate that works; raise AllBackendsFailed otherwise."""
    progress = _Progress()
    failures: list[tuple[str, GatewayError]] = []
    full: list[Backend] = []
    heartbeat = asyncio.create_task(_heartbeat(sink, ctx.server, progress)) if call.stream else None
    try:
        attempts = 0
        for backend in _order(candidates):
            if attempts >= ctx.server.max_attempts or call.remaining_s() <= 0:
                break
            if not backend.health.ready:
                failures.append((backend.name, Unavailable("the backend is starting", retry_after_s=5)))
                continue
            cooling = backend.health.cooling_for()
            if cooling > 0:
                failures.append((backend.name, RateLimited(f"asked us to back off for {cooling:.1f}s more", retry_after_s=cooling)))
                continue
            if not backend.slots.try_acquire():
                full.append(backend)
                continue
            attempts += 1
            if await _try(call, backend, ctx, sink, progress, failures):
                return
        if attempts == 0 and full:
            # Every candidate is at its max_concurrency: queue for the first one, within the deadline.
            backend = full[0]
            started = time.perf_counter()
            got = await backend.slots.acquire(min(call.remaining_s(), backend.timeouts.first_token_ms / 1000))
            waited = time.perf_counter() - started
            call.queue_ms += waited * 1000
            ctx.metrics.queue_wait.observe(waited)
            sink.set_header("x-gateway-queue-ms", f"{call.queue_ms:.1f}")
            if got and await _try(call, backend, ctx, sink, progress, failures):
                return
            if not got:
                failures.extend((b.name, Unavailable("at max_concurrency", retry_after_s=1)) for b in full)
        raise AllBackendsFailed(failures, deadline_hit=call.remaining_s() <= 0)
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await heartbeat


async def _try(
    call: Call,
    backend: Backend,
    ctx: RelayContext,
    sink: Sink,
    progress: _Progress,
    failures: list[tuple[str, GatewayError]],
) -> bool:
    """One attempt on a backend whose slot we hold. True when the call is answered (or lost to
    a mid-stream failure, which is answered with an error event)."""
    m = ctx.metrics.for_backend(backend.name)
    tracker = backend.tracker
    tracker.inflight += 1
    m.inflight.inc()
    started = time.perf_counter()
    if call.attempts:
        m.failovers.inc()
    call.attempts.append(backend.name)
    call.backend = backend.name
    sink.set_header("x-gateway-backend", backend.name)
    try:
        ok = await _attempt(call, backend, ctx, sink, progress, started)
    except _AttemptFailed as failed:
        failures.append((backend.name, failed.err))
        m.error(failed.kind)
        tracker.observe_done(time.perf_counter() - started, ok=False)
        if failed.counts_against_health:
            backend.health.report_failure()
        return False
    except UpstreamRejected:
        tracker.observe_done(time.perf_counter() - started, ok=True)  # the backend itself is fine
        raise
    finally:
        tracker.inflight -= 1
        m.inflight.dec()
        backend.slots.release()
    tracker.observe_done(time.perf_counter() - started, ok=ok)
    if ok:
        backend.health.report_success()
    else:
        backend.health.report_failure()
    return True


async def _attempt(
    call: Call, backend: Backend, ctx: RelayContext, sink: Sink, progress: _Progress, started: float
) -> bool:
    """Send the request; True when answered in full, False when a stream failed after its first
    token (the client got an error event). Raises _AttemptFailed to fail over."""
    loop = asyncio.get_running_loop()
    t = backend.timeouts
    now = loop.time()
    call_deadline = now + call.remaining_s()
    first_deadline = min(now + t.first_token_ms / 1000, call_deadline)
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
                raw = await resp.read()
    except TimeoutError:
        if resp is None:
            raise _AttemptFailed(UpstreamTimeout(f"no response within {_ms(first_deadline - now)} ms"), "timeout") from None
        resp.close()
        raise _AttemptFailed(UpstreamTimeout("the answer did not complete in time"), "timeout") from None
    except UpstreamConnectError as exc:
        raise _AttemptFailed(UpstreamError(f"cannot connect to {url}: {exc}"), "connect") from None
    except (UpstreamHTTPError, OSError) as exc:
        if resp is not None:
            resp.close()
            raise _AttemptFailed(UpstreamError(f"connection lost while reading the answer: {exc}"), "disconnect") from None
        raise _AttemptFailed(UpstreamError(f"request failed: {type(exc).__name__}: {exc}"), "connect") from None
    done = False
    try:
        if resp.status != 200:
            await _refuse(resp, backend, first_deadline)
        if call.stream:
            done = await _stream(call, backend, resp, ctx, sink, progress, started, first_deadline, call_deadline)
        else:
            await _deliver(call, raw, sink)
            done = True
        return done
    finally:
        if done:
            resp.release()
        else:
            resp.close()  # never leave a half-read or cancelled upstream on the pool


async def _refuse(resp: UpstreamResponse, backend: Backend, deadline: float) -> None:
    """Turn a non-200 answer into a failover (raise _AttemptFailed) or a pass-back (UpstreamRejected)."""
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
        # A backend that asks for a pause is busy, not broken: it cools down, it is not ejected.
        raise _AttemptFailed(err, f"http_{status}", counts_against_health=status == 503)
    if status >= 500 or status in (401, 403, 404, 408):
        # Our key, our model name, or the backend itself is wrong: another backend may do better.
        raise _AttemptFailed(UpstreamError(f"HTTP {status}: {snippet}"), f"http_{status}")
    raise UpstreamRejected(status, raw, backend.name)


async def _deliver(call: Call, raw: bytes, sink: Sink) -> None:
    """Check a whole answer is an answer (a 200 with garbage fails over), then pass its bytes on."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or ("choices" not in obj and "data" not in obj):
        raise _AttemptFailed(UpstreamError("the backend answered 200 with a malformed body"), "malformed")
    usage = obj.get("usage")
    if isinstance(usage, dict):
        call.usage = usage
    call.finish = "ok"
    await _client_write(sink.send(200, raw))


async def _stream(
    call: Call,
    backend: Backend,
    resp: UpstreamResponse,
    ctx: RelayContext,
    sink: Sink,
    progress: _Progress,
    started: float,
    first_deadline: float,
    call_deadline: float,
) -> bool:
    """Pass a stream through event by event, as bytes. True when it ended properly."""
    loop = asyncio.get_running_loop()
    m = ctx.metrics.for_backend(backend.name)
    idle_s = backend.timeouts.idle_ms / 1000
    itl_hist = m.inter_token
    decoder = SSEDecoder()
    held: list[bytes] = []  # events before the first content token, released with it
    first = finished = saw_done = error_event = False
    last_content = 0.0
    timer = asyncio.timeout_at(first_deadline)
    cut: str | None = None
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
                            raise _AttemptFailed(UpstreamError(f"error event before the first token: {msg}"), "error_event")
                        out.append(ev)
                        error_event = True
                        break
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
                    if content:
                        now = time.perf_counter()
                        if last_content:
                            itl_hist.observe(now - last_content)
                            backend.tracker.observe_itl(now - last_content)
                        else:
                            call.ttft_s = now - call.t0
                            backend.tracker.observe_ttft(now - started)
                            m.ttft.observe(call.ttft_s)
                        last_content = now
                    if first:
                        out.append(ev)
                    else:
                        held.append(ev)
                        if content or finished:
                            first = progress.first_sent = True
                            out, held = held, []
                if out:
                    await _client_write(sink.write(b"".join(out)))
                if saw_done or error_event:
                    break
                if first:
                    timer.reschedule(min(loop.time() + (_AFTER_FINISH_S if finished else idle_s), call_deadline))
    except TimeoutError:
        if not first:
            raise _AttemptFailed(
                UpstreamTimeout(f"no first token within {_ms(first_deadline - loop.time() + (time.perf_counter() - started))} ms"),
                "first_token_timeout",
            ) from None
        cut = None if finished else f"the stream stalled for more than {backend.timeouts.idle_ms} ms"
    except UpstreamHTTPError as exc:
        if not first:
            raise _AttemptFailed(UpstreamError(f"connection lost before the first token: {exc}"), "disconnect") from None
        cut = None if finished else "the backend's connection was lost mid-stream"
    else:
        if error_event:
            m.error("error_event_mid_stream")
            call.finish = "error"
            await _client_write(sink.end())
            return False
        if not saw_done and not finished:
            if not first:
                raise _AttemptFailed(UpstreamError("the stream ended before the first token"), "cut")
            cut = "the backend's stream ended before its finish reason"
    if cut is not None:
        # A cut stream is never presented as a success: an error event, and no [DONE].
        m.error("cut_mid_stream")
        call.finish = "cut"
        await _client_write(sink.fail(UpstreamError(cut)))
        return False
    if not saw_done:
        m.error("missing_done")  # completed by the gateway
    call.finish = "ok"
    await _client_write(sink.write(SSE_DONE))
    await _client_write(sink.end())
    return True


async def _heartbeat(sink: Sink, server: ServerPolicy, progress: _Progress) -> None:
    """SSE comments while a stream waits for its first token, so idle-timeout proxies keep it open.

    They start only after heartbeat_after_ms: a fast failure still gets a real HTTP status."""
    await asyncio.sleep(server.heartbeat_after_ms / 1000)
    while not progress.first_sent:
        await sink.write(SSE_HEARTBEAT)
        await asyncio.sleep(server.heartbeat_interval_ms / 1000)


async def _client_write(aw: object) -> None:
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
