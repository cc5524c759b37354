"""The console's overview: the last minutes of traffic, read from the request log (so it covers
every replica on a shared store): request rate, errors, cache hit ratio, and per backend its
requests, errors, TTFT (streams) and latency (every answer). Requests no backend answered are
counted apart: `cache_hits`, and `unrouted` (refused before routing, or every candidate failed)."""

from __future__ import annotations

from typing import Any

from .log_store import Cursor, Filter, LogStore

__all__ = ["overview", "WINDOW_S"]

WINDOW_S = 300
_MAX_ENTRIES = 10_000  # a busier window is summarised from its newest entries (`sampled`)


async def overview(store: LogStore, now: float) -> dict[str, Any]:
    """Figures over the last WINDOW_S seconds."""
    since = now - WINDOW_S
    entries: list[dict[str, Any]] = []
    at: Cursor | None = None
    sampled = False
    while True:
        page = await store.page(Filter(), 1000, at)
        fresh = [e for e in page.entries if isinstance(e.get("time"), (int, float)) and e["time"] >= since]
        entries += fresh
        if len(entries) >= _MAX_ENTRIES:
            sampled = True
            break
        if page.next is None or len(fresh) < len(page.entries):
            break
        at = Cursor.parse(page.next)
    return _figures(entries, now, sampled)


def _figures(entries: list[dict[str, Any]], now: float, sampled: bool) -> dict[str, Any]:
    n = len(entries)
    span = WINDOW_S if not sampled or not entries else max(1.0, now - min(e["time"] for e in entries))
    errors = sum(1 for e in entries if _error(e))
    refused = sum(1 for e in entries if isinstance(e.get("status"), int) and 400 <= e["status"] < 500)
    looked = [e for e in entries if e.get("cache") in ("hit", "miss")]
    backends: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    durations: dict[str, list[float]] = {}
    unrouted = cache_hits = 0
    for e in entries:
        name = e.get("backend")
        if name == "cache":
            cache_hits += 1
            continue
        if not isinstance(name, str):
            unrouted += 1
            continue
        b = backends.setdefault(name, {"requests": 0, "errors": 0})
        b["requests"] += 1
        b["errors"] += _error(e)
        for key, into in (("ttft_ms", ttfts), ("duration_ms", durations)):
            v = e.get(key)
            if isinstance(v, (int, float)):
                into.setdefault(name, []).append(float(v))
    for name, b in backends.items():
        ts, ds = sorted(ttfts.get(name, ())), sorted(durations.get(name, ()))
        b.update(ttft_ms_p50=_pct(ts, 0.5), ttft_ms_p95=_pct(ts, 0.95), latency_ms_p50=_pct(ds, 0.5), latency_ms_p95=_pct(ds, 0.95))
    return {
        "window_s": WINDOW_S, "requests": n, "rate_per_s": round(n / span, 3), "errors": errors, "client_errors": refused,
        "error_ratio": round(errors / n, 4) if n else 0.0,
        "cache_hit_ratio": round(sum(1 for e in looked if e["cache"] == "hit") / len(looked), 4) if looked else None,
        "cache_hits": cache_hits, "unrouted": unrouted, "sampled": sampled, "backends": backends,
    }  # fmt: skip


def _error(e: dict[str, Any]) -> int:
    """A failure of the gateway or its backends (5xx); a refused request (4xx) is the caller's."""
    s = e.get("status")
    return 1 if isinstance(s, int) and s >= 500 else 0


def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return round(sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))], 2)
