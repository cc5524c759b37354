"""The hedge budget of one route: how many extra upstream calls hedges may add, and each tenant's share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["HedgeBudget"]


class _Share:
    """Decayed requests and hedges on a route: one tenant's, or all of them (HedgeBudget)."""

    __slots__ = ("requests", "hedges", "at")

    def __init__(self, at: float) -> None:
        self.requests, self.hedges, self.at = 0.0, 0.0, at

    def fits(self, pct: float) -> bool:
        """Whether one more hedge stays within `pct` % of these requests (+1: one allowed from the start)."""
        return self.hedges + 1 <= pct / 100 * self.requests + 1

    def decay(self, now: float, half_life_s: float) -> None:
        if now != self.at:
            k = 0.5 ** ((now - self.at) / half_life_s)
            self.requests *= k
            self.hedges *= k
            self.at = now


@dataclass(eq=False)
class HedgeBudget:
    """Hedges may add at most `pct` % extra upstream calls, measured over a decaying window (one
    hedge allowed from the start), and so may each tenant's requests, of their own number: one
    tenant's requests with deliberately late first tokens had every hedge the route's traffic
    earned, and the others' late ones met `budget_exhausted` (review helper's repro). A tenant
    never spends the share the others' requests earned; the route's cap still bounds the sum (many
    tenants' one free hedge each included). O(1) a request: a dict look-up and a decay per call.
    `tenant` None (open mode, a call before auth) is one more share.

    Kept across policy reloads while its route is unchanged (config/runtime.py `_hedge_budget`): a new one's free
    hedge at each reload made a reload storm a hedge per reload."""

    pct: float
    half_life_s: float = 60.0
    clock: object = time.monotonic
    _route: _Share = field(default_factory=lambda: _Share(time.monotonic()), repr=False)  # every tenant's together
    # tenant name -> its share: as many as the policies' tenants (a virtual key's is its tenant's)
    _tenants: dict[str | None, _Share] = field(default_factory=dict, repr=False)

    def _shares(self, tenant: str | None) -> tuple[_Share, _Share]:
        """The route's counts and `tenant`'s, decayed to now."""
        now: float = self.clock()  # type: ignore[operator]
        self._route.decay(now, self.half_life_s)
        share = self._tenants.get(tenant)
        if share is None:
            share = self._tenants[tenant] = _Share(now)
        else:
            share.decay(now, self.half_life_s)
        return self._route, share

    def note_request(self, tenant: str | None = None) -> None:
        for counts in self._shares(tenant):
            counts.requests += 1

    def try_spend(self, tenant: str | None = None) -> bool:
        """True (and counted) when one more hedge stays within the route's budget and `tenant`'s share."""
        route, share = self._shares(tenant)
        if not (route.fits(self.pct) and share.fits(self.pct)):
            return False
        route.hedges += 1
        share.hedges += 1
        return True
