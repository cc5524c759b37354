"""Slots are owned by the attempt that takes them: cancelling a request at any await point, plain
or hedged, leaves every in-flight count at zero, and nothing starts after an attempt owns the client."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest
import yaml

from gateway.web.keys import LIVE, RELOADER
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


async def _wait_for(cond, timeout: float = 3.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def _hedged_policy(a, b) -> dict:
    policy = simple_policy(a, b)
    for name in ("a", "b"):
        policy["backends"][name]["max_concurrency"] = 2
    policy["models"]["gpt-test"]["hedge"] = {"max_extra_pct": 100, "min_delay_ms": 0, "default_delay_ms": 20}
    return policy


def _slots_policy(a, b, hedged: bool) -> dict:
    policy = _hedged_policy(a, b) if hedged else simple_policy(a, b)
    # The burst below shares this one event loop with its 128 clients and the fake upstreams:
    # on a loaded machine a's answers came over 2 s late, past its live first-token deadline
    # (max(2 x a P95 of ~60 ms, this floor; live once the stream variant's cancellations left
    # 20 samples)), and failed over to a full b (504) or got a ejected. The floor at
    # first_token_ms: no live deadline cuts an answer here (every cancellation is within 130 ms).
    policy["routing"] = {"deadline_floor_ms": 30_000}
    return policy


@pytest.mark.parametrize("hedged", [False, True], ids=["plain", "hedged"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_cancelling_at_every_point_leaks_no_slot(upstream, gateway, hedged, stream):
    a = await upstream("a", ttft_ms=60, itl_ms=5, tokens=6)
    b = await upstream("b", ttft_ms=30, itl_ms=5, tokens=6)
    gw = await gateway(_slots_policy(a, b, hedged))
    backends = gw.app[LIVE].runtime.backends
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": stream})
    async with aiohttp.ClientSession() as http:

        async def one() -> None:
            async with http.post(gw.url + "/v1/chat/completions", data=body) as r:
                await r.read()

        # Cancel 1 ms apart over the whole life of a request: before the connection, while queued,
        # while the primary waits, right after the hedge starts, mid-stream, after the end.
        for delay_ms in range(0, 130, 3):
            task = asyncio.create_task(one())
            await asyncio.sleep(delay_ms / 1000)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    await _wait_for(lambda: all(b.slots.used == 0 for b in backends.values()))
    assert all(b.tracker.inflight == 0 for b in backends.values())
    if hedged:
        # The burst checks the slots, not hedging: a hedge takes a free slot 20 ms (or the live
        # P95) after its primary started, and on a loaded machine the burst's last requests came
        # later than that and queued behind the burst's own hedges. The same slots (a reload
        # keeps each backend's state by name), without the hedge.
        policy = yaml.safe_load(gw.policy_path.read_text())
        del policy["models"]["gpt-test"]["hedge"]
        gw.write_policy(policy)
        ok, why = await gw.app[RELOADER].reload("test")
        assert ok, why
        assert all(gw.app[LIVE].runtime.backends[n].slots is b.slots for n, b in backends.items())
    # A burst of max_concurrency requests per backend is served without queueing.
    policy_limit = sum(b.slots.limit for b in backends.values())
    client = gw.client()
    resps = await asyncio.gather(
        *[client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG) for _ in range(policy_limit)]
    )
    assert all(float(r.headers["x-gateway-queue-ms"]) < 1.0 for r in resps)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    assert 'gateway_backend_inflight{backend="a"} 0.0' in text and 'gateway_backend_inflight{backend="b"} 0.0' in text


async def test_nothing_starts_after_the_hedge_winner_owns_the_client(upstream, gateway):
    # a is slow to its first token, b (the hedge) wins and streams slowly; the client leaves mid-stream.
    a = await upstream("a", ttft_ms=400, itl_ms=5, tokens=4)
    b = await upstream("b", ttft_ms=0, itl_ms=100, tokens=50)
    c = await upstream("c", ttft_ms=0, itl_ms=5, tokens=4)
    policy = simple_policy(a, b, c)
    policy["models"]["gpt-test"]["hedge"] = {"max_extra_pct": 100, "min_delay_ms": 0, "default_delay_ms": 30}
    gw = await gateway(policy)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        r = await http.post(gw.url + "/v1/chat/completions", data=body)
        assert r.headers["x-gateway-backend"] == "b"
        await r.content.readuntil(b"w1 ")
        r.close()
    await asyncio.sleep(0.6)
    assert c.stats.requests == 0  # no third upstream request after bytes reached the client
    backends = gw.app[LIVE].runtime.backends
    await _wait_for(lambda: all(x.slots.used == 0 for x in backends.values()))
