"""Small units: errors, auth, slots, health, the latency window."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from gateway.tenants.auth import Tenants, hash_key
from gateway.routing.backends import Slots
from gateway.errors import AllBackendsFailed, BadRequest, RateLimited, UpstreamError, UpstreamRejected, UpstreamTimeout
from gateway.routing.health import Health
from gateway.routing.latency import Tracker, quantile
from gateway.config.policy import parse_policy


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_errors_have_openai_shape():
    body = orjson.loads(BadRequest("bad field", param="messages").to_body())
    assert body == {"error": {"message": "bad field", "type": "invalid_request_error", "param": "messages", "code": None}}


def test_upstream_rejections_pass_the_backends_error_through():
    raw = b'{"error": {"message": "context too long", "type": "invalid_request_error", "param": null, "code": "context_length_exceeded"}}'
    assert UpstreamRejected(400, raw, "a").to_body() == raw
    wrapped = orjson.loads(UpstreamRejected(422, b"nope", "a").to_body())
    assert "nope" in wrapped["error"]["message"] and wrapped["error"]["code"] == "upstream_rejected"


def test_all_backends_failed_picks_the_status_a_client_expects():
    assert AllBackendsFailed([("a", UpstreamTimeout("slow"))]).status == 504
    assert AllBackendsFailed([("a", UpstreamError("x")), ("b", UpstreamTimeout("y"))]).status == 502
    busy = AllBackendsFailed([("a", RateLimited("x", retry_after_s=9)), ("b", RateLimited("y", retry_after_s=3))])
    assert busy.status == 429 and busy.headers() == {"Retry-After": "3"}
    assert AllBackendsFailed([], deadline_hit=True).status == 504


def test_tenants_authenticate_by_digest_and_open_mode():
    policy = parse_policy(
        f"""
backends: {{a: {{url: "http://127.0.0.1:1/v1", models: [m]}}}}
tenants: {{acme: {{key_sha256: ["{hash_key('sk-1')}"], models: [m]}}}}
admin: {{key_sha256: ["{hash_key('sk-admin')}"]}}
"""
    )
    t = Tenants(policy)
    assert t.authenticate("sk-1").name == "acme"
    assert t.is_admin("sk-admin") and not t.is_admin("sk-1") and not t.is_admin(None)
    for bad in (None, "", "sk-2"):
        with pytest.raises(Exception) as exc:
            t.authenticate(bad)
        assert getattr(exc.value, "status", None) == 401
    open_ = Tenants(parse_policy('backends: {a: {url: "http://127.0.0.1:1/v1", models: [m]}}'))
    assert open_.authenticate(None).name == "default" and open_.is_admin(None)


async def test_slots_are_first_come_first_served_and_time_out():
    s = Slots(1)
    assert s.try_acquire() and not s.try_acquire()
    order: list[int] = []

    async def waiter(i: int) -> None:
        assert await s.acquire(2.0)
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    for _ in range(3):
        s.release()
        await asyncio.sleep(0.01)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and s.used == 1
    assert not await s.acquire(0.02)
    s.release()
    assert s.used == 0


async def test_a_cancelled_waiter_never_leaks_a_slot():
    s = Slots(1)
    assert s.try_acquire()
    t = asyncio.create_task(s.acquire(5.0))
    await asyncio.sleep(0)
    s.release()  # hands the slot to the waiter...
    t.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await t
    assert s.used == 0 and s.try_acquire()


def test_a_backends_slots_name_it_in_the_queues_safety_net_log(caplog):
    from gateway.admission.gate import Ticket

    with caplog.at_level("ERROR", logger="gateway"):
        Slots(1, backend="gpu-a").queue._uncount(Ticket())  # a waiter counted out that was never counted
        Slots(1).queue._uncount(Ticket())
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("backend 'gpu-a''s slots: ") and lines[1].startswith("a backend's slots: "), lines


def test_health_ejects_after_consecutive_failures_and_recovers():
    clock = Clock()
    h = Health(failures_to_eject=2, eject_s=10, clock=clock)
    h.report_failure()
    assert h.healthy
    h.report_failure()
    assert not h.healthy and h.state() == "ejected"
    clock.t += 10.1
    assert h.healthy
    h.cool_down(5)
    assert h.state() == "cooling" and 4.9 < h.cooling_for() <= 5


def test_tracker_window_and_quantiles():
    clock = Clock()
    tr = Tracker(window_s=60, clock=clock)
    for i in range(1, 101):
        tr.observe_ttft(i / 1000)
    tr.observe_done(0.5, ok=False)
    snap = tr.snapshot()
    assert snap["ttft_p50_ms"] == 50 and snap["ttft_p95_ms"] == 95 and snap["errors"] == 1
    clock.t += 61
    assert tr.snapshot()["ttft_p50_ms"] is None
    assert quantile([], 0.5) is None and quantile([1.0], 0.99) == 1.0


def test_a_backend_price_is_its_routing_cost_unless_a_cost_is_given():
    from gateway.config.runtime import build_runtime

    policy = parse_policy(
        "backends:\n"
        "  a: {url: 'http://127.0.0.1:1/v1', models: [m], price: {input_per_mtok: 0.5, output_per_mtok: 1.5}}\n"
        "  b: {url: 'http://127.0.0.1:2/v1', models: [m], cost: 3, price: {input_per_mtok: 9}}\n"
        "  c: {url: 'http://127.0.0.1:3/v1', models: [m]}\n"
    )
    rt = build_runtime(policy, {}, generation=1)
    costs = {c.name: c.cost for c in rt.route("m").pool("none").candidates}
    assert costs == {"a": 2.0, "b": 3.0, "c": 0.0}


def test_missing_redis_fails_under_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    # A green CI must not hide the store, quota and single-flight tests behind skips.
    from tests.procs import redis_missing

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI is set"):
        redis_missing("no Redis at 127.0.0.1:6379")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        redis_missing("no Redis at 127.0.0.1:6379")
