"""A reload that turns admission on while requests relayed with it off are still in flight.

Those requests took no place in the gate (admission was off), so the gate started counting from
zero at the swap and let `max_inflight` more in beside them: the bound was exceeded by as many
as were in flight. They are counted now, cheaply, and join the gate's count at the swap.
A gateway in this process (the `gateway` fixture), a fake upstream that holds each answer.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from gateway.web.keys import ADMISSION, RELOADER
from tests.test_admission_e2e import assert_all_counts_zero, chat, make_policy, n_queued, session, wait_for


async def _reload(gw: Any, policy: dict[str, Any]) -> None:
    gw.write_policy(policy)
    ok, why = await gw.app[RELOADER].reload("test")
    assert ok, why


async def test_turning_admission_on_counts_the_requests_already_in_flight(upstream, gateway):
    up = await upstream("a", ttft_ms=1500, tokens=2)
    off = make_policy(up, admission={"enabled": False, "max_inflight": 2}, reload={"watch": False})
    gw = await gateway(off)
    adm = gw.app[ADMISSION]
    async with session() as http:
        early = [asyncio.create_task(chat(http, gw, content=f"early {i}")) for i in range(3)]
        await wait_for(lambda: up.stats.active == 3, 5.0, "3 requests upstream with admission off")
        assert adm.gate.used == 0  # off: nothing shows in the gate (test_admission_e2e holds this too)
        await _reload(gw, make_policy(up, admission={"enabled": True, "max_inflight": 2}, reload={"watch": False}))
        late = asyncio.create_task(chat(http, gw, content="late"))
        await asyncio.sleep(0.3)
        assert up.stats.active == 3 and up.stats.peak_active == 3, "nothing past max_inflight went upstream"
        assert n_queued(gw, "admission") == 1, "the late request waits in the gate"
        assert adm.gate.used == 3, "the 3 in flight count against max_inflight from the swap on"
        answers = await asyncio.gather(*early, late)
    assert [a.status for a in answers] == [200] * 4
    # It went in only once the early ones were down to one in flight (max_inflight 2).
    assert up.stats.peak_active <= 3
    await assert_all_counts_zero(gw)


async def test_admission_turned_off_and_on_again_keeps_the_count_exact(upstream, gateway):
    """on -> off -> on with requests of each period in flight: every place is given back once."""
    up = await upstream("a", ttft_ms=800, tokens=2)
    on = make_policy(up, admission={"enabled": True, "max_inflight": 8}, reload={"watch": False})
    off = make_policy(up, admission={"enabled": False, "max_inflight": 8}, reload={"watch": False})
    gw = await gateway(on)
    adm = gw.app[ADMISSION]
    async with session() as http:
        tasks = [asyncio.create_task(chat(http, gw, content="on 0"))]
        await wait_for(lambda: up.stats.active == 1, 5.0, "one upstream")
        await _reload(gw, off)
        tasks += [asyncio.create_task(chat(http, gw, content=f"off {i}")) for i in range(2)]
        await wait_for(lambda: up.stats.active == 3, 5.0, "three upstream")
        await _reload(gw, on)
        assert adm.gate.used == 3
        await _reload(gw, off)  # off and on again: the ones carried are not counted twice
        await _reload(gw, on)
        assert adm.gate.used == 3
        answers = await asyncio.gather(*tasks)
    assert [a.status for a in answers] == [200] * 3
    await assert_all_counts_zero(gw)


async def test_admission_off_shows_nothing_in_the_gate(upstream, gateway):
    """Counted aside while off: /admin/backends' admission in-flight stays 0 (no gate)."""
    up = await upstream("a", ttft_ms=500, tokens=2)
    gw = await gateway(make_policy(up, admission={"enabled": False, "max_inflight": 1}))
    async with session() as http:
        tasks = [asyncio.create_task(chat(http, gw, content=f"q{i}")) for i in range(2)]
        await wait_for(lambda: up.stats.active == 2, 5.0, "two upstream")
        async with aiohttp.ClientSession() as h2:
            from tests.test_admission_e2e import ADMIN_KEY
            async with h2.get(gw.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                assert (await r.json())["admission"]["inflight"] == 0
        await asyncio.gather(*tasks)
    await assert_all_counts_zero(gw)
