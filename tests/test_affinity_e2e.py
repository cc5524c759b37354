"""Prefix-cache affinity end to end: fake vLLM replicas with a prefix cache (tests/fake_replica.py)
on loopback, the gateway in between (in-process, or `gateway serve --workers 2`), the official
openai SDK as the client. Conversations keep their replica turn after turn, a hot prompt spills
over replicas under load, health and load signals win over affinity, reloads move only what they
must, workers agree on a new prompt's home, and explain, the access log and /metrics say why."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import httpx2
import openai
import orjson
import pytest

from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE, OBSERVER
from tests.fake_replica import FakeReplica
from tests.procs import free_port, serve

# Fast fakes: a 3,100-character prompt costs ~51 ms uncached, ~20 ms once its blocks are cached.
FAST = {"base_ms": 20, "prefill_ms_per_kchar": 10, "tokens": 2, "itl_ms": 1}
ANSWER = "w0 w1 "
KEY, ADMIN = "sk-test", "sk-admin"


# --- helpers ---------------------------------------------------------------------------------


def _system(seed: int, chars: int = 3100) -> str:
    """A distinct system prompt of `chars` characters (three full 1,024-char blocks and a bit)."""
    rng = random.Random(seed)
    words: list[str] = []
    n = 0
    while n < chars:
        w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        words.append(w)
        n += len(w) + 1
    return (f"[system prompt {seed}] " + " ".join(words))[:chars]


@pytest.fixture
async def replicas() -> AsyncIterator[Callable[..., Awaitable[dict[str, FakeReplica]]]]:
    """Factory: `await replicas("r0", "r1", base_ms=...)` starts fake replicas (FAST unless told),
    by name; all are stopped when the test ends."""
    started: list[FakeReplica] = []

    async def make(*names: str, **options: Any) -> dict[str, FakeReplica]:
        out = {}
        for name in names:
            rep = await FakeReplica(name=name, **{**FAST, **options}).start()
            started.append(rep)
            out[name] = rep
        return out

    yield make
    for rep in started:
        await rep.stop()


def _metrics_url(rep: FakeReplica) -> str:
    return f"http://127.0.0.1:{rep.port}/metrics"


def _policy(reps: dict[str, FakeReplica], *, affinity: dict[str, Any] | None = None, stale_ms: int = 2000,
            auth: bool = False, **extra: Any) -> dict[str, Any]:
    """Model `m` on every replica, the latency strategy, load scrapes every 100 ms."""
    routing: dict[str, Any] = {"load_signals": {"interval_ms": 100, "timeout_ms": 300, "stale_ms": stale_ms}}
    if affinity is not None:
        routing["prefix_affinity"] = affinity
    p: dict[str, Any] = {
        "version": 1,
        "backends": {n: {"url": r.url, "models": ["m"], "metrics_url": _metrics_url(r)} for n, r in reps.items()},
        "models": {"m": {"backends": list(reps), "strategy": "latency"}},
        "reload": {"watch": False},
        "cache": {"enabled": False},
        "routing": routing,
    }
    if auth:
        p["tenants"] = {"t": {"key_sha256": [hash_key(KEY)]}}
        p["admin"] = {"key_sha256": [hash_key(ADMIN)]}
    p.update(extra)
    return p


class Conv:
    """A multi-turn conversation on its own ~3,100-character system prompt."""

    def __init__(self, seed: int, system: str | None = None) -> None:
        self.seed = seed
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system or _system(seed)}]
        self.turns: list[tuple[str, str | None]] = []  # (x-gateway-backend, x-gateway-affinity) per turn

    def next_messages(self) -> list[dict[str, str]]:
        """The next turn's messages (the history plus a new user message), not sent."""
        return [*self.messages, {"role": "user", "content": f"question {len(self.turns)} of conversation {self.seed}?"}]

    async def turn(self, client: openai.AsyncOpenAI) -> tuple[str, str | None]:
        msgs = self.next_messages()
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=msgs)  # type: ignore[arg-type]
        answer = raw.parse().choices[0].message.content
        assert answer == ANSWER
        self.messages = [*msgs, {"role": "assistant", "content": answer}]
        got = (raw.headers["x-gateway-backend"], raw.headers.get("x-gateway-affinity"))
        self.turns.append(got)
        return got

    @property
    def home(self) -> str:
        return self.turns[0][0]

    @property
    def last(self) -> str:
        return self.turns[-1][0]


async def _two_turns_each(gateway: Any, policy: dict[str, Any], reps: dict[str, FakeReplica],
                          seeds: range) -> tuple[Any, openai.AsyncOpenAI, list[Conv]]:
    """A gateway on `policy`, every replica measured, and a conversation per seed two turns in."""
    gw = await gateway(policy)
    c = gw.client()
    await _warm(c, reps)
    convs = [Conv(seed) for seed in seeds]
    for _ in range(2):
        for conv in convs:
            await conv.turn(c)
    return gw, c, convs


async def _warm(client: openai.AsyncOpenAI, reps: dict[str, FakeReplica]) -> None:
    """One short request per replica: the selector's cold start sends the first request to each
    backend without samples, which would otherwise override affinity on the test's own turns."""
    before = {n: r.stats.requests for n, r in reps.items()}
    for i in range(len(reps)):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"warm-up {i}"}])
    assert all(r.stats.requests > before[n] for n, r in reps.items()), {n: r.stats.requests for n, r in reps.items()}


async def _measured_alike(gateway: Any, policy: dict[str, Any], reps: dict[str, FakeReplica],
                          tries: int = 5) -> tuple[Any, openai.AsyncOpenAI]:
    """A gateway on `policy` whose selector measured the (identical) replicas alike: each one's
    predicted TTFT within 20 % of the fastest's.

    One warm-up answer each is all the latency ranking knows of them, and it keeps a replica's
    estimate while the replica is idle: on a loaded machine one late warm-up answer (38 ms, or
    110 ms, where the others took 24) ranked its replica behind even the hot prompt's holder with
    several in flight, so nothing spilled there (served {'r2': 6, 'r1': 6}, or all 12 on r2). The
    warm-ups go out at once (the cold start still gives each replica one), so a pause of this
    process delays them alike; a gateway that measured a difference all the same is replaced."""
    levels: dict[str, float | None] = {}
    for _ in range(tries):
        gw = await gateway(policy)
        c = gw.client()
        before = {n: r.stats.requests for n, r in reps.items()}
        await asyncio.gather(*(c.chat.completions.create(model="m", messages=[{"role": "user", "content": f"warm-up {i}"}])
                               for i in range(len(reps))))
        assert all(r.stats.requests == before[n] + 1 for n, r in reps.items()), {n: r.stats.requests for n, r in reps.items()}
        backends = gw.app[LIVE].runtime.backends
        levels = {n: backends[n].tracker.predict_ttft() for n in reps}
        known = [v for v in levels.values() if v is not None]
        if len(known) == len(reps) and max(known) <= 1.2 * min(known):
            return gw, c
        await gw.runner.cleanup()
    raise AssertionError(f"the replicas never measured alike in {tries} gateways: {levels}")


async def _post_json(url: str, body: dict[str, Any], key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers) as r:
            text = await r.text()
            assert r.status == 200, text
            return orjson.loads(text)


async def _explain(url: str, messages: list[dict[str, str]], key: str | None = None) -> dict[str, Any]:
    return await _post_json(url + "/v1/route/explain", {"model": "m", "messages": messages}, key)


def _candidate(view: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in view["candidates"] if c["backend"] == name)


async def _until(pred: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not await pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _cached_share(reps: dict[str, FakeReplica], since: dict[str, tuple[int, int]] | None = None) -> float:
    """Cached prompt characters / prompt characters over the replicas (since a snapshot)."""
    cached = sum(r.stats.cached_chars - (since[n][0] if since else 0) for n, r in reps.items())
    prompt = sum(r.stats.prompt_chars - (since[n][1] if since else 0) for n, r in reps.items())
    return cached / prompt if prompt else 0.0


def _snap(reps: dict[str, FakeReplica]) -> dict[str, tuple[int, int]]:
    return {n: (r.stats.cached_chars, r.stats.prompt_chars) for n, r in reps.items()}


# --- 1. affinity kept across turns -----------------------------------------------------------


async def test_every_later_turn_goes_where_its_conversation_started_and_hits_the_cache(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    gw = await gateway(_policy(reps))
    c = gw.client()
    await _warm(c, reps)
    convs = [Conv(seed) for seed in range(6)]
    for conv in convs:
        await conv.turn(c)
    after_first = _snap(reps)
    for _ in range(4):  # turns interleaved across the conversations
        for conv in convs:
            await conv.turn(c)
    for conv in convs:
        assert conv.turns[0][1] == "miss", conv.turns
        assert conv.turns[1:] == [(conv.home, "hit")] * 4, conv.turns
    homes = collections.Counter(conv.home for conv in convs)
    assert len(homes) >= 2, homes  # new system prompts spread over the replicas (rendezvous, max_share)
    later = _cached_share(reps, after_first)
    assert later > 0.9, later  # every later turn found its prefix in its replica's cache
    assert _cached_share(reps) > 0.7

    # The same workload with prefix affinity off: no header, no prefix_affinity in explain.
    reps_off = await replicas("s0", "s1", "s2")
    gw_off = await gateway(_policy(reps_off, affinity={"enabled": False}), name="off.yaml")
    c_off = gw_off.client()
    await _warm(c_off, reps_off)
    convs_off = [Conv(seed) for seed in range(6)]
    for _ in range(5):
        for conv in convs_off:
            await conv.turn(c_off)
    assert {a for conv in convs_off for _, a in conv.turns} == {None}
    view = await _explain(gw_off.url, convs_off[0].next_messages())
    assert view["prefix_affinity"] is None


async def _turns_with_reasons(gw: Any, c: openai.AsyncOpenAI, conv: Conv, n: int) -> list[tuple[str, str | None, str]]:
    out = []
    for _ in range(n):
        pa = (await _explain(gw.url, conv.next_messages()))["prefix_affinity"]
        backend, result = await conv.turn(c)
        out.append((backend, result, pa["reason"]))
    return out


async def test_a_holders_own_prefill_does_not_make_its_next_turn_spill(gateway, replicas):
    # The brief's fast settings: TTFT ~7 ms when cached; an 8,000-char (~2k-token) system prompt
    # costs its first replica ~85 ms of prefill.
    reps = await replicas("r0", "r1", "r2", base_ms=5, prefill_ms_per_kchar=10)
    gw = await gateway(_policy(reps))
    c = gw.client()
    for _ in range(6):  # every replica measured, on short cached prompts
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm-up"}])
    conv = Conv(77, system=_system(77, chars=8000))
    turns = await _turns_with_reasons(gw, c, conv, 3)
    assert turns[0][1] == "miss"
    # Seen: turn 2 "spill" to r1 ("r0 holds 9 of 11 prefix blocks but predicted 48 ms vs 7 ms best"),
    # turn 3 "spill" to r2 the same way: every replica prefills the prompt once.
    assert [t[:2] for t in turns[1:]] == [(conv.home, "hit")] * 2, turns


# --- 2. spill under load ---------------------------------------------------------------------


async def test_a_hot_system_prompt_spills_over_several_replicas_under_load(gateway, replicas):
    reps = await replicas("r0", "r1", "r2", capacity=2, base_ms=20, prefill_ms_per_kchar=100)
    # The spills go to the latency pick: the replicas must look alike to it, whatever the machine's load.
    gw, c = await _measured_alike(gateway, _policy(reps), reps)
    hot = _system(1000)

    async def ask(i: int) -> tuple[str, str]:
        msgs = [{"role": "system", "content": hot}, {"role": "user", "content": f"user {i} asks"}]
        raw = await c.chat.completions.with_raw_response.create(model="m", messages=msgs)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == ANSWER
        return raw.headers["x-gateway-backend"], raw.headers["x-gateway-affinity"]

    t0 = time.monotonic()
    got = await asyncio.gather(*(ask(i) for i in range(12)))
    took = time.monotonic() - t0
    served = collections.Counter(b for b, _ in got)
    results = collections.Counter(a for _, a in got)
    # Each replica takes the prompt until it has max_imbalance (2) more in flight than the least
    # loaded; past that the request spills to the latency pick, which then holds the prompt too.
    assert len(served) == 3 and max(served.values()) <= 8, (served, results)  # no replica takes all
    assert results["miss"] == 1 and results["spill"] >= 1, (served, results)  # one home, then spills past the bound
    assert results["hit"] >= 2, (served, results)  # the home and the replicas it spilled to serve it again
    assert took < 5, took
    # Once spread, the prompt is at home on each replica that served it: sequential requests hit.
    for i in range(12, 15):
        backend, result = await ask(i)
        assert result == "hit" and backend in served, (backend, result, served)


# --- 3. health wins over affinity ------------------------------------------------------------


async def test_a_holder_ejected_by_a_probe_spills_its_conversations_and_explain_says_why(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    policy = _policy(reps, health={"failures_to_eject": 1, "probe_interval_ms": 100, "probe_timeout_ms": 500,
                                   "eject_ms": 30000, "max_eject_ms": 30000})
    gw, c, convs = await _two_turns_each(gateway, policy, reps, range(300, 306))
    holder = convs[0].home
    orphans = [conv for conv in convs if conv.home == holder]
    others = [conv for conv in convs if conv.home != holder]
    assert others, [conv.home for conv in convs]
    await reps[holder].stop()  # gone: the model-list probe of an idle backend ejects it

    async def ejected() -> bool:
        return _candidate(await _explain(gw.url, orphans[0].next_messages()), holder)["skipped"] == "ejected"

    await _until(ejected, f"{holder} ejected by a probe")
    for conv in orphans:
        view = await _explain(gw.url, conv.next_messages())
        pa = view["prefix_affinity"]
        assert pa["result"] == "spill" and pa["preferred"] == holder, pa
        assert pa["backend"] != holder and holder in pa["reason"] and "ejected" in pa["reason"], pa
        assert pa["matched_blocks"] > 0, pa
        assert _candidate(view, holder)["skipped"] == "ejected"
        assert view["chosen"] != holder
        backend, result = await conv.turn(c)
        assert result == "spill" and backend != holder, conv.turns
    for conv in orphans:  # the replica it spilled to holds it now: the turns after stay there
        moved_to = conv.last
        await conv.turn(c)
        assert conv.turns[-1] == (moved_to, "hit"), conv.turns
    for conv in others:  # conversations elsewhere never noticed
        await conv.turn(c)
        assert conv.turns[-1] == (conv.home, "hit"), conv.turns


async def test_a_holder_that_dies_mid_conversation_costs_no_client_error(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    # Probes slow: the next turn itself finds the holder dead, and fails over before the first byte.
    policy = _policy(reps, health={"failures_to_eject": 1, "probe_interval_ms": 60000, "eject_ms": 30000})
    gw, c, convs = await _two_turns_each(gateway, policy, reps, range(400, 406))
    holder = convs[0].home
    await reps[holder].stop()
    for conv in convs:  # no error reaches any client
        await conv.turn(c)
    for conv in convs:
        assert conv.last != holder, conv.turns
        if conv.home != holder:
            assert conv.turns[-1] == (conv.home, "hit"), conv.turns
    view = await _explain(gw.url, convs[0].next_messages())
    assert _candidate(view, holder)["skipped"] == "ejected"
    for conv in convs:  # every conversation stays where it is now
        where = conv.last
        await conv.turn(c)
        assert conv.turns[-1] == (where, "hit"), conv.turns


async def test_an_answer_failed_over_from_a_dead_holder_does_not_claim_a_hit(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    gw = await gateway(_policy(reps, health={"failures_to_eject": 1, "probe_interval_ms": 60000}))
    c = gw.client()
    await _warm(c, reps)
    conv = Conv(450)
    for _ in range(2):
        await conv.turn(c)
    await reps[conv.home].stop()
    backend, result = await conv.turn(c)
    assert backend != conv.home  # answered, by failover
    assert result != "hit", conv.turns  # seen: "hit", from a replica that had never seen the prompt


# --- 4. replicas joining and leaving ---------------------------------------------------------


async def _reload(gw: Any, policy: dict[str, Any]) -> None:
    gw.write_policy(policy)
    body = await _post_json(gw.url + "/admin/reload", {}, ADMIN)
    assert body["status"] == "reloaded", body


async def test_a_replica_joining_or_leaving_moves_only_the_conversations_it_must(gateway, replicas):
    reps = await replicas("r0", "r1", "r2", "r3")
    first3 = {n: reps[n] for n in ("r0", "r1", "r2")}
    gw = await gateway(_policy(first3, auth=True))
    c = gw.client(KEY)
    await _warm(c, first3)
    convs = [Conv(seed) for seed in range(500, 508)]
    for _ in range(2):
        for conv in convs:
            await conv.turn(c)
    assert all(conv.turns[1] == (conv.home, "hit") for conv in convs), [conv.turns for conv in convs]

    # r3 joins. Its first request is the selector's cold start (a new conversation); then every
    # existing conversation keeps its replica.
    await _reload(gw, _policy(reps, auth=True))
    newcomer = Conv(599)
    assert (await newcomer.turn(c))[0] == "r3", newcomer.turns
    for conv in convs:
        await conv.turn(c)
        assert conv.turns[-1] == (conv.home, "hit"), conv.turns
    # New system prompts: the newcomer, holding the fewest, is the home of some of them.
    fresh = [Conv(seed) for seed in range(600, 606)]
    for conv in fresh:
        await conv.turn(c)
    assert "r3" in {conv.home for conv in fresh}, [conv.turns for conv in fresh]
    for conv in fresh:
        await conv.turn(c)
        assert conv.turns[-1] == (conv.home, "hit"), conv.turns

    # The replica holding the most of the first conversations leaves.
    gone = collections.Counter(conv.home for conv in convs).most_common(1)[0][0]
    moved = [conv for conv in convs if conv.home == gone]
    stayed = [conv for conv in convs + fresh if conv.home != gone]
    assert moved and stayed
    await _reload(gw, _policy({n: r for n, r in reps.items() if n != gone}, auth=True))
    served_before = reps[gone].stats.requests
    for conv in convs + fresh:
        await conv.turn(c)
    for conv in moved:
        assert conv.last != gone and conv.turns[-1][1] == "miss", conv.turns  # held nowhere now: a new home
    for conv in stayed:
        assert conv.turns[-1] == (conv.home, "hit"), conv.turns
    for conv in moved:  # and the new home keeps it
        where = conv.last
        await conv.turn(c)
        assert conv.turns[-1] == (where, "hit"), conv.turns
    assert reps[gone].stats.requests == served_before


# --- 5. load signals: scrape failures degrade, a deep queue repels ---------------------------


async def test_failing_scrapes_degrade_routing_but_never_a_request(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    reps["r0"].options.fail_metrics = True
    policy = _policy(reps)
    policy["backends"]["r1"]["metrics_url"] = f"http://127.0.0.1:{free_port()}/metrics"  # nobody listens
    gw = await gateway(policy)
    c = gw.client()

    async def scraped() -> bool:
        view = await _explain(gw.url, [{"role": "user", "content": "x"}])
        return all(_candidate(view, n)["load"]["error"] for n in ("r0", "r1")) and not _candidate(view, "r2")["load"]["stale"]

    await _until(scraped, "the first scrapes")
    await _warm(c, reps)
    convs = [Conv(seed) for seed in range(700, 709)]
    for _ in range(3):
        for conv in convs:
            await conv.turn(c)  # every one answered
    view = await _explain(gw.url, convs[0].next_messages())
    r0, r1, r2 = (_candidate(view, n)["load"] for n in ("r0", "r1", "r2"))
    assert r0["error"] == "HTTP 500" and r0["stale"] is True and r0["waiting"] is None, r0
    assert r1["error"].startswith("connect") and r1["stale"] is True, r1
    assert r2["error"] is None and r2["stale"] is False and r2["waiting"] == 0, r2
    assert view["prefix_affinity"]["result"] == "hit"
    homes = collections.Counter(conv.home for conv in convs)
    assert homes["r0"] >= 1 and homes["r1"] >= 1, homes  # both still get their share of conversations
    for conv in convs:
        assert conv.turns[1:] == [(conv.home, "hit")] * 2, conv.turns
    assert reps["r0"].stats.metrics_scrapes >= 2  # it kept being asked


async def test_a_replica_reporting_a_deep_queue_gets_almost_no_traffic_while_its_scrape_is_fresh(gateway, replicas):
    reps = await replicas("r0", "r1", "r2")
    reps["r2"].options.report_waiting = 40
    gw = await gateway(_policy(reps, stale_ms=600))
    c = gw.client()

    async def scraped() -> bool:
        load = _candidate(await _explain(gw.url, [{"role": "user", "content": "x"}]), "r2")["load"]
        return load["waiting"] == 40 and not load["stale"]

    await _until(scraped, "r2's queue in a fresh scrape")
    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm-up"}])
    await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm-up 2"}])
    convs = [Conv(seed) for seed in range(800, 810)]
    for _ in range(3):
        for conv in convs:
            await conv.turn(c)
    total = sum(r.stats.requests for r in reps.values())
    assert reps["r2"].stats.requests <= 0.1 * total, {n: r.stats.requests for n, r in reps.items()}
    view = await _explain(gw.url, convs[0].next_messages())
    r2 = _candidate(view, "r2")
    assert r2["load"]["waiting"] == 40 and r2["load"]["queue_rounds"] == 40 and r2["load"]["stale"] is False, r2
    assert view["prefix_affinity"]["load"]["r2"] >= 40, view["prefix_affinity"]
    assert view["chosen"] != "r2"

    # Its scrape starts failing: the deep queue goes stale after stale_ms and r2 takes traffic again.
    reps["r2"].options.fail_metrics = True

    async def stale() -> bool:
        load = _candidate(await _explain(gw.url, [{"role": "user", "content": "x"}]), "r2")["load"]
        return load["stale"] and load["error"] == "HTTP 500"

    await _until(stale, "r2's sample going stale")
    before = reps["r2"].stats.requests
    fresh = [Conv(seed) for seed in range(850, 856)]
    for conv in fresh:
        await conv.turn(c)
    assert reps["r2"].stats.requests > before, [conv.turns for conv in fresh]


# --- 6. workers agree ------------------------------------------------------------------------


async def test_two_workers_send_a_new_system_prompt_to_the_same_replica(replicas, tmp_path):
    reps = await replicas("r0", "r1", "r2")
    policy = _policy(reps, auth=True, health={"probe_interval_ms": 60000})
    hdr = {"Authorization": f"Bearer {ADMIN}"}

    def fresh_client() -> openai.AsyncOpenAI:
        # No keep-alive: every request on a connection of its own, so the workers share them.
        http = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_keepalive_connections=0))
        return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, http_client=http)

    async def per_worker() -> dict[int, dict[str, int]]:
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/admin/backends", headers=hdr) as r:
                body = await r.json()
        workers = body.get("workers", [])
        return {w["worker"]: {n: b["requests"] for n, b in w["backends"].items()} for w in workers if "backends" in w}

    async def first_turn(client: openai.AsyncOpenAI, system: str, i: int) -> tuple[str, str]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"first question {i}"}]
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=msgs)  # type: ignore[arg-type]
        assert raw.parse().choices[0].message.content == ANSWER
        return raw.headers["x-gateway-backend"], raw.headers["x-gateway-affinity"]

    async with serve(policy, tmp_path, "--workers", "2") as gw:
        client = fresh_client()
        try:
            # Warm up every worker's view of every replica (each worker's selector sends its first
            # request to each backend without samples), all with the same prompt so that both
            # workers hold the same prefixes afterwards.
            warm = [{"role": "user", "content": "warm-up"}]
            end = time.monotonic() + 20
            while True:
                for _ in range(6):
                    await client.chat.completions.create(model="m", messages=warm)  # type: ignore[arg-type]
                seen = await per_worker()
                if len(seen) == 2 and all(v > 0 for w in seen.values() for v in w.values()):
                    break
                assert time.monotonic() < end, seen
            before = await per_worker()
            homes = {}
            for k in range(4):
                system = _system(900 + k)
                got = [await first_turn(client, system, i) for i in range(12)]
                assert len({b for b, _ in got}) == 1, got  # one home, whichever worker answered
                assert {a for _, a in got} <= {"miss", "hit"} and got[0][1] == "miss", got
                homes[k] = got[0][0]
            after = await per_worker()
        finally:
            await client.close()
    gained = {w: sum(after[w].values()) - sum(before[w].values()) for w in after}
    assert len(gained) == 2 and all(g >= 5 for g in gained.values()), gained  # both workers saw every prompt, or nearly
    assert len(set(homes.values())) >= 2, homes


# --- 7. explain, the access log and /metrics --------------------------------------------------


@pytest.fixture
def captured_access_log(capsys: pytest.CaptureFixture[str]) -> Any:
    """The access log's stdout (its writer thread writes to the sys.stdout of its start)."""
    yield capsys
    logging.getLogger("gateway.access").handlers[:] = []


async def test_explain_the_access_log_and_metrics_show_the_affinity_decision(gateway, replicas, captured_access_log):
    reps = await replicas("r0", "r1", "r2")
    gw = await gateway(_policy(reps, log={"access": True}))
    c = gw.client()
    await _warm(c, reps)
    conv = Conv(42)
    home, result = await conv.turn(c)
    assert result == "miss"

    async def scraped() -> bool:  # a scrape taken since the first turn filled the home's cache
        view = await _explain(gw.url, conv.next_messages())
        fresh = all(cand["load"] is not None and not cand["load"]["stale"] for cand in view["candidates"])
        return fresh and (_candidate(view, home)["load"]["kv_cache_usage"] or 0) > 0

    await _until(scraped, "fresh scrapes of every replica")
    view = await _explain(gw.url, conv.next_messages())
    pa = view["prefix_affinity"]
    # Turn 1: the system prompt (3,100 chars: 4 blocks) and a user message (1); turn 2 adds the
    # answer and a question (one block each), and holds every block of turn 1.
    assert pa["result"] == "hit" and pa["backend"] == home and pa["preferred"] == home, pa
    assert (pa["matched_blocks"], pa["blocks"]) == (5, 7), pa
    assert set(pa["load"]) == set(reps), pa
    assert view["chosen"] == home
    for cand in view["candidates"]:
        load = cand["load"]
        assert {"waiting", "running", "kv_cache_usage", "age_s", "stale", "error", "queue_rounds"} <= set(load), load
        assert load["error"] is None and load["waiting"] == 0
    assert _candidate(view, home)["load"]["kv_cache_usage"] == pytest.approx(3 / 30)  # the prompt's 3 full blocks, of 30

    assert await conv.turn(c) == (home, "hit")
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    # The label set, as /metrics writes it: class, model, result.
    counts = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^gateway_prefix_affinity_total\{class="none",model="m",result="(\w+)"\} (\S+)$', text, re.M)
    }
    shown = [line for line in text.splitlines() if line.startswith("gateway_prefix_affinity_total")]
    assert counts == {"hit": 1.0, "miss": 1.0 + len(reps)}, shown  # the warm-ups and turn 1 missed; explain counts nothing
    assert 'gateway_prefix_affinity_total{class="none",model="m",result="hit"} 1.0' in text

    gw.app[OBSERVER].close()  # flushes the writer thread
    out = captured_access_log.readouterr().out
    lines = [orjson.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == len(reps) + 2, out[-2000:]
    last = lines[-1]
    assert last["backend"] == home and last["status"] == 200
    aff = last["affinity"]
    assert aff["result"] == "hit" and aff["backend"] == home and (aff["matched_blocks"], aff["blocks"]) == (5, 7), aff
    assert lines[-2]["affinity"]["result"] == "miss" and lines[-2]["affinity"]["matched_blocks"] == 0


async def test_one_tenants_prompts_tell_another_nothing(gateway, replicas):
    """The learned map is per cache namespace: a second tenant sending the same conversation gets
    `miss` (its own first), never a `hit` that would reveal what the first tenant sent."""
    reps = await replicas("r0", "r1", "r2")
    other = "sk-other"
    policy = _policy(reps, auth=True)
    policy["tenants"]["u"] = {"key_sha256": [hash_key(other)]}
    gw = await gateway(policy)
    a, b = gw.client(KEY), gw.client(other)
    for c in (a, b):  # every replica measured: no cold-start exploration below
        for _ in range(3):
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "warm-up"}])
    first, second = Conv(501), Conv(501)
    await first.turn(a)
    assert (await first.turn(a))[1] == "hit"
    assert (await second.turn(b))[1] == "miss"  # the same text, another tenant: nothing learned from the first
    assert (await second.turn(b))[1] == "hit"  # its own history counts
