"""Runtime builds and their activation: a build only reads the live state; `Runtime.activate`, at
the swap, puts the new limits in force once, and measurements and stores carry over."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.gate import reserve_slots
from gateway.routing.backends import BackendState
from gateway.config.policy import Policy, StorePolicy, parse_policy
from gateway.config.runtime import build_runtime
from gateway.store.core import Store

UNSET = "GATEWAY_TEST_KEYS_NOT_SET"


def _policy(max_concurrency: int = 1, failures: int = 3, eject_ms: int = 10_000, extra: str = "", models: str = "[m]") -> Policy:
    return parse_policy(
        f"backends:\n  a: {{url: 'http://127.0.0.1:1/v1', models: {models}, max_concurrency: {max_concurrency}}}\n"
        f"health: {{failures_to_eject: {failures}, eject_ms: {eject_ms}}}\n" + extra
    )


def _slots(state: BackendState) -> tuple[object, ...]:
    s = state.slots
    assert s is not None
    return s.limit, s.reserve, s.queue.starvation_share, s.standing_target_s, s.standing_interval_s


def _healths(state: BackendState) -> dict[str, tuple[int, float, float]]:
    """The thresholds of the backend's own health ("") and of each model's."""
    return {m: (h.failures_to_eject, h.eject_s, h.max_eject_s) for m, h in [("", state.health), *state.models.items()]}


def _limits(state: BackendState) -> tuple[object, ...]:
    return _slots(state), _healths(state)


def _live() -> tuple[dict[str, BackendState], dict[StorePolicy, Store], BackendState]:
    states: dict[str, BackendState] = {}
    stores: dict[StorePolicy, Store] = {}
    build_runtime(_policy(), states, 1, stores).activate(states, stores)
    return states, stores, states["a"]


def test_a_build_changes_nothing_live_and_its_activation_applies_every_limit() -> None:
    states: dict[str, BackendState] = {}
    stores: dict[StorePolicy, Store] = {}
    first = build_runtime(_policy(), states, 1, stores)
    assert states == {} and stores == {}  # recorded at the swap, not before
    first.activate(states, stores)
    a = states["a"]
    assert first.backends["a"].state is a and stores == first.stores
    before = _limits(a)
    stricter = "admission: {starvation_share: 0.3, priority_reserve_pct: 50, standing_target_ms: 700, standing_interval_ms: 900}\n"
    second = build_runtime(_policy(max_concurrency=4, failures=7, eject_ms=2000, extra=stricter), states, 2, stores)
    assert _limits(a) == before and states == {"a": a} and stores == first.stores
    assert second.backends["a"].state is a  # measurements carry over by name
    second.activate(states, stores)
    assert _slots(a) == (4, reserve_slots(4, 50), 0.3, 0.7, 0.9)
    assert _healths(a) == {"": (7, 2.0, 30.0), "m": (7, 2.0, 30.0)}


def test_a_policy_that_fails_late_in_its_build_leaves_every_live_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    states, stores, a = _live()
    before, registered = _limits(a), dict(stores)
    monkeypatch.delenv(UNSET, raising=False)
    # New limits, a store of other settings, then a tenant whose keys are missing: Runtime() fails,
    # after the backends, the classifier and the stores were built.
    failing = _policy(
        max_concurrency=9, failures=8, eject_ms=1234,
        extra=f"store: {{memory_max_bytes: 4096}}\nadmission: {{starvation_share: 0.5}}\ntenants: {{t: {{key_sha256_env: {UNSET}}}}}\n",
    )  # fmt: skip
    with pytest.raises(ValueError, match=UNSET):
        build_runtime(failing, states, 2, stores)
    assert _limits(a) == before
    assert states == {"a": a} and stores == registered  # the store it opened is not registered


async def test_a_raised_limit_lets_waiters_in_at_the_swap_not_at_the_build() -> None:
    states, stores, a = _live()
    slots = a.slots
    assert slots is not None and slots.try_acquire()
    waiter = asyncio.create_task(slots.acquire(5.0))
    await asyncio.sleep(0.01)
    raised = build_runtime(_policy(max_concurrency=2), states, 2, stores)
    await asyncio.sleep(0.01)
    assert not waiter.done() and slots.limit == 1
    raised.activate(states, stores)
    assert await asyncio.wait_for(waiter, 1.0) is True
    slots.release()
    slots.release()
    assert slots.used == 0


def test_a_runtime_never_activated_adds_no_model_health_to_the_live_state() -> None:
    # `gateway serve` builds one only to validate, and a reload that fails drops the one it built.
    states, stores, a = _live()
    assert set(a.models) == {"m"}
    two = build_runtime(_policy(models="[m, n]"), states, 2, stores)
    assert set(a.models) == {"m"}
    two.activate(states, stores)
    assert set(a.models) == {"m", "n"}
    assert two.route("n").pool("none").candidates[0].health is a.models["n"]  # what routing reads is what the relay reports to


def test_stores_carry_over_while_their_settings_stay() -> None:
    states, stores, _ = _live()
    kept = dict(stores)
    same = build_runtime(_policy(failures=5), states, 2, stores)
    assert same.stores == kept  # the very same objects
    same.activate(states, stores)
    other = build_runtime(_policy(extra="store: {memory_max_bytes: 4096}\n"), states, 3, stores)
    (opened,) = set(other.stores) - set(kept)
    assert opened.memory_max_bytes == 4096 and opened not in stores
    other.activate(states, stores)
    # registered at the swap; the one no longer used stays, for requests in flight, closed with the app
    assert stores == {**kept, opened: other.stores[opened]}


def test_a_workers_share_is_the_slot_limit_it_activates() -> None:
    states: dict[str, BackendState] = {}
    stores: dict[StorePolicy, Store] = {}
    policy = _policy(max_concurrency=5, extra="admission: {priority_reserve_pct: 50}\n")
    rt = build_runtime(policy, states, 1, stores, slot_share=lambda n: n // 2)
    rt.activate(states, stores)
    slots = states["a"].slots
    assert slots is not None and (slots.limit, slots.reserve) == (2, 1)


def test_a_runtime_is_activated_once() -> None:
    states: dict[str, BackendState] = {}
    stores: dict[StorePolicy, Store] = {}
    rt = build_runtime(_policy(), states, 1, stores)
    rt.activate(states, stores)
    with pytest.raises(RuntimeError, match="activated twice"):
        rt.activate(states, stores)
