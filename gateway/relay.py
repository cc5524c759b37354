"""The upstream call: which backend, failover before the first byte, retries, hedging,
context-window fallbacks, continuation of a broken stream, reports.

The relay *reports* outcomes (to each backend's tracker and health); health decides ejection and
the selector ranks. Once content reached the client nothing is sent again: a stream that breaks
is continued from where it broke (continuation.py) or ends with an error event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .admission import MAX_WAIT_SHARE, Shed, Ticket
from .attempt import AttemptFailed, ClientGone, Cut, Lost, Progress, RelayContext, attempt, client_write
from .backends import Backend
from .call import CacheResult, Call, Finish
from .continuation import Resume, Transcript
from .errors import AllBackendsFailed, GatewayError, RateLimited, Unavailable, UpstreamRejected, UpstreamTimeout
from .health import Kind
from .heartbeat import Heartbeat
from .latency import quantile
from .policy import RoutingPolicy
from .report import report
from .runtime import Pool, Route
from .sink import Sink
from .timing import cold_first_token_s, retry_wait

__all__ = ["relay", "ClientGone", "RelayContext"]

log = logging.getLogger("gateway.relay")


def _plan(call: Call, pool: Pool, failures: list[tuple[str, GatewayError]]) -> list[Backend]:
    """The backends to try, best first, from the pool's selector; skipped ones explain themselves."""
    ranked = pool.selector.rank(pool.candidates, call.prompt_tokens)
    order = [pool.backends[r.index] for r in ranked if r.skipped is None]
    if not order and ranked and ranked[0].last_resort:
        last = pool.backends[ranked[0].index]
        if pool.candidates[ranked[0].index].health.cooling_for() <= 0:  # never call a backend that asked for a pause
            order.append(last)
    for r in ranked:
        b = pool.backends[r.index]
        h = pool.candidates[r.index].health  # this model's health on that backend
        if r.skipped is None or b in order:
            continue
        if r.skipped == "starting":  # the launcher's reason when its launch failed, else "starting"
            wait = b.health.starting_retry_s()
            # tenants hear that the launch failed, not its words (an address, an OS error): /readyz has them
            failures.append((b.name, Unavailable(b.health.starting_reason(detail=False), retry_after_s=5 if wait is None else wait)))
        elif r.skipped == "cooling":
            wait = h.cooling_for()
            failures.append((b.name, RateLimited(f"asked us to back off for {wait:.1f}s more", retry_after_s=wait)))
        else:
            failures.append((b.name, Unavailable(f"skipped: {r.skipped}", retry_after_s=max(1.0, h.available_in()))))
    return order


async def relay(call: Call, route: Route, ctx: RelayContext, sink: Sink) -> None:
    """Answer `call` from the best candidate that works, once admitted; raise a GatewayError
    (AllBackendsFailed, or a shed) otherwise."""
    pool = route.pool(call.cls, call.endpoint.name)
    server = route.server
    # Started first: a stream waiting in a queue gets heartbeats too.
    heartbeat = Heartbeat(sink, server, Progress()) if call.stream else None
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
    usable = [b for b, c in zip(pool.backends, pool.candidates) if c.health.healthy] or list(pool.backends)
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
    """Answer from the candidates (failover, same-backend retries, context-window fallbacks), then
    continue the answer elsewhere if its stream broke mid-way."""
    tries = _Tries()
    if call.stream and route.routing.continuation and len(pool.backends) > 1 and _one_answer(call):
        call.transcript = Transcript()
    try:
        await _answer(call, route, pool, ticket, ctx, sink, progress, tries, shed)
    except UpstreamRejected as rejected:
        if not (rejected.context_length and route.context_fallbacks) or progress.owner is not None:
            raise
        await _context_fallback(call, route, rejected, ctx, sink, progress, tries)
    if progress.cut is not None:
        await _rescue(call, route, pool, ctx, sink, progress, tries)


def _one_answer(call: Call) -> bool:
    """A stream whose text a continuation could reproduce: one choice, no tool calls asked for."""
    body = call.body
    return call.endpoint.name in ("chat", "completions") and body.get("n") in (None, 1) and not body.get("tools")


@dataclass(slots=True)
class _Tries:
    """One request's attempts so far."""

    failures: list[tuple[str, GatewayError]] = field(default_factory=list)
    count: int = 0  # attempts started, retries included (bounded by server.max_attempts)
    last_kind: str | None = None  # how the last failed attempt failed (a health.OUTCOMES key)
    on: dict[str, int] = field(default_factory=dict)  # backend -> attempts on it


async def _answer(
    call: Call, route: Route, pool: Pool, ticket: Ticket, ctx: RelayContext, sink: Sink, progress: Progress,
    tries: _Tries, shed: bool,
) -> None:
    failures = tries.failures
    order = _plan(call, pool, failures)
    full: list[Backend] = []
    server = route.server
    cold_s = cold_first_token_s(pool.backends, call.prompt_tokens, route.routing)
    for i, backend in enumerate(order):
        if tries.count >= server.max_attempts or call.remaining_s() <= 0:
            break
        if backend.name in call.attempts:
            continue  # it already ran as a hedge
        if not backend.slots.free(ticket.band):
            full.append(backend)
            continue
        while True:
            tries.count += 1
            # The live-P95 deadline only while another backend could take over.
            last = tries.count >= server.max_attempts or i == len(order) - 1
            if route.hedge is not None and tries.count == 1 and not last:
                answered = await _hedged(call, backend, order[i + 1 :], route, ctx, sink, progress, tries, cold_s)
            else:
                answered = await _try(call, backend, ctx, sink, progress, tries,
                                      live_deadline=None if last else route.routing, cold_s=cold_s)
            if answered or progress.owner is not None:
                return  # once an attempt owns the client, nothing else starts for this request
            health = backend.health_for(call.model)
            wait = retry_wait(
                route.retry, tries.last_kind, tries_here=tries.on.get(backend.name, 0), tries_total=tries.count,
                max_attempts=server.max_attempts, cooling_s=health.cooling_for(),
                remaining_s=call.remaining_s(), ejected=not health.healthy,  # health ejected it: fail over now
            )
            if wait is None or not backend.slots.free(ticket.band):
                break
            ctx.metrics.relay_events.labels("retry", tries.last_kind or "unknown").inc()
            log.info("request %s: retrying backend %r in %.0f ms after %s", call.request_id, backend.name, wait * 1000, tries.last_kind)
            await asyncio.sleep(wait)
    if tries.count == 0 and full:
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
        tries.count += 1
        answered = await _try(call, backend, ctx, sink, progress, tries, live_deadline=None, wait_s=wait_s, ticket=ticket)
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


async def _context_fallback(
    call: Call, route: Route, rejected: UpstreamRejected, ctx: RelayContext, sink: Sink, progress: Progress, tries: _Tries,
) -> None:
    """The prompt did not fit: try the route's larger-context backends, never the same (backend,
    upstream model) twice; pass the rejection back when none answers."""
    by_name = {b.name: b for b in (*route.simple.backends, *route.complex.backends, *route.context_fallbacks)}
    too_small = {(rejected.backend, by_name[rejected.backend].upstream_model(call.model))} if rejected.backend in by_name else set()
    for fb in route.context_fallbacks:
        model = fb.upstream_model(call.model)
        if (fb.name, model) in too_small or call.remaining_s() <= 0:
            continue
        ctx.metrics.relay_events.labels("context_fallback", "context_length").inc()
        log.info("request %s: backend %r said context length exceeded; trying %r (model %r)",
                 call.request_id, rejected.backend, fb.name, model)
        sink.set_header("x-gateway-fallback", "context_length")
        tries.count += 1
        tries.last_kind = "context_length"
        try:
            answered = await _try(call, fb, ctx, sink, progress, tries, live_deadline=None,
                                  wait_s=min(call.remaining_s(), fb.timeouts.first_token_ms / 1000), ticket=call.ticket)
        except UpstreamRejected as again:
            if not again.context_length:
                raise
            too_small.add((fb.name, model))
            continue
        if answered or progress.owner is not None:
            return
    raise rejected


# Mid-stream failures another backend may rescue (a caller's deadline is not one of them).
_RESCUABLE = frozenset({"cut_mid_stream", "error_event_mid_stream", "too_large"})


async def _rescue(
    call: Call, route: Route, pool: Pool, ctx: RelayContext, sink: Sink, progress: Progress, tries: _Tries,
) -> None:
    """A stream broke after content reached the client: continue it on the next candidates
    (prefill where the backend takes one, else restart and skip the delivered text), or end it
    with an error event naming the original failure."""
    original = cut = progress.cut
    assert cut is not None
    transcript = call.transcript
    broken = {call.backend}
    notes: list[str] = []
    if transcript is not None and transcript.continuable and cut.kind in _RESCUABLE:
        call.capture, call.entry = 0, None  # an answer spliced from two backends is not cached
        rescues = 0
        ranked = [r for r in pool.selector.rank(pool.candidates, call.prompt_tokens) if r.skipped is None]
        candidates = [pool.backends[r.index] for r in ranked if pool.backends[r.index].name not in broken]
        for n, backend in enumerate(candidates):
            if rescues >= route.server.max_attempts or call.remaining_s() <= 0 or cut.kind not in _RESCUABLE:
                break
            modes = ("prefill", "restart") if backend.prefill else ("restart",)
            for mode in modes:
                rescues += 1
                progress.cut, progress.owner, progress.rivals = None, None, None
                resume = Resume(transcript, mode, backend.name, original.err.message)
                log.warning("request %s: %s; continuing the answer on %r (%s, %d characters delivered)",
                            call.request_id, cut.err.message, backend.name, mode, len(transcript.text))
                last = n == len(candidates) - 1
                try:
                    answered = await _try(call, backend, ctx, sink, progress, tries,
                                          live_deadline=None if last else route.routing, resume=resume)
                except UpstreamRejected as rejected:
                    # A 4xx to a continuation: most likely the prefill itself; restart instead.
                    notes.append(f"{backend.name} ({mode}): HTTP {rejected.status}")
                    ctx.metrics.relay_events.labels("continuation", f"{mode}_rejected").inc()
                    continue
                if progress.cut is not None:  # the continuation broke too: go on from there
                    cut = progress.cut
                    broken.add(backend.name)
                    notes.append(f"{backend.name} ({mode}): {cut.err.message}")
                    ctx.metrics.relay_events.labels("continuation", f"{mode}_cut").inc()
                    break
                if answered:
                    ctx.metrics.relay_events.labels("continuation", mode).inc()
                    log.info("request %s: answer continued on %r (%s); backends %s",
                             call.request_id, backend.name, mode, ", ".join(transcript.backends))
                    return
                why = tries.failures[-1][1].message if tries.failures else "no slot"
                notes.append(f"{backend.name} ({mode}): {why}")
                ctx.metrics.relay_events.labels("continuation", f"{mode}_failed").inc()
                break
    call.finish = Finish.CUT
    err = original.err
    if notes:
        err = type(err)(f"{err.message}; the answer could not be continued ({'; '.join(notes)})")
    log.warning("request %s: stream ended with an error after content was sent: %s", call.request_id, err.message)
    await client_write(sink.fail(err))


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
    tries: _Tries,
    cold_s: float | None,
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
    tasks = [asyncio.create_task(_try(call, primary, ctx, sink, progress, tries, live_deadline=route.routing, cold_s=cold_s))]
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
                tasks.append(asyncio.create_task(_try(call, second, ctx, sink, progress, tries, live_deadline=route.routing, cold_s=cold_s)))
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
    tries: _Tries,
    *,
    live_deadline: RoutingPolicy | None,
    wait_s: float = 0.0,
    ticket: Ticket | None = None,
    cold_s: float | None = None,
    resume: Resume | None = None,
) -> bool | None:
    """One attempt on a backend, holding one of its slots from start to end (`wait_s`: how long
    to queue for one). `live_deadline`: the rule for first-token and stall deadlines from live
    data, None for the backend's fixed ones. True when this attempt owned the client: answered,
    or its stream broke mid-way (then `progress.cut` says how); False when it failed before the
    first byte (or lost a hedge); None when no slot came free."""
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
        if call.attempts and resume is None and call.attempts[-1] != backend.name and tries.last_kind != "context_length":
            m.failovers.inc()
            ctx.metrics.relay_events.labels("failover", tries.last_kind or "unknown").inc()
            log.info("request %s: failing over from %r (%s) to %r", call.request_id, call.attempts[-1], tries.last_kind, backend.name)
        call.attempts.append(backend.name)
        tries.on[backend.name] = tries.on.get(backend.name, 0) + 1
        call.backend = backend.name
        sink.set_header("x-gateway-backend", backend.name)
        try:
            kind = await attempt(call, backend, ctx, sink, progress, started, live_deadline, cold_s=cold_s, resume=resume)
        except AttemptFailed as failed:
            tries.failures.append((backend.name, failed.err))
            tries.last_kind = failed.label
            report(call, backend, ctx.metrics, m, failed.kind, time.perf_counter() - started, status=failed.status)
            log.info("request %s: backend %r failed before the first token (%s): %s",
                     call.request_id, backend.name, failed.kind, failed.err.message)
            return False
        except Cut as cut:
            progress.cut = cut
            report(call, backend, ctx.metrics, m, Kind(cut.kind), time.perf_counter() - started)
            return True
        except Lost:
            return False  # a hedged rival answered first: nothing about this backend is known
        except UpstreamRejected as rejected:
            kind = Kind.CONTEXT_LENGTH if rejected.context_length else Kind.REJECTED
            report(call, backend, ctx.metrics, m, kind, time.perf_counter() - started)
            raise
        report(call, backend, ctx.metrics, m, Kind(kind), time.perf_counter() - started)
        return True
    finally:
        slots.release(_band(call))
        m.inflight.dec()
