"""The hedge budget is fair across tenants and outlives a policy reload.

A route's budget (`hedge.max_extra_pct` of its requests) was one pot: a tenant whose requests have
deliberately slow first tokens had each of them hedged until the pot was empty, and everyone
else's late first tokens met `budget_exhausted` (review helper's repro). Each tenant now spends
at most that share of its own requests (and the route's cap still holds). And a reload built a new
budget, with its hedge allowed from the start: a reload storm gave a hedge per reload; an
unchanged route now keeps its budget."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.config.policy import Policy
from gateway.config.runtime import build_runtime
from gateway.routing.hedge_budget import HedgeBudget
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE, RELOADER
from tests.clock import Clock
from tests.servers import serve_app

MALLORY, ALICE, BOB = "sk-mallory", "sk-alice", "sk-bob"


# ---- the budget itself -------------------------------------------------------------------------


def test_a_tenant_spends_at_most_its_share_of_its_own_requests_and_the_others_keep_theirs():
    clock = Clock()
    b = HedgeBudget(10, clock=clock)
    for _ in range(90):
        b.note_request("alice")
    spent = 0
    for _ in range(30):  # every one of mallory's requests asks for a hedge
        b.note_request("mallory")
        spent += b.try_spend("mallory")
    assert spent == 4  # 10 % of its 30, plus one (before: 13, all the route allowed)
    alice = 0
    for _ in range(10):
        b.note_request("alice")
        alice += b.try_spend("alice")
    assert alice == 10  # before: 0 (budget_exhausted)


def test_the_routes_cap_still_holds_whoever_spends():
    b = HedgeBudget(10, clock=Clock())
    spent = 0
    for i in range(200):  # 200 tenants of one request each: one free hedge each, but not past the route's cap
        b.note_request(f"t{i}")
        spent += b.try_spend(f"t{i}")
    assert spent <= 1 + 0.10 * 200


def test_one_tenant_or_none_spends_as_the_route_did():
    for tenant in ("alice", None):
        b = HedgeBudget(10, clock=Clock())
        spent = 0
        for _ in range(100):
            b.note_request(tenant)
            spent += b.try_spend(tenant)
        assert spent == 11  # 10 % of 100, plus one to start


def test_a_tenants_share_decays_with_the_window():
    clock = Clock()
    b = HedgeBudget(10, half_life_s=60, clock=clock)
    for _ in range(50):
        b.note_request("mallory")
        b.try_spend("mallory")
    assert not b.try_spend("mallory")
    clock.t += 600  # ten half-lives: what it spent is forgotten, as the route's own figures are
    b.note_request("mallory")
    assert b.try_spend("mallory")


# ---- end to end -------------------------------------------------------------------------------


async def _chat(slow_s: float) -> tuple[web.AppRunner, int]:
    """A streaming chat backend whose first token takes `slow_s` for a prompt holding "SLOW" (a
    caller can make its own first tokens late: a long think, a slow tool), three times that for
    one holding "LATER", 5 ms otherwise."""
    async def chat(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(slow_s if b"SLOW" in raw else 3 * slow_s if b"LATER" in raw else 0.005)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"
        await resp.write(chunk({"role": "assistant", "content": "po"}) + chunk({"content": "ng"}) + chunk({}, "stop") + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return await serve_app(app)


async def _stream(c: openai.AsyncOpenAI, text: str) -> str:
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": text}], stream=True)
    async for _ in raw.parse():
        pass
    return raw.headers["x-gateway-backend"]


async def _hedges(gw: Any) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as r:
        text = await r.text()
    return {line.split('result="')[1].split('"')[0]: float(line.split()[-1])
            for line in text.splitlines() if line.startswith("gateway_hedges_total{")}


@pytest.fixture
async def pair(gateway):
    """make(**hedge) -> gateway: `a` (a first token of 0.5 s for "SLOW", 1.5 s for "LATER")
    before `b` (5 ms), model m hedged, three tenants."""
    runners: list[web.AppRunner] = []

    async def make(**hedge: Any) -> Any:
        (ra, pa), (rb, pb) = await _chat(0.5), await _chat(0.0)
        runners.extend((ra, rb))
        return await gateway({
            "backends": {"a": {"url": f"http://127.0.0.1:{pa}/v1", "models": ["m"]}, "b": {"url": f"http://127.0.0.1:{pb}/v1", "models": ["m"]}},
            "models": {"m": {"backends": ["a", "b"], "strategy": "ordered",
                             "hedge": {"max_extra_pct": 10, "min_delay_ms": 100, "default_delay_ms": 150, **hedge}}},
            "cache": {"enabled": False}, "reload": {"watch": False},
            "tenants": {n: {"key_sha256": [hash_key(k)]} for n, k in (("mallory", MALLORY), ("alice", ALICE), ("bob", BOB))},
        })

    yield make
    for r in runners:
        await r.cleanup()


async def test_one_tenants_slow_first_tokens_do_not_spend_the_others_hedges(pair):
    gw = await pair()
    alice, mallory = gw.client(ALICE), gw.client(MALLORY)
    for i in range(90):
        await _stream(alice, f"hello {i}")
    for i in range(30):  # each one's first token is late on `a`: each asks for a hedge
        await _stream(mallory, f"SLOW {i}")
    mallory_hedges = (await _hedges(gw)).get("started", 0.0)
    # Alice's own late first tokens (later than mallory's: its unhedged ones taught `a` a P95 of
    # 0.5 s, which is latency.py's business; the hedge waits that long now).
    late = [await _stream(alice, f"LATER {i}") for i in range(8)]
    # Before: mallory started 12 hedges and alice's late first tokens got 0 of 8 (all
    # budget_exhausted, answered by `a` after its 1.5 s).
    assert mallory_hedges <= 4 + 1, (mallory_hedges, await _hedges(gw))  # its 10 %, one to start (+1: a slow machine's)
    assert late.count("b") >= 6, (late, await _hedges(gw))


async def test_a_reload_storm_gives_no_hedge_per_reload(pair):
    gw = await pair()
    c = gw.client(ALICE)
    assert await _stream(c, "SLOW first") == "b"  # the hedge allowed from the start
    reloader = gw.app[RELOADER]
    gen, routes = gw.app[LIVE].runtime.generation, gw.app[LIVE].runtime.routes["m"]
    got = []
    for i in range(10):
        ok, why = await reloader.reload("test")  # the same policy: the route is unchanged
        assert ok, why
        got.append(await _stream(c, f"SLOW {i}"))
    runtime = gw.app[LIVE].runtime
    assert runtime.generation == gen + 10 and runtime.routes["m"] is not routes
    # Before: each reload's new budget allowed one more, 10 of 10 hedged (100 % extra calls, not 10 %).
    assert got.count("b") <= 1, (got, await _hedges(gw))
    assert runtime.routes["m"].budget is routes.budget


def _policy(**hedge: Any) -> Policy:
    return Policy.model_validate({
        "backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}, "b": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
        "models": {"m": {"backends": ["a", "b"], "hedge": {"max_extra_pct": 10, **hedge}}},
    })


def test_a_budget_is_kept_across_builds_only_while_its_route_is_unchanged():
    states: dict[str, Any] = {}
    first = build_runtime(_policy(), states, 0)
    first.activate(states, {})
    budget = first.routes["m"].budget
    assert budget is not None
    again = build_runtime(_policy(), states, 1)
    assert again.routes["m"].budget is budget  # unchanged: carried, as the backends' measurements are
    assert build_runtime(_policy(max_extra_pct=20), states, 2).routes["m"].budget is not budget
    assert build_runtime(_policy(), {}, 3).routes["m"].budget is not budget  # another app's backends: its own
