"""The upstream call: which backend, failover before the first byte, hedging, reports.

The relay *reports* outcomes (to each backend's tracker and health); health decides ejection and
the selector ranks. Nothing is retried once a content byte reached the client (see attempt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from .admission import MAX_WAIT_SHARE, Shed, Ticket
from .attempt import AttemptFailed, ClientGone, Lost, Progress, RelayContext, attempt
from .backends import Backend
from .call import Call
from .errors import AllBackendsFailed, GatewayError, RateLimited, Unavailable, UpstreamRejected, UpstreamTimeout
from .health import outcome
from .latency import quantile
from .metrics import BackendMetrics
from .policy import RoutingPolicy, ServerPolicy
from .runtime import Pool, Route
from .sink import Sink
from .wire import SSE_HEARTBEAT

__all__ = ["relay", "ClientGone", "RelayContext"]


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
    """Answer `call` from the best candidate that works, once admitted; raise a GatewayError
    (AllBackendsFailed, or a shed) otherwise."""
    pool = route.pool(call.cls, call.endpoint.name)
    server = route.server
    # Started first: a stream waiting in a queue gets heartbeats too.
    heartbeat = _Heartbeat(sink, server, Progress()) if call.stream else None
    admission = ctx.admission
    # Admission off: one band, one tenant (a first come, first served queue), no shedding.
    if not admission.enabled:
        call.ticket = None  # one band, one tenant: slots are taken and given back as "default"
    ticket = call.ticket if call.ticket is not None else Ticket()
    try:
        progress = heartbeat.progress if heartbeat is not None else Progress()
        if not admission.enabled:
            await _relay(call, route, pool, ticket, ctx, sink, progress, shed=False)
            return
        await _admit(call, ticket, pool, ctx, sink)
        held = time.monotonic()
        try:
            await _relay(call, route, pool, ticket, ctx, sink, progress)
        finally:
            admission.leave(time.monotonic() - held, ticket.band)
    finally:
        if heartbeat is not None:
            await heartbeat.stop()


async def _admit(call: Call, ticket: Ticket, pool: Pool, ctx: RelayContext, sink: Sink) -> None:
    """The admission stage: a place among the process's `max_inflight`, or a quick refusal when
    the predicted wait (here, and then at the best backend) cannot meet the deadline."""
    downstream = None
    usable = [b for b in pool.backends if b.health.healthy] or list(pool.backends)
    first_token_s = min((b.tracker.predict_ttft(call.prompt_tokens) or 0.0) for b in usable) if usable else 0.0
    if usable and not any(b.slots.free(ticket.band) for b in usable):
        # Every candidate is full: the wait continues at the one that frees up soonest. (Not the
        # selector's pick: ranking has side effects, such as exploration, that belong to _relay.)
        waits = []
        for b in usable:
            per = _service_s(b) / max(1, b.slots.limit)
            waits.append((b.slots.queue.position(ticket.band, ticket.tenant, ticket.weight), per))

        def downstream(ahead: int) -> float:
            return min((behind + ahead + 1) * per for behind, per in waits)

    try:
        waited = await ctx.admission.enter(ticket, call.remaining_s(), downstream, first_token_s)
    except Shed as shed:
        ctx.metrics.shed.labels(shed.reason, ticket.band).inc()
        raise Unavailable(str(shed), code="overloaded", retry_after_s=shed.retry_after_s) from None
    except TimeoutError:
        ctx.metrics.shed.labels("expired", ticket.band).inc()
        raise UpstreamTimeout(
            f"the request's deadline of {call.timeout_ms()} ms passed while it waited for admission: not sent"
        ) from None
    if waited:
        call.queue_ms += waited * 1000
        ctx.metrics.queue_wait.labels(ticket.band).observe(waited)
        sink.set_header("x-gateway-queue-ms", f"{call.queue_ms:.1f}")


async def _relay(
    call: Call, route: Route, pool: Pool, ticket: Ticket, ctx: RelayContext, sink: Sink, progress: Progress,
    *, shed: bool = True,
) -> None:
    failures: list[tuple[str, GatewayError]] = []
    order = _plan(call, pool, failures)
    full: list[Backend] = []
    server = route.server
    attempts = 0
    for i, backend in enumerate(order):
        if attempts >= server.max_attempts or call.remaining_s() <= 0:
            break
        if backend.name in call.attempts:
            continue  # it already ran as a hedge
        if not backend.slots.free(ticket.band):
            full.append(backend)
            continue
        attempts += 1
        # The live-P95 deadline only while another backend could take over.
        last = attempts >= server.max_attempts or i == len(order) - 1
        if route.hedge is not None and attempts == 1 and not last:
            answered = await _hedged(call, backend, order[i + 1 :], route, ctx, sink, progress, failures)
        else:
            answered = await _try(call, backend, ctx, sink, progress, failures, live_deadline=None if last else route.routing)
        if answered or progress.owner is not None:
            return  # once an attempt owns the client, nothing else starts for this request
    if attempts == 0 and full:
        # Every candidate is at its max_concurrency: queue for the best one, if it can answer in time.
        backend = full[0]
        remaining = call.remaining_s()
        ttft = backend.tracker.predict_ttft(call.prompt_tokens) or 0.0
        wait = backend.slots.predicted_wait_s(ticket.band, ticket.tenant, _service_s(backend), ticket.weight)
        if shed and wait > MAX_WAIT_SHARE * (remaining - ttft):
            # Refused now, not after the deadline: the wait would use it up.
            ctx.metrics.shed.labels("deadline", ticket.band).inc()
            msg = (f"overloaded: predicted wait {wait * 1000:.0f} ms + first token {ttft * 1000:.0f} ms "
                   f"exceeds the {remaining * 1000:.0f} ms left of the deadline")
            raise Unavailable(f"{msg} (backend {backend.name!r} is full)", code="overloaded", retry_after_s=max(1.0, wait))
        budget = remaining - ttft if shed else remaining  # shedding: never hold a slot it cannot use
        by_deadline = budget <= backend.timeouts.first_token_ms / 1000
        wait_s = min(budget, backend.timeouts.first_token_ms / 1000)
        answered = await _try(call, backend, ctx, sink, progress, failures, live_deadline=None, wait_s=wait_s, ticket=ticket)
        if answered or progress.owner is not None:
            return
        if answered is None:
            if by_deadline:  # left the queue when it could no longer be answered in time: never sent
                ctx.metrics.shed.labels("expired", ticket.band).inc()
                err: GatewayError = UpstreamTimeout(f"the deadline of {call.timeout_ms()} ms came while queued for a slot: not sent")
                failures.extend((b.name, err) for b in full)
            else:
                failures.extend((b.name, Unavailable("at max_concurrency", retry_after_s=1)) for b in full)
    raise AllBackendsFailed(failures, deadline_hit=call.remaining_s() <= 0)


def _band(call: Call) -> str:
    return call.ticket.band if call.ticket is not None else "default"


def _service_s(backend: Backend) -> float:
    """How long one request holds a slot of this backend: its live median duration, else its
    predicted TTFT, else 1 s."""
    t = backend.tracker
    median = quantile(t.duration.sorted(t.clock()), 0.5)
    if median is not None:
        return median
    return t.predict_ttft() or 1.0


async def _hedged(
    call: Call,
    primary: Backend,
    others: Sequence[Backend],
    route: Route,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    failures: list[tuple[str, GatewayError]],
) -> bool:
    """Run the primary; if its first token is later than its live P95, run the same request on
    the next best backend too. Whichever reaches the client first wins; the other is cancelled.

    Each attempt acquires and releases its own slot inside its task, so cancelling a task at any
    point (before its first step included) leaks nothing."""
    hp, budget = route.hedge, route.budget
    assert hp is not None and budget is not None
    budget.note_request()
    p95 = primary.tracker.ttft_p95_s(call.prompt_tokens)
    delay = hp.default_delay_ms / 1000 if p95 is None else max(hp.min_delay_ms / 1000, p95)
    tasks = [asyncio.create_task(_try(call, primary, ctx, sink, progress, failures, live_deadline=route.routing))]
    try:
        done, _ = await asyncio.wait(tasks, timeout=min(delay, max(0.0, call.remaining_s())))
        if not done and progress.owner is None:
            second = next((b for b in others if b.slots.free(_band(call))), None)
            if second is None:
                ctx.metrics.hedges.labels("no_candidate").inc()
            elif not budget.try_spend():
                ctx.metrics.hedges.labels("budget_exhausted").inc()
            else:
                ctx.metrics.hedges.labels("started").inc()
                progress.rivals = tasks
                tasks.append(asyncio.create_task(_try(call, second, ctx, sink, progress, failures, live_deadline=route.routing)))
        results = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for task in tasks:
            task.cancel()  # the client went away, or we are done: no attempt outlives the relay
        await asyncio.gather(*tasks, return_exceptions=True)
    if len(tasks) == 2 and progress.owner is not None:
        ctx.metrics.hedges.labels("won" if progress.owner != primary.name else "lost").inc()
    for r in results:
        if isinstance(r, ClientGone) or (isinstance(r, UpstreamRejected) and progress.owner is None):
            raise r
        if isinstance(r, BaseException) and not isinstance(r, (UpstreamRejected, asyncio.CancelledError)):
            raise r  # a bug in an attempt: the pipeline's edge answers it
    return any(r is True for r in results)


async def _try(
    call: Call,
    backend: Backend,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    failures: list[tuple[str, GatewayError]],
    *,
    live_deadline: RoutingPolicy | None,
    wait_s: float = 0.0,
    ticket: Ticket | None = None,
) -> bool | None:
    """One attempt on a backend, holding one of its slots from start to end (`wait_s`: how long
    to queue for one). `live_deadline`: the rule for a first-token deadline from live data, None
    for the backend's fixed one. True when the call is answered (or lost to a mid-stream failure,
    answered with an error event); False when it failed before the first byte (or lost a hedge);
    None when no slot came free."""
    slots = backend.slots
    if not slots.try_acquire(_band(call)):
        if wait_s <= 0:
            return None
        queued = time.perf_counter()
        try:
            got = await slots.acquire(wait_s, ticket)
        except Shed as shed:  # a standing queue shed it
            ctx.metrics.shed.labels(shed.reason, _band(call)).inc()
            raise Unavailable(str(shed), code="overloaded", retry_after_s=shed.retry_after_s) from None
        waited = time.perf_counter() - queued
        call.queue_ms += waited * 1000
        ctx.metrics.queue_wait.labels(ticket.band if ticket is not None else "default").observe(waited)
        sink.set_header("x-gateway-queue-ms", f"{call.queue_ms:.1f}")
        if not got:
            return None
    m = ctx.metrics.for_backend(backend.name)
    m.inflight.inc()
    try:
        started = time.perf_counter()
        if call.attempts:
            m.failovers.inc()
        call.attempts.append(backend.name)
        call.backend = backend.name
        sink.set_header("x-gateway-backend", backend.name)
        try:
            kind = await attempt(call, backend, ctx, sink, progress, started, live_deadline)
        except AttemptFailed as failed:
            failures.append((backend.name, failed.err))
            _account(call, backend, m, failed.kind, time.perf_counter() - started)
            return False
        except Lost:
            return False  # a hedged rival answered first: nothing about this backend is known
        except UpstreamRejected:
            _account(call, backend, m, "rejected", time.perf_counter() - started)
            raise
        _account(call, backend, m, kind, time.perf_counter() - started)
        return True
    finally:
        slots.release(_band(call))
        m.inflight.dec()


# Outcomes that are not the backend's errors: not in gateway_upstream_errors_total.
_NOT_UPSTREAM_ERRORS = frozenset({"rejected", "caller_deadline", "client_disconnect", "lost"})


def _account(call: Call, backend: Backend, m: BackendMetrics, kind: str, seconds: float) -> None:
    """Report one attempt's outcome to the backend's tracker and health, as health.OUTCOMES says."""
    o = outcome(kind)
    if o.sample:
        completion = (call.usage or {}).get("completion_tokens") if kind == "ok" else None
        backend.tracker.observe_done(
            seconds,
            ok=kind == "ok",
            prompt_tokens=call.prompt_tokens,
            completion_tokens=completion if isinstance(completion, int) else None,
            streamed=call.stream,
            timeout=kind in ("timeout", "first_token_timeout"),
        )
    if kind == "ok":
        backend.health.report_success()
        return
    if kind not in _NOT_UPSTREAM_ERRORS:
        m.error(kind)
    if o.health:
        ejections = backend.health.ejections
        backend.health.report_failure()
        if backend.health.ejections > ejections:
            m.ejections.inc()


class _Heartbeat:
    """SSE comments while a stream waits for its first token, so idle-timeout proxies keep it open.

    They start only after heartbeat_after_ms (a fast failure still gets a real HTTP status), and
    only then does a task exist: most streams never need one, and a timer is cheaper than a task."""

    __slots__ = ("_sink", "_server", "progress", "_timer", "_task")

    def __init__(self, sink: Sink, server: ServerPolicy, progress: Progress) -> None:
        self._sink, self._server, self.progress = sink, server, progress
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(server.heartbeat_after_ms / 1000, self._start)

    def _start(self) -> None:
        if not self.progress.first_sent:
            self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while not self.progress.first_sent:
            await self._sink.write(SSE_HEARTBEAT)
            await asyncio.sleep(self._server.heartbeat_interval_ms / 1000)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self._task


