"""A client that goes away cancels its upstream request at once and leaks nothing."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from gateway.web.keys import LIVE
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


async def _wait_for(cond, timeout: float = 2.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def _admin(gw) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends") as r:
            return (await r.json())["backends"]


@pytest.mark.parametrize("when", ["mid_stream", "before_first_token", "non_stream"])
async def test_disconnect_cancels_upstream_and_frees_the_slot(upstream, gateway, when):
    ttft = 5000 if when != "mid_stream" else 0
    up = await upstream("a", tokens=200, itl_ms=50, ttft_ms=ttft)
    policy = simple_policy(up)
    policy["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(policy)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": when != "non_stream"})
    http = aiohttp.ClientSession()
    resp_task = None
    try:
        if when == "mid_stream":
            r = await http.post(gw.url + "/v1/chat/completions", data=body)
            await r.content.readuntil(b"w1 ")  # a few tokens arrived
            r.close()  # the client goes away
        else:
            resp_task = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", data=body))
            await _wait_for(lambda: up.stats.active == 1)
            resp_task.cancel()
    finally:
        await http.close()
    await _wait_for(lambda: up.stats.cancelled == 1)
    backend = gw.app[LIVE].runtime.backends["a"]
    await _wait_for(lambda: backend.slots.used == 0 and backend.tracker.inflight == 0)
    assert (await _admin(gw))["a"]["inflight"] == 0
    # the single slot is free again: the next request gets through at once
    up.set(ttft_ms=0, tokens=2, itl_ms=0)
    r = await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 w1 "
    async with aiohttp.ClientSession() as http2:
        async with http2.get(gw.url + "/metrics") as m:
            text = await m.text()
    assert "gateway_client_disconnects_total 1.0" in text
    assert 'gateway_backend_inflight{backend="a"} 0.0' in text
