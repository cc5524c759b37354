"""The latency tracker: windowed quantiles, the TTFT prediction and the first-token deadline."""

from __future__ import annotations

import random

import pytest

from gateway.routing.latency import Tracker, Window, quantile
from tests.clock import Clock


def test_quantile_is_nearest_rank():
    values = [float(i) for i in range(1, 101)]
    assert quantile(values, 0.5) == 50 and quantile(values, 0.95) == 95 and quantile(values, 0.99) == 99
    assert quantile(values, 0.0) == 1 and quantile(values, 1.0) == 100
    assert quantile([], 0.5) is None and quantile([7.0], 0.99) == 7.0


def test_window_forgets_old_samples_and_caps_its_size():
    w = Window(span_s=10, max_samples=5)
    for i in range(8):
        w.add(100.0 + i, float(i))
    assert w.sorted(107.0) == [3.0, 4.0, 5.0, 6.0, 7.0]  # only the newest 5 are kept
    assert w.sorted(114.5) == [5.0, 6.0, 7.0]  # the rest are older than 10 s


def test_window_reuses_its_sorted_copy_when_allowed_to():
    w = Window(span_s=60, max_samples=1000)
    for i in range(100):
        w.add(0.0, float(i))
    assert w.sorted(0.0, max_age_s=1.0)[0] == 0.0
    w.add(0.5, -1.0)
    assert w.sorted(0.5, max_age_s=1.0)[0] == 0.0  # cached: at most 1 s old
    assert w.sorted(0.5)[0] == -1.0  # exact on demand
    w.add(0.6, -2.0)
    assert w.sorted(1.7, max_age_s=1.0)[0] == -2.0


def test_small_windows_are_always_exact():
    w = Window(span_s=60, max_samples=100)
    w.add(0.0, 2.0)
    assert w.sorted(0.0, max_age_s=1.0) == [2.0]
    w.add(0.1, 1.0)
    assert w.sorted(0.1, max_age_s=1.0) == [1.0, 2.0]  # a young backend's first samples count at once


def test_snapshot_reports_windowed_quantiles_and_rates():
    clock = Clock()
    tr = Tracker(window_s=60, clock=clock)
    for i in range(1, 101):
        tr.observe_ttft(i / 1000)
        tr.observe_itl(i / 10000)
        tr.observe_done(i / 100, ok=i % 10 != 0, timeout=i % 20 == 0)
    snap = tr.snapshot()
    assert (snap["ttft_p50_ms"], snap["ttft_p95_ms"], snap["ttft_p99_ms"]) == (50, 95, 99)
    assert (snap["inter_token_p50_ms"], snap["inter_token_p95_ms"]) == (5, 9.5)
    assert (snap["duration_p50_ms"], snap["duration_p95_ms"]) == (500, 950)
    assert snap["requests"] == 100 and snap["errors"] == 10 and snap["error_rate"] == 0.1
    assert snap["timeouts"] == 5 and snap["timeout_rate"] == 0.05
    tr.inflight = 3
    assert tr.snapshot()["inflight"] == 3
    clock.t += 61
    later = tr.snapshot()
    assert later["ttft_p50_ms"] is None and later["requests"] == 0 and later["error_rate"] == 0.0
    assert later["predicted_ttft_ms"] is not None  # the prediction outlives the window


def test_prediction_is_none_until_the_first_sample():
    tr = Tracker(clock=Clock())
    assert tr.predict_ttft(100) is None and tr.snapshot()["predicted_ttft_ms"] is None
    tr.observe_ttft(0.2)
    assert tr.predict_ttft(100) == pytest.approx(0.2)


def test_prediction_reacts_at_once_to_a_slow_spike():
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(50):
        clock.t += 0.1
        tr.observe_ttft(0.05)
    clock.t += 0.1
    tr.observe_ttft(1.0)
    assert tr.predict_ttft() == pytest.approx(0.525)  # half the gap closed by one sample
    clock.t += 0.1
    tr.observe_ttft(1.0)
    assert tr.predict_ttft() > 0.75


def _steady(clock: Clock, tr: Tracker, seconds: float = 0.05, n: int = 50, tenant: str = "alice") -> None:
    for _ in range(n):
        clock.t += 0.1
        tr.observe_ttft(seconds, tenant=tenant)


def test_one_tenants_spikes_raise_the_level_at_most_twice_until_another_tenants_agree():
    """One tenant's slow first tokens (an image its provider fetches slowly) raised a backend's
    predicted TTFT from 7 ms to 1-2 s and moved every tenant's traffic (review helper's repro)."""
    clock = Clock()
    tr = Tracker(clock=clock)
    tr.corroborate = True
    _steady(clock, tr)
    for _ in range(5):  # however many of one tenant's, timeouts included
        clock.t += 0.1
        tr.observe_ttft(4.0, tenant="mallory")
        tr.observe_done(2.0, ok=False, timeout=True, tenant="mallory")
        assert tr.predict_ttft() <= 0.1 + 1e-9
    clock.t += 0.1
    tr.observe_ttft(1.0, tenant="bob")  # another tenant's agrees: in full
    assert tr.predict_ttft() > 0.3
    clock.t += 0.1
    tr.observe_ttft(1.0, tenant="bob")
    assert tr.predict_ttft() > 0.6


def test_spikes_count_in_full_from_the_gateway_itself_after_the_window_or_when_not_corroborating():
    for corroborate, tenant, gap in ((False, "mallory", 0.1), (True, None, 0.1)):
        clock = Clock()
        tr = Tracker(clock=clock)
        tr.corroborate = corroborate
        _steady(clock, tr)
        clock.t += gap
        tr.observe_ttft(1.0, tenant=tenant)
        assert tr.predict_ttft() == pytest.approx(0.525), (corroborate, tenant)
    clock = Clock()
    tr = Tracker(clock=clock)
    tr.corroborate = True
    _steady(clock, tr)
    tr.observe_ttft(1.0, tenant="mallory")
    level = tr.predict_ttft()
    assert level is not None and level <= 0.1 + 1e-9
    clock.t += 31  # the window passed: bob's spike starts a run of its own, capped at twice the level now
    tr.observe_ttft(1.0, tenant="bob")
    assert tr.predict_ttft() <= 2 * level


def test_a_prompt_far_beyond_the_usual_sizes_does_not_teach_the_level_or_the_error_rate():
    # One tenant's 75,000-token prompts, timing out or slow to answer, moved a backend's predicted
    # TTFT for 20-token prompts from 7 ms to ~1 s; a prompt of the usual size still does.
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(50):
        clock.t += 0.1
        tr.observe_ttft(0.01, prompt_tokens=20)
        tr.observe_done(0.02, True, prompt_tokens=20)
    assert tr.outsized(75_000) and not tr.outsized(2_000) and not Tracker().outsized(75_000)  # unknown: no
    clock.t += 0.1
    tr.observe_done(2.0, False, prompt_tokens=75_000, timeout=True)
    tr.observe_ttft(3.0, prompt_tokens=75_000)  # answered elsewhere, slowly: its prefill
    assert tr.predict_ttft(20) == pytest.approx(0.01, abs=0.002) and tr.error_ewma < 0.001
    assert tr.snapshot()["timeouts"] == 1  # still counted
    tr.observe_done(2.0, False, prompt_tokens=20, timeout=True)  # a usual prompt timing out: the backend's
    assert tr.predict_ttft(20) > 0.5 and tr.error_ewma > 0.01


def test_prediction_recovers_over_about_ten_seconds_of_fast_samples():
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(10):
        clock.t += 0.1
        tr.observe_ttft(1.0)
    for _ in range(50):  # 5 s at 10 rps
        clock.t += 0.1
        tr.observe_ttft(0.05)
    halfway = tr.predict_ttft()
    assert 0.05 < halfway < 0.3
    for _ in range(50):
        clock.t += 0.1
        tr.observe_ttft(0.05)
    assert tr.predict_ttft() < 0.1


def test_recovery_speed_does_not_depend_on_the_request_rate():
    def after(rate: float) -> float:
        clock = Clock()
        tr = Tracker(clock=clock)
        tr.observe_ttft(1.0)
        for _ in range(int(5 * rate)):
            clock.t += 1 / rate
            tr.observe_ttft(0.01)
        return tr.predict_ttft() or 0.0

    assert after(10) == pytest.approx(after(200), rel=0.02)


def test_an_idle_backend_keeps_its_estimate():
    clock = Clock()
    tr = Tracker(clock=clock)
    tr.observe_ttft(2.0)
    clock.t += 3600
    assert tr.predict_ttft() == pytest.approx(2.0)
    assert tr.idle_s() == pytest.approx(3600)
    clock.t += 1
    tr.observe_ttft(0.1)  # after a long silence, one fresh sample outweighs the old estimate
    assert tr.predict_ttft() == pytest.approx(0.1, abs=1e-6)


def test_prediction_fits_prefill_cost_per_prompt_token():
    clock = Clock()
    tr = Tracker(clock=clock)
    rng = random.Random(7)
    for _ in range(200):
        clock.t += 0.05
        n = rng.randrange(10, 4000)
        tr.observe_ttft(0.08 + 0.0002 * n, prompt_tokens=n)
    assert tr.slope_s_per_token == pytest.approx(0.0002, rel=0.01)
    assert tr.predict_ttft(0) == pytest.approx(0.08, abs=0.005)
    assert tr.predict_ttft(3000) == pytest.approx(0.68, abs=0.01)
    assert tr.snapshot()["ttft_ms_per_1k_prompt_tokens"] == pytest.approx(200, rel=0.01)


def test_a_long_prompt_does_not_make_a_backend_look_slow():
    clock = Clock()
    fast, slow = Tracker(clock=clock), Tracker(clock=clock)
    rng = random.Random(3)
    for _ in range(100):
        clock.t += 0.05
        n = rng.randrange(10, 2000)
        fast.observe_ttft(0.05 + 0.0005 * n, prompt_tokens=n)
        slow.observe_ttft(0.30 + 0.0005 * n, prompt_tokens=n)
    clock.t += 0.05
    fast.observe_ttft(0.05 + 0.0005 * 8000, prompt_tokens=8000)  # a huge prompt on the fast one
    assert (fast.predict_ttft(100) or 0) < (slow.predict_ttft(100) or 0)
    assert fast.predict_ttft(100) == pytest.approx(0.1, abs=0.01)


def test_slope_stays_flat_while_prompt_sizes_do_not_vary():
    tr = Tracker(clock=Clock())
    for i in range(50):
        tr.observe_ttft(0.1 + (i % 3) * 0.01, prompt_tokens=500 + i % 5)
    assert tr.slope_s_per_token == 0.0


def test_non_streamed_answers_teach_the_prediction_without_their_decode_time():
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(20):
        tr.observe_itl(0.01)
    tr.observe_done(1.3, ok=True, completion_tokens=100, streamed=False)
    assert tr.predict_ttft() == pytest.approx(0.3)
    assert len(tr.ttft) == 0  # the quantiles hold measured TTFTs only
    tr.observe_done(5.0, ok=True)  # a streamed attempt: its TTFT came through observe_ttft
    assert tr.predict_ttft() == pytest.approx(0.3)


def test_a_timeout_raises_the_estimate_but_not_the_quantiles():
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(30):
        clock.t += 0.1
        tr.observe_ttft(0.1)
    clock.t += 2
    tr.observe_done(2.0, ok=False, timeout=True)
    assert (tr.predict_ttft() or 0) > 1.0
    assert tr.snapshot()["ttft_p95_ms"] == 100 and tr.total_timeouts == 1


def test_error_ewma_rises_on_failures_and_persists_while_idle():
    clock = Clock()
    tr = Tracker(clock=clock)
    for _ in range(3):
        tr.observe_done(0.01, ok=False)
    assert tr.error_ewma == pytest.approx(1 - 0.9**3)
    clock.t += 3600
    assert tr.error_ewma == pytest.approx(1 - 0.9**3)
    for _ in range(30):
        tr.observe_done(0.5, ok=True)
    assert tr.error_ewma < 0.02


def test_first_token_deadline_follows_the_live_p95():
    clock = Clock()
    tr = Tracker(clock=clock)
    assert tr.first_token_deadline_s(30.0) == 30.0  # no data: the configured timeout
    for i in range(100):
        clock.t += 0.01
        tr.observe_ttft(0.5 + i / 100)  # P95 = 1.44 s
    clock.t += 1
    assert tr.first_token_deadline_s(30.0) == pytest.approx(2.88)
    assert tr.first_token_deadline_s(2.5) == 2.5  # never above the configured timeout
    fast = Tracker(clock=clock)
    for _ in range(50):
        fast.observe_ttft(0.05)
    clock.t += 1
    assert fast.first_token_deadline_s(30.0) == 2.0  # the floor
    assert fast.first_token_deadline_s(30.0, floor_s=0.5) == 0.5


def test_first_token_deadline_waits_longer_for_a_long_prompt():
    clock = Clock()
    tr = Tracker(clock=clock)
    rng = random.Random(1)
    for _ in range(100):
        clock.t += 0.01
        n = rng.randrange(100, 1100)
        tr.observe_ttft(1.0 + 0.001 * n, prompt_tokens=n)
    clock.t += 1
    usual = tr.first_token_deadline_s(60.0)
    assert tr.first_token_deadline_s(60.0, prompt_tokens=10_600) == pytest.approx(usual + 2 * 10.0, rel=0.02)
    assert tr.first_token_deadline_s(60.0, prompt_tokens=10) == usual
