"""How many CPU threads each forward pass gets: the faster of a few counts, by live timings.

The model shares a small machine with the gateway and whatever else runs there. With the other
core idle, 2 threads decode 10-50% faster than 1 (bench/local_threads.py, 2 cores); while
something else keeps that core busy, 2 OpenMP threads wait on each other and the same pass takes
2-3x longer than on 1 thread. Neither fixed count is right, so every pass is timed and each kind
of pass (a decode step of R rows, a prefill of about T tokens) runs on the count that has been
fastest for it lately, trying the others now and then to notice when the machine changes. The
choice never changes a token: every kernel computes each output element in the same order
whatever the thread count (tested).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

__all__ = ["ThreadPicker"]


@dataclass
class _Arms:
    """One kind of pass: a cost estimate per thread count and when each was last tried."""

    cost: dict[int, float | None]
    last_tried: dict[int, int]
    picks: int = 0
    passes: dict[int, int] = field(default_factory=dict)


class ThreadPicker:
    """Chooses a thread count per pass from an exponentially weighted cost per count.

    ``pick(key)`` returns the count to run the next pass of kind ``key`` on: each count once
    while any has no estimate, then the cheapest, except when another count is due a retry. A
    count is due ``explore_every`` x (counts - 1) x (its cost / the cheapest's) passes after it
    last ran, so retries take about 1/``explore_every`` of the time however many counts there are
    and however slow they are (a count 10x slower is retried 10x less often). ``record`` feeds back
    the pass's cost (seconds, or seconds per token: anything comparable within one key). One count
    means a fixed choice.
    """

    def __init__(self, choices: Iterable[int], *, explore_every: int = 32, alpha: float = 0.3) -> None:
        self.choices = tuple(sorted(set(choices)))
        if not self.choices or self.choices[0] < 1:
            raise ValueError(f"thread choices must be positive counts, not {choices!r}")
        if explore_every < 2 or not 0 < alpha <= 1:
            raise ValueError(f"explore_every must be >= 2 and alpha in (0, 1], not {explore_every}, {alpha}")
        self.explore_every = explore_every
        self.alpha = alpha
        self._kinds: dict[Hashable, _Arms] = {}
        self._lock = threading.Lock()  # the engine thread writes, /metrics reads

    @property
    def adaptive(self) -> bool:
        """Whether there is anything to choose between."""
        return len(self.choices) > 1

    def describe(self) -> str:
        """For the start-up line: ``1 torch thread`` or ``1/2 torch threads (picked per pass by live timings)``."""
        if not self.adaptive:
            n = self.choices[0]
            return f"{n} torch thread{'s' if n > 1 else ''}"
        return f"{'/'.join(map(str, self.choices))} torch threads (picked per pass by live timings)"

    def pick(self, key: Hashable) -> int:
        """The thread count for the next pass of kind ``key``."""
        if not self.adaptive:
            return self.choices[0]
        with self._lock:
            arms = self._arms(key)
            arms.picks += 1
            cost = arms.cost
            untried = [n for n in self.choices if cost[n] is None]
            if untried:
                # A new kind of pass starts on what its nearest measured sibling runs best on (a
                # prefill of a new length on many cores need not pay a 1-thread pass first).
                hint = self._nearest_best(key) if len(untried) == len(self.choices) else None
                return hint if hint is not None else untried[0]
            measured = {n: c for n in self.choices if (c := cost[n]) is not None}  # every count, by now
            best = min(measured, key=measured.__getitem__)
            spacing = self.explore_every * (len(self.choices) - 1) / max(measured[best], 1e-12)
            # How overdue each other count is: >= 1 means due a retry.
            overdue = {
                n: (arms.picks - arms.last_tried[n]) / (spacing * measured[n])
                for n in self.choices
                if n != best
            }
            late = max(overdue, key=overdue.__getitem__)
            return late if overdue[late] >= 1 else best

    def record(self, key: Hashable, threads: int, cost: float) -> None:
        """Feed back what a pass of kind ``key`` on ``threads`` threads cost."""
        if not math.isfinite(cost):
            return
        cost = max(cost, 1e-9)  # a zero or negative reading (a coarse clock) would stop every retry
        with self._lock:
            arms = self._arms(key)
            arms.passes[threads] = arms.passes.get(threads, 0) + 1
            if threads not in arms.cost:
                return  # a count outside the choices (set by hand): counted, not learned from
            old = arms.cost[threads]
            arms.cost[threads] = cost if old is None else old + self.alpha * (cost - old)
            arms.last_tried[threads] = arms.picks

    def passes(self) -> dict[tuple[str, int], int]:
        """Passes run so far per (kind's first element, e.g. ``decode``, thread count)."""
        out: dict[tuple[str, int], int] = {}
        with self._lock:
            for key, arms in self._kinds.items():
                kind = str(key[0] if isinstance(key, tuple) and key else key)
                for n, count in arms.passes.items():
                    out[(kind, n)] = out.get((kind, n), 0) + count
        return out

    def estimates(self, key: Hashable) -> dict[int, float | None]:
        """The current cost estimate per thread count for ``key`` (None: not measured yet)."""
        with self._lock:
            arms = self._kinds.get(key)
            return dict(arms.cost) if arms is not None else dict.fromkeys(self.choices)

    def _nearest_best(self, key: Hashable) -> int | None:
        """The cheapest count of the measured key of the same kind nearest in size to ``key``
        (keys like ``("decode", rows)``), or None."""
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int)):
            return None
        best: tuple[int, int] | None = None  # (distance, count)
        for other, arms in self._kinds.items():
            if other == key or not (isinstance(other, tuple) and len(other) == 2 and other[0] == key[0]):
                continue
            if not isinstance(other[1], int) or any(c is None for c in arms.cost.values()):
                continue
            distance = abs(other[1] - key[1])
            if best is None or distance < best[0]:
                best = (distance, min(self.choices, key=lambda n: arms.cost[n]))  # type: ignore[arg-type,return-value]
        return best[1] if best is not None else None

    def _arms(self, key: Hashable) -> _Arms:
        arms = self._kinds.get(key)
        if arms is None:
            arms = self._kinds[key] = _Arms(dict.fromkeys(self.choices), dict.fromkeys(self.choices, 0))
        return arms
