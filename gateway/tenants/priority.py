"""A tenant's priority is a ceiling: the band a request gets, and the `service_tier` sent upstream.

`tenants.<name>.priority` is the highest band the tenant's requests may ask for, and its
`default_priority` (else `priority`) the band of a request that asks for none. A request asks with
`x-priority` (the gateway's own header, which wins when sent) or the body's `service_tier`; an ask
above the ceiling is clamped to it, never refused, as OpenAI serves a tier a project may not use
at the one it may (the answer's own `service_tier` says which).

A `service_tier` above the ceiling is also removed from the body sent upstream: a provider bills
priority processing to the gateway's account, so only a tenant allowed that band may ask for it
there. A tier within the ceiling goes upstream as sent; the gateway never adds one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import orjson

from ..admission.gate import BANDS
from ..pipeline.call import Call
from .auth import Tenant

__all__ = ["Band", "TIER_BANDS", "asked_band", "band_for", "cap", "without_tier"]


class Band(StrEnum):
    """A request's priority band, highest first (admission.BANDS: its queues' order)."""

    PRIORITY = "priority"
    DEFAULT = "default"
    FLEX = "flex"


assert tuple(Band) == BANDS
_BANDS = {b.value: b for b in Band}  # a dict lookup: calling Band(name) costs microseconds

# OpenAI's service tiers and the band each asks for (`scale`: reserved capacity, default processing).
TIER_BANDS = {"priority": Band.PRIORITY, "default": Band.DEFAULT, "auto": Band.DEFAULT, "scale": Band.DEFAULT,
              "flex": Band.FLEX,
              "standard_only": Band.DEFAULT}  # Anthropic's: standard capacity, never its Priority Tier


def _above(band: str, ceiling: str) -> bool:
    return BANDS.index(band) < BANDS.index(ceiling)


def asked_band(header: str | None, body: dict[str, Any]) -> Band | None:
    """The band a request asks for: `x-priority` when sent (a band's name), else its
    `service_tier`'s, else None."""
    if header is not None:
        return _BANDS[header]
    tier = body.get("service_tier")
    return TIER_BANDS.get(tier) if isinstance(tier, str) else None


def band_for(asked: str | None, tenant: Tenant) -> Band:
    """The band a request gets: what it asked for (else the tenant's default), at most the ceiling."""
    band = asked or tenant.default_priority or tenant.priority
    return _BANDS[tenant.priority if _above(band, tenant.priority) else band]


def without_tier(body: dict[str, Any], tenant: Tenant) -> dict[str, Any] | None:
    """The body to send upstream when its `service_tier` may not go there (above the tenant's
    ceiling, or no tier at all): the body without it. None when the body may go as it is."""
    if "service_tier" not in body:
        return None
    tier = body["service_tier"]
    band = TIER_BANDS.get(tier) if isinstance(tier, str) else None
    if tier is None or (band is not None and not _above(band, tenant.priority)):
        return None
    return {k: v for k, v in body.items() if k != "service_tier"}


def cap(call: Call, tenant: Tenant) -> None:
    """Hold the call to its tenant's ceiling: its band (`call.asked.priority`), and the `service_tier`
    its body sends upstream (removed above the ceiling; `call.raw` re-encoded then)."""
    call.asked.priority = band_for(call.asked.priority, tenant)
    body = without_tier(call.body, tenant)
    if body is not None:
        call.body, call.raw = body, orjson.dumps(body)
