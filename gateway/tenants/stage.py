"""The quota stage: the tenant's limits taken before the answer and settled with what it used."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from ..config.runtime import Runtime
from ..observe.metrics import Metrics
from ..pipeline.call import CacheResult, Call
from ..web.sink import Sink
from .auth import Tenant
from .quota import QuotaExceeded

__all__ = ["QuotaStage"]


class QuotaStage:
    """One per process; the limits and counters come with each request's runtime snapshot."""

    __slots__ = ("metrics",)

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    @asynccontextmanager
    async def hold(self, rt: Runtime, call: Call, tenant: Tenant, sink: Sink) -> AsyncIterator[None]:
        """Reserve the call's share of the tenant's limits for the block (x-ratelimit headers set;
        QuotaExceeded when a limit refuses), then settle it with the tokens and spend it used,
        on every way out of the block."""
        quota = rt.quota
        if quota is None:
            yield
            return
        try:
            hold = await quota.reserve(call, tenant, sink)
        except QuotaExceeded as err:
            self.metrics.quota_rejections.labels(rt.tenants.metric_label(tenant.name), err.limit).inc()
            raise
        try:
            yield
        finally:
            if hold is not None:
                spend = _spend_usd(call, rt)
                if spend:
                    self.metrics.spend.labels(rt.tenants.metric_label(hold.tenant)).inc(spend)
                quota.settle(hold, call, spend)


def _spend_usd(call: Call, rt: Runtime) -> float:
    """What the answer cost at its backend's `price` (0 without a price, a usage or a backend)."""
    backend = rt.backends.get(call.out.backend or "")
    usage = call.out.usage
    if backend is None or backend.policy.price is None or not usage or call.cache.result is CacheResult.HIT:
        return 0.0
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return backend.policy.price.usd(p if isinstance(p, int) else 0, c if isinstance(c, int) else 0)
