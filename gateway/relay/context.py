"""What every request's relay shares in one process: the upstream pool, the metrics, single
flight, the admission gate, and the relays carried on for single-flight followers."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..admission.gate import Admission
from ..cache.core import SingleFlight
from ..observe.metrics import Metrics
from ..upstream.client import UpstreamPool

__all__ = ["RelayContext"]


@dataclass(slots=True)
class RelayContext:
    """Shared by every request in one process. Policy settings come with each request's Route
    instead, so a reload never changes them mid-request."""

    pool: UpstreamPool
    metrics: Metrics
    flight: SingleFlight = field(default_factory=SingleFlight)
    # The process-wide admission gate: it outlives reloads (they change its limits, not its queue).
    admission: Admission = field(default_factory=lambda: Admission(1024, 4096))
    # Relays going on for single-flight followers after their leader's client left (cache/stage.py):
    # a shutdown that runs out of time cancels them before the pool closes.
    carried: set[asyncio.Task[None]] = field(default_factory=set)

    async def cancel_carried(self) -> None:
        """Cancel the relays still going on for followers, and wait until they have ended."""
        tasks = list(self.carried)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
