"""The console's overview: the last minutes of traffic, read from the request log (so it covers
every replica on a shared store): request rate, errors, cache hit ratio, and per backend its
requests, errors, TTFT (streams) and latency (every answer). Requests no backend answered are
counted apart: `cache_hits`, and `unrouted` (refused before routing, or every candidate failed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from .log_store import Cursor, Filter, LogStore
from .request_log import RequestLog

__all__ = ["Overviews", "overview", "WINDOW_S"]

WINDOW_S = 300
_MAX_ENTRIES = 10_000  # a busier window is summarised from its newest entries (`sampled`)
FRESH_S = 2.0  # an overview this recent is answered again (the console refreshes every 5 s)


class Overviews:
    """The app's overview, computed once at a time and reused for FRESH_S: each one reads up to
    10,000 log entries, and viewers polling it at once each paid that on the event loop (8 of
    them held /healthz ~0.5 s: review helper's repro)."""

    __slots__ = ("_clock", "_at", "_last", "_running")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._at = -1e18
        self._last: dict[str, Any] | None = None
        self._running: asyncio.Task[dict[str, Any]] | None = None

    async def get(self, log: RequestLog) -> dict[str, Any]:
        """A recent overview of `log`: the last one while fresh, else the one being computed, else a new one."""
        if self._last is not None and self._clock() - self._at < FRESH_S:
            return self._last
        task = self._running
        if task is None:
            task = self._running = asyncio.get_running_loop().create_task(self._compute(log))
        return await asyncio.shield(task)  # a caller that leaves does not cancel the others' answer

    async def _compute(self, log: RequestLog) -> dict[str, Any]:
        try:
            await log.flush()  # what this process has not written yet
            out = await overview(log.store, time.time())
            self._last, self._at = out, self._clock()
            return out
        finally:
            self._running = None


async def overview(store: LogStore, now: float) -> dict[str, Any]:
    """Figures over the last WINDOW_S seconds, summed a page (1,000 entries) at a time: the event
    loop serves other requests between pages (summing 10,000 at once held it 67 ms)."""
    since = now - WINDOW_S
    acc = _Figures()
    at: Cursor | None = None
    sampled = False
    while True:
        page = await store.page(Filter(), 1000, at)
        fresh = [e for e in page.entries if isinstance(e.get("time"), (int, float)) and e["time"] >= since]
        acc.add(fresh)
        if acc.n >= _MAX_ENTRIES:
            sampled = True
            break
        if page.next is None or len(fresh) < len(page.entries):
            break
        at = Cursor.parse(page.next)
        await asyncio.sleep(0)  # a page of the memory store is read without a pause of its own
    return acc.figures(now, sampled)


class _Figures:
    """The overview's sums, added to a page at a time."""

    def __init__(self) -> None:
        self.n = self.errors = self.refused = self.looked = self.hits = self.unrouted = self.cache_hits = 0
        self.oldest: float | None = None
        self.backends: dict[str, dict[str, Any]] = {}
        self.ttfts: dict[str, list[float]] = {}
        self.durations: dict[str, list[float]] = {}

    def add(self, entries: list[dict[str, Any]]) -> None:
        self.n += len(entries)
        for e in entries:
            t = e["time"]
            self.oldest = t if self.oldest is None else min(self.oldest, t)
            err = _error(e)
            self.errors += err
            status = e.get("status")
            self.refused += isinstance(status, int) and 400 <= status < 500
            cache = e.get("cache")
            if cache in ("hit", "miss"):
                self.looked += 1
                self.hits += cache == "hit"
            name = e.get("backend")
            if name == "cache":
                self.cache_hits += 1
                continue
            if not isinstance(name, str):
                self.unrouted += 1
                continue
            b = self.backends.setdefault(name, {"requests": 0, "errors": 0})
            b["requests"] += 1
            b["errors"] += err
            for key, into in (("ttft_ms", self.ttfts), ("duration_ms", self.durations)):
                v = e.get(key)
                if isinstance(v, (int, float)):
                    into.setdefault(name, []).append(float(v))

    def figures(self, now: float, sampled: bool) -> dict[str, Any]:
        n = self.n
        span = WINDOW_S if not sampled or self.oldest is None else max(1.0, now - self.oldest)
        for name, b in self.backends.items():
            ts, ds = sorted(self.ttfts.get(name, ())), sorted(self.durations.get(name, ()))
            b.update(ttft_ms_p50=_pct(ts, 0.5), ttft_ms_p95=_pct(ts, 0.95), latency_ms_p50=_pct(ds, 0.5), latency_ms_p95=_pct(ds, 0.95))
        return {
            "window_s": WINDOW_S, "requests": n, "rate_per_s": round(n / span, 3), "errors": self.errors,
            "client_errors": self.refused, "error_ratio": round(self.errors / n, 4) if n else 0.0,
            "cache_hit_ratio": round(self.hits / self.looked, 4) if self.looked else None,
            "cache_hits": self.cache_hits, "unrouted": self.unrouted, "sampled": sampled, "backends": self.backends,
        }  # fmt: skip


def _error(e: dict[str, Any]) -> int:
    """A failure of the gateway or its backends (5xx); a refused request (4xx) is the caller's."""
    s = e.get("status")
    return 1 if isinstance(s, int) and s >= 500 else 0


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 2)
