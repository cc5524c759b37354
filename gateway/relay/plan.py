"""The order a request tries its candidates in: the selector's ranking, then two preferences on top.

1. `routing.simple: local_first`: a simple prompt on a pool that mixes local models and others goes
   to a local one (cost first) unless every local one is unhealthy, saturated (no free slot) or
   predicted to miss the request's deadline; `latency` leaves the ranking as it is.
2. Prefix affinity (routing/affinity.py): among the candidates step 1 put in front, the one that
   most likely holds the prompt's prefix in its cache, within the load bound.

Health still decides eligibility: neither step ever moves a skipped candidate forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from ..config.runtime import Pool, Route
from ..pipeline.call import Call
from ..routing.affinity import AffinityResult, Decision, Option, choose
from ..routing.selector import Candidate, Ranked
from ..tenants.priority import Band

__all__ = ["Plan", "plan"]


class Plan(NamedTuple):  # a tuple: one per request, and a frozen dataclass's __init__ costs ~1 us more
    ranked: list[Ranked]  # every candidate: the order to try the eligible ones in, skipped ones last
    affinity: Decision | None  # None: prefix affinity does not apply to this pool or request
    simple: str | None  # what routing.simple did for a simple prompt on a mixed pool (None: not asked)


def plan(call: Call, route: Route, pool: Pool, band: str = Band.DEFAULT) -> Plan:
    """Rank `pool`'s candidates for `call` (pure: learns nothing; the relay learns as it sends)."""
    ranked = pool.selector.rank(pool.candidates, call.prompt_tokens)
    simple = None
    front = 0  # ranked[:front] are the candidates the preferences choose among (0: every eligible one)
    if pool.mixed and call.cls == "simple":
        ranked, front, simple = _local_first(call, route, pool, ranked, band)
    decision = None
    keys = call.prefix
    if pool.affinity and keys is not None and route.prefixes is not None:
        group = ranked[:front] if front else ranked
        pa = route.routing.prefix_affinity
        decision = choose(
            _options(group, pool.candidates, pool.selector.load_stale_s), keys, route.prefixes,
            max_imbalance=pa.max_imbalance, max_slowdown=pa.max_slowdown, max_share=pa.max_share,
        )
        if ranked and ranked[0].explore and decision.backend != ranked[0].name:
            # The selector's exploration (a backend without samples, or silent too long) goes first:
            # else a prompt repeated to one holder would keep every other backend unmeasured.
            result = AffinityResult.SPILL if decision.result is AffinityResult.HIT else decision.result
            decision = replace(decision, result=result, backend=ranked[0].name,
                               reason=f"{ranked[0].note} on {ranked[0].name} goes first (affinity wanted {decision.backend})")
        elif decision.backend is not None and ranked and ranked[0].name != decision.backend:
            at = next(i for i, r in enumerate(ranked) if r.name == decision.backend)
            ranked.insert(0, ranked.pop(at))
    return Plan(ranked, decision, simple)


def _options(ranked: Sequence[Ranked], candidates: Sequence[Candidate], stale_s: float) -> list[Option]:
    now = time.monotonic()
    out = []
    for r in ranked:
        c = candidates[r.index]
        out.append(Option(r.name, r.skipped is None, r.skipped, c.outstanding(now, stale_s), r.score))
    return out


def _local_first(call: Call, route: Route, pool: Pool, ranked: list[Ranked], band: str) -> tuple[list[Ranked], int, str]:
    """Local candidates first when one can take the request; (order, how many lead, what applied)."""
    if route.routing.simple != "local_first":
        return ranked, 0, "latency: every candidate ranked by predicted latency (routing.simple)"
    fit: list[Ranked] = []
    why: list[str] = []
    remaining = call.remaining_s()
    for r in ranked:
        if not pool.candidates[r.index].local:
            continue
        b = pool.backends[r.index]
        if r.skipped is not None:
            why.append(f"{r.name} is {r.skipped}")
        elif not b.slots.free(band):
            why.append(f"{r.name} is saturated ({b.slots.used}/{b.slots.limit} in flight)")
        elif r.predicted_ttft_s is not None and r.predicted_ttft_s > remaining:
            why.append(f"{r.name} is predicted at {r.predicted_ttft_s * 1000:.0f} ms, past the {remaining * 1000:.0f} ms left")
        else:
            fit.append(r)
    if not fit:
        # The others lead, and only they are affinity's to choose among: a local model just passed
        # over (full, too slow for the deadline) must not come back first as a prefix's holder.
        others = [r for r in ranked if not pool.candidates[r.index].local]
        order = others + [r for r in ranked if pool.candidates[r.index].local]
        return order, len(others), "local first, spilled: " + "; ".join(why or ["no local candidate"])
    rest = [r for r in ranked if r not in fit]
    return fit + rest, len(fit), f"local first: {fit[0].name}"


def plan_view(p: Plan) -> dict[str, Any]:
    """The preferences' part of /v1/route/explain."""
    return {
        "prefix_affinity": None if p.affinity is None else p.affinity.view(),
        "simple_routing": p.simple,
    }
