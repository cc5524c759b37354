"""The request pipeline, top to bottom, in one place.

authenticate -> parse -> authorize -> classify -> quota (reserve) -> cache lookup (single flight)
-> route + relay (failover, hedging, streaming) -> cache store -> quota (settle) -> observe
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from . import cache_flight
from .auth import Tenant
from .admission import Admission, Ticket
from .backends import Backend
from .cache import Cache, Flight
from .cache_entry import Entry
from .call import CacheResult, Call, Finish
from .errors import AllBackendsFailed, GatewayError, InternalError
from .flight import TeeSink, follow
from .priority import asked_band, cap
from .quota import Hold, QuotaExceeded
from .relay import ClientGone, RelayContext, relay
from .runtime import Route, Runtime
from .sink import Sink
from .pinning import Pinned, pin
from .wire import parse_body

__all__ = ["run", "explain", "parse"]

log = logging.getLogger("gateway.pipeline")


def parse(call: Call) -> None:
    """Validate the body and fill in the call's model, stream flag and the band it asks for
    (x-priority when sent, else its service_tier's; the tenant's ceiling applies later)."""
    typed, body = parse_body(call.raw, call.endpoint.request)
    call.body = body
    call.model = typed.model
    call.stream = bool(getattr(typed, "stream", False)) and call.endpoint.streams
    call.priority = asked_band(call.priority, body)


def _prepare(call: Call, rt: Runtime) -> tuple[Route, Tenant]:
    tenant = rt.tenants.authenticate(call.api_key)
    call.tenant = tenant.name
    parse(call)
    rt.tenants.authorize(tenant, call.model)
    cap(call, tenant)  # the band at most the tenant's priority; a service_tier above it not sent upstream
    route = rt.route(call.model)
    call.prompt_tokens = len(call.raw) // 4  # cheap; the classifier's estimate replaces it when it runs
    if call.endpoint.classifies:
        call.verdict = verdict = rt.classify(call, route)
        if verdict.features:  # classified (an unclassified route keeps cls "none")
            call.cls, call.score, call.reasons = verdict.cls, verdict.score, verdict.reasons
        estimate = verdict.features.get("prompt_tokens")
        if isinstance(estimate, int):
            call.prompt_tokens = estimate
    route.pool(call.cls, call.endpoint.name)  # an endpoint no candidate serves: a 400 now, no upstream call
    return route, tenant


async def run(call: Call, rt: Runtime, ctx: RelayContext, sink: Sink) -> None:
    """Answer one request through every stage; always leaves an answer (data or error) in `sink`."""
    hold: Hold | None = None
    try:
        route, tenant = _prepare(call, rt)
        if rt.quota is not None:
            hold = await rt.quota.reserve(call, tenant, sink)
        _band(call, rt, tenant)
        if call.cls != "none":
            sink.set_header("x-gateway-class", call.cls)
            ctx.metrics.per_class[call.cls].inc()
        pinned = await _pin(call, route, rt, tenant) if call.endpoint.stateful else None
        if pinned is not None:
            route = pinned.route
        plan = rt.cache_plan(call, route, tenant)
        if plan.key is None or rt.cache is None:
            call.cache = CacheResult.BYPASS
            ctx.metrics.lookup[CacheResult.BYPASS].inc()
            sink.set_header("x-gateway-cache", CacheResult.BYPASS)
            try:
                await relay(call, route, ctx, sink)
            except AllBackendsFailed as err:
                raise err if pinned is None else pinned.failed(err) from None
            return
        entry = await rt.cache.lookup(plan.key)
        if entry is None:
            usage = _wants_usage(call)
            async with ctx.flight.hold(plan.key, wait_s=call.remaining_s(), stream=call.stream, include_usage=usage) as flight:
                entry = None if flight.leader else flight.entry
                if not flight.leader and flight.stream is not None and await follow(flight.stream, call, sink):
                    ctx.metrics.lookup[CacheResult.HIT].inc()  # a streamed follower, answered from its leader's live stream
                    return
                if entry is None:  # the leader, or a follower whose leader stored (or streamed) nothing
                    tee = TeeSink(sink, flight.stream) if flight.leader and flight.stream is not None else sink
                    locked = False
                    if flight.leader and cache_flight.shared(rt.cache):  # another process may be answering it
                        lock_s = rt.policy.cache.lock_ms / 1000
                        locked, entry = await cache_flight.claim(rt.cache, plan.key, wait_s=call.remaining_s(), lock_s=lock_s)
                        if entry is not None:
                            flight.publish(entry)
                            await _replay(call, entry, tee)
                            ctx.metrics.lookup[CacheResult.HIT].inc()
                            return
                    try:
                        call.cache = CacheResult.MISS
                        ctx.metrics.lookup[CacheResult.MISS].inc()
                        sink.set_header("x-gateway-cache", CacheResult.MISS)
                        call.capture = rt.cache.max_entry_bytes
                        await _lead(call, route, ctx, tee)
                    finally:
                        # Also when _lead raised: a client that closes its connection as soon as it
                        # has the last byte gets this handler cancelled (handler_cancellation) before
                        # the store, and a lock let go without the answer stored sends the other
                        # replicas' waiting requests upstream again.
                        stored = call.entry if plan.store else None
                        await asyncio.shield(_land(rt.cache, plan.key, stored, plan.ttl_s, flight, locked))
                    return
        await _replay(call, entry, sink)
        ctx.metrics.lookup[CacheResult.HIT].inc()
    except ClientGone:
        call.finish = Finish.CLIENT_DISCONNECT
    except GatewayError as err:
        if isinstance(err, QuotaExceeded):
            ctx.metrics.quota_rejections.labels(rt.tenants.metric_label(call.tenant or "none"), err.limit).inc()
        await _refuse(call, sink, err)
    except asyncio.CancelledError:
        call.finish = Finish.CLIENT_DISCONNECT  # aiohttp cancels the handler when the client goes away
        raise
    except Exception:  # a bug: still an answer in the contract, and the traceback in the log
        log.exception("request %s: internal error", call.request_id)
        await _refuse(call, sink, InternalError(f"internal error in the gateway (request id {call.request_id})"), bug=True)
    finally:
        if hold is not None:
            _settle(call, rt, ctx, hold)
        _observe(call, rt, ctx)


async def _pin(call: Call, route: Route, rt: Runtime, tenant: Tenant) -> Pinned | None:
    """An endpoint whose answers leave state on a backend: record the ids each answer makes it
    hold, and send a follow-up to the backend holding what it builds on (pinning.py)."""
    call.affinity = rt.affinity.learner(tenant.cache_namespace)
    return await pin(call, route, rt, tenant.cache_namespace)


async def _refuse(call: Call, sink: Sink, err: GatewayError, *, bug: bool = False) -> None:
    """Answer with `err` (a status, or an error event once streaming)."""
    call.status, call.error, call.finish = err.status, err.message, Finish.ERROR
    try:
        await sink.fail(err)
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        call.finish = Finish.CLIENT_DISCONNECT
    except Exception:
        if not bug:
            raise
        call.finish = Finish.CLIENT_DISCONNECT


def _settle(call: Call, rt: Runtime, ctx: RelayContext, hold: Hold) -> None:
    """The quota's part after the answer: what it used (tokens, spend)."""
    assert rt.quota is not None
    spend = _spend_usd(call, rt)
    if spend:
        ctx.metrics.spend.labels(rt.tenants.metric_label(hold.tenant)).inc(spend)
    rt.quota.settle(hold, call, spend)


def _wants_usage(call: Call) -> bool:
    """Whether the client's stream carries a usage chunk (one it asked for)."""
    opts = call.body.get("stream_options") if call.stream else None
    return isinstance(opts, dict) and bool(opts.get("include_usage")) and not call.strip_usage


def _band(call: Call, rt: Runtime, tenant: Tenant) -> None:
    """The call's place in the queues: its band (already held to the tenant's ceiling by
    priority.cap), its band's default deadline, its token cost."""
    band = call.priority or "default"
    if not call.deadline_asked:
        band_ms = getattr(rt.policy.admission.deadline_ms, band)
        if band_ms is not None:
            call.deadline = min(call.deadline, call.t0_monotonic + band_ms / 1000)
    max_tokens = call.body.get("max_completion_tokens") or call.body.get("max_tokens") or call.body.get("max_output_tokens")
    # A base per request, so tiny requests do not take many turns each (DRR shares tokens).
    cost = 256 + call.prompt_tokens + (max_tokens if isinstance(max_tokens, int) else 256)
    call.ticket = Ticket(band, tenant.name, max(1, cost), rt.tenants.weight(tenant.name))


def _queue_view(ticket: Ticket, admission: Admission, backend: Backend | None) -> dict[str, Any]:
    """Where a request of this band and tenant would wait now, and about how long (explain)."""
    return {
        "admission_position": admission.gate.position(ticket.band, ticket.tenant, ticket.weight),
        "admission_predicted_wait_ms": round(admission.predicted_wait_s(ticket) * 1000, 2),
        "backend": None if backend is None else backend.name,
        "backend_position": None if backend is None else backend.slots.position(ticket.band, ticket.tenant, ticket.weight),
    }


def _spend_usd(call: Call, rt: Runtime) -> float:
    """What the answer cost at its backend's `price` (0 without a price, a usage or a backend)."""
    backend = rt.backends.get(call.backend or "")
    usage = call.usage
    if backend is None or backend.policy.price is None or not usage or call.cache is CacheResult.HIT:
        return 0.0
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return backend.policy.price.usd(p if isinstance(p, int) else 0, c if isinstance(c, int) else 0)


async def _replay(call: Call, entry: Entry, sink: Sink) -> None:
    """Answer from the cache: the stored answer, or the same answer replayed as a stream."""
    call.cache, call.backend = CacheResult.HIT, "cache"
    sink.set_header("x-gateway-cache", CacheResult.HIT)
    sink.set_header("x-gateway-backend", "cache")
    try:
        body = call.endpoint.replay(entry, stream=call.stream, include_usage=_wants_usage(call))
        if call.stream:
            await sink.write(body)
            await sink.end()
        else:
            await sink.send(200, body)
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        raise ClientGone() from None
    call.finish = Finish.OK


async def _land(cache: Cache, key: str, entry: Entry | None, ttl_s: float, flight: Flight, locked: bool) -> None:
    """A flight leader's last step: store its complete answer (`entry`, None when there is none or
    it may not be stored), hand it to this process's followers, and only then give back the
    cross-process lock, so a follower elsewhere that sees the lock gone finds the answer."""
    try:
        if entry is not None:
            await cache.save(key, entry, ttl_s=ttl_s)
            flight.publish(entry)
    finally:
        if locked:
            await cache_flight.release(cache, key)


async def _lead(call: Call, route: Route, ctx: RelayContext, sink: Sink) -> None:
    """The flight leader's relay. A streamed leader's answer is its followers' too (TeeSink): if
    its own client leaves after content reached them, the relay goes on for them to the end, in a
    task of its own so that the handler's cancellation does not end it. The leader is then a
    client_disconnect, charged the whole answer (the upstream call was its own, and ran)."""
    if not isinstance(sink, TeeSink):
        await relay(call, route, ctx, sink)
        return
    task = asyncio.ensure_future(relay(call, route, ctx, sink))
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.done() or not sink.keeps_followers():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        sink.detach()
        ctx.carried.add(task)
        task.add_done_callback(ctx.carried.discard)
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # this handler's client is gone; the work it started is not
        try:
            await task
        except asyncio.CancelledError:  # cancelled again (a shutdown): the followers' stream ends too
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
    if sink.detached and call.finish is Finish.OK:  # a cut after it left stays a cut
        call.finish = Finish.CLIENT_DISCONNECT


def _observe(call: Call, rt: Runtime, ctx: RelayContext) -> None:
    m = ctx.metrics
    backend = call.backend or "none"
    # Labels only from the policy: a client-chosen model string would grow the series without bound.
    model = call.model if call.model in rt.routes else "other"
    m.request_done(model, backend, call.cls, call.cache, call.status)
    m.duration_of(backend).observe(call.elapsed_s())
    if call.finish is Finish.CLIENT_DISCONNECT:
        m.client_disconnects.inc()
    usage = call.usage
    if usage and call.backend and call.backend != "cache":
        tenant = rt.tenants.metric_label(call.tenant or "none")
        for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
            n = usage.get(key)
            if isinstance(n, int) and n > 0:
                m.tokens_of(tenant, backend, kind).inc(n)
    if call.status >= 500:
        log.warning("request %s failed with %s: %s", call.request_id, call.status, call.error)


async def explain(call: Call, rt: Runtime, admission: Admission) -> dict[str, Any]:
    """What the gateway would do with this request, calling no backend."""
    route, tenant = _prepare(call, rt)
    _band(call, rt, tenant)
    pinned = await pin(call, route, rt, tenant.cache_namespace) if call.endpoint.stateful else None
    if pinned is not None:
        route = pinned.route
    ticket = call.ticket
    assert ticket is not None
    plan = rt.cache_plan(call, route, tenant)
    if plan.key is not None and rt.cache is not None:
        call.cache = CacheResult.MISS if await rt.cache.lookup(plan.key) is None else CacheResult.HIT
    pool = route.pool(call.cls, call.endpoint.name)
    ranked = pool.selector.rank(pool.candidates, call.prompt_tokens)
    candidates = []
    for r in ranked:
        b = pool.backends[r.index]
        snap = b.tracker.snapshot()
        candidates.append(
            {
                "backend": b.name,
                "upstream_model": b.upstream_model(call.model),
                "health": b.health_for(call.model).state(),
                "inflight": b.slots.used,
                "max_concurrency": b.slots.limit,
                "ttft_p50_ms": snap["ttft_p50_ms"],
                "ttft_p95_ms": snap["ttft_p95_ms"],
                "predicted_ttft_ms": None if r.predicted_ttft_s is None else round(r.predicted_ttft_s * 1000, 2),
                "score": None if r.score == float("inf") else round(r.score, 6),
                "error_rate": snap["error_rate"],
                "skipped": r.skipped,
                "note": r.note,
            }
        )
    chosen = None
    if ranked and (ranked[0].skipped is None or ranked[0].last_resort):
        chosen = pool.backends[ranked[0].index].name
    v = call.verdict
    return {
        "endpoint": call.endpoint.name,
        "model": call.model,
        "tenant": call.tenant,
        "priority": call.priority,
        "priority_ceiling": tenant.priority,  # the tenant's `priority`: the most a request may ask for
        "service_tier_upstream": call.body.get("service_tier"),  # what a backend would be sent (None: none)
        "class": call.cls if v is None else v.cls,
        "score": None if v is None else round(v.score, 4),
        "threshold": None if v is None else round(v.threshold, 4),
        "rule": None if v is None else v.rule,
        "reasons": call.reasons if v is None else v.reasons,
        "features": {} if v is None else v.features,
        "prompt_tokens": call.prompt_tokens,
        "cache": call.cache,
        "cache_reason": plan.reason,
        "band": ticket.band,
        "queue": _queue_view(ticket, admission, pool.backends[ranked[0].index] if ranked else None),
        "strategy": pool.selector.strategy,
        "hedge": route.hedge is not None,
        # A Responses follow-up: the backend that holds the state it builds on (its only candidate).
        "affinity": None if pinned is None else {"field": pinned.field, "id": pinned.ref, "backend": pinned.backend},
        "candidates": candidates,
        "chosen": chosen,
    }
