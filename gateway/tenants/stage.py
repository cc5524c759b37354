"""The quota stage: the tenant's limits taken before the answer and settled with what it used."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from ..config.runtime import Route, Runtime, answer_ceiling, answer_cost_usd
from ..errors import GatewayError
from ..observe.metrics import Metrics
from ..pipeline.call import Call
from ..web.sink import Sink
from .auth import Tenant
from .quota import Hold, QuotaExceeded

__all__ = ["QuotaHold", "QuotaStage"]


def count_rejection(metrics: Metrics, rt: Runtime, tenant: Tenant, err: QuotaExceeded) -> None:
    """gateway_quota_rejections_total, for a refusal of `tenant` by `err`'s limit."""
    metrics.quota_rejections.labels(rt.tenants.metric_label(tenant.name), err.limit).inc()


def _no_header(name: str, value: str) -> None:
    """Where the x-ratelimit headers of an answer that carries none go."""


class QuotaStage:
    """One per process; the limits and counters come with each request's runtime snapshot."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def early(self, rt: Runtime, call: Call, sink: Sink) -> None:
        """Before intake: refuse (QuotaExceeded) a caller whose tenant is out of requests for a
        while, before its body is parsed (an unauthenticated one is intake's 401)."""
        quota, tenant = rt.quota, call.tenant
        if quota is None or tenant is None:
            return
        try:
            quota.refuse_early(tenant, sink.set_header)
        except QuotaExceeded as err:
            count_rejection(self.metrics, rt, tenant, err)
            raise

    async def refused(self, rt: Runtime, call: Call, err: GatewayError) -> None:
        """A request intake refused (a 400, 403, 404) is a request all the same: taken from the
        tenant's `rpm` (and given back at once), so a flood of bodies that fail validation spends
        it and is then refused before parsing too (each cost up to ~50 ms of the event loop to
        decode). Its own error stands."""
        quota, tenant = rt.quota, call.tenant
        if quota is None or tenant is None or isinstance(err, QuotaExceeded):
            return
        try:
            quota.release(await quota.reserve_request(tenant, call.remaining_s(), _no_header))
        except QuotaExceeded as rpm:
            count_rejection(self.metrics, rt, tenant, rpm)

    @contextlib.asynccontextmanager
    async def one_request(self, rt: Runtime, tenant: Tenant | None, timeout_s: float) -> AsyncIterator[None]:
        """One request of the tenant's request limits (`rpm`, `concurrency`) for the block, as a
        by-id call takes: for a request that calls no backend but is parsed like one
        (/v1/route/explain, /v1/messages/count_tokens). None: not authenticated yet (its 401 comes
        from the block)."""
        if rt.quota is None or tenant is None:
            yield
            return
        try:
            hold = await rt.quota.reserve_request(tenant, timeout_s, _no_header)
        except QuotaExceeded as err:
            count_rejection(self.metrics, rt, tenant, err)
            raise
        try:
            yield
        finally:
            rt.quota.release(hold)

    def hold(self, rt: Runtime, call: Call, route: Route, tenant: Tenant, sink: Sink) -> QuotaHold:
        """`async with` it: the call's share of the tenant's limits reserved for the block
        (x-ratelimit headers set; QuotaExceeded when a limit refuses), then settled with the
        tokens and spend it used, on every way out of the block."""
        return QuotaHold(self.metrics, rt, call, route, tenant, sink)


class QuotaHold:
    """One call's quota hold (a class, not a generator: entered on every request)."""

    __slots__ = ("metrics", "rt", "call", "route", "tenant", "sink", "hold")

    def __init__(self, metrics: Metrics, rt: Runtime, call: Call, route: Route, tenant: Tenant, sink: Sink) -> None:
        self.metrics, self.rt, self.call, self.route, self.tenant, self.sink = metrics, rt, call, route, tenant, sink
        self.hold: Hold | None = None

    async def __aenter__(self) -> None:
        rt = self.rt
        if rt.quota is None:
            return
        try:
            self.hold = await rt.quota.reserve(self.call, self.tenant, self.sink, lambda: answer_ceiling(self.call, self.route),
                                               lambda p, c: answer_cost_usd(self.call, self.route, p, c))
        except QuotaExceeded as err:
            count_rejection(self.metrics, rt, self.tenant, err)
            raise

    async def __aexit__(self, *exc: object) -> None:
        hold, rt = self.hold, self.rt
        if hold is None or rt.quota is None:
            return
        call = self.call
        spend = call.out.spend_usd = rt.quota.settle(hold, call, rt.spend_usd)
        if spend > 0:  # a Counter raises on a negative amount
            self.metrics.spend_of(rt.tenants.metric_label(hold.tenant)).inc(spend)
