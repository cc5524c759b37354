"""Counters, gauges and histograms updated on every request, at the cost of an addition.

prometheus_client spends ~50 interpreter steps on each `inc` or `observe` (an observability
check, a lock, an exemplar branch, a walk over the buckets), and a request makes ~20 of them.
In one process these children add into plain numbers on the event loop and fold what they hold
into their prometheus_client child whenever the registry is collected (`Folder`, registered
first): /metrics and `registry.get_sample_value` see every update, as before. With
`--workers N` (PROMETHEUS_MULTIPROC_DIR) the values must reach each worker's mmap file as they
happen (a scrape served by another worker reads them there), so `Hot.wrap` hands back
prometheus_client's own child unchanged.

Only the event loop's thread may update them (a thread's `+=` could race the fold): children
updated from other threads (the access log's writer, the encoder's worker) stay plain
prometheus_client children.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Iterator
from typing import Any

__all__ = ["Hot", "HotCounter", "HotGauge", "HotHistogram"]


class _Pending:
    """A counter or gauge child's pending change, added into it at the fold."""

    __slots__ = ("_child", "pending")

    def __init__(self, child: Any) -> None:
        self._child = child
        self.pending = 0.0

    def fold(self) -> None:
        if self.pending:
            n, self.pending = self.pending, 0.0
            self._child.inc(n)


class HotCounter(_Pending):
    """A counter child's pending increments."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        """Count `amount` (not negative: a counter only grows)."""
        if amount < 0:
            raise ValueError(f"a counter only grows: inc({amount})")
        self.pending += amount


class HotGauge(_Pending):
    """A gauge child moved up and down by the requests in flight (its `set` is not hot: use the child)."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        self.pending += amount

    def dec(self, amount: float = 1) -> None:
        self.pending -= amount


class HotHistogram:
    """A histogram child's pending observations, counted per bucket as prometheus_client does
    (the first bucket whose upper bound is at least the value)."""

    __slots__ = ("_buckets", "_sum", "_bounds", "counts", "total")

    def __init__(self, child: Any) -> None:
        # prometheus_client keeps a histogram child's state in these (the same since 0.4); a test
        # holds the folded exposition to the one its own observe() makes.
        self._buckets, self._sum = child._buckets, child._sum
        self._bounds: list[float] = list(child._upper_bounds)
        self.counts = [0] * len(self._bounds)
        self.total = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.total += amount

    def fold(self) -> None:
        counts = self.counts
        if not any(counts):
            return
        total, self.total = self.total, 0.0
        for i, n in enumerate(counts):
            if n:
                self._buckets[i].inc(n)
                counts[i] = 0
        self._sum.inc(total)


_HotChild = HotCounter | HotGauge | HotHistogram


class Hot:
    """The hot children of one registry, and their fold."""

    def __init__(self, multiprocess: bool | None = None) -> None:
        if multiprocess is None:
            multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.enabled = not multiprocess
        self._children: list[_HotChild] = []

    def counter(self, child: Any) -> Any:
        """`child` (a Counter's labelled child) as a hot one, or itself with --workers N."""
        return self._keep(HotCounter(child)) if self.enabled else child

    def gauge(self, child: Any) -> Any:
        """`child` (a Gauge's labelled child, moved by inc/dec) as a hot one, or itself."""
        return self._keep(HotGauge(child)) if self.enabled else child

    def histogram(self, child: Any) -> Any:
        """`child` (a Histogram's labelled child) as a hot one, or itself."""
        return self._keep(HotHistogram(child)) if self.enabled else child

    def _keep(self, child: _HotChild) -> Any:
        self._children.append(child)
        return child

    def fold(self) -> None:
        """Add what every hot child holds into its prometheus_client child."""
        for child in self._children:
            child.fold()


class Folder:
    """A collector that yields no metric: registered first, it folds the hot children into theirs
    before the registry's other collectors are read."""

    def __init__(self, hot: Hot) -> None:
        self._hot = hot

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        self._hot.fold()
        return iter(())
