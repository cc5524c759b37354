"""The quota stage: the tenant's limits taken before the answer and settled with what it used."""

from __future__ import annotations

from ..config.runtime import Route, Runtime, answer_ceiling
from ..observe.metrics import Metrics
from ..pipeline.call import Call
from ..web.sink import Sink
from .auth import Tenant
from .quota import Hold, QuotaExceeded

__all__ = ["QuotaHold", "QuotaStage"]


class QuotaStage:
    """One per process; the limits and counters come with each request's runtime snapshot."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

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
            self.hold = await rt.quota.reserve(self.call, self.tenant, self.sink, lambda: answer_ceiling(self.call, self.route))
        except QuotaExceeded as err:
            self.metrics.quota_rejections.labels(rt.tenants.metric_label(self.tenant.name), err.limit).inc()
            raise

    async def __aexit__(self, *exc: object) -> None:
        hold, rt = self.hold, self.rt
        if hold is None or rt.quota is None:
            return
        spend = rt.spend_usd(self.call)
        if spend:
            self.metrics.spend.labels(rt.tenants.metric_label(hold.tenant)).inc(spend)
        rt.quota.settle(hold, self.call, spend)
