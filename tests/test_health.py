"""Health state transitions: ejection, growing back-off, half-open trials, probes, cool-downs."""

from __future__ import annotations

import math
import random

import pytest

from gateway.health import Health, outcome


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _health(clock: Clock, **kw: object) -> Health:
    return Health(failures_to_eject=3, eject_s=10, clock=clock, rng=random.Random(0), **kw)  # type: ignore[arg-type]


def _fail(h: Health, n: int) -> None:
    for _ in range(n):
        h.report_failure()


def test_consecutive_failures_eject_and_a_success_in_between_resets_the_count():
    clock = Clock()
    h = _health(clock)
    _fail(h, 2)
    h.report_success()
    _fail(h, 2)
    assert h.state() == "healthy" and h.healthy and h.consecutive_failures == 2
    h.report_failure()
    assert h.state() == "ejected" and not h.healthy
    assert 8.0 <= h.available_in() <= 10.0  # eject_s less up to 20% jitter


def test_after_the_back_off_a_backend_is_half_open_and_one_success_restores_it():
    clock = Clock()
    h = _health(clock)
    _fail(h, 3)
    clock.t += 10
    assert h.state() == "probing" and h.healthy and h.probing
    h.report_success()
    assert h.state() == "healthy" and h.ejections == 0 and h.consecutive_failures == 0


def test_a_failed_trial_ejects_again_for_twice_as_long_up_to_the_cap():
    clock = Clock()
    h = Health(failures_to_eject=3, eject_s=10, max_eject_s=60, jitter=0.0, clock=clock)
    _fail(h, 3)
    backoffs = []
    for _ in range(5):
        backoffs.append(h.available_in())
        clock.t += h.available_in()
        assert h.state() == "probing"
        h.report_failure()  # one failure is enough while half-open
    assert backoffs == [10, 20, 40, 60, 60]


def test_jitter_only_shortens_the_back_off_and_differs_between_replicas():
    ends = set()
    for seed in range(20):
        clock = Clock()
        h = Health(failures_to_eject=1, eject_s=10, clock=clock, rng=random.Random(seed))
        h.report_failure()
        assert 8.0 <= h.available_in() <= 10.0
        ends.add(round(h.available_in(), 6))
    assert len(ends) == 20


def test_failures_reported_while_ejected_do_not_extend_the_ejection():
    clock = Clock()
    h = _health(clock, jitter=0.0)
    _fail(h, 3)
    clock.t += 5
    _fail(h, 10)  # requests that started before the ejection, finishing now
    assert h.available_in() == pytest.approx(5) and h.ejections == 1


def test_a_late_success_while_ejected_restores_the_backend():
    clock = Clock()
    h = _health(clock)
    _fail(h, 3)
    h.report_success()
    assert h.state() == "healthy"


def test_a_good_probe_ends_an_ejection_early_into_half_open():
    clock = Clock()
    h = _health(clock)
    _fail(h, 3)
    clock.t += 1
    h.report_probe(True)
    assert h.state() == "probing" and h.healthy
    h.report_failure()  # the trial request failed: out again, for longer
    assert h.state() == "ejected" and h.available_in() > 10


def test_failed_probes_count_as_failures_unless_already_ejected():
    clock = Clock()
    h = _health(clock)
    h.report_probe(False)
    h.report_probe(False)
    assert h.state() == "healthy"
    h.report_probe(False)
    assert h.state() == "ejected" and h.ejections == 1
    h.report_probe(False)
    assert h.ejections == 1
    h.report_probe(True)
    h.report_probe(True)  # probes alone do not declare it healthy: a real request must succeed
    assert h.state() == "probing"


def test_a_good_probe_never_resets_the_count_of_real_failures():
    # A provider's model list answers 200 while its chat endpoint fails: the breaker still opens.
    h = _health(Clock())
    for _ in range(3):
        h.report_failure()
        h.report_probe(True)
    assert h.ejections == 1  # the third failure ejected it (the probe then lets one trial through)


@pytest.mark.parametrize(
    "kind,counts,sample",
    [
        ("ok", False, True),
        ("connect", True, True),
        ("reset_before_headers", True, True),
        ("timeout", True, True),
        ("first_token_timeout", True, True),
        ("http_500", True, True),
        ("http_502", True, True),
        ("http_503", True, True),
        ("http_429", False, False),
        ("http_401", True, True),
        ("http_404", False, False),
        ("http_405", False, False),
        ("malformed", True, True),
        ("too_large", True, True),
        ("error_event", True, True),
        ("cut", True, True),
        ("cut_mid_stream", True, True),
        ("rejected", False, False),
        ("caller_deadline", False, False),
        ("client_disconnect", False, False),
        ("lost", False, False),
    ],
)
def test_the_outcome_table_says_what_counts_against_health_and_what_is_a_latency_sample(kind, counts, sample):
    o = outcome(kind)
    assert (o.health, o.sample) == (counts, sample)


def test_an_unknown_outcome_kind_is_a_loud_error():
    with pytest.raises(KeyError):
        outcome("something_new")


def test_retry_after_cools_a_backend_without_ejecting_it():
    clock = Clock()
    h = _health(clock)
    h.cool_down(5)
    assert h.state() == "cooling" and h.healthy and 4.9 < h.cooling_for() <= 5
    h.cool_down(2)  # a shorter pause never shortens a longer one
    assert h.cooling_for() == pytest.approx(5)
    clock.t += 5.01
    assert h.state() == "healthy" and h.cooling_for() == 0


def test_a_starting_backend_is_not_available_at_all():
    h = _health(Clock())
    h.ready = False
    assert h.state() == "starting" and not h.healthy and math.isinf(h.available_in())


def test_limits_can_be_changed_after_construction():
    clock = Clock()
    h = _health(clock, jitter=0.0)
    h.failures_to_eject, h.eject_s = 1, 2.0
    h.report_failure()
    assert h.state() == "ejected" and h.available_in() == pytest.approx(2.0)


def test_a_good_probe_does_not_cut_short_a_repeated_ejection():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, jitter=0.0, clock=clock)
    h.report_failure()  # first ejection: 10 s
    h.report_probe(True)
    assert h.state() == "probing"  # a first ejection ends early on a good probe
    h.report_failure()  # the trial failed: ejected again, for 20 s
    h.report_probe(True)  # the cheap probe works, the real requests do not
    assert h.state() == "ejected"
    clock.t += 20.1
    assert h.state() == "probing"
