"""Hedging: when the first backend's first token is late, the same request on the next one too."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ..errors import UpstreamRejected
from ..routing.backends import Backend
from .attempt import ClientGone
from .base import RelayBase

__all__ = ["Hedging"]


class Hedging(RelayBase):
    __slots__ = ()

    async def hedged(self, primary: Backend, others: Sequence[Backend], cold_s: float | None) -> bool | None:
        """Run the primary; if its first token (a whole answer: the answer) is later than its
        live P95, run the same request on the next best backend too, while the route's hedge
        budget and the tenant's share of it allow (routing/hedge_budget.py). Whichever
        reaches the client first wins; the other is cancelled. The hedge is a try of its own (the caller
        hedges only while one more fits within max_attempts). None when the primary found no slot after all
        (taken by another request before its task ran) and nothing was sent.

        Each attempt acquires and releases its own slot inside its task, so cancelling a task at
        any point (before its first step included) leaks nothing."""
        call, route, progress, metrics = self.call, self.route, self.progress, self.ctx.metrics
        hp, budget = route.hedge, route.budget
        assert hp is not None and budget is not None
        # Per tenant too: one tenant's late first tokens spend only its own share (HedgeBudget).
        tenant = None if call.tenant is None else call.tenant.name
        budget.note_request(tenant)
        tracker = primary.tracker_for(call.model)  # its model's figures, not the backend's other models'
        if call.stream or not call.endpoint.generates:
            p95 = tracker.ttft_p95_s(call.prompt_tokens)
        else:  # a whole answer comes with its last token: hedge past the P95 of whole answers
            p95 = tracker.whole_deadline_s(mult=1.0, min_samples=10) or None
        delay = hp.default_delay_ms / 1000 if p95 is None else max(hp.min_delay_ms / 1000, p95)
        tasks = [asyncio.create_task(self.attempt(primary, live=route.routing, cold_s=cold_s))]
        try:
            done, _ = await asyncio.wait(tasks, timeout=min(delay, max(0.0, call.remaining_s())))
            if not done and progress.owner is None:
                second = next((b for b in others if b.slots.free(self.band)), None)
                if second is None:
                    metrics.hedges.labels("no_candidate").inc()
                elif not budget.try_spend(tenant):
                    metrics.hedges.labels("budget_exhausted").inc()
                else:
                    metrics.hedges.labels("started").inc()
                    self.tries.count += 1  # a second upstream call: it counts within server.max_attempts
                    progress.rivals = tasks
                    # The live-P95 deadline only while another backend could take over (as the relay
                    # does): a hedge on the last candidate cut at it failed requests that backend
                    # would have answered (three huge prompts: 504 on both, both ejected).
                    last = self.tries.count >= route.server.max_attempts or second is others[-1]
                    tasks.append(asyncio.create_task(self.attempt(second, live=None if last else route.routing, cold_s=cold_s,
                                                                  hedge=True)))
            results = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()  # the client went away, or we are done: no attempt outlives the relay
            await asyncio.gather(*tasks, return_exceptions=True)
            progress.rivals = None  # the race is over: a later attempt (a failover) sets the call's timing again
        if len(tasks) == 2 and progress.owner is not None:
            metrics.hedges.labels("won" if progress.owner != primary.name else "lost").inc()
        for r in results:
            if isinstance(r, ClientGone) or (isinstance(r, UpstreamRejected) and progress.owner is None):
                raise r
            if isinstance(r, BaseException) and not isinstance(r, (UpstreamRejected, asyncio.CancelledError)):
                raise r  # a bug in an attempt: the pipeline's edge answers it
        if len(results) == 1 and results[0] is None:
            return None  # the primary's slot was taken before its task ran (attempt's None)
        return any(r is True for r in results)
