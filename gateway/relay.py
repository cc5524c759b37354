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
from dataclasses import dataclass, field

import orjson

from .backends import Backend
from .cache import SingleFlight, StreamAssembler, entry_from_response
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
from .policy import RoutingPolicy, ServerPolicy
from .runtime import Pool, Route
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
    owner: str | None = None  # the backend whose answer the client gets (first content, or whole body)
    rivals: list[asyncio.Task[bool]] | None = None  # hedged attempts: the owner cancels the others


class _Lost(Exception):
    """A hedged attempt whose rival reached the client first."""


@dataclass(slots=True)
class RelayContext:
    """What every request shares in one process (sessions, metrics, single flight)."""

    pool: UpstreamPool
    metrics: Metrics
    server: ServerPolicy
    routing: RoutingPolicy
    flight: SingleFlight = field(default_factory=SingleFlight)


def _claim(progress: _Progress, backend: Backend, call: Call, sink: Sink) -> None:
    """Take the client for `backend` (first content token, or a whole answer); raise _Lost when a
    hedged rival already has it. Synchronous: check-and-set cannot interleave on one loop."""
    if progress.owner is not None and progress.owner != backend.name:
        raise _Lost()
    progress.owner = backend.name
    call.backend = backend.name
    sink.set_header("x-gateway-backend", backend.name)
    if progress.rivals:
        me = asyncio.current_task()
        for task in progress.rivals:
            if task is not me:
                task.cancel()  # the loser's upstream connection closes at once


def _plan(call: Call, pool: Pool, failures: list[tuple[str, GatewayError]]) -> list[Backend]:
    """The backends to try, best first, from the pool's selector; skipped ones explain themselves."""
    ranked = pool.selector.rank(pool.candidates, call.prompt_tokens)
    order = [pool.backends[r.index] for r in ranked if r.skipped is None]
    if not order and ranked and ranked[0].note and ranked[0].note.startswith("last resort"):
        last = pool.backends[ranked[0].index]
        if last.health.cooling_for() <= 0:  # never call a backend that asked for a pause
            order.append(last)
    for r in ranked:
        b = pool.backends[r.index]
        if r.skipped is None or b in order:
            continue
        if r.skipped == "starting":
            failures.append((b.name, Unavailable("the backend is starting", retry_after_s=5)))
        elif r.skipped == "cooling":
            wait = b.health.cooling_for()
            failures.append((b.name, RateLimited(f"asked us to back off for {wait:.1f}s more", retry_after_s=wait)))
        else:
            failures.append((b.name, Unavailable(f"skipped: {r.skipped}", retry_after_s=max(1.0, b.health.available_in()))))
    return order


async def relay(call: Call, route: Route, ctx: RelayContext, sink: Sink) -> None:
    """Answer `call` from the best candidate that works; raise AllBackendsFailed otherwise."""
    pool = route.pool(call.cls)
    progress = _Progress()
    failures: list[tuple[str, GatewayError]] = []
    order = _plan(call, pool, failures)
    full: list[Backend] = []
    heartbeat = _Heartbeat(sink, ctx.server, progress) if call.stream else None
    try:
        attempts = 0
        for i, backend in enumerate(order):
            if attempts >= ctx.server.max_attempts or call.remaining_s() <= 0:
                break
            if backend.name in call.attempts:
                continue  # it already ran as a hedge
            if not backend.slots.try_acquire():
                full.append(backend)
                continue
            attempts += 1
            # The live-P95 deadline only while another backend could take over.
            last = attempts >= ctx.server.max_attempts or i == len(order) - 1
            if route.hedge is not None and attempts == 1 and not last:
                answered = await _hedged(call, backend, order[i + 1 :], route, ctx, sink, progress, failures)
            else:
                answered = await _try(call, backend, ctx, sink, progress, failures, live_deadline=not last)
            if answered:
                return
        if attempts == 0 and full:
            # Every candidate is at its max_concurrency: queue for the best one, within the deadline.
            backend = full[0]
            started = time.perf_counter()
            got = await backend.slots.acquire(min(call.remaining_s(), backend.timeouts.first_token_ms / 1000))
            waited = time.perf_counter() - started
            call.queue_ms += waited * 1000
            ctx.metrics.queue_wait.observe(waited)
            sink.set_header("x-gateway-queue-ms", f"{call.queue_ms:.1f}")
            if got and await _try(call, backend, ctx, sink, progress, failures, live_deadline=False):
                return
            if not got:
                failures.extend((b.name, Unavailable("at max_concurrency", retry_after_s=1)) for b in full)
        raise AllBackendsFailed(failures, deadline_hit=call.remaining_s() <= 0)
    finally:
        if heartbeat is not None:
            await heartbeat.stop()


async def _hedged(
    call: Call,
    primary: Backend,
    others: Sequence[Backend],
    route: Route,
    ctx: RelayContext,
    sink: Sink,
    progress: _Progress,
    failures: list[tuple[str, GatewayError]],
) -> bool:
    """Run the primary; if its first token is later than its live P95, run the same request on
    the next best backend too. Whichever reaches the client first wins; the other is cancelled."""
    hp, budget = route.hedge, route.budget
    assert hp is not None and budget is not None
    budget.note_request()
    p95 = primary.tracker.ttft_p95_s(call.prompt_tokens)
    delay = hp.default_delay_ms / 1000 if p95 is None else max(hp.min_delay_ms / 1000, p95)
    tasks = [asyncio.create_task(_try(call, primary, ctx, sink, progress, failures, live_deadline=True))]
    try:
        done, _ = await asyncio.wait(tasks, timeout=min(delay, max(0.0, call.remaining_s())))
        if not done and progress.owner is None:
            second = next((b for b in others if b.slots.try_acquire()), None)
            if second is None:
                ctx.metrics.hedges.labels("no_candidate").inc()
            elif not budget.try_spend():
                second.slots.release()
                ctx.metrics.hedges.labels("budget_exhausted").inc()
            else:
                ctx.metrics.hedges.labels("started").inc()
                progress.rivals = tasks
                tasks.append(asyncio.create_task(_try(call, second, ctx, sink, progress, failures, live_deadline=True)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()  # the client went away, or we are done: no attempt outlives the relay
        await asyncio.gather(*tasks, return_exceptions=True)
    if len(tasks) == 2 and progress.owner is not None:
        ctx.metrics.hedges.labels("won" if progress.owner != primary.name else "lost").inc()
    for r in results:
        if isinstance(r, (ClientGone, UpstreamRejected)) and progress.owner is None:
            raise r
    return any(r is True for r in results)


async def _try(
    call: Call,
    backend: Backend,
    ctx: RelayContext,
    sink: Sink,
    progress: _Progress,
    failures: list[tuple[str, GatewayError]],
    *,
    live_deadline: bool,
) -> bool:
    """One attempt on a backend whose slot we hold. True when the call is answered (or lost to
    a mid-stream failure, which is answered with an error event)."""
    m = ctx.metrics.for_backend(backend.name)
    tracker = backend.tracker
    health = backend.health
    tracker.inflight += 1
    m.inflight.inc()
    started = time.perf_counter()
    if call.attempts:
        m.failovers.inc()
    call.attempts.append(backend.name)
    call.backend = backend.name
    sink.set_header("x-gateway-backend", backend.name)
    pt = call.prompt_tokens
    ejections = health.ejections
    try:
        ok = await _attempt(call, backend, ctx, sink, progress, started, live_deadline)
    except _AttemptFailed as failed:
        failures.append((backend.name, failed.err))
        m.error(failed.kind)
        timeout = failed.kind in ("timeout", "first_token_timeout")
        tracker.observe_done(time.perf_counter() - started, ok=False, prompt_tokens=pt, streamed=call.stream, timeout=timeout)
        if failed.counts_against_health:
            health.report_failure()
            if health.ejections > ejections:
                m.ejections.inc()
        return False
    except _Lost:
        return False  # a hedged rival answered first: nothing about this backend is known
    except UpstreamRejected:
        # The backend is fine; it rejected the request. Not a latency sample (an instant 4xx).
        tracker.observe_done(time.perf_counter() - started, ok=True)
        raise
    finally:
        tracker.inflight -= 1
        m.inflight.dec()
        backend.slots.release()
    completion = (call.usage or {}).get("completion_tokens")
    tracker.observe_done(
        time.perf_counter() - started,
        ok=ok,
        prompt_tokens=pt,
        completion_tokens=completion if isinstance(completion, int) else None,
        streamed=call.stream,
    )
    if ok:
        health.report_success()
    else:
        health.report_failure()
        if health.ejections > ejections:
            m.ejections.inc()
    return True


async def _attempt(
    call: Call, backend: Backend, ctx: RelayContext, sink: Sink, progress: _Progress, started: float, live_deadline: bool
) -> bool:
    """Send the request; True when answered in full, False when a stream failed after its first
    token (the client got an error event). Raises _AttemptFailed to fail over."""
    loop = asyncio.get_running_loop()
    t = backend.timeouts
    now = loop.time()
    call_deadline = now + call.remaining_s()
    first_s = t.first_token_ms / 1000
    if live_deadline:  # a stuck backend is abandoned after ~2x its live P95, not a fixed timeout
        rp = ctx.routing
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
            await _deliver(call, backend, raw, sink, progress)
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


async def _deliver(call: Call, backend: Backend, raw: bytes, sink: Sink, progress: _Progress) -> None:
    """Check a whole answer is an answer (a 200 with garbage fails over), then pass its bytes on."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or ("choices" not in obj and "data" not in obj):
        raise _AttemptFailed(UpstreamError("the backend answered 200 with a malformed body"), "malformed")
    _claim(progress, backend, call, sink)
    if call.capture:
        call.entry = entry_from_response(raw, call.capture)
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
                            raise _AttemptFailed(UpstreamError(f"error event before the first token: {msg}"), "error_event")
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
                            _claim(progress, backend, call, sink)
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
                                _claim(progress, backend, call, sink)  # an empty answer: its finish is its first byte
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
    if assembler is not None:
        call.entry = assembler.entry()
    call.finish = "ok"
    await _client_write(sink.write(SSE_DONE))
    await _client_write(sink.end())
    return True


class _Heartbeat:
    """SSE comments while a stream waits for its first token, so idle-timeout proxies keep it open.

    They start only after heartbeat_after_ms (a fast failure still gets a real HTTP status), and
    only then does a task exist: most streams never need one, and a timer is cheaper than a task."""

    __slots__ = ("_sink", "_server", "_progress", "_timer", "_task")

    def __init__(self, sink: Sink, server: ServerPolicy, progress: _Progress) -> None:
        self._sink, self._server, self._progress = sink, server, progress
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(server.heartbeat_after_ms / 1000, self._start)

    def _start(self) -> None:
        if not self._progress.first_sent:
            self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while not self._progress.first_sent:
            await self._sink.write(SSE_HEARTBEAT)
            await asyncio.sleep(self._server.heartbeat_interval_ms / 1000)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self._task


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
