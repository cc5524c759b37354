"""Passive health: a backend that keeps failing is ejected for a while; Retry-After cools it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Health"]


@dataclass
class Health:
    """Health state of one backend. The relay reports outcomes; this object decides."""

    failures_to_eject: int = 3
    eject_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    cooldown_until: float = 0.0  # from an upstream Retry-After
    ready: bool = True  # False while a launched backend starts

    def report_success(self) -> None:
        self.consecutive_failures = 0
        self.ejected_until = 0.0

    def report_failure(self) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.failures_to_eject:
            self.ejected_until = self.clock() + self.eject_s

    def cool_down(self, seconds: float) -> None:
        self.cooldown_until = max(self.cooldown_until, self.clock() + seconds)

    def cooling_for(self) -> float:
        """Seconds left of an upstream-requested pause (0 when none)."""
        return max(0.0, self.cooldown_until - self.clock())

    @property
    def healthy(self) -> bool:
        return self.ready and self.clock() >= self.ejected_until

    def state(self) -> str:
        if not self.ready:
            return "starting"
        if self.clock() < self.ejected_until:
            return "ejected"
        if self.cooling_for() > 0:
            return "cooling"
        return "healthy"
