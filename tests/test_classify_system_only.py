"""A task sent as the only system or developer message is read as the request (it read as "" and
went to the small model: review helper's repro), as the last assistant or tool text is without a
user turn."""

from __future__ import annotations

import asyncio
import aiohttp

TASK = "Write a Python function that implements Dijkstra's shortest path algorithm with a binary heap, prove its correctness and explain its time complexity."

async def test_a_task_sent_as_the_only_system_or_developer_message_is_classified_by_it(upstream, gateway):
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway({"version": 1,
        "backends": {"small": {"url": small.url, "models": ["m"]}, "big": {"url": big.url, "models": ["m"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}}})
    async with aiohttp.ClientSession() as http:
        for _ in range(300):
            async with http.get(gw.url + "/readyz") as r:
                if r.status == 200: break
            await asyncio.sleep(0.1)
    c = gw.client()
    got = {}
    for role in ("user", "assistant", "system", "developer"):
        raw = await c.chat.completions.with_raw_response.create(model="auto", messages=[{"role": role, "content": TASK}])
        got[role] = (raw.headers["x-gateway-class"], raw.headers["x-gateway-backend"])

    assert got["user"] == ("complex", "big") and got["assistant"] == ("complex", "big")
    assert got["system"] == ("complex", "big"), got  # the only turn there is: read as the assistant's fallback is
    assert got["developer"] == ("complex", "big"), got
