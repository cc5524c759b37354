"""What the gateway says about a request (headers, access log, request log, metrics) is what it did:
hedges are not failovers, waits are queue time, every API request is counted, a client that left
before any answer is a 499, and a flight's streamed follower is a `cache` hit everywhere."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.admission.gate import Admission, Shed, Ticket
from gateway.observe.observer import stages
from gateway.pipeline.call import Call
from gateway.web.keys import OBSERVER
from gateway.wire.endpoints import CHAT
from tests.conftest import simple_policy

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


async def _metrics(gw: Any) -> list[str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return (await r.text()).splitlines()


def _sum(lines: list[str], prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


# ---- 1. a hedge is not a failover ----------------------------------------------------------------


async def test_hedge_where_the_primary_wins_is_no_failover_and_keeps_its_timing(upstream, gateway):
    a = await upstream("a", ttft_ms=250, tokens=2)  # late past the 60 ms hedge delay, but first
    b = await upstream("b", ttft_ms=2000, tokens=2)  # the hedge: much later
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False},
        "backends": {u.name: {"url": u.url, "models": ["m"]} for u in (a, b)},
        "models": {"m": {"backends": ["a", "b"], "strategy": "ordered",
                         "hedge": {"max_extra_pct": 100, "min_delay_ms": 60, "default_delay_ms": 60}}},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            await r.read()
            backend, st = r.headers["x-gateway-backend"], r.headers["server-timing"]
    assert backend == "a"
    text = await _metrics(gw)
    assert _sum(text, 'gateway_hedges_total{result="started"}') == 1
    # Nothing failed: no request moved to another backend before the first byte.
    failovers, events = _sum(text, "gateway_failovers_total"), _sum(text, 'gateway_relay_events_total{event="failover"')
    # The gateway's own work is parse+classify+route, not the hedge delay the primary spent upstream.
    m = re.search(r"gateway;dur=([0-9.]+)", st)
    assert m is not None
    assert (failovers, events) == (0, 0) and float(m.group(1)) < 40, (failovers, events, st)


@pytest.mark.parametrize("winner", ["holder", "hedge"])
async def test_a_hedge_beside_an_affinity_hit_spills_only_when_it_answers(upstream, gateway, capsys, winner):
    a = await upstream("a", ttft_ms=30, tokens=2)
    b = await upstream("b", ttft_ms=30, tokens=2)
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False}, "log": {"access": True},
        "backends": {u.name: {"url": u.url, "models": ["m"]} for u in (a, b)},
        "models": {"m": {"backends": ["a", "b"], "strategy": "latency",
                         "hedge": {"max_extra_pct": 100, "min_delay_ms": 80, "default_delay_ms": 80}}},
    })
    ups = {"a": a, "b": b}
    system = "You are a careful assistant. " * 60  # > one 1,024-char block

    async def ask(http: aiohttp.ClientSession, user: str) -> tuple[str, str | None, str]:
        body = {"model": "m", "stream": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
        async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
            await r.read()
            return r.headers["x-gateway-backend"], r.headers.get("x-gateway-affinity"), r.headers["x-request-id"]

    async with aiohttp.ClientSession() as http:
        for i in range(12):  # both backends measured
            await ask(http, f"warm {i}")
        holder, _, _ = await ask(http, "the question")
        other = "b" if holder == "a" else "a"
        if winner == "holder":
            ups[holder].set(ttft_ms=300)  # late enough to be hedged, still first
            ups[other].set(ttft_ms=3000)
        else:
            ups[holder].set(ttft_ms=3000)
            ups[other].set(ttft_ms=30)
        backend, affinity, rid = await ask(http, "the question")
    gw.app[OBSERVER].close()
    line = next(entry for entry in _lines(capsys) if entry["request_id"] == rid)
    text = await _metrics(gw)
    assert _sum(text, 'gateway_hedges_total{result="started"}') == 1
    assert _sum(text, "gateway_failovers_total") == 0
    if winner == "holder":
        assert backend == holder and affinity == "hit" and line["affinity"]["backend"] == holder, (backend, affinity, line)
    else:
        assert backend == other == line["backend"] and affinity == "spill", (backend, affinity, line)
        assert line["affinity"]["backend"] == other and "hedge" in line["affinity"]["reason"], line["affinity"]
    assert line["affinity"]["result"] == affinity


# ---- 2. waits are queue time ---------------------------------------------------------------------


async def test_expired_in_admission_queue_reports_its_wait_as_queue(upstream, gateway, capsys):
    up = await upstream("a", ttft_ms=3200)
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False}, "log": {"access": True},
        "backends": {"a": {"url": up.url, "models": ["m"]}},
        "models": {"m": {"backends": ["a"]}},
        "admission": {"max_inflight": 1},
    })
    async with aiohttp.ClientSession() as http:
        async def slow() -> None:
            async with http.post(gw.url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
        first = asyncio.create_task(slow())
        await asyncio.sleep(0.2)
        async with http.post(gw.url + "/v1/chat/completions", json=BODY, headers={"x-request-timeout-ms": "2300"}) as r:
            await r.read()
            status, st, qms, rid = r.status, r.headers["server-timing"], r.headers["x-gateway-queue-ms"], r.headers["x-request-id"]
        await first
    gw.app[OBSERVER].close()
    line = next(entry for entry in _lines(capsys) if entry["request_id"] == rid)
    assert status == 504
    assert line["queue_ms"] > 1000 and float(qms) > 1000 and line["gateway_ms"] < 500, (line, qms, st)
    queue = re.search(r"queue;dur=([0-9.]+)", st)
    assert queue is not None and float(queue.group(1)) > 1000, st


async def test_a_waiter_pushed_out_of_the_admission_queue_says_how_long_it_waited():
    adm = Admission(1, 1)
    adm._service_s = 0.01  # the waits fit any deadline
    await adm.enter(Ticket(), 5.0)
    pushed = asyncio.create_task(adm.enter(Ticket("flex", "mallory"), 5.0))
    await asyncio.sleep(0.05)
    newcomer = asyncio.create_task(adm.enter(Ticket("default", "quiet"), 5.0))
    with pytest.raises(Shed) as out:
        await pushed
    assert out.value.reason == "queue_full" and out.value.waited_s >= 0.04
    with pytest.raises(Shed) as at_once:  # refused as it came: it waited for nothing
        await adm.enter(Ticket("flex", "late"), 5.0)
    assert at_once.value.waited_s == 0.0
    newcomer.cancel()
    await asyncio.gather(newcomer, return_exceptions=True)
    adm.leave(0.01)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_followers_wait_for_its_leader_is_queue_and_it_is_a_cache_hit(upstream, gateway, capsys, stream):
    up = await upstream("a", ttft_ms=800, tokens=3)
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "log": {"access": True},
        "backends": {"a": {"url": up.url, "models": ["m"]}},
        "models": {"m": {"backends": ["a"]}},
    })
    body = {**BODY, "temperature": 0, "stream": stream}
    async with aiohttp.ClientSession() as http:
        async def one(delay: float) -> dict[str, str]:
            await asyncio.sleep(delay)
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return {k.lower(): v for k, v in r.headers.items()}
        got = await asyncio.gather(one(0), one(0.15))
        async with http.get(gw.url + "/admin/requests") as r:
            entries = (await r.json())["data"]
    gw.app[OBSERVER].close()
    follower = got[1]
    assert up.stats.requests == 1 and follower["x-gateway-cache"] == "hit", got
    hit = next(line for line in _lines(capsys) if line["cache"] == "hit")
    # The gateway's own work (parse, auth, lookup) is a few ms; the ~650 ms it waited for its
    # leader is queue time, in the access log, the header and Server-Timing alike.
    assert hit["gateway_ms"] < 100 and hit["queue_ms"] > 400, hit
    assert float(follower["x-gateway-queue-ms"]) > 400, follower
    queue = re.search(r"queue;dur=([0-9.]+)", follower["server-timing"])
    assert queue is not None and float(queue.group(1)) > 400, follower["server-timing"]
    if stream:  # its first token came with its leader's: its client's TTFT, then the leader's decode
        assert hit["ttft_ms"] is not None and hit["ttft_ms"] > 400 and "decode_ms" in hit, hit
    # Every place names the same backend for a hit: `cache`.
    entry = next(e for e in entries if e["cache"] == "hit")
    assert follower["x-gateway-backend"] == hit["backend"] == entry["backend"] == "cache", (follower, hit, entry)
    text = await _metrics(gw)
    assert _sum(text, 'gateway_requests_total{backend="cache"') == 1, [t for t in text if t.startswith("gateway_requests_total")]


def test_a_followers_stages_split_at_its_first_token_without_overlap():
    call = Call("r", CHAT, b"", None, time.monotonic() + 10)
    call.stream = True
    t0 = call.timing.t0
    call.timing.queue_ms, call.timing.ttft_s = 600.0, 0.605
    st = stages(call, t0 + 1.0)
    assert st["queue"] == pytest.approx(0.6) and st["gateway"] == pytest.approx(0.005) and st["decode"] == pytest.approx(0.395)
    assert sum(st.values()) == pytest.approx(1.0)


# ---- 3. every API request is counted -------------------------------------------------------------


async def test_a_by_id_call_is_counted_like_any_request(upstream, gateway, capsys):
    up = await upstream(f"r{uuid.uuid4().hex[:8]}", tokens=2)
    gw = await gateway(simple_policy(up, log={"access": True}, cache={"enabled": False}))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", json={"model": "gpt-test", "input": "hi", "store": True}) as r:
            rid = (await r.json())["id"]
        async with http.get(gw.url + f"/v1/responses/{rid}") as r:
            assert r.status == 200, await r.text()
            assert r.headers["x-gateway-backend"] == up.name
        async with http.get(gw.url + "/v1/responses/resp_nobodyhasthisone") as r:
            assert r.status == 404
        async with http.get(gw.url + "/admin/requests") as r:
            entries = (await r.json())["data"]
    gw.app[OBSERVER].close()
    lines = _lines(capsys)
    text = await _metrics(gw)
    assert len(lines) == len(entries) == 3
    assert _sum(text, "gateway_requests_total{") == 3 and _sum(text, "gateway_request_duration_seconds_count") == 3, text
    assert _sum(text, 'gateway_requests_total{backend="none",cache="bypass",class="none",code="404"') == 1


# ---- 4. a client that left before any answer: 499 -----------------------------------------------


def _policy(up: Any) -> dict[str, Any]:
    return {"version": 1, "reload": {"watch": False}, "cache": {"enabled": False}, "log": {"access": True},
            "backends": {"a": {"url": up.url, "models": ["m"]}}, "models": {"m": {"backends": ["a"]}}}


async def _records(gw: Any, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    await asyncio.sleep(0.3)
    text = [line for line in await _metrics(gw) if line.startswith("gateway_requests_total{")]
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/requests") as r:
            entry = (await r.json())["data"][0]
    gw.app[OBSERVER].close()
    return text, _lines(capsys)[0], entry


async def test_a_client_gone_before_any_answer_is_a_499(upstream, gateway, capsys):
    gw = await gateway(_policy(await upstream("a", ttft_ms=1500)))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(gw.url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
    text, line, entry = await _records(gw, capsys)
    assert line["finish"] == entry["finish"] == "client_disconnect"
    assert line["status"] == entry["status"] == 499, (line, entry)
    assert any('code="499"' in t for t in text) and not any('code="200"' in t for t in text), text


async def test_a_stream_cut_after_its_200_went_out_keeps_its_200(upstream, gateway, capsys):
    gw = await gateway(_policy(await upstream("a", mode="cut", tokens=6, fail_after=2)))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
            assert r.status == 200
            await r.read()
    text, line, entry = await _records(gw, capsys)
    assert line["finish"] == entry["finish"] == "cut"
    assert line["status"] == entry["status"] == 200 and any('code="200"' in t for t in text), (line, text)


async def test_a_stream_left_mid_answer_keeps_its_200(upstream, gateway, capsys):
    gw = await gateway(_policy(await upstream("a", tokens=200, itl_ms=20)))
    async with aiohttp.ClientSession() as http:
        r = await http.post(gw.url + "/v1/chat/completions", json={**BODY, "stream": True})
        await r.content.readuntil(b"w1 ")
        r.close()  # the client goes away after its 200 and some content
    text, line, entry = await _records(gw, capsys)
    assert line["finish"] == entry["finish"] == "client_disconnect"
    assert line["status"] == entry["status"] == 200 and any('code="200"' in t for t in text), (line, text)
