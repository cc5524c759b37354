"""Active health probes: a cheap `GET /models` to ejected, half-open and idle backends.

Passive checks see only the traffic a backend gets; an ejected or idle backend gets none, so this
is how a recovered backend is noticed (and a dead idle one is ejected before a user finds out).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from .backends import Backend
from .metrics import Metrics
from .reload import Live

__all__ = ["run_probes", "probe"]

log = logging.getLogger("gateway.probes")


async def probe(http: aiohttp.ClientSession, backend: Backend, timeout_s: float) -> bool:
    """True when the backend answers its model list (any status below 500 but 429)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(backend.base_url + "/models", headers=backend.headers) as resp:
                await resp.read()
                return resp.status < 500 and resp.status != 429
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False


def _due(backend: Backend, interval_s: float) -> bool:
    h = backend.health
    if not h.ready:
        return False  # a launched backend still starting: its launcher watches it
    healths = (h, *backend.state.models.values())
    return any(x.state() in ("ejected", "probing") for x in healths) or backend.tracker.idle_s() > interval_s


async def run_probes(live: Live, metrics: Metrics) -> None:
    """Probe due backends every `health.probe_interval_ms` until cancelled."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        while True:
            rt = live.runtime  # follows reloads
            hp = rt.policy.health
            interval = hp.probe_interval_ms / 1000
            await asyncio.sleep(interval)
            due = [b for b in rt.backends.values() if _due(b, interval)]
            if not due:
                continue
            results = await asyncio.gather(*(probe(http, b, hp.probe_timeout_ms / 1000) for b in due))
            for backend, ok in zip(due, results, strict=True):
                before = backend.headline_health().state()
                backend.health.report_probe(ok)  # a failed probe counts against the backend as a whole
                if ok:  # a good one may end a first ejection early, the backend's or a model's (half-open)
                    for h in backend.state.models.values():
                        h.report_probe(True)
                metrics.probes.labels(backend.name, "ok" if ok else "failed").inc()
                after = backend.headline_health().state()
                if before != after:
                    log.info("backend %s: %s -> %s after a %s probe", backend.name, before, after, "good" if ok else "failed")
