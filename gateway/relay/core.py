"""The upstream call: which backend, failover before the first byte, retries, hedging,
context-window fallbacks, continuation of a broken stream, reports.

One `Relay` per request (base.py: its state and its one primitive, an attempt on one
backend; hedge.py, rescue.py: the ways that need a second backend). The relay
*reports* outcomes (to each backend's tracker and health); health decides ejection and the
selector ranks. Once content reached the client nothing is sent again: a stream that breaks is
continued from where it broke (continuation.py) or ends with an error event.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from ..admission.stage import refuse_late, slot_refusal
from ..config.runtime import Route
from ..errors import AllBackendsFailed, RateLimited, Unavailable, UpstreamRejected
from ..pipeline.call import Call
from ..routing.backends import Backend
from ..routing.health import Kind
from ..tenants.priority import Band
from ..web.drain import cut_by_shutdown, shutdown_error
from .attempt import ClientGone, Cut
from .context import RelayContext
from .continuation import Transcript
from .heartbeat import Heartbeat
from .hedge import Hedging
from .plan import plan
from .plan import plan_view as preferences_view
from .rescue import Rescue
from .timing import cold_first_token_s, retry_wait

__all__ = ["ClientGone", "Relay", "RelayContext", "plan_view"]

log = logging.getLogger("gateway.relay")


class Relay(Rescue, Hedging):
    """One request's way to an answer once admitted (the pipeline's last stage)."""

    __slots__ = ()

    def heartbeat(self) -> Beating:
        """`async with` it: SSE comments while a stream waits for its first token, admission's
        queue included."""
        return Beating(self)

    async def run(self, *, shed: bool) -> None:
        """Answer from the candidates (failover, same-backend retries, context-window fallbacks),
        then continue the answer elsewhere if its stream broke mid-way. `shed`: refuse a queue
        wait that cannot meet the deadline (admission is on). Raises a GatewayError
        (AllBackendsFailed, or a shed) when no backend answers; Unavailable when a shutdown cut it
        before anything reached the client (end_in_flight, web/drain.py)."""
        call = self.call
        # Continued only where every candidate's leg can be (continuation.py reads chat chunks).
        if call.stream and self.route.routing.continuation and len(self.pool.backends) > 1 \
                and call.endpoint.name in self.pool.continues and call.endpoint.continuable(call.body):
            call.transcript = Transcript()
        try:
            try:
                await self._answer(shed)
            except UpstreamRejected as rejected:
                if not (rejected.context_length and self.route.context_fallbacks) or self.progress.owner is not None:
                    raise
                await self.context_fallback(rejected)
            if self.progress.cut is not None:
                await self.rescue()
        except asyncio.CancelledError as exc:  # a try costs nothing until something is raised
            if not cut_by_shutdown(exc):
                raise  # the client left
            await self._shut_down()

    async def _shut_down(self) -> None:
        """The shutdown timeout cut this request (the attempt under way ended as for a client that
        left: its slot given back, the backend not blamed). A stream whose content reached the
        client ends as any stream cut mid-answer (rescue: its endpoint's error event, the request
        a cut), never continued elsewhere; before that, a 503 (an error event once the heartbeat
        began the stream), as the pipeline answers any refusal."""
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()  # handled: the writes of the error ending run as usual
        err = shutdown_error()
        if not self.progress.first_sent:
            raise err
        self.progress.cut = Cut(err, Kind.CLIENT_DISCONNECT)  # a kind that rescue never continues elsewhere
        await self.rescue()

    async def _answer(self, shed: bool) -> None:
        call, route, tries = self.call, self.route, self.tries
        order = self._plan()
        full: list[Backend] = []
        max_attempts = route.server.max_attempts
        cold_s = cold_first_token_s(self.pool.backends, call.prompt_tokens, route.routing, call.model)
        for i, backend in enumerate(order):
            if tries.count >= max_attempts or call.remaining_s() <= 0:
                break
            if backend.name in call.out.attempts:
                continue  # it already ran as a hedge
            if not backend.slots.free(self.band):
                full.append(backend)
                continue
            while True:
                answered: bool | None
                tries.count += 1
                # The live-P95 deadline only while another backend could take over.
                last = tries.count >= max_attempts or i == len(order) - 1
                if route.hedge is not None and tries.count == 1 and not last:
                    answered = await self.hedged(backend, order[i + 1 :], cold_s)
                else:
                    answered = await self.attempt(backend, live=None if last else route.routing, cold_s=cold_s)
                if answered or self.progress.owner is not None:
                    return  # once an attempt owns the client, nothing else starts for this request
                if answered is None:  # its last slot went to another request since free(): full after all
                    tries.count -= 1
                    full.append(backend)
                    break
                if not await self._retrying(backend):
                    break
        if tries.count == 0 and full and await self._queued(full, shed):
            return
        raise AllBackendsFailed(tries.failures, deadline_hit=call.remaining_s() <= 0)

    async def _retrying(self, backend: Backend) -> bool:
        """After a failed attempt: wait and try the same backend again (the route's `retry`)?"""
        call, tries = self.call, self.tries
        health = backend.health_for(call.model)
        wait = retry_wait(
            self.route.retry, tries.last_label, tries_here=tries.on.get(backend.name, 0), tries_total=tries.count,
            max_attempts=self.route.server.max_attempts, cooling_s=health.cooling_for(),
            remaining_s=call.remaining_s(), ejected=not health.healthy,  # health ejected it: fail over now
        )
        if wait is None or not backend.slots.free(self.band):
            return False
        self.ctx.metrics.relay_events.labels("retry", tries.last_label or "unknown").inc()
        log.info("request %s: retrying backend %r in %.0f ms after %s", call.request_id, backend.name, wait * 1000, tries.last_label)
        await asyncio.sleep(wait)
        return True

    async def _queued(self, full: list[Backend], shed: bool) -> bool:
        """Every candidate is at its max_concurrency: queue for the best one, if it can answer in
        time; whether the client has its answer (else `tries.failures` say why not)."""
        call, ticket = self.call, self.ticket
        backend = full[0]
        remaining = call.remaining_s()
        ttft = backend.tracker_for(call.model).predict_ttft(call.prompt_tokens) or 0.0
        if shed:
            refuse_late(backend, ticket, remaining, self.ctx.metrics, ttft)
        budget = remaining - ttft if shed else remaining  # shedding: never hold a slot it cannot use
        by_deadline = budget <= backend.timeouts.first_token_ms / 1000
        self.tries.count += 1
        answered = await self.attempt(backend, live=None, wait_s=min(budget, backend.timeouts.first_token_ms / 1000),
                                      queue=ticket)
        if answered or self.progress.owner is not None:
            return True
        if answered is None:  # never sent
            err = slot_refusal(by_deadline, call.timeout_ms(), ticket.band, self.ctx.metrics)
            self.tries.failures.extend((b.name, err) for b in full)
        return False

    def _plan(self) -> list[Backend]:
        """The backends to try, best first, from the pool's selector; skipped ones explain themselves."""
        pool, failures, call = self.pool, self.tries.failures, self.call
        if pool.affinity or pool.mixed:
            p = plan(call, self.route, pool, self.band)
            ranked = p.ranked
            call.out.affinity = p.affinity  # x-gateway-affinity goes out with each attempt (base.py)
        else:  # neither preference applies: the ranking is the plan
            ranked = pool.selector.rank(pool.candidates, call.prompt_tokens)
        order = [pool.backends[r.index] for r in ranked if r.skipped is None]
        if not order and ranked and ranked[0].last_resort:
            if pool.candidates[ranked[0].index].health.cooling_for() <= 0:  # never call a backend that asked for a pause
                order.append(pool.backends[ranked[0].index])
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



class Beating:
    """A stream's heartbeat for the block (a class, not a generator: entered on every request)."""

    __slots__ = ("relay", "beat")

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.beat: Heartbeat | None = None

    async def __aenter__(self) -> None:
        r = self.relay
        if r.call.stream:
            self.beat = Heartbeat(r.sink, r.route.server, r.progress)

    async def __aexit__(self, *exc: object) -> None:
        if self.beat is not None:
            await self.beat.stop()


def plan_view(call: Call, route: Route) -> tuple[dict[str, Any], Backend | None]:
    """The relay's part of /v1/route/explain: the candidates as the selector ranks them now, each
    with its live figures and why it would be skipped, and the one it would try first; where
    that one is drawn at random, `chosen_among` names those it is drawn from (`chosen` is then
    the best of them). Ranked by a peeking copy of the selector: the live one's rank() advances
    its round-robin position, exploration budget and random draws, so each explain moved the
    real traffic and named a backend the next request did not go to."""
    live = route.pool(call.cls, call.endpoint.name)
    peek = live.selector.peeking()
    pool = dataclasses.replace(live, selector=peek)
    p = plan(call, route, pool, call.ticket.band if call.ticket is not None else Band.DEFAULT)
    ranked = p.ranked
    candidates = []
    now, stale = time.monotonic(), pool.selector.load_stale_s
    for r in ranked:
        b = pool.backends[r.index]
        c = pool.candidates[r.index]
        snap = b.tracker_for(call.model).snapshot()  # the figures its ranking read: its model's
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
                "local": c.local,
                # The model server's own gauges (metrics_url) and the queue term they add to the score.
                "load": None if b.metrics_url is None else {**b.state.load.view(now, stale), "queue_rounds": round(c.queue_rounds(now, stale), 3)},
                "skipped": r.skipped,
                "note": r.note,
            }
        )
    chosen = None
    if ranked and (ranked[0].skipped is None or ranked[0].last_resort):
        chosen = pool.backends[ranked[0].index].name
    # The draw decides the first unless prefix affinity put its own choice (a holder, the home) there.
    a = p.affinity
    decided = a is not None and a.backend is not None and a.backend == a.preferred
    among = list(peek.drawn) if peek.drawn and chosen in peek.drawn and not decided else None
    view = {"strategy": peek.strategy, "hedge": route.hedge is not None, **preferences_view(p),
            "candidates": candidates, "chosen": chosen, "chosen_among": among}
    return view, pool.backends[ranked[0].index] if ranked else None
