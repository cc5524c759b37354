"""A clock a test sets by hand (`clock.t`), for the parts that take a `clock=` callable."""

from __future__ import annotations


class Clock:
    """Time in seconds, from 1000.0, moved only by the test."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
