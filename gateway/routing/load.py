"""Load signals from model servers: the queue and KV-cache gauges their Prometheus endpoint reports.

A backend that names a `metrics_url` is scraped off the request path (routing/scrape.py); the
latest sample lives in its `Load` (one per backend, kept across reloads with its BackendState).
Routing reads it through `fresh()`: a sample older than `routing.load_signals.stale_ms`, or none
at all, reads as None and routing falls back to its own view (in-flight counts, measured TTFT),
so a stale or failing scrape degrades routing, never a request.

Recognised gauges (summed over label sets, e.g. one per model):

- waiting:  vllm:num_requests_waiting, sglang:num_queue_reqs, tgi_queue_size
- running:  vllm:num_requests_running, sglang:num_running_reqs, tgi_batch_current_size
- KV use:   vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc, sglang:token_usage (0..1)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Load", "LoadSample", "parse_load"]


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One scrape's figures."""

    waiting: float  # requests queued at the server (everyone's, not only ours)
    running: float  # requests being served
    kv_usage: float | None = None  # share of the KV cache in use, 0..1 (None: not reported)


_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "tgi_queue_size")
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "tgi_batch_current_size")
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_NAME = re.compile(r"[^{ \t]+")
_WANTED = {**{n: 0 for n in _WAITING}, **{n: 1 for n in _RUNNING}, **{n: 2 for n in _KV}}


def parse_load(text: str) -> LoadSample | None:
    """The load figures in a Prometheus text exposition (None when it has none of the gauges).

    Reads only the sample lines of the recognised names, so a large exposition costs one pass and
    nothing else of it is kept; a malformed line is skipped."""
    sums: list[float | None] = [None, None, None]
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _NAME.match(line)
        kind = _WANTED.get(m.group()) if m is not None else None
        if kind is None:
            continue
        end = m.end()  # type: ignore[union-attr]  # kind is set only when m matched
        rest = line[end:].lstrip()
        if rest.startswith("{"):
            close = _labels_end(rest)
            if close < 0:
                continue
            rest = rest[close + 1 :]
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value) or value < 0:  # NaN, infinite or negative: not a load figure
            continue
        if kind == 2:  # a share: several label sets (per model) -> the largest, not a sum
            prev = sums[2]
            sums[2] = value if prev is None else max(prev, value)
        else:
            sums[kind] = (sums[kind] or 0.0) + value
    if sums[0] is None and sums[1] is None and sums[2] is None:
        return None
    kv = sums[2]
    return LoadSample(sums[0] or 0.0, sums[1] or 0.0, None if kv is None else min(1.0, kv))


def _labels_end(rest: str) -> int:
    """The index of the `}` that closes the label set `rest` starts with (a quoted value may hold
    one), or -1."""
    quoted = escaped = False
    for i, ch in enumerate(rest):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1


class Load:
    """A backend's latest load sample, and how its scrapes go (the scraper writes, routing reads)."""

    __slots__ = ("sample", "at", "error", "scrapes", "failures")

    def __init__(self) -> None:
        self.sample: LoadSample | None = None
        self.at = float("-inf")  # time.monotonic() of the sample
        self.error: str | None = None  # the last scrape's failure (None: it worked)
        self.scrapes = 0
        self.failures = 0

    def update(self, sample: LoadSample, now: float) -> None:
        self.sample, self.at, self.error = sample, now, None
        self.scrapes += 1

    def failed(self, why: str) -> None:
        """A scrape failed: the old sample stays until it goes stale."""
        self.error = why
        self.scrapes += 1
        self.failures += 1

    def fresh(self, now: float, stale_s: float) -> LoadSample | None:
        """The sample when it is at most `stale_s` old, else None."""
        return self.sample if now - self.at <= stale_s else None

    def view(self, now: float, stale_s: float) -> dict[str, Any]:
        """For /v1/route/explain and /admin/backends."""
        s = self.sample
        return {
            "waiting": None if s is None else s.waiting,
            "running": None if s is None else s.running,
            "kv_cache_usage": None if s is None or s.kv_usage is None else round(s.kv_usage, 4),
            "age_s": None if s is None else round(now - self.at, 2),
            "stale": self.fresh(now, stale_s) is None,
            "error": self.error,
        }
