"""The quota store's breaker (tenants/breaker.py) on a fake clock: when it opens, probes, closes."""

from __future__ import annotations

from gateway.tenants.breaker import Breaker


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _opened(clock: _Clock) -> Breaker:
    b = Breaker(threshold=3, first_pause_s=0.5, max_pause_s=2.0, probe_s=5.0, clock=clock)
    for _ in range(3):
        assert b.allows()
        b.failed()
    assert b.open and not b.allows()
    return b


def test_it_opens_after_failures_in_a_row_only():
    clock = _Clock()
    b = Breaker(threshold=3, clock=clock)
    for _ in range(5):  # a success between failures: never three in a row
        b.failed()
        b.failed()
        b.succeeded()
    assert not b.open and b.allows()
    _opened(clock)


def test_one_probe_after_the_pause_and_a_success_closes_it():
    clock = _Clock()
    b = _opened(clock)
    clock.t += 0.49
    assert not b.allows()
    clock.t += 0.02
    assert b.allows()  # the probe
    assert not b.allows() and not b.allows()  # the others skip while it is out
    b.succeeded()
    assert not b.open and b.allows() and b.allows()


def test_a_failed_probe_doubles_the_pause_up_to_the_most():
    clock = _Clock()
    b = _opened(clock)
    for pause in (1.0, 2.0, 2.0):
        clock.t += 10
        assert b.allows()
        b.failed()
        clock.t += pause - 0.01
        assert not b.allows()
        clock.t += 0.02
        assert b.allows()
        b.failed()  # this probe too
        clock.t -= 0.01
    b.succeeded()
    b.failed()  # closed again, the count from zero and the first pause
    assert not b.open


def test_a_probe_that_never_reports_is_given_up():
    clock = _Clock()
    b = _opened(clock)
    clock.t += 0.6
    assert b.allows()
    clock.t += 4.9
    assert not b.allows()
    clock.t += 0.2
    assert b.allows()  # another probe
