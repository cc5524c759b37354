"""Latency-aware routing end to end: several fake upstreams on loopback, the gateway in between."""

from __future__ import annotations

import asyncio
import collections
import time

import aiohttp
import openai

from gateway.web.keys import LIVE

MSG = [{"role": "user", "content": "hi"}]


def _policy(*ups, strategy="latency", **extra):
    policy = {
        "backends": {u.name: {"url": u.url, "models": ["m"]} for u in ups},
        "models": {"m": {"backends": [u.name for u in ups], "strategy": strategy}},
        "reload": {"watch": False},
    }
    for key, value in extra.items():
        if key == "model":
            policy["models"]["m"].update(value)
        else:
            policy[key] = value
    return policy


async def _stream(client) -> str:
    raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG, stream=True)
    async for _ in raw.parse():
        pass
    return raw.headers["x-gateway-backend"]


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return await r.text()


async def test_traffic_moves_off_a_slow_backend_and_comes_back_when_it_heals(upstream, gateway):
    a = await upstream("a", ttft_ms=10, tokens=2)
    b = await upstream("b", ttft_ms=10, tokens=2)
    gw = await gateway(_policy(a, b))
    c = gw.client()
    for _ in range(20):
        await _stream(c)
    a.set(ttft_ms=250)  # a degrades
    for _ in range(6):  # a few requests find out
        await _stream(c)
    after = collections.Counter([await _stream(c) for _ in range(30)])
    assert after["a"] <= 2, after  # exploration aside, traffic left a
    a.set(ttft_ms=5)  # a heals, and is now the faster one
    # It wins traffic back once exploration has refreshed its estimate (the level falls over
    # ~3 s of fast samples, and only as samples come): at least 15% of 50 picks in a row. Within
    # a bound, not over a fixed 9 s: that averaged the transition too, and on a loaded CI machine
    # (a 5 vs 10 ms contrast under scheduling noise) read 18 of 230.
    recent: collections.deque[str] = collections.deque(maxlen=50)
    end = time.monotonic() + 30
    while not (len(recent) == 50 and recent.count("a") >= 0.15 * 50):
        assert time.monotonic() < end, collections.Counter(recent)
        recent.append(await _stream(c))
        await asyncio.sleep(0.02)


async def test_a_backend_killed_mid_run_causes_no_client_visible_error(upstream, gateway):
    a = await upstream("a", ttft_ms=5, tokens=2)
    b = await upstream("b", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(a, b, strategy="round_robin"))
    c = gw.client()
    errors, done = [], 0

    async def worker():
        nonlocal done
        for _ in range(25):
            try:
                r = await c.chat.completions.create(model="m", messages=MSG)
                assert r.choices[0].message.content == "w0 w1 "
                done += 1
            except openai.APIError as exc:  # pragma: no cover - the assertion below reports it
                errors.append(exc)

    workers = [asyncio.create_task(worker()) for _ in range(4)]
    await asyncio.sleep(0.15)
    await a.stop()  # killed while requests are in flight on it
    await asyncio.gather(*workers)
    assert not errors and done == 100


async def test_a_stuck_backend_is_abandoned_at_its_live_deadline_not_the_fixed_one(upstream, gateway):
    a = await upstream("a", ttft_ms=20, tokens=2)
    b = await upstream("b", ttft_ms=20, tokens=2)
    policy = _policy(a, b, strategy="ordered", routing={"deadline_floor_ms": 150})
    policy["backends"]["a"]["timeouts"] = {"first_token_ms": 30000}
    gw = await gateway(policy)
    c = gw.client()
    for _ in range(25):  # a learns a ~20 ms P95
        assert await _stream(c) == "a"
    a.set(mode="stall")
    t0 = time.perf_counter()
    assert await _stream(c) == "b"
    took = time.perf_counter() - t0
    assert 0.1 < took < 1.5, took  # max(2 x P95, 150 ms), not 30 s
    assert 'kind="first_token_timeout"' in await _metrics(gw)


async def test_a_hedge_wins_against_a_stalled_backend_and_the_loser_is_closed(upstream, gateway):
    a = await upstream("a", mode="stall")
    b = await upstream("b", ttft_ms=5, tokens=3)
    policy = _policy(a, b, strategy="ordered", model={"hedge": {"max_extra_pct": 50, "min_delay_ms": 50, "default_delay_ms": 100}})
    policy["backends"]["a"]["timeouts"] = {"first_token_ms": 20000}
    gw = await gateway(policy)
    c = gw.client()
    t0 = time.perf_counter()
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=MSG, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in raw.parse() if ch.choices])
    assert text == "w0 w1 w2 " and raw.headers["x-gateway-backend"] == "b"
    assert time.perf_counter() - t0 < 2.0
    await asyncio.sleep(0.05)
    assert a.stats.cancelled == 1 and a.stats.active == 0  # the loser's connection was closed
    text = await _metrics(gw)
    assert 'gateway_hedges_total{result="started"} 1.0' in text and 'gateway_hedges_total{result="won"} 1.0' in text
    backend_a = gw.app[LIVE].runtime.backends["a"]
    assert backend_a.slots.used == 0 and backend_a.tracker.inflight == 0


async def test_the_hedge_budget_caps_extra_calls(upstream, gateway):
    a = await upstream("a", ttft_ms=150, tokens=1)
    b = await upstream("b", ttft_ms=150, tokens=1)
    policy = _policy(a, b, strategy="ordered", model={"hedge": {"max_extra_pct": 10, "min_delay_ms": 10, "default_delay_ms": 20}})
    gw = await gateway(policy)
    c = gw.client()
    for _ in range(20):
        await _stream(c)
    text = await _metrics(gw)
    started = float(text.split('gateway_hedges_total{result="started"} ')[1].split("\n")[0])
    exhausted = float(text.split('gateway_hedges_total{result="budget_exhausted"} ')[1].split("\n")[0])
    assert started <= 1 + 0.10 * 20 and exhausted >= 1  # 10 % of 20 requests, plus one to start
    # Every request b saw was a hedge (a hedge cancelled by the winner before its request left
    # never reaches b, which happens on a loaded machine).
    assert b.stats.requests <= started


async def test_an_ejected_backend_is_probed_back_and_explain_shows_why_it_was_skipped(upstream, gateway):
    a = await upstream("a", mode="error_500")
    b = await upstream("b", tokens=1)
    # Request probes off: this is the model-list probe's half-open path (a request probe that lands
    # between the polls below would end the ejection at once, which test_recovery.py covers).
    policy = _policy(
        a, b, strategy="ordered", health={"failures_to_eject": 2, "eject_ms": 60000, "probe_interval_ms": 100, "probe_timeout_ms": 500,
                                          "recovery_probe_interval_ms": 0}
    )
    gw = await gateway(policy)
    c = gw.client()
    for _ in range(2):
        await c.chat.completions.create(model="m", messages=MSG)  # a fails twice: ejected
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json={"model": "m", "messages": MSG}) as r:
            out = await r.json()
        assert out["chosen"] == "b"
        skipped = {x["backend"]: x["skipped"] for x in out["candidates"]}
        assert skipped["a"] == "ejected" and skipped["b"] is None
        async with http.get(gw.url + "/admin/backends") as r:
            assert (await r.json())["backends"]["a"]["health"] == "ejected"
    assert 'gateway_backend_ejections_total{backend="a"} 1.0' in await _metrics(gw)
    # the probe GETs /models, which works even while chat fails: a real request must decide
    a.set(mode="ok", tokens=1)
    health = gw.app[LIVE].runtime.backends["a"].health_for("m")  # model m's health on backend a
    for _ in range(50):
        if health.state() == "probing":
            break
        await asyncio.sleep(0.05)
    assert health.state() == "probing"  # a probe noticed it, long before the 60 s ejection ends
    r = await c.chat.completions.with_raw_response.create(model="m", messages=MSG)
    assert r.headers["x-gateway-backend"] == "a" and health.state() == "healthy"
    assert 'gateway_probes_total{backend="a",result="ok"}' in await _metrics(gw)


async def test_when_both_hedged_attempts_fail_the_next_backend_answers_and_none_is_tried_twice(upstream, gateway):
    a = await upstream("a", mode="stall")
    b = await upstream("b", mode="stall")
    c3 = await upstream("c", ttft_ms=5, tokens=2)
    policy = _policy(a, b, c3, strategy="ordered", model={"hedge": {"max_extra_pct": 100, "min_delay_ms": 20, "default_delay_ms": 50}})
    for name in ("a", "b"):
        policy["backends"][name]["timeouts"] = {"first_token_ms": 300}
    gw = await gateway(policy)
    assert await _stream(gw.client()) == "c"
    assert (a.stats.requests, b.stats.requests, c3.stats.requests) == (1, 1, 1)


async def test_a_hedge_counts_within_max_attempts(upstream, gateway):
    # max_attempts 2: the primary and its hedge are the two; a third backend is never called.
    a = await upstream("a", mode="stall")
    b = await upstream("b", mode="stall")
    c3 = await upstream("c", ttft_ms=5, tokens=2)
    policy = _policy(a, b, c3, strategy="ordered", model={"hedge": {"max_extra_pct": 100, "min_delay_ms": 20, "default_delay_ms": 50}},
                     server={"max_attempts": 2})
    for name in ("a", "b"):
        policy["backends"][name]["timeouts"] = {"first_token_ms": 300}
    gw = await gateway(policy)
    try:
        await _stream(gw.client())
        raise AssertionError(f"answered: {(a.stats.requests, b.stats.requests, c3.stats.requests)}")
    except openai.APIStatusError as err:
        assert err.status_code in (502, 504), err
    assert (a.stats.requests, b.stats.requests, c3.stats.requests) == (1, 1, 0)
    assert 'gateway_hedges_total{result="started"} 1.0' in await _metrics(gw)
