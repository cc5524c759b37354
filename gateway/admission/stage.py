"""The admission stage: a place among the process's `max_inflight` for a request that goes
upstream (a cache hit takes none), or a quick refusal when the predicted wait cannot meet its
deadline (gate.py holds the gate and its queues)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..config.runtime import Pool
from ..errors import Unavailable, UpstreamTimeout
from ..observe.metrics import Metrics
from ..pipeline.call import Call
from ..routing.backends import Backend
from ..routing.latency import quantile
from ..web.sink import Sink
from ..errors import GatewayError
from .gate import MAX_RETRY_AFTER_S, MAX_WAIT_SHARE, Admission, Shed, Ticket

__all__ = ["AdmissionStage", "Place", "queue_view", "refuse_late", "service_s", "slot_refusal", "wait_for_slot"]


class AdmissionStage:
    """One per process, over the process-wide gate (it outlives reloads)."""

    __slots__ = ("admission", "metrics")

    def __init__(self, admission: Admission, metrics: Metrics) -> None:
        self.admission, self.metrics = admission, metrics

    def slot(self, call: Call, pool: Pool, ticket: Ticket, sink: Sink) -> Place:
        """`async with` it: a place in the gate for the block; it gives whether the relay may
        shed (False: admission is off, one first come, first served queue). Entering raises
        Unavailable (shed) or UpstreamTimeout (the deadline passed while it waited)."""
        return Place(self, call, pool, ticket, sink)

    async def _enter(self, call: Call, pool: Pool, ticket: Ticket, sink: Sink) -> None:
        band = ticket.band
        if any(c.health.healthy and b.slots.free(band) for b, c in zip(pool.backends, pool.candidates)) \
                and self.admission.gate.try_acquire(band):
            return  # the common case: room here and at a healthy backend, so no wait to predict
        metrics = self.metrics
        usable = [b for b, c in zip(pool.backends, pool.candidates) if c.health.healthy] or list(pool.backends)
        first_token_s = min((b.tracker_for(call.model).predict_ttft(call.prompt_tokens) or 0.0) for b in usable) if usable else 0.0
        # Every way out of the wait records it (queue_ms, the header, the histogram): a request
        # refused after waiting until its deadline showed that wait as the gateway's own work.
        queued = time.perf_counter()
        try:
            waited = await self.admission.enter(ticket, call.remaining_s(), _downstream(usable, ticket), first_token_s)
        except Shed as shed:
            _waited(call, sink, metrics, ticket, shed.waited_s)  # 0 when refused before it queued
            metrics.shed.labels(shed.reason, ticket.band).inc()
            raise Unavailable(str(shed), code="overloaded", retry_after_s=shed.retry_after_s) from None
        except TimeoutError:
            _waited(call, sink, metrics, ticket, time.perf_counter() - queued)
            metrics.shed.labels("expired", ticket.band).inc()
            raise UpstreamTimeout(
                f"the request's deadline of {call.timeout_ms()} ms passed while it waited for admission: not sent"
            ) from None
        except asyncio.CancelledError:  # its client left while it waited in the queue
            _waited(call, sink, metrics, ticket, time.perf_counter() - queued)
            raise
        _waited(call, sink, metrics, ticket, waited)


def _waited(call: Call, sink: Sink, metrics: Metrics, ticket: Ticket, seconds: float) -> None:
    """`seconds` waited for admission (nothing when it did not wait): the request's queue stage."""
    if seconds:
        call.timing.queue_ms += seconds * 1000
        metrics.queue_wait.labels(ticket.band).observe(seconds)
        sink.set_header("x-gateway-queue-ms", f"{call.timing.queue_ms:.1f}")


class Place:
    """One call's place in the gate (a class, not a generator: entered on every request)."""

    __slots__ = ("stage", "call", "pool", "ticket", "sink", "held")

    def __init__(self, stage: AdmissionStage, call: Call, pool: Pool, ticket: Ticket, sink: Sink) -> None:
        self.stage, self.call, self.pool, self.ticket, self.sink = stage, call, pool, ticket, sink
        self.held: float | None = None

    async def __aenter__(self) -> bool:
        if not self.stage.admission.enabled:
            self.stage.admission.enter_off()  # `held` stays None
            return False
        await self.stage._enter(self.call, self.pool, self.ticket, self.sink)
        self.held = time.monotonic()
        return True

    async def __aexit__(self, *exc: object) -> None:
        if self.held is not None:
            self.stage.admission.leave(time.monotonic() - self.held, self.ticket.band)
        else:  # entered while admission was off (an entry that raised never gets here)
            self.stage.admission.leave_off()


def _downstream(usable: list[Backend], ticket: Ticket) -> Callable[[int], float] | None:
    """When every candidate is full, the wait goes on at the one that frees up soonest: the
    predicted wait there for a request with `ahead` others before it in the gate. (Not the
    selector's pick: ranking has side effects, such as exploration, that belong to the relay.)"""
    if not usable or any(b.slots.free(ticket.band) for b in usable):
        return None
    waits = [(b.slots.queue.position(ticket.band, ticket.tenant, ticket.weight), service_s(b) / max(1, b.slots.limit))
             for b in usable]

    def downstream(ahead: int) -> float:
        return min((behind + ahead + 1) * per for behind, per in waits)

    return downstream


def service_s(backend: Backend) -> float:
    """How long one request holds a slot of this backend: its live median duration, else its
    predicted TTFT, else 1 s."""
    t = backend.tracker
    median = quantile(t.duration.sorted(t.clock()), 0.5)
    if median is not None:
        return median
    return t.predict_ttft() or 1.0


def refuse_late(backend: Backend, ticket: Ticket, left_s: float, metrics: Metrics, first_token_s: float = 0.0) -> None:
    """Raise Unavailable (`overloaded`) when the predicted wait for one of the full `backend`'s
    slots would use up the `left_s` the request has (less its first token): refused now, not
    after its deadline."""
    wait = backend.slots.predicted_wait_s(ticket.band, ticket.tenant, service_s(backend), ticket.weight)
    if wait <= MAX_WAIT_SHARE * (left_s - first_token_s):
        return
    metrics.shed.labels("deadline", ticket.band).inc()
    first = f" + first token {first_token_s * 1000:.0f} ms" if first_token_s else ""
    raise Unavailable(f"overloaded: predicted wait {wait * 1000:.0f} ms{first} exceeds the {left_s * 1000:.0f} ms "
                      f"left of the deadline (backend {backend.name!r} is full)", code="overloaded",
                      retry_after_s=min(max(1.0, wait), MAX_RETRY_AFTER_S))


async def wait_for_slot(backend: Backend, wait_s: float, ticket: Ticket | None, band: str, metrics: Metrics,
                        waited: Callable[[float], None]) -> bool:
    """Wait up to `wait_s` for one of the backend's slots as a waiter like `ticket`; whether one
    came. `waited` is told the seconds it waited however the wait ended (the request's queue
    stage, a client that left included); a standing queue that sheds it is Unavailable (`overloaded`)."""
    queued = time.perf_counter()
    try:
        got = await backend.slots.acquire(wait_s, ticket)
    except Shed as shed:  # a standing queue shed it, after its wait
        waited(time.perf_counter() - queued)
        metrics.shed.labels(shed.reason, band).inc()
        raise Unavailable(str(shed), code="overloaded", retry_after_s=shed.retry_after_s) from None
    except asyncio.CancelledError:  # its client left while it waited: the wait is still the request's
        waited(time.perf_counter() - queued)
        raise
    waited(time.perf_counter() - queued)
    return bool(got)


def slot_refusal(by_deadline: bool, timeout_ms: int, band: str, metrics: Metrics) -> GatewayError:
    """Why a request that queued for a slot and got none was not sent: its deadline came while it
    waited (a 504, counted `expired`), else the backend stayed at max_concurrency (a 503)."""
    if by_deadline:
        metrics.shed.labels("expired", band).inc()
        return UpstreamTimeout(f"the deadline of {timeout_ms} ms came while queued for a slot: not sent")
    return Unavailable("at max_concurrency", retry_after_s=1)


def queue_view(admission: Admission, ticket: Ticket, backend: Backend | None) -> dict[str, Any]:
    """Where a request of this band and tenant would wait now, and about how long (explain)."""
    return {
        "admission_position": admission.gate.position(ticket.band, ticket.tenant, ticket.weight),
        "admission_predicted_wait_ms": round(admission.predicted_wait_s(ticket) * 1000, 2),
        "backend": None if backend is None else backend.name,
        "backend_position": None if backend is None else backend.slots.position(ticket.band, ticket.tenant, ticket.weight),
    }
