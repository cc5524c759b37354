"""Per-backend latency tracking: recent TTFT, inter-token gaps, durations and errors.

State stays in process (per replica): a shared, stale view makes replicas herd onto one backend.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Tracker", "quantile"]


def quantile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank quantile of an already sorted list."""
    if not sorted_values:
        return None
    idx = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


@dataclass
class Tracker:
    """Sliding-window samples for one backend; cheap to update on every request."""

    window_s: float = 60.0
    max_samples: int = 512
    clock: Callable[[], float] = time.monotonic
    ttft: deque[tuple[float, float]] = field(default_factory=deque)
    itl: deque[tuple[float, float]] = field(default_factory=deque)
    duration: deque[tuple[float, float]] = field(default_factory=deque)
    outcomes: deque[tuple[float, bool]] = field(default_factory=deque)
    inflight: int = 0

    def _push(self, q: deque, value: object) -> None:
        q.append((self.clock(), value))
        if len(q) > self.max_samples:
            q.popleft()

    def observe_ttft(self, seconds: float) -> None:
        self._push(self.ttft, seconds)

    def observe_itl(self, seconds: float) -> None:
        self._push(self.itl, seconds)

    def observe_done(self, seconds: float, ok: bool) -> None:
        self._push(self.duration, seconds)
        self._push(self.outcomes, ok)

    def _recent(self, q: deque) -> list:
        horizon = self.clock() - self.window_s
        while q and q[0][0] < horizon:
            q.popleft()
        return [v for _, v in q]

    def snapshot(self) -> dict[str, float | int | None]:
        """The numbers /admin/backends shows."""
        ttft = sorted(self._recent(self.ttft))
        itl = sorted(self._recent(self.itl))
        dur = sorted(self._recent(self.duration))
        outcomes = self._recent(self.outcomes)
        errors = sum(1 for ok in outcomes if not ok)
        return {
            "inflight": self.inflight,
            "requests": len(outcomes),
            "errors": errors,
            "error_rate": round(errors / len(outcomes), 4) if outcomes else 0.0,
            "ttft_p50_ms": _ms(quantile(ttft, 0.5)),
            "ttft_p95_ms": _ms(quantile(ttft, 0.95)),
            "inter_token_p50_ms": _ms(quantile(itl, 0.5)),
            "inter_token_p95_ms": _ms(quantile(itl, 0.95)),
            "duration_p50_ms": _ms(quantile(dur, 0.5)),
            "duration_p95_ms": _ms(quantile(dur, 0.95)),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)
