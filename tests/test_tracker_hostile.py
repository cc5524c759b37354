"""What one tenant (a valid key, within its quota) cannot do to everyone's routing through the
latency trackers: ladder a backend's predicted TTFT up in steps under the cap, poison its error
rate with failures of its own making, or shrink another model's first-token deadline until a
healthy backend is ejected (review helper's repros). Units of the Tracker first, without sockets;
then the three repros, end to end."""

from __future__ import annotations

import asyncio
import collections
import math
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.config.policy import Policy
from gateway.config.runtime import build_runtime
from gateway.relay.report import cut_short
from gateway.routing.latency import Tracker
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE, METRICS
from tests.clock import Clock
from tests.servers import serve_app

MALLORY, ALICE, BOB = "sk-mallory", "sk-alice", "sk-bob"
TENANTS = {n: {"key_sha256": [hash_key(k)]} for n, k in (("mallory", MALLORY), ("alice", ALICE), ("bob", BOB))}


def _tracker(clock: Clock) -> Tracker:
    tr = Tracker(clock=clock)
    tr.corroborate = True
    return tr


def _steady(clock: Clock, tr: Tracker, tenant: str = "alice", seconds: float = 0.01, n: int = 30) -> None:
    for _ in range(n):
        clock.t += 0.1
        tr.observe_ttft(seconds, tenant=tenant)


# -- the TTFT level: no ladder ---------------------------------------------------------------------


@pytest.mark.parametrize("step", [1.1, 1.5, 1.9, 3.0, 100.0])
def test_one_tenants_rising_samples_never_take_the_level_past_twice_its_base_whatever_the_step(step: float) -> None:
    clock = Clock()
    tr = _tracker(clock)
    _steady(clock, tr)
    before = tr.predict_ttft()
    assert before == pytest.approx(0.01)
    for i in range(40):  # each just under (or over) `step` x what explain shows now; alice still about
        clock.t += 0.1
        tr.observe_ttft(step * (tr.predict_ttft() or 0.0), tenant="mallory")
        if i % 10 == 9:
            clock.t += 0.1
            tr.observe_ttft(0.01, tenant="alice")
    assert tr.predict_ttft() <= 2 * before + 1e-9


def test_waiting_out_the_window_starts_no_higher_run() -> None:
    clock = Clock()
    tr = _tracker(clock)
    _steady(clock, tr)
    for _ in range(5):  # five rounds: climb, then wait until every other tenant's sample is stale
        for _ in range(10):
            clock.t += 0.1
            tr.observe_ttft(1.9 * (tr.predict_ttft() or 0.0), tenant="mallory")
        clock.t += 600
    # Alone, the base rises only with samples (~2x per 80 s of them; a sample after a pause
    # counts for 1 s): these 40 alone moved it by ~7%, not 2x a round.
    assert tr.predict_ttft() <= 2 * 0.01 * 1.1


def test_another_tenants_agreeing_sample_counts_and_a_lone_tenants_own_backend_still_shows() -> None:
    clock = Clock()
    tr = _tracker(clock)
    _steady(clock, tr)
    for _ in range(5):
        clock.t += 0.1
        tr.observe_ttft(0.1, tenant="mallory")
    assert tr.predict_ttft() <= 0.02 + 1e-9
    clock.t += 0.1
    tr.observe_ttft(0.1, tenant="bob")  # bob sees it too: in full, up to what both saw
    assert tr.predict_ttft() > 0.05
    clock.t += 0.1
    tr.observe_ttft(0.1, tenant="bob")
    assert tr.predict_ttft() > 0.07
    # A model only alice uses, really 5x slower from now on: 2x at once, all of it within minutes.
    clock = Clock()
    tr = _tracker(clock)
    _steady(clock, tr)
    clock.t += 60
    for _ in range(10):
        clock.t += 1.0
        tr.observe_ttft(0.05, tenant="alice")
    assert 0.019 < (tr.predict_ttft() or 0.0) <= 0.022
    for _ in range(300):
        clock.t += 1.0
        tr.observe_ttft(0.05, tenant="alice")
    assert tr.predict_ttft() == pytest.approx(0.05, rel=0.02)


def test_a_capped_sample_leaves_the_tracker_idle_and_its_slope_unfitted() -> None:
    clock = Clock()
    tr = _tracker(clock)
    _steady(clock, tr)
    clock.t += 10
    tr.observe_ttft(5.0, prompt_tokens=4000, tenant="mallory")
    assert tr.idle_s() == pytest.approx(10.0) and tr.slope_s_per_token == 0.0
    clock.t += 0.1
    tr.observe_ttft(0.01, tenant="alice")  # alice's next sample replaces mallory's rise at once
    assert tr.predict_ttft() == pytest.approx(0.01, rel=0.05)


def test_without_corroboration_or_from_the_gateway_itself_a_sample_counts_in_full() -> None:
    for corroborate, tenant in ((False, "mallory"), (True, None)):
        clock = Clock()
        tr = Tracker(clock=clock)
        tr.corroborate = corroborate
        _steady(clock, tr)
        clock.t += 0.1
        tr.observe_ttft(1.0, tenant=tenant)
        assert tr.predict_ttft() == pytest.approx(0.505)


# -- the error rate: no poisoning ------------------------------------------------------------------


def test_one_tenants_asked_failures_teach_the_error_rate_only_when_another_tenants_agree() -> None:
    clock = Clock()
    tr = _tracker(clock)
    for _ in range(20):
        clock.t += 0.1
        tr.observe_done(0.01, ok=True, tenant="alice")
    for _ in range(12):  # a 500 on what mallory sends, each time
        clock.t += 0.1
        tr.observe_done(0.01, ok=False, asked=True, tenant="mallory")
    assert tr.error_ewma == 0.0 and tr.snapshot()["errors"] == 12  # counted, not taught
    clock.t += 0.1
    tr.observe_done(0.01, ok=False, asked=True, tenant="bob")  # another tenant's agrees: both count
    assert tr.error_ewma == pytest.approx(1 - 0.9**2)
    clock.t += 0.1
    tr.observe_done(0.01, ok=False, tenant="mallory")  # the backend's own kind (refused, cut): at once
    assert tr.error_ewma == pytest.approx(1 - 0.9**3)
    clock.t += 31
    tr.observe_done(0.01, ok=False, asked=True, tenant="mallory")
    clock.t += 31  # a window later: bob's does not agree with it
    tr.observe_done(0.01, ok=False, asked=True, tenant="bob")
    assert tr.error_ewma == pytest.approx(1 - 0.9**3)
    untrusting = Tracker(clock=clock)  # one tenant (or open mode): nobody to protect
    untrusting.observe_done(0.01, ok=False, asked=True, tenant="mallory")
    assert untrusting.error_ewma == pytest.approx(0.1)


# -- per (backend, model) ----------------------------------------------------------------------------


def test_a_models_tracker_is_its_own_and_reports_to_its_backends() -> None:
    clock = Clock()
    backend = _tracker(clock)
    big, tiny = backend.for_model(), backend.for_model()
    assert big.corroborate and big.parent is backend
    for i in range(30):
        clock.t += 0.01
        big.observe_ttft(0.3, tenant="alice" if i % 2 else "bob")
    assert tiny.predict_ttft() == pytest.approx(0.3)  # nothing learnt yet: its backend's estimate
    assert tiny.idle_s() == pytest.approx(backend.idle_s())
    for _ in range(500):  # one tenant's flood of a 5 ms model on the same backend
        clock.t += 0.01
        tiny.observe_ttft(0.005, tenant="mallory")
        tiny.observe_done(0.006, ok=True, tenant="mallory")
    assert tiny.first_token_deadline_s(30.0, 0.2) == pytest.approx(0.2)
    assert big.first_token_deadline_s(30.0, 0.2) == pytest.approx(0.6)  # its own P95: as it was
    assert big.predict_ttft() == pytest.approx(0.3) and big.ttft_p95_s() == pytest.approx(0.3)
    assert backend.first_token_deadline_s(30.0, 0.2) == pytest.approx(0.2)  # the backend's whole view
    assert backend.snapshot()["requests"] == 500 and big.snapshot()["requests"] == 0
    backend.inflight = 2  # the backend's slots count; its models read that one number
    assert big.inflight == 2 and tiny.snapshot()["inflight"] == 2
    tiny.inflight += 1
    assert backend.inflight == 3


def test_the_runtime_gives_each_upstream_model_its_own_tracker_and_keeps_them_across_a_reload() -> None:
    policy = Policy.model_validate({
        "backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": {"m": "big", "tiny": "small"}},
                     "b": {"url": "http://127.0.0.1:10/v1", "models": ["m"]}},
        "models": {"m": {"backends": ["a", "b"]}, "tiny": {"backends": ["a"]}},
        "tenants": TENANTS,
    })
    states: dict[str, Any] = {}
    rt = build_runtime(policy, states, 1)
    rt.activate(states, {})
    a = rt.backends["a"]
    big, small = a.state.trackers["big"], a.state.trackers["small"]
    assert rt.route("m").pool("complex").candidates[0].tracker is big is a.tracker_for("m")
    assert rt.route("tiny").pool("complex").candidates[0].tracker is small is a.tracker_for("tiny")
    assert big.parent is a.tracker and a.tracker_for(None) is a.tracker  # a call that names no model
    assert all(t.corroborate for t in (a.tracker, big, small))  # three tenants: corroborated
    big.observe_ttft(0.3, tenant="alice")
    rt2 = build_runtime(policy, states, 2)
    rt2.activate(states, {})
    assert rt2.route("m").pool("complex").candidates[0].tracker is big and big.predict_ttft() == pytest.approx(0.3)


def test_a_timeout_short_of_the_configured_first_token_limit_is_the_live_deadlines() -> None:
    backend: Any = SimpleNamespace(timeouts=SimpleNamespace(first_token_ms=30_000))
    assert cut_short(backend, 2.05)  # the live deadline (2x P95, its floor): blamed on LIVE_DEADLINE
    assert not cut_short(backend, 30.0) and not cut_short(backend, 30.4)


# -- end to end: the three repros ------------------------------------------------------------------


async def _chat_backend(base_ms: float, slow_ms: float = 600) -> tuple[web.AppRunner, int]:
    """A streaming chat backend: first token after `base_ms`; for a prompt with an image, after the
    `ms=` its (caller-chosen) URL names (its provider fetching the image from the caller's slow
    server); for a prompt that says THINK (a reasoning model's thinking), after `slow_ms`. The
    model `tiny` answers in 5 ms. Request probes (text completions) answer at once."""
    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = orjson.loads(raw)
        delay = base_ms / 1000
        if body.get("model") == "tiny":
            delay = 0.005
        elif b"image_url" in raw and b"ms=" in raw:
            delay = int(raw.split(b"ms=", 1)[1].split(b'"', 1)[0]) / 1000
        elif b"THINK" in raw:
            delay = slow_ms / 1000
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(delay)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
        await resp.write(chunk({"role": "assistant", "content": "po"}) + chunk({"content": "ng"}) + chunk({}, "stop") + b"data: [DONE]\n\n")
        return resp

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}, {"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return await serve_app(app)


async def _streamed(gw: Any, key: str, content: Any, model: str = "m") -> str:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30) as c:
        raw = await c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": content}], stream=True)
        async for _ in raw.parse():
            pass
        return raw.headers["x-gateway-backend"]


async def _predicted_ms(gw: Any, key: str, model: str, backend: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", headers={"Authorization": f"Bearer {key}"},
                             json={"model": model, "messages": [{"role": "user", "content": "hello"}]}) as r:
            assert r.status == 200, await r.text()
            ex = await r.json()
    return {c["backend"]: c["predicted_ttft_ms"] for c in ex["candidates"]}[backend]


async def test_one_tenant_cannot_ladder_a_backends_predicted_ttft_and_move_anothers_traffic(gateway):
    """Mallory reads a's predicted TTFT from /v1/route/explain and sends requests whose first
    token comes at 1.9x it (an image on her own slow server): each such step raised it ~45%
    under a cap that looked only at the level of the moment, 5.9 -> 543 ms in 12 steps, and
    alice's traffic moved to the 40 ms backend. Now neither a model only `a` serves (its own
    tracker) nor the shared one moves past twice where it stood."""
    runner_a, port_a = await _chat_backend(5)
    runner_b, port_b = await _chat_backend(40)
    try:
        gw = await gateway({
            "backends": {"a": {"url": f"http://127.0.0.1:{port_a}/v1", "models": ["m", "m-vision"]},
                         "b": {"url": f"http://127.0.0.1:{port_b}/v1", "models": ["m"]}},
            "models": {"m": {"backends": ["a", "b"]}, "m-vision": {"backends": ["a"]}},
            "routing": {"prefix_affinity": {"enabled": False}},
            "cache": {"enabled": False}, "reload": {"watch": False}, "tenants": TENANTS,
        })
        a = gw.app[LIVE].runtime.backends["a"]
        for i in range(25):
            await _streamed(gw, ALICE, f"hello {i}")
        before = a.tracker_for("m").predict_ttft()
        assert before is not None and before < 0.03
        for model in ("m-vision", "m"):
            for _ in range(12):
                ms = int(await _predicted_ms(gw, MALLORY, model, "a") * 1.9)
                image = [{"type": "text", "text": "what is this?"},
                         {"type": "image_url", "image_url": {"url": f"https://mallory.example/x.png?ms={ms}"}}]
                await _streamed(gw, MALLORY, image, model=model)
            if model == "m-vision":  # another model's climb leaves m's estimate alone
                assert a.tracker_for("m").predict_ttft() == pytest.approx(before, rel=0.05)
        after = a.tracker_for("m").predict_ttft()
        assert after is not None and after <= 2 * before * 1.02, (before, after)
        routed = collections.Counter([await _streamed(gw, ALICE, f"again {i}") for i in range(10)])
        assert routed["a"] >= 8, routed  # (at most one exploration of b)
    finally:
        await runner_a.cleanup()
        await runner_b.cleanup()


async def _poisoned() -> tuple[web.AppRunner, int]:
    """A chat backend (~5 ms) that answers 500 to any prompt holding "POISON"."""
    async def chat(request: web.Request) -> web.Response:
        if b"POISON" in await request.read():
            return web.json_response({"error": {"message": "internal error", "type": "server_error"}}, status=500)
        await asyncio.sleep(0.005)
        answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return await serve_app(app)


async def _ask(gw: Any, key: str, text: str) -> str:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30) as c:
        raw = await c.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": text}])
        return raw.headers["x-gateway-backend"]


@pytest.mark.parametrize("affinity,poison", [(False, 1), (None, 12)])
async def test_one_tenants_poison_requests_do_not_move_anothers_traffic_through_the_error_rate(upstream, gateway, affinity, poison):
    """One request that fast answers 500 (and slow answers) added error_penalty_s x error_ewma
    (~100 ms) to a 5 ms backend's score: alice's traffic went 29/30 -> 0/30 to the 40 ms one.
    One tenant's `asked` failures now teach the error rate only when another tenant's agree."""
    runner, port = await _poisoned()
    slow = await upstream("slow", ttft_ms=40, tokens=1)
    try:
        gw = await gateway({
            "backends": {"fast": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]}, "slow": {"url": slow.url, "models": ["m"]}},
            "models": {"m": {"backends": ["fast", "slow"]}},
            "routing": {"prefix_affinity": {"enabled": affinity}},
            "health": {"failures_to_eject": 3, "recovery_probe_interval_ms": 200},
            "cache": {"enabled": False}, "reload": {"watch": False}, "tenants": TENANTS,
        })
        fast = gw.app[LIVE].runtime.backends["fast"]
        before = collections.Counter([await _ask(gw, ALICE, f"hello {i}") for i in range(30)])
        assert before["fast"] >= (25 if affinity is False else 10), before
        for i in range(poison):
            assert await _ask(gw, MALLORY, f"POISON please {i}") == "slow"  # failed over, answered
        assert fast.tracker_for("m").error_ewma == 0.0
        after = collections.Counter([await _ask(gw, ALICE, f"again {i}") for i in range(30)])
        assert after["fast"] >= 0.7 * before["fast"], (before, after)
        if poison == 1:  # a second tenant meeting it too: the error rate learns (both count)
            await _ask(gw, BOB, "POISON as well")
            assert fast.tracker_for("m").error_ewma > 0.1
    finally:
        await runner.cleanup()


async def test_one_tenants_fast_requests_neither_shrink_anothers_deadline_nor_eject_it(gateway):
    """Mallory floods a 5 ms model on backend a; the first-token deadline of every model on a was
    2x a P95 over all of them, so it fell to its floor (200 ms here, 2 s by default), and alice's
    and bob's ordinary 300 ms first tokens of the big model (600 ms here) timed out there: two tenants'
    timeouts, so no probe was asked, and healthy `a` was ejected. Now each model has its own
    window; and when mallory deflates the big model's own P95 (fast prompts of it), the others'
    slow ones (THINK: a reasoning model's thinking) time out at the live deadline, which fails
    over; their ejection of a is the live deadline's (short of a's first_token_ms), which the
    gateway's own request probe undoes."""
    runner_a, port_a = await _chat_backend(5)
    runner_b, port_b = await _chat_backend(5)
    try:
        gw = await gateway({
            "backends": {"a": {"url": f"http://127.0.0.1:{port_a}/v1", "models": ["m", "tiny"]},
                         "b": {"url": f"http://127.0.0.1:{port_b}/v1", "models": ["m"]}},
            "models": {"m": {"backends": ["a", "b"], "strategy": "ordered"}, "tiny": {"backends": ["a"]}},
            "routing": {"deadline_floor_ms": 200},
            "health": {"recovery_probe_interval_ms": 200},
            "cache": {"enabled": False}, "reload": {"watch": False}, "tenants": TENANTS,
        })
        a = gw.app[LIVE].runtime.backends["a"]
        h = a.health_for("m")
        alice, bob, mallory = gw.client(ALICE, timeout=30), gw.client(BOB, timeout=30), gw.client(MALLORY, timeout=30)

        async def streamed(c: openai.AsyncOpenAI, model: str, text: str) -> str:
            raw = await c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": text}], stream=True)
            async for _ in raw.parse():
                pass
            return raw.headers["x-gateway-backend"]

        got = await asyncio.gather(*[streamed(alice if i % 2 else bob, "m", f"THINK {i}") for i in range(24)])
        assert set(got) == {"a"}, got
        sem = asyncio.Semaphore(16)

        async def flood(model: str, i: int) -> None:
            async with sem:
                await streamed(mallory, model, f"x{i}")

        await asyncio.gather(*[flood("tiny", i) for i in range(500)])
        await asyncio.sleep(0.3)  # a hot-path quantile read may be 0.25 s stale (latency._SORT_EVERY_S)
        assert a.tracker_for("m").first_token_deadline_s(30.0, 0.2) > 1.0  # its own P95: ~600 ms
        assert a.tracker.first_token_deadline_s(30.0, 0.2) < 0.6  # the backend's whole view: m's would time out
        got = [await streamed(c, "m", f"THINK as usual {i}") for i, c in enumerate((alice, bob, alice))]
        assert got == ["a", "a", "a"] and h.state() == "healthy", (got, h.state())
        # The same model's own P95, deflated by mallory's fast prompts of it.
        await asyncio.gather(*[flood("m", i) for i in range(520)])  # past its 512-sample window
        await asyncio.sleep(0.3)
        assert a.tracker_for("m").first_token_deadline_s(30.0, 0.2) < 0.6
        got = [await streamed(c, "m", f"THINK again {i}") for i, c in enumerate((alice, bob, alice, bob))]
        assert got == ["b"] * 4, got  # cut at the live deadline (or a out meanwhile): failed over
        assert a.tracker_for("m").total_timeouts >= 3
        assert not math.isinf(a.tracker_for("m").idle_s())
        # Three such timeouts ejected a, as the live deadline's doing: the gateway's own request
        # probe (due at once) was answered, so the ejection is undone and they count for nothing.
        for _ in range(100):
            if h.state() == "healthy" and not h.verifying:
                break
            await asyncio.sleep(0.05)
        assert h.state() == "healthy" and not h.verifying and h.ejections == 0, (h.state(), h.verifying)
        cleared = gw.app[METRICS].health_verifications.labels("a", "cleared")._value.get()
        assert cleared >= 1
        got = [await streamed(c, "m", f"THINK once more {i}") for i, c in enumerate((alice, bob, alice, bob))]
        assert got == ["b"] * 4 and h.state() == "healthy" and h.consecutive_failures == 0, (got, h.state())
    finally:
        await runner_a.cleanup()
        await runner_b.cleanup()


def test_a_cut_at_a_live_deadline_is_blamed_on_the_live_deadline_not_the_backend() -> None:
    """report(): a stall cut at a live idle deadline (`live`), or a timeout short of first_token_ms,
    counts against health as LIVE_DEADLINE's (its ejection waits for a request probe); a timeout at
    the configured limit, or a stall at the backend's own idle_ms, as the tenant's or the backend's."""
    from gateway.observe.metrics import Metrics
    from gateway.relay.report import report
    from gateway.routing.backends import Backend
    from gateway.routing.health import LIVE_DEADLINE, Kind

    states: dict[str, Any] = {}
    rt = build_runtime(Policy.model_validate({
        "backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"], "timeouts": {"first_token_ms": 10_000}}},
        "models": {"m": {"backends": ["a"]}}, "tenants": TENANTS,
    }), states, 1)
    rt.activate(states, {})
    backend: Backend = rt.backends["a"]
    metrics = Metrics()
    call: Any = SimpleNamespace(model="m", request_id="r1", tenant=SimpleNamespace(name="alice"), prompt_tokens=10, stream=True,
                                out=SimpleNamespace(usage=None), endpoint=SimpleNamespace(generates=True),
                                max_output_tokens=lambda: 16)
    h = backend.health_for("m")
    report(call, backend, metrics, metrics.for_backend("a"), Kind.CUT_MID_STREAM, 4.0, live=True)
    report(call, backend, metrics, metrics.for_backend("a"), Kind.FIRST_TOKEN_TIMEOUT, 2.0)
    assert h.run_deadline == 2 and h.run_unblamed == 0 and h.run_tenant is None
    report(call, backend, metrics, metrics.for_backend("a"), Kind.CUT_MID_STREAM, 40.0)  # at the backend's own idle_ms
    assert h.state() == "ejected" and h.suspect == LIVE_DEADLINE  # fewer unblamed than eject: still verified
