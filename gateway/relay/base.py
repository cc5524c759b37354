"""One request's relay state, and its one primitive: try one backend (core.py builds on it).

`RelayBase.attempt(backend, ...)` holds one of the backend's slots for one attempt, runs it
(attempt.py: send; a whole answer, or the pump for a stream), and reports its outcome (report.py):
every way to the client (failover, retry, hedge, context fallback, rescue) goes through it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from ..admission.gate import Ticket
from ..admission.stage import wait_for_slot
from ..config.policy import RoutingPolicy
from ..config.runtime import Pool, Route
from ..errors import GatewayError, UpstreamRejected
from ..pipeline.call import Call
from ..routing.affinity import AffinityResult
from ..routing.backends import Backend
from ..routing.health import Kind
from ..tenants.priority import Band
from ..web.sink import Sink
from .attempt import Attempt, AttemptFailed, Cut, Lost, Progress
from .context import RelayContext
from .continuation import Resume
from .pump import Pump
from .report import READ_PROMPT, report

__all__ = ["RelayBase", "Tries"]

log = logging.getLogger("gateway.relay")


@dataclass(slots=True)
class Tries:
    """One request's attempts so far."""

    failures: list[tuple[str, GatewayError]] = field(default_factory=list)
    count: int = 0  # attempts started, retries included (bounded by server.max_attempts)
    last_kind: Kind | None = None  # how the last failed attempt failed (health.OUTCOMES)
    last_label: str | None = None  # the same with its status (`http_502`): metrics and retry.on
    on: dict[str, int] = field(default_factory=dict)  # backend -> attempts on it

    def failed(self, backend: str, err: GatewayError, kind: Kind, label: str) -> None:
        self.failures.append((backend, err))
        self.last_kind, self.last_label = kind, label


class RelayBase:
    """One request on its way to a backend: the route and pool it is answered from, its place in
    the queues (`ticket`, `band`), what reached the client (`progress`) and its tries so far."""

    __slots__ = ("call", "route", "ctx", "sink", "pool", "ticket", "band", "progress", "tries")

    def __init__(self, call: Call, route: Route, ctx: RelayContext, sink: Sink) -> None:
        self.call, self.route, self.ctx, self.sink = call, route, ctx, sink
        self.pool: Pool = route.pool(call.cls, call.endpoint.name)
        if not ctx.admission.enabled:
            call.ticket = None  # one band, one tenant: slots are taken and given back as "default"
        self.ticket = call.ticket if call.ticket is not None else Ticket()
        self.band = call.ticket.band if call.ticket is not None else Band.DEFAULT
        self.progress = Progress()
        self.tries = Tries()

    async def attempt(
        self, backend: Backend, *, live: RoutingPolicy | None, wait_s: float = 0.0, queue: Ticket | None = None,
        cold_s: float | None = None, resume: Resume | None = None, hedge: bool = False,
    ) -> bool | None:
        """One attempt on a backend, holding one of its slots from start to end (`wait_s`: how
        long to queue for one, as `queue`). `live`: the rule for first-token and stall deadlines
        from live data, None for the backend's fixed ones; `hedge`: a hedge started beside an
        attempt still under way (hedge.py), not a failover. True when this attempt owned the client:
        answered, or its stream broke mid-way (then `progress.cut` says how); False when it failed
        before the first byte (or lost a hedge); None when no slot came free."""
        slots = backend.slots
        if not slots.try_acquire(self.band) and not await self._queue(backend, wait_s, queue):
            return None
        m = self.ctx.metrics.for_backend(backend.name)
        m.inflight.inc()
        try:
            att = Attempt(self, backend, m, live=live, cold_s=cold_s, resume=resume)
            self._started(backend, resume, hedge)
            try:
                resp, raw = await att.send()
                ok = False
                try:  # the answer: a whole body, or the stream through the pump
                    if resp.status != 200:
                        await att.refuse(resp)
                    kind = await Pump(att, resp).run() if self.call.stream else await att.deliver(raw)
                    ok = kind is Kind.OK
                finally:
                    if ok:
                        resp.release()
                    else:
                        resp.close()  # never leave a half-read or cancelled upstream on the pool
            except AttemptFailed as failed:
                self.tries.failed(backend.name, failed.err, failed.kind, failed.label)
                self._report(att, failed.kind, failed.status)
                log.info("request %s: backend %r failed before the first token (%s): %s",
                         self.call.request_id, backend.name, failed.label, failed.err.message)
                return False
            except Cut as cut:
                self.progress.cut = cut
                self._report(att, cut.kind, live=cut.live)
                return True
            except Lost:
                self.call.out.read_prompts += 1  # it was at work on the prompt: the tenant is charged it
                return False  # a hedged rival answered first: nothing about this backend is known
            except asyncio.CancelledError:
                # A hedge's loser (its rival's claim cancels it) or a client that left: a backend
                # that had the request was at work on the prompt, and the tenant is charged it.
                if att.sent:
                    self.call.out.read_prompts += 1
                raise
            except UpstreamRejected as rejected:
                self._report(att, Kind.CONTEXT_LENGTH if rejected.context_length else Kind.REJECTED)
                raise
            self._report(att, kind)
            return True
        finally:
            slots.release(self.band)
            m.inflight.dec()

    async def _queue(self, backend: Backend, wait_s: float, ticket: Ticket | None) -> bool:
        """Wait up to `wait_s` for one of the backend's slots; whether one came."""
        if wait_s <= 0:
            return False
        return await wait_for_slot(backend, wait_s, ticket, self.band, self.ctx.metrics, lambda s: self._waited(s, ticket))

    def _waited(self, seconds: float, ticket: Ticket | None) -> None:
        """`seconds` spent in a backend's queue, however the wait ended: the request's queue stage."""
        self.call.timing.queue_ms += seconds * 1000
        self.ctx.metrics.queue_wait.labels(ticket.band if ticket is not None else Band.DEFAULT).observe(seconds)
        self.sink.set_header("x-gateway-queue-ms", f"{self.call.timing.queue_ms:.1f}")

    def _started(self, backend: Backend, resume: Resume | None, hedge: bool = False) -> None:
        """An attempt starts on `backend`: a failover when it follows another backend's failure.
        A hedge is none: the attempt beside it has not failed (it may well answer), so it is
        neither counted as one nor turns an affinity hit into a spill (Attempt.claim does, if
        the hedge answers)."""
        call, tries = self.call, self.tries
        if not hedge and call.out.attempts and resume is None and call.out.attempts[-1] != backend.name and tries.last_kind is not Kind.CONTEXT_LENGTH:
            self.ctx.metrics.for_backend(backend.name).failovers.inc()
            self.ctx.metrics.relay_events.labels("failover", tries.last_label or "unknown").inc()
            log.info("request %s: failing over from %r (%s) to %r", call.request_id, call.out.attempts[-1], tries.last_label, backend.name)
        if call.prefix and self.route.prefixes is not None:
            tenant = call.tenant
            # its cache holds this prompt now
            self.route.prefixes.learn(call.prefix, backend.name, call.cls, "" if tenant is None else tenant.cache_namespace)
            d = call.out.affinity
            if d is not None:
                if d.result is AffinityResult.HIT and backend.name != d.backend and not hedge:
                    call.out.affinity = d = replace(d, result=AffinityResult.SPILL, backend=backend.name,
                                                    reason=f"{d.reason}; then failed over from {d.backend}")
                self.sink.set_header("x-gateway-affinity", d.result.value)
        call.out.attempts.append(backend.name)
        tries.on[backend.name] = tries.on.get(backend.name, 0) + 1
        if not hedge:  # a hedge names itself only once it answers first (Attempt.claim)
            call.out.backend = backend.name
            self.sink.set_header("x-gateway-backend", backend.name)

    def _report(self, att: Attempt, kind: Kind, status: int | None = None, *, live: bool = False) -> None:
        seconds = time.perf_counter() - att.started - att.client_wait_s  # the backend's time, not the client's
        report(self.call, att.backend, self.ctx.metrics, att.m, kind, seconds, status=status, live=live)
        if kind in READ_PROMPT:
            self.call.out.read_prompts += 1
