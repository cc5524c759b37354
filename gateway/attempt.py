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

from .backends import Backend
from .cache import SingleFlight
from .cache_entry import StreamAssembler, entry_from_response
from .call import Call
from .errors import GatewayError, RateLimited, Unavailable, UpstreamError, UpstreamRejected, UpstreamTimeout
from .metrics import Metrics
from .policy import RoutingPolicy
from .sink import Sink
from .upstream_http import UpstreamConnectError, UpstreamHTTPError, UpstreamPool, UpstreamResponse
from .wire import SSE_DONE, SSEDecoder, event_data

__all__ = ["AttemptFailed", "ClientGone", "Lost", "Progress", "RelayContext", "attempt", "claim", "client_write"]

_AFTER_FINISH_S = 2.0  # how long to wait for a usage chunk or [DONE] after the finish reason
_DEFAULT_COOLDOWN_S = 1.0  # a 429/503 without Retry-After still pauses that backend briefly
_ERROR_SNIPPET = 300


class ClientGone(Exception):
    """The client disconnected; the upstream request is abandoned."""


class AttemptFailed(Exception):
    """A backend failed before anything reached the client: the next candidate may take over."""

    def __init__(self, err: GatewayError, kind: str, *, counts_against_health: bool = True) -> None:
        super().__init__(err.message)
        self.err = err
        self.kind = kind
        self.counts_against_health = counts_against_health


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
) -> bool:
    """Send the request; True when answered in full, False when a stream failed after its first
    token (the client got an error event). Raises AttemptFailed to fail over."""
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
                raw = await resp.read()
    except TimeoutError:
        if resp is None:
            raise AttemptFailed(UpstreamTimeout(f"no response within {_ms(first_deadline - now)} ms"), "timeout") from None
        resp.close()
        raise AttemptFailed(UpstreamTimeout("the answer did not complete in time"), "timeout") from None
    except UpstreamConnectError as exc:
        raise AttemptFailed(UpstreamError(f"cannot connect to {url}: {exc}"), "connect") from None
    except (UpstreamHTTPError, OSError) as exc:
        if resp is not None:
            resp.close()
            raise AttemptFailed(UpstreamError(f"connection lost while reading the answer: {exc}"), "disconnect") from None
        raise AttemptFailed(UpstreamError(f"request failed: {type(exc).__name__}: {exc}"), "connect") from None
    done = False
    try:
        if resp.status != 200:
            await _refuse(resp, backend, first_deadline)
        if call.stream:
            done = await _stream(call, backend, resp, ctx, sink, progress, started, first_deadline, call_deadline)
        else:
            await _deliver(call, backend, raw, sink, progress)
            done = True
        return done
    finally:
        if done:
            resp.release()
        else:
            resp.close()  # never leave a half-read or cancelled upstream on the pool


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
        # A backend that asks for a pause is busy, not broken: it cools down, it is not ejected.
        raise AttemptFailed(err, f"http_{status}", counts_against_health=status == 503)
    if status >= 500 or status in (401, 403, 404, 408):
        # Our key, our model name, or the backend itself is wrong: another backend may do better.
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
) -> bool:
    """Pass a stream through event by event, as bytes. True when it ended properly."""
    loop = asyncio.get_running_loop()
    m = ctx.metrics.for_backend(backend.name)
    idle_s = backend.timeouts.idle_ms / 1000
    itl_hist = m.inter_token
    decoder = SSEDecoder()
    assembler = StreamAssembler(call.capture) if call.capture else None  # the answer, for the cache
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
                    if content:
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
        if not first:
            raise AttemptFailed(
                UpstreamTimeout(f"no first token within {_ms(first_deadline - loop.time() + (time.perf_counter() - started))} ms"),
                "first_token_timeout",
            ) from None
        cut = None if finished else f"the stream stalled for more than {backend.timeouts.idle_ms} ms"
    except UpstreamHTTPError as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"connection lost before the first token: {exc}"), "disconnect") from None
        cut = None if finished else "the backend's connection was lost mid-stream"
    else:
        if error_event:
            m.error("error_event_mid_stream")
            call.finish = "error"
            await client_write(sink.end())
            return False
        if not saw_done and not finished:
            if not first:
                raise AttemptFailed(UpstreamError("the stream ended before the first token"), "cut")
            cut = "the backend's stream ended before its finish reason"
    if cut is not None:
        # A cut stream is never presented as a success: an error event, and no [DONE].
        m.error("cut_mid_stream")
        call.finish = "cut"
        await client_write(sink.fail(UpstreamError(cut)))
        return False
    if not saw_done:
        m.error("missing_done")  # completed by the gateway
    if assembler is not None:
        call.entry = assembler.entry()
    call.finish = "ok"
    await client_write(sink.write(SSE_DONE))
    await client_write(sink.end())
    return True


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
