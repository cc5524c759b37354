"""The selector: plain function calls over trackers and health with an injected clock."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.routing.health import Health
from gateway.routing.latency import Tracker
from gateway.routing.selector import Candidate, Selector, skip_reason, usable


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _cand(clock: Clock, name: str, ttft: float | None = None, **kw: float) -> Candidate:
    tr = Tracker(clock=clock)
    if ttft is not None:
        tr.observe_ttft(ttft)
        tr.observe_done(ttft, ok=True)
    return Candidate(name, tr, Health(clock=clock, rng=random.Random(0)), **kw)


def _selector(strategy: str = "latency", seed: int = 0, **kw: float) -> Selector:
    return Selector(strategy, rng=random.Random(seed), **kw)  # type: ignore[arg-type]


def _picks(sel: Selector, cands: list[Candidate], n: int, prompt_tokens: int | None = None) -> Counter[str]:
    return Counter(sel.rank(cands, prompt_tokens)[0].name for _ in range(n))


def test_latency_ranks_by_predicted_ttft_best_first():
    clock = Clock()
    cands = [_cand(clock, "slow", 0.9), _cand(clock, "fast", 0.1), _cand(clock, "mid", 0.4)]
    ranked = _selector().rank(cands, 100)
    assert [r.name for r in ranked] == ["fast", "mid", "slow"]
    assert [r.index for r in ranked] == [1, 2, 0]
    assert ranked[0].predicted_ttft_s == pytest.approx(0.1) and ranked[0].skipped is None
    assert ranked[0].score < ranked[1].score < ranked[2].score


def test_the_prompt_size_decides_between_fast_prefill_and_low_overhead():
    clock = Clock()
    rng = random.Random(5)
    low_overhead, fast_prefill = _cand(clock, "low_overhead"), _cand(clock, "fast_prefill")
    for _ in range(100):
        clock.t += 0.05
        n = rng.randrange(10, 4000)
        low_overhead.tracker.observe_ttft(0.05 + 0.0004 * n, prompt_tokens=n)
        fast_prefill.tracker.observe_ttft(0.30 + 0.0001 * n, prompt_tokens=n)
    sel = _selector()
    assert sel.rank([low_overhead, fast_prefill], 100)[0].name == "low_overhead"
    assert sel.rank([low_overhead, fast_prefill], 3000)[0].name == "fast_prefill"


def test_unavailable_backends_come_last_least_bad_first_with_the_reason():
    clock = Clock()
    ok = _cand(clock, "ok", 0.5)
    starting = _cand(clock, "starting", 0.01)
    starting.health.ready = False
    cooling = _cand(clock, "cooling", 0.01)
    cooling.health.cool_down(3)
    ejected = _cand(clock, "ejected", 0.01)
    for _ in range(3):
        ejected.health.report_failure()
    ranked = _selector().rank([starting, ejected, cooling, ok])
    assert [(r.name, r.skipped) for r in ranked] == [
        ("ok", None),
        ("cooling", "cooling"),
        ("ejected", "ejected"),
        ("starting", "starting"),
    ]
    assert all(r.score == float("inf") for r in ranked[1:])


def test_the_last_backend_is_never_taken_out_of_a_route():
    clock = Clock()
    a, b = _cand(clock, "a", 0.1), _cand(clock, "b", 0.1)
    for _ in range(3):
        a.health.report_failure()
    clock.t += 4
    for _ in range(3):
        b.health.report_failure()
    assert usable([a, b]) == [a]  # both ejected: the one back soonest stays usable
    ranked = _selector().rank([a, b])
    assert ranked[0].name == "a" and ranked[0].note and "last resort" in ranked[0].note
    assert ranked[0].last_resort and not any(r.last_resort for r in ranked[1:])
    c = _cand(clock, "c", 0.1)
    assert usable([a, c, b]) == [c]  # any available one: the ejected ones are not kept
    a.health.ready = b.health.ready = False
    assert usable([a, b]) == []  # nothing that is still starting can answer


def test_a_half_open_backend_gets_one_trial_request_at_a_time():
    clock = Clock()
    c = _cand(clock, "c", 0.1)
    for _ in range(3):
        c.health.report_failure()
    clock.t += 10
    assert c.health.state() == "probing" and skip_reason(c) is None
    c.tracker.inflight = 1
    assert skip_reason(c) == "probing: a trial request is in flight"


def test_near_ties_are_broken_at_random_so_replicas_do_not_herd():
    clock = Clock()
    cands = [_cand(clock, "a", 0.100), _cand(clock, "b", 0.103), _cand(clock, "c", 0.2)]
    picks = _picks(_selector(), cands, 400)
    assert set(picks) == {"a", "b"} and 120 < picks["a"] < 280
    picks = _picks(_selector(tie_pct=0.0), cands, 50)
    assert picks == Counter({"a": 50})


def test_in_flight_load_spreads_requests_between_equals():
    clock = Clock()
    a, b = _cand(clock, "a", 0.1), _cand(clock, "b", 0.1)
    a.tracker.inflight = 1
    assert _selector().rank([a, b])[0].name == "b"
    slow = _cand(clock, "slow", 0.5)
    a.tracker.inflight = b.tracker.inflight = 10  # 2x: still better than a 5x slower idle backend
    assert _selector().rank([a, b, slow])[-1].name == "slow"
    a.tracker.inflight = b.tracker.inflight = 50  # 6x: now the slow one is worth it
    assert _selector().rank([a, b, slow])[0].name == "slow"


def test_recent_errors_and_cost_weigh_against_a_backend():
    clock = Clock()
    flaky, steady = _cand(clock, "flaky", 0.1), _cand(clock, "steady", 0.3)
    flaky.tracker.observe_done(0.01, ok=False)
    flaky.tracker.observe_done(0.01, ok=False)
    assert _selector().rank([flaky, steady])[0].name == "steady"
    cheap, pricey = _cand(clock, "cheap", 0.3), _cand(clock, "pricey", 0.2, cost=2.0)
    assert _selector().rank([cheap, pricey])[0].name == "pricey"
    assert _selector(cost_weight_s=0.1).rank([cheap, pricey])[0].name == "cheap"


def test_a_new_backend_is_tried_once_then_scored_at_the_median_of_the_others():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1), _cand(clock, "b", 0.2), _cand(clock, "c", 0.3), _cand(clock, "new")]
    sel = _selector()
    first = sel.rank(cands)[0]
    assert first.name == "new" and first.predicted_ttft_s is None and first.note == "cold start: no samples yet"
    cands[3].tracker.inflight = 1  # the relay took it: no second cold-start request meanwhile
    ranked = sel.rank(cands)
    assert ranked[0].name == "a"
    new = next(r for r in ranked if r.name == "new")
    assert new.score == pytest.approx(0.2 * 1.1) and new.note and "median" in new.note


def test_an_idle_degraded_backend_stays_last_and_is_only_explored_now_and_then():
    clock = Clock()
    good, degraded = _cand(clock, "good", 0.05), _cand(clock, "degraded", 2.0)
    sel = _selector(explore_after_s=3.0, explore_every=50)
    clock.t += 3600  # an hour without traffic to it: its estimate has not decayed
    picks = []
    for _ in range(500):
        clock.t += 0.01  # 100 requests/s; every one of them teaches `good`
        r = sel.rank([good, degraded])[0]
        picks.append(r)
        cand = good if r.name == "good" else degraded
        if r.name == "degraded":
            assert r.note and r.note.startswith("explore")
        cand.tracker.observe_ttft(0.05 if cand is good else 2.0)
        cand.tracker.observe_done(0.1, ok=True)
    explored = sum(1 for r in picks if r.name == "degraded")
    assert 1 <= explored <= 2  # once every 3 s at most: under 0.5% of 500 requests over 5 s
    assert picks[0].name == "degraded"  # it had been silent for an hour


def test_exploration_notices_a_healed_backend_within_seconds():
    clock = Clock()
    good, healed = _cand(clock, "good", 0.05), _cand(clock, "healed", 2.0)
    sel = _selector(explore_after_s=3.0, explore_every=50)
    share_late = 0
    for step in range(2000):  # 20 s at 100 requests/s
        clock.t += 0.01
        r = sel.rank([good, healed])[0]
        cand = good if r.name == "good" else healed
        cand.tracker.observe_ttft(0.05)
        cand.tracker.observe_done(0.1, ok=True)
        if step >= 1500:
            share_late += r.name == "healed"
    assert share_late / 500 > 0.3


def test_exploration_can_be_turned_off():
    clock = Clock()
    good, degraded = _cand(clock, "good", 0.05), _cand(clock, "degraded", 2.0)
    clock.t += 3600
    assert _picks(_selector(explore_after_s=0), [good, degraded], 200) == Counter({"good": 200})


def test_best_of_two_among_many_spreads_load_but_never_picks_a_much_slower_one():
    clock = Clock()
    cands = [_cand(clock, f"g{i}", 0.1 + i * 0.005) for i in range(8)] + [_cand(clock, f"s{i}", 1.0) for i in range(8)]
    picks = _picks(_selector(p2c_min=6, tie_pct=0.0), cands, 2000)
    assert set(picks) == {f"g{i}" for i in range(7)}  # the worst of the good ones never wins a pair
    assert picks["g0"] > picks["g3"] > picks["g6"]  # the better of two wins more often
    equals = [_cand(clock, f"e{i}", 0.1) for i in range(8)]
    picks = _picks(_selector(p2c_min=6), equals, 4000)
    assert len(picks) == 8 and min(picks.values()) > 350  # equal scores: every one gets its share


def test_round_robin_rotates_over_the_eligible_ones():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1), _cand(clock, "b", 0.9), _cand(clock, "c", 0.5)]
    sel = _selector("round_robin")
    assert [sel.rank(cands)[0].name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert [r.name for r in sel.rank(cands)] == ["a", "b", "c"]
    cands[1].health.cool_down(10)
    assert [r.name for r in sel.rank(cands)] == ["c", "a", "b"]


def test_least_inflight_picks_the_least_loaded_at_random_among_equals():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1), _cand(clock, "b", 0.9), _cand(clock, "c", 0.5)]
    cands[0].tracker.inflight = 3
    cands[1].tracker.inflight = 1
    cands[2].tracker.inflight = 1
    ranked = _selector("least_inflight").rank(cands)
    assert ranked[-1].name == "a" and ranked[0].score == 1.0
    assert set(_picks(_selector("least_inflight"), cands, 50)) == {"b", "c"}


def test_weighted_picks_in_proportion_to_weight():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1, weight=3.0), _cand(clock, "b", 0.1, weight=1.0), _cand(clock, "z", 0.1, weight=0.0)]
    picks = _picks(_selector("weighted"), cands, 4000)
    assert 0.72 < picks["a"] / 4000 < 0.78 and "z" not in picks
    assert [r.name for r in _selector("weighted", seed=1).rank(cands)][1:] in (["b", "z"], ["a", "z"])


def test_unknown_strategies_are_refused():
    with pytest.raises(ValueError, match="unknown routing strategy"):
        Selector("fastest")


def test_rank_of_nothing_is_empty():
    assert _selector().rank([]) == []
