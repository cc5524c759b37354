"""Health state transitions: ejection, growing back-off, half-open trials, probes, cool-downs."""

from __future__ import annotations

import math
import random

import pytest

from gateway.routing.health import LIVE_DEADLINE, OUTCOMES, Health, Kind, outcome
from tests.clock import Clock


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
        ("too_large", False, False),  # its size depends on what was asked (echo, a long think)
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


def test_every_outcome_kind_has_its_accounting_and_an_http_status_maps_to_a_kind():
    assert set(OUTCOMES) == set(Kind)
    assert Kind.http(500) is Kind.HTTP_5XX and Kind.http(502) is Kind.HTTP_5XX
    assert Kind.http(503) is Kind.HTTP_503 and Kind.http(429) is Kind.HTTP_429 and Kind.http(404) is Kind.HTTP_404
    # Labels (metrics, retry `on`) keep a 5xx's own status.
    assert Kind.HTTP_5XX.label(502) == "http_502" and Kind.HTTP_503.label(503) == "http_503"
    assert Kind.CUT_MID_STREAM.label() == "cut_mid_stream"


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


# -- recovery: request probes, their limits, and the flapping primary ---------------------------------


def _eject_n_times(h: Health, clock: Clock, n: int) -> None:
    """Eject `h` n times in a row: the first by a run of failures, the others by failed trials."""
    h.report_failure()  # failures_to_eject=1 in the tests that use this
    for _ in range(n - 1):
        clock.t += h.available_in()
        assert h.state() == "probing"
        h.report_failure()


def test_a_good_request_probe_ends_any_ejection_and_a_real_success_then_restores_it():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, max_eject_s=300, jitter=0.0, clock=clock)
    _eject_n_times(h, clock, 4)
    assert h.state() == "ejected" and h.available_in() == pytest.approx(80)
    h.report_probe(True)  # a model list: no evidence for a repeated ejection
    assert h.state() == "ejected"
    h.report_probe(True, request=True)  # the model answered a real (one-token) request
    assert h.state() == "probing" and h.healthy and h.available_in() == 0
    assert h.ejections == 4 and h.consecutive_failures == 4  # no count reset: the next request decides
    h.report_success()
    assert h.state() == "healthy" and h.ejections == 0 and h.consecutive_failures == 0


def test_failed_request_probes_while_ejected_neither_extend_nor_end_it():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, jitter=0.0, clock=clock)
    h.report_failure()
    for _ in range(5):
        clock.t += 1
        h.report_probe(False, request=True)
    assert h.state() == "ejected" and h.available_in() == pytest.approx(5) and h.ejections == 1


def test_a_request_probe_failing_in_half_open_re_ejects_before_a_user_request_pays_for_it():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, jitter=0.0, clock=clock)
    h.report_failure()
    clock.t += 10
    assert h.state() == "probing"
    h.report_probe(False, request=True)
    assert h.state() == "ejected" and h.available_in() == pytest.approx(20)
    h.report_probe(True, request=True)  # a probe failing is no reason to distrust the next good one
    assert h.state() == "probing"


def test_a_trial_that_fails_after_a_good_request_probe_stops_probes_ending_ejections_until_a_real_success():
    # The backend answers a one-token probe while its real requests fail (overloaded, long prompts):
    # without this, every probe interval would cost a user request a failed attempt.
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, max_eject_s=30, jitter=0.0, clock=clock)
    _eject_n_times(h, clock, 2)
    h.report_probe(True, request=True)
    assert h.state() == "probing" and h.probe_opened
    h.report_failure()  # the trial the probe let through failed
    assert h.state() == "ejected" and h.probes_misled and h.available_in() == pytest.approx(30)
    h.report_probe(True, request=True)
    assert h.state() == "ejected"  # the back-off decides now (capped at max_eject_s)
    clock.t += 30
    assert h.state() == "probing"
    h.report_success()  # a real request answered: probes are trusted again
    assert not h.probes_misled
    _eject_n_times(h, clock, 3)
    h.report_probe(True, request=True)
    assert h.state() == "probing"


def test_a_trial_opened_by_the_back_off_that_fails_does_not_distrust_probes():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, jitter=0.0, clock=clock)
    _eject_n_times(h, clock, 3)  # two trials after the back-off ran out, both failed
    assert not h.probes_misled
    h.report_probe(True, request=True)
    assert h.state() == "probing"


def test_the_back_off_is_capped_however_long_the_outage():
    clock = Clock()
    h = Health(failures_to_eject=1, eject_s=10, max_eject_s=30, jitter=0.0, clock=clock)
    _eject_n_times(h, clock, 200)
    assert h.available_in() == pytest.approx(30)


def _flapping_primary(*, request_probes: bool) -> tuple[float, list[int]]:
    """The fault suite's "primary down 60 s, then healthy", as plain calls: a user request every
    0.25 s (the relay's rule: the selector lets one trial through while half-open; same-backend
    retries up to 3 attempts while health has not ejected it), and a request probe every second
    while it is ejected. Returns the seconds from recovery to the first request it answers, and
    the primary's attempts for each request that reached it after the first ejection."""
    from gateway.config.policy import RetryPolicy
    from gateway.relay.timing import retry_wait

    clock = Clock()
    h = Health(failures_to_eject=3, eject_s=10, max_eject_s=30, clock=clock, rng=random.Random(7))
    rp = RetryPolicy(attempts=3, on=(500,), max_wait_ms=3000)
    start, down_s = clock.t, 60.0
    attempts_per_trial: list[int] = []
    next_probe = clock.t + 1
    while clock.t < start + 200:
        up = clock.t >= start + down_s
        if request_probes and clock.t >= next_probe:
            next_probe += 1
            if clock.t < h.ejected_until:  # probes.recovery_targets: ejected models only
                h.report_probe(up, request=True)
        if h.state() in ("healthy", "probing"):
            was_ejected, tries = h.ejections > 0, 0
            while True:
                tries += 1
                if up:
                    h.report_success()
                    break
                h.report_failure()
                if retry_wait(rp, "http_500", tries_here=tries, tries_total=tries, max_attempts=3, cooling_s=0,
                              remaining_s=30, ejected=not h.healthy) is None:
                    break
            if was_ejected:
                attempts_per_trial.append(tries)
            if up:
                return clock.t - (start + down_s), attempts_per_trial
        clock.t += 0.25
    return math.inf, attempts_per_trial


def test_a_primary_down_60_s_is_used_again_within_seconds_of_recovery_with_one_attempt_per_trial():
    recovered_after, trials = _flapping_primary(request_probes=True)
    assert recovered_after <= 1.25  # the next probe after the recovery, then the next request
    assert trials and all(n == 1 for n in trials), trials  # retries stop once health ejects it
    assert len(trials) <= 5  # one trial per back-off (10, 20, 30, 30 s), never one per request


def test_without_request_probes_the_capped_back_off_still_brings_it_back():
    recovered_after, trials = _flapping_primary(request_probes=False)
    assert recovered_after <= 30.25 and all(n == 1 for n in trials), (recovered_after, trials)


def _asked(h: Health, tenant: str, n: int = 1) -> None:
    for _ in range(n):
        h.report_failure(tenant, asked=True)


def test_an_ejection_one_tenant_alone_caused_waits_for_a_probe_that_undoes_it_and_forgives_that_tenant():
    clock = Clock()
    h = _health(clock, max_eject_s=30)
    _asked(h, "mallory", 3)
    assert h.state() == "ejected" and h.verifying and h.suspect == "mallory"
    h.report_probe(True)  # a model list answering is no word on completions: still waiting
    assert h.verifying
    h.report_probe(True, request=True)  # the gateway's own request is answered
    assert h.state() == "healthy" and not h.verifying and h.ejections == 0 and h.consecutive_failures == 0
    _asked(h, "mallory", 10)  # forgiven for max_eject_s
    assert h.state() == "healthy" and h.consecutive_failures == 0
    _asked(h, "alice", 2)  # anyone else's count as ever
    assert h.consecutive_failures == 2
    h.report_success()
    clock.t += 31  # forgiveness runs out
    _asked(h, "mallory", 3)
    assert h.state() == "ejected" and h.suspect == "mallory"


def test_a_failed_probe_confirms_the_ejection():
    clock = Clock()
    h = _health(clock)
    _asked(h, "alice", 3)
    h.report_probe(False)
    assert h.state() == "ejected" and not h.verifying and h.ejections == 1
    h.report_probe(True, request=True)  # later, a good one is a recovery as usual: half-open, not undone
    assert h.state() == "probing" and h.ejections == 1


@pytest.mark.parametrize(
    "run",
    [
        [("alice", True), ("bob", True), ("alice", True)],  # two tenants corroborate each other
        [("alice", False), ("alice", False), ("alice", False)],  # a timeout or a cut is the backend's own
        [(None, True), ("alice", False), (None, True)],  # no tenant (a by-id call before auth)
    ],
)
def test_a_run_of_several_tenants_or_of_the_backends_own_kinds_ejects_without_waiting(run):
    h = _health(Clock())
    for tenant, asked in run:
        h.report_failure(tenant, asked=asked)
    assert h.state() == "ejected" and not h.verifying


@pytest.mark.parametrize(
    "run",
    [
        [("alice", True), ("alice", False), ("alice", True)],  # a cut among them
        [("alice", True), (None, True), ("alice", True)],  # a by-id call's failure, before auth
        [(None, True), ("alice", False), ("alice", True)],  # in any order
    ],
)
def test_a_run_of_one_tenants_failures_with_fewer_unblamed_than_eject_waits_for_the_probe(run):
    """One failure no caller is blamed for (the backend's own kind, or one misread as such: a
    by-id call's oversized answer read as a disconnect) does not make a run a tenant caused
    "mixed": the ejection still waits for the request probe that confirms or undoes it."""
    h = _health(Clock())
    for tenant, asked in run:
        h.report_failure(tenant, asked=asked)
    assert h.state() == "ejected" and h.verifying and h.suspect == "alice"
    h.report_probe(True, request=True)
    assert h.state() == "healthy" and h.ejections == 0
    h.report_failure("alice", asked=True)  # forgiven for a while
    assert h.consecutive_failures == 0


def test_without_corroboration_and_in_half_open_one_tenant_ejects_as_before():
    h = _health(Clock(), corroborate=False)
    _asked(h, "mallory", 3)
    assert h.state() == "ejected" and not h.verifying
    clock = Clock()
    h = _health(clock)
    _fail(h, 3)  # the backend's own failures: ejected, nothing to verify
    clock.t += 11
    assert h.state() == "probing"
    _asked(h, "mallory")  # a failed half-open trial re-ejects at once, whoever sent it
    assert h.state() == "ejected" and not h.verifying and h.ejections == 2


def test_asked_kinds_are_the_ones_a_request_can_cause():
    asked = {k for k, o in OUTCOMES.items() if o.asked}
    # 401/403/408 too: a WAF or an ingress rule in front of a model server refuses what one caller sends
    assert asked == {Kind.HTTP_5XX, Kind.MALFORMED, Kind.ERROR_EVENT, Kind.ERROR_EVENT_MID_STREAM, Kind.TIMEOUT,
                     Kind.FIRST_TOKEN_TIMEOUT, Kind.HTTP_401, Kind.HTTP_403, Kind.HTTP_408}
    assert all(OUTCOMES[k].health for k in asked)


def _deadline(h: Health, n: int = 1) -> None:
    for _ in range(n):
        h.report_failure(LIVE_DEADLINE, asked=True)


def test_timeouts_at_live_deadlines_eject_only_until_a_request_probe_answers():
    """A timeout at a deadline set from live data (2x a P95 other requests set) may be the
    deadline's doing (a flood of fast requests shrank it under ordinary slow ones): whoever met
    them, their ejection waits for the gateway's own request probe. Answered: undone, and such
    timeouts count for nothing for max_eject_s (a tenant's own failures still count)."""
    clock = Clock()
    h = _health(clock)
    _deadline(h, 3)
    assert h.state() == "ejected" and h.verifying and h.suspect == LIVE_DEADLINE and h.suspect_deadline
    h.report_probe(True, request=True)
    assert h.state() == "healthy" and h.ejections == 0 and not h.verifying
    _deadline(h, 5)
    assert h.state() == "healthy" and h.consecutive_failures == 0
    _asked(h, "alice", 3)
    assert h.state() == "ejected" and h.suspect == "alice"
    h.report_probe(True, request=True)
    clock.t += h.max_eject_s + 1
    _deadline(h, 3)  # forgiven no longer
    assert h.state() == "ejected" and h.suspect == LIVE_DEADLINE


def test_a_hung_backend_fails_the_probe_and_its_live_deadline_ejection_stands():
    clock = Clock()
    h = _health(clock)
    _deadline(h, 3)
    h.report_probe(False)
    assert h.state() == "ejected" and not h.verifying and h.ejections == 1
    clock.t += 60
    _deadline(h, 1)  # a failed half-open trial re-ejects at once, without a second verification
    assert h.state() == "ejected" and not h.verifying and h.ejections == 2


def test_live_deadline_timeouts_with_one_tenants_failures_are_that_tenants_run_and_both_are_forgiven():
    clock = Clock()
    h = _health(clock)
    _asked(h, "alice", 1)
    _deadline(h, 2)
    assert h.state() == "ejected" and h.suspect == "alice" and h.suspect_deadline
    h.report_probe(True, request=True)
    _asked(h, "alice", 3)
    _deadline(h, 3)
    assert h.state() == "healthy" and h.consecutive_failures == 0


def test_live_deadline_timeouts_eject_at_once_without_corroboration_or_beside_another_tenants_failures():
    h = _health(Clock())
    h.corroborate = False  # one tenant, or no request probes: nothing would decide
    _deadline(h, 3)
    assert h.state() == "ejected" and not h.verifying
    h = _health(Clock())
    _asked(h, "alice", 1)
    _deadline(h, 1)
    _asked(h, "bob", 1)  # two tenants' failures corroborate each other
    assert h.state() == "ejected" and not h.verifying
