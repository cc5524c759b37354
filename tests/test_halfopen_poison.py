"""A half-open trial that one tenant's request fails: the gateway's own request probe decides.

After an ejection, a request probe that answers lets one trial request through (half-open). When
that trial was one tenant's poison (a prompt the backend answers 500 to, or one that times out),
its failure re-ejected the backend for longer and made its probes distrusted ("the probe said
back, a real request said otherwise"), so from then on only the back-off let a trial through, and
the tenant's next poison took it again: one tenant kept a healthy backend out for everyone, for as
long as it kept sending (review helper's repro). Such a failure now waits for a probe like any
other run of failures one tenant alone met: answered, the backend is half-open again and that
tenant's failures count for nothing a while; failed (a backend broken or hung for everyone), the
ejection stands."""

from __future__ import annotations

import asyncio
import collections
import random
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from gateway.routing.health import LIVE_DEADLINE, Health
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE
from tests.clock import Clock
from tests.servers import serve_app

MALLORY, ALICE, BOB = "sk-mallory", "sk-alice", "sk-bob"


def _outage(clock: Clock) -> Health:
    """A backend that an outage several tenants met ejected (no probe needed to confirm it)."""
    h = Health(failures_to_eject=3, eject_s=10, max_eject_s=30, jitter=0.0, clock=clock, rng=random.Random(0))
    for tenant in ("alice", "bob", "alice"):
        h.report_failure(tenant, asked=True)
    assert h.state() == "ejected" and not h.verifying
    return h


# ---- the health state machine ------------------------------------------------------------------


def test_a_trial_a_probe_let_through_that_one_tenant_fails_waits_for_the_probe():
    clock = Clock()
    h = _outage(clock)
    h.report_probe(True, request=True)  # it is back: half-open
    assert h.state() == "probing" and h.probe_opened
    h.report_failure("mallory", asked=True)  # mallory's poison took the trial
    assert h.state() == "ejected" and h.verifying and h.suspect == "mallory" and not h.probes_misled
    h.report_probe(True, request=True)  # the gateway's own request is answered
    assert h.state() == "probing" and h.ejections == 1 and not h.verifying and h.probe_opened
    h.report_failure("mallory", asked=True)  # forgiven for max_eject_s: nothing counted
    assert h.state() == "probing" and h.ejections == 1
    h.report_success()  # anyone else's trial decides
    assert h.state() == "healthy"


def test_after_a_cleared_trial_another_tenants_failed_trial_corroborates_and_ejects_at_once():
    # A backend that answers one-token probes while everyone's real requests fail: the second
    # tenant's failed trial is the corroboration, and its probes are distrusted as before.
    clock = Clock()
    h = _outage(clock)
    h.report_probe(True, request=True)
    h.report_failure("mallory", asked=True)
    h.report_probe(True, request=True)
    h.report_failure("alice", asked=True)
    assert h.state() == "ejected" and not h.verifying and h.probes_misled and h.ejections == 2
    h.report_probe(True, request=True)
    assert h.state() == "ejected"  # the back-off decides now


@pytest.mark.parametrize("tenant", ["mallory", LIVE_DEADLINE])
def test_a_trial_failed_by_one_tenant_on_a_backend_broken_for_everyone_is_confirmed_by_the_probe(tenant):
    clock = Clock()
    h = _outage(clock)
    h.report_probe(True, request=True)  # it answered once, then broke (or hung) again
    h.report_failure(tenant, asked=True)
    assert h.verifying
    h.report_probe(False)  # the probe fails (or times out) too
    assert h.state() == "ejected" and not h.verifying and h.ejections == 2 and h.available_in() == pytest.approx(20)
    assert h.run_tenant is None  # the run ends with the confirmed ejection
    h.report_probe(True, request=True)  # a later recovery: half-open as ever
    assert h.state() == "probing"


def _simulate(*, broken: bool, misled: bool = False, seconds: float = 300.0) -> tuple[int, int, float]:
    """Mallory sends a poison prompt every 0.1 s (it takes every trial: it comes first); Alice asks
    every 0.5 s; the prober probes an ejected backend every second, and one that waits for its word
    at once. Returns Alice's requests the backend answered, her requests, and the share of the
    time it was out (ejected), over `seconds` after an outage ended (`broken`: it did not).
    `misled`: during the outage, a trial a probe let through failed (its probes are distrusted)."""
    clock = Clock()
    h = _outage(clock)
    if misled:
        h.report_probe(True, request=True)
        h.report_failure()  # the backend's own kind of failure: no tenant to blame
        assert h.probes_misled and h.state() == "ejected"
    last_probe, alice_total, alice_here, out = clock.t, 0, 0, 0
    ticks = int(seconds / 0.1)
    for i in range(ticks):
        clock.t += 0.1
        if h.verifying or (h.state() == "ejected" and clock.t - last_probe >= 1.0):
            last_probe = clock.t
            h.report_probe(not broken, request=True)
        if h.state() in ("healthy", "probing"):
            h.report_failure("mallory", asked=True)
        if i % 5 == 0:
            alice_total += 1
            if h.state() in ("healthy", "probing"):
                if broken:
                    h.report_failure("alice", asked=True)
                else:
                    alice_here += 1
                    h.report_success()
        out += h.state() == "ejected"
    return alice_here, alice_total, out / ticks


@pytest.mark.parametrize("misled", [False, True])
def test_one_tenants_poison_cannot_keep_a_recovered_backend_out(misled):
    here, total, out = _simulate(broken=False, misled=misled)
    # Before: 0 of 600 of Alice's requests, out 100 % of the time, either way. Now out only while
    # each run of Mallory's waits for its probe (once per forgiveness, max_eject_s), and, when its
    # probes were distrusted, for the outage's last back-off (20 s of the 300).
    assert here >= (0.9 if misled else 0.95) * total and out < (0.08 if misled else 0.02), (here, total, out)


def test_a_backend_that_answers_probes_but_fails_everyones_requests_costs_a_few_trials_per_back_off():
    """What distrusting its probes is for: while every real request fails, a trial costs a user
    request an attempt a few times per back-off (30 s here), never once per probe interval."""
    clock = Clock()
    h = Health(failures_to_eject=3, eject_s=10, max_eject_s=30, jitter=0.0, clock=clock, rng=random.Random(0))
    failed, last_probe = 0, clock.t
    for i in range(int(600 / 0.25)):  # alice and bob in turn, a request each 0.25 s
        clock.t += 0.25
        if h.verifying or (h.state() == "ejected" and clock.t - last_probe >= 1.0):
            last_probe = clock.t
            h.report_probe(True, request=True)
        if h.state() in ("healthy", "probing"):
            failed += 1
            h.report_failure(("alice", "bob")[i % 2], asked=True)
    assert failed <= 70, failed  # 24 before (one per back-off); unchecked, one per probe: ~600


@pytest.mark.parametrize("misled", [False, True])
def test_a_backend_broken_for_everyone_stays_out_whoever_takes_its_trials(misled):
    here, _, out = _simulate(broken=True, misled=misled)
    assert here == 0 and out > 0.95, (here, out)


# ---- end to end: a real gateway, a backend that answers 500 to one prompt ------------------------


async def _backend(mode: dict[str, str]) -> tuple[web.AppRunner, int, collections.Counter[str]]:
    """A chat backend: answers 500 to a prompt holding "POISON"; per `mode["state"]`, everything
    else (its request probes, text completions, included) is answered ("ok"), a 500 ("fail"), or
    never answered ("hang")."""
    seen: collections.Counter[str] = collections.Counter()

    async def broken(what: str) -> web.Response | None:
        state = mode["state"]
        if state == "hang":
            seen[f"{what} hang"] += 1
            await asyncio.sleep(60)
        if state != "ok":
            seen[f"{what} 500"] += 1
            return web.json_response({"error": {"message": "internal error", "type": "server_error"}}, status=500)
        return None

    async def chat(request: web.Request) -> web.Response:
        body = await request.read()
        if b"POISON" in body:
            seen["poison 500"] += 1
            return web.json_response({"error": {"message": "internal error", "type": "server_error"}}, status=500)
        if (failed := await broken("chat")) is not None:
            return failed
        seen["chat ok"] += 1
        answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def completions(_: web.Request) -> web.Response:  # what a request probe asks
        if (failed := await broken("probe")) is not None:
            return failed
        seen["probe ok"] += 1
        return web.json_response({"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner, port = await serve_app(app)
    return runner, port, seen


@pytest.fixture
async def halfopen(upstream, gateway):
    """make() -> (gateway, `fast`'s health for m, its mode, what it saw): `fast` (the backend
    above) before a healthy `slow`, three tenants, request probes every 200 ms."""
    runners: list[web.AppRunner] = []

    async def make() -> tuple[Any, Any, dict[str, str], collections.Counter[str]]:
        mode = {"state": "ok"}
        runner, port, seen = await _backend(mode)
        runners.append(runner)
        slow = await upstream("slow", ttft_ms=5, tokens=1)
        gw = await gateway({
            "backends": {"fast": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"], "timeouts": {"first_token_ms": 500}},
                         "slow": {"url": slow.url, "models": ["m"]}},
            "models": {"m": {"backends": ["fast", "slow"], "strategy": "ordered"}},
            "health": {"failures_to_eject": 3, "eject_ms": 1500, "max_eject_ms": 4000, "recovery_probe_interval_ms": 200,
                       "probe_timeout_ms": 500},
            "cache": {"enabled": False}, "reload": {"watch": False},
            "tenants": {n: {"key_sha256": [hash_key(k)]} for n, k in (("mallory", MALLORY), ("alice", ALICE), ("bob", BOB))},
        })
        return gw, gw.app[LIVE].runtime.backends["fast"].health_for("m"), mode, seen

    yield make
    for runner in runners:
        await runner.cleanup()


async def _ask(c: openai.AsyncOpenAI, text: str) -> str:
    raw = await c.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": text}])
    return raw.headers["x-gateway-backend"]


async def _metric(gw: Any, name: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as r:
        return "\n".join(line for line in (await r.text()).splitlines() if line.startswith(name))


async def _until(check: Any, timeout_s: float = 5.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return bool(check())


async def _eject_by_an_outage(gw: Any, health: Any, mode: dict[str, str]) -> None:
    """`fast` fails everyone (alice's and bob's requests: corroborated, no probe needed), then recovers."""
    mode["state"] = "fail"
    for key in (ALICE, BOB, ALICE):
        assert await _ask(gw.client(key), "hello") == "slow"
    assert health.state() == "ejected" and not health.verifying
    mode["state"] = "ok"


async def test_one_tenant_sending_poison_does_not_keep_a_recovered_backend_out(halfopen):
    gw, health, mode, seen = await halfopen()
    await _eject_by_an_outage(gw, health, mode)
    mallory, alice = gw.client(MALLORY), gw.client(ALICE)
    stop = asyncio.Event()

    async def poison() -> None:  # as fast as it goes: mallory's requests take the trials
        while not stop.is_set():
            assert await _ask(mallory, "POISON") == "slow"

    async def sample() -> None:
        while not stop.is_set():
            states[health.state()] += 1
            await asyncio.sleep(0.02)

    states: collections.Counter[str] = collections.Counter()
    loops = [asyncio.create_task(poison()) for _ in range(3)] + [asyncio.create_task(sample())]
    got: list[str] = []
    try:
        for i in range(40):  # 4 s: the probe finds it back within ~0.3 s
            got.append(await _ask(alice, f"hello {i}"))
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    late = got[20:]
    # Before: alice had 0 of 40 on `fast` (ejected ~95 % of the samples, its trials all mallory's).
    assert late.count("fast") >= 0.8 * len(late), (got, states, seen)
    assert 'result="cleared"' in await _metric(gw, "gateway_health_verifications_total")


@pytest.mark.parametrize("state", ["fail", "hang"])
async def test_a_trial_one_tenant_fails_on_a_backend_broken_for_everyone_is_confirmed_and_it_stays_out(halfopen, state):
    gw, health, mode, seen = await halfopen()
    await _eject_by_an_outage(gw, health, mode)
    assert await _until(lambda: health.state() == "probing")  # a probe answered: half-open
    mode["state"] = state  # ... and it broke (or hung) again before the trial
    assert await _ask(gw.client(MALLORY), "hello") == "slow"  # the trial: a 500, or a first-token timeout
    assert health.state() == "ejected"

    async def confirmed() -> bool:
        return 'result="confirmed"' in await _metric(gw, "gateway_health_verifications_total")

    for _ in range(100):
        if await confirmed():
            break
        await asyncio.sleep(0.05)
    assert await confirmed(), (health.state(), seen)
    assert health.state() == "ejected" and not health.verifying and health.ejections == 2
    alice = gw.client(ALICE)
    assert [await _ask(alice, f"hi {i}") for i in range(5)] == ["slow"] * 5
