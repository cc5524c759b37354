"""Admission and backend slots against what one request or tenant can do to everyone else's
queue (review findings, each reproduced before its fix):

- one Ticket waited with at several gates in turn (context fallbacks): a copy left at the first,
  marked gone, came back to life when the second queued it; counted out twice, both backends
  answered 503 to everyone until a restart;
- deficit round robin credit banked behind an unaffordable head (max_tokens 1e15) and kept after
  that head left: the tenant's cheap requests went 100 in a row ahead of a quiet tenant;
- the admission gate's service time, a moving average of every hold: two long answers of one
  tenant raised it 60x and shed other tenants' requests; its queue_full Retry-After and the
  backend-level deadline shed's had no upper bound (600 s);
- cancelled waiters behind a live head were never removed (50,000 of them, 14.5 MB).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import orjson
import pytest

from gateway.admission.gate import MAX_COST, MAX_RETRY_AFTER_S, Admission, FairQueue, Gate, Shed, Ticket
from gateway.tenants.auth import hash_key
from gateway.web.keys import ADMISSION, LIVE
from tests.test_admission_e2e import ADMIN_KEY, KEYS, ZERO, assert_all_counts_zero, chat, make_policy, queued, session, wait_for
from tests.test_rescue import CONTEXT_LENGTH


def _consistent(g: Gate) -> None:
    """Every count of a gate's queue agrees with the live waiters its deques hold."""
    q = g.queue
    for band in ("priority", "default", "flex"):
        live: dict[str, int] = {}
        for tenant, d in q._q[band].items():
            n = sum(not t.gone for t in d)
            if n:
                live[tenant] = n
        assert q._live[band] == live, band
        assert q.sizes[band] == sum(live.values()), band


# -- one ticket, several gates ------------------------------------------------------------------------


async def test_a_ticket_that_left_one_gate_does_not_come_back_to_life_when_it_waits_at_the_next():
    """The context fallbacks' sequence: the wait at full f1 times out, the same ticket queues at
    full f2. f1's next releases go to its real waiters (no KeyError, no count below zero), and f2's
    waiter is granted when f2 frees up: nothing is left behind at either."""
    f1, f2 = Gate(1), Gate(1)
    assert f1.try_acquire() and f2.try_acquire()
    other = asyncio.create_task(f1.acquire(10, Ticket("default", "other", 300)))
    await asyncio.sleep(0)
    mine = Ticket("default", "attacker", 300)
    assert await f1.acquire(0.05, mine) is False
    at_f2 = asyncio.create_task(f2.acquire(10, mine))
    await asyncio.sleep(0.01)
    f1.release()
    assert await other
    third = asyncio.create_task(f1.acquire(10, Ticket("default", "third", 300)))
    await asyncio.sleep(0)
    f1.release()  # `other` ends: the slot goes to `third`, not to a resurrected copy of `mine`
    assert await asyncio.wait_for(third, 1.0)
    assert f1.used == 1 and f1.queue.sizes == ZERO
    assert not at_f2.done() and f2.queue.sizes["default"] == 1
    f2.release()
    assert await asyncio.wait_for(at_f2, 1.0)
    f1.release()
    f2.release()
    for g in (f1, f2):
        assert g.used == 0 and g.queue.sizes == ZERO and g.free()
        _consistent(g)
    assert mine.fut is None and not mine.gone  # the caller's ticket was never queued


async def test_every_way_a_request_waits_again_leaves_its_ticket_untouched():
    """One request's ticket through admission, then backends' queues as the relay uses them: a
    timed-out wait (a context fallback, the relay's queue for a full backend), a cancelled one (a
    hedge's loser, a client gone), a granted one, and a second wait at a gate it already left
    (a retry). No gate keeps a count of it afterwards, and every gate still admits."""
    adm = Admission(1, 100)
    a, b, c = Gate(1), Gate(1), Gate(1)
    t = Ticket("flex", "acme", 500, 2.0)
    assert adm.gate.try_acquire() and a.try_acquire() and b.try_acquire() and c.try_acquire()
    entering = asyncio.create_task(adm.enter(t, 10.0))
    await asyncio.sleep(0.01)
    adm.leave(0.01)
    await entering  # admitted after a wait: the gate's copy was dispatched
    assert await a.acquire(0.02, t) is False  # timed out at a
    hedge = asyncio.create_task(b.acquire(10, t))
    await asyncio.sleep(0.01)
    hedge.cancel()  # cancelled at b
    await asyncio.gather(hedge, return_exceptions=True)
    granted = asyncio.create_task(c.acquire(10, t))
    await asyncio.sleep(0.01)
    c.release()
    assert await granted  # granted at c
    assert await a.acquire(0.02, t) is False  # at a again, behind its own departed copy
    assert t.fut is None and not t.gone
    for g in (adm.gate, a, b, c):
        g.release(t.band if g in (adm.gate, c) else "default")  # the slots its copies were granted
        assert g.used == 0 and g.queue.sizes == ZERO and g.free(), g
        _consistent(g)
        assert await g.acquire(0.01, t)  # each gate admits it at once
        g.release(t.band)


def test_a_waiter_counted_out_twice_never_drives_a_count_below_zero(caplog: pytest.LogCaptureFixture):
    """The safety net: a second uncount of one waiter (what the reused ticket did) keeps the
    counts at zero and says which gate it happened at, instead of a KeyError out of another
    request's release and a band's size of -1 that refused everyone."""
    g = Admission(1, 10).gate
    t = Ticket("default", "x", 10)
    g.queue.push(t)
    assert g.queue.pop() is t and g.queue.sizes == ZERO
    t.gone = False  # as queueing the same object elsewhere did
    with caplog.at_level(logging.ERROR, "gateway.admission"):
        g.queue.leave(t)
    assert g.queue.sizes == ZERO and g.queue._live["default"] == {}
    assert "the admission gate" in caplog.text and "'x'" in caplog.text
    assert g.try_acquire()
    assert Gate(1, name="backend 'f1'").queue.name == "backend 'f1'"


async def test_context_fallbacks_that_time_out_one_after_another_leave_both_backends_working(upstream, gateway):
    """Over real sockets: a prompt too long for `p` goes to context fallbacks f1 then f2, both
    full; its wait at f1 runs out (first_token_ms) and it queues at f2. Afterwards both answer
    requests again and every count is back at zero (the reused ticket left f1's queue at -1 and a
    phantom waiter at f2: every later request to either was a 503, idle or not)."""
    p = await upstream("p", mode="error_400", error_body=CONTEXT_LENGTH)
    f1 = await upstream("f1", ttft_ms=10, itl_ms=50, tokens=10)  # a stream holds f1 ~0.5 s
    f2 = await upstream("f2", ttft_ms=10, itl_ms=100, tokens=20)  # ~2 s
    fb = {"max_concurrency": 1, "timeouts": {"first_token_ms": 300}}
    gw = await gateway({
        "version": 1, "cache": {"enabled": False}, "health": {"probe_interval_ms": 600_000},
        "admin": {"key_sha256": [hash_key(ADMIN_KEY)]},
        "tenants": {n: {"key_sha256": [hash_key(k)]} for n, k in KEYS.items()},
        "backends": {"p": {"url": p.url, "models": ["m"]},
                     "f1": {"url": f1.url, "models": ["m", "busy1"], **fb},
                     "f2": {"url": f2.url, "models": ["m", "busy2"], **fb}},
        "models": {"m": {"backends": ["p"], "context_fallbacks": ["f1", "f2"]},
                   "busy1": {"backends": ["f1"]}, "busy2": {"backends": ["f2"]}},
    })

    async def post(key: str, model: str, stream: bool = True, max_tokens: int = 20) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": stream, "max_tokens": max_tokens}
        headers = {"Authorization": f"Bearer {key}", "x-request-timeout-ms": "5000"}
        async with http.post(gw.url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
            await r.read()
            return r.status

    async with session() as http:
        holders = [asyncio.create_task(post(KEYS["quiet"], "busy1")), asyncio.create_task(post(KEYS["quiet"], "busy2"))]
        await wait_for(lambda: f1.stats.active == 1 and f2.stats.active == 1, 5.0, "both fallbacks busy")
        fallback = asyncio.create_task(post(KEYS["noisy"], "m", stream=False))  # waits at f1, then at f2
        await asyncio.sleep(0.31)
        at_f1 = [asyncio.create_task(post(KEYS["quiet"], "busy1")) for _ in range(2)]
        results = await asyncio.gather(*holders, fallback, *at_f1)
        assert results[:2] == [200, 200], results
        await assert_all_counts_zero(gw)
        later = [await post(KEYS["quiet"], model, stream=False, max_tokens=1) for model in ("busy1", "busy2") for _ in range(3)]
    assert later == [200] * 6, later


# -- credit banked behind an unaffordable head --------------------------------------------------------


def _longest_run(tenants: list[str], who: str) -> int:
    best = run = 0
    for t in tenants:
        run = run + 1 if t == who else 0
        best = max(best, run)
    return best


def test_credit_banked_for_a_head_that_leaves_goes_with_it():
    """200 dispatches to quiet while the attacker's MAX_COST head waits bank it 60,000 tokens of
    credit; when that head leaves, the credit goes too: the two tenants alternate (it was 100
    attacker dispatches in a row). A queue its last waiter leaves starts from nothing."""
    q = FairQueue()
    big = Ticket("default", "attacker", MAX_COST)
    q.push(big)
    for _ in range(300):
        q.push(Ticket("default", "attacker", 300))
        q.push(Ticket("default", "quiet", 300))
    assert {q.pop().tenant for _ in range(200)} == {"quiet"}  # type: ignore[union-attr]
    assert q._deficit["default"]["attacker"] > 50_000
    q.leave(big)
    assert q._deficit["default"]["attacker"] <= 256
    order = [q.pop().tenant for _ in range(100)]  # type: ignore[union-attr]
    assert _longest_run(order, "attacker") <= 2 and order.count("attacker") <= 52, order
    lone = FairQueue()
    head = Ticket("default", "x", MAX_COST)
    lone.push(head)
    lone.push(Ticket("default", "y", 10))
    for _ in range(5):
        assert lone.pop().tenant == "y"  # type: ignore[union-attr]
        lone.push(Ticket("default", "y", 10))
    lone.leave(head)
    assert lone._deficit["default"]["x"] == 0.0


async def test_a_head_whose_wait_runs_out_takes_its_banked_credit_with_it():
    """The same through a gate, the unaffordable head leaving by its deadline (acquire's
    timeout): afterwards the attacker's cheap waiters and the quiet tenant's alternate."""
    g = Gate(1)
    assert g.try_acquire()
    order: list[str] = []

    async def wait(t: Ticket) -> None:
        if await g.acquire(30, t):
            order.append(t.tenant)

    big = asyncio.create_task(g.acquire(0.2, Ticket("default", "attacker", MAX_COST)))
    await asyncio.sleep(0)
    tasks = [asyncio.create_task(wait(Ticket("default", name, 300))) for _ in range(60) for name in ("attacker", "quiet")]
    await asyncio.sleep(0)
    for _ in range(40):  # quiet is served while the big head banks credit
        g.release()
        await asyncio.sleep(0)
    assert set(order) == {"quiet"}
    assert await big is False
    order.clear()
    for _ in range(30):  # quiet has 20 left
        g.release()
        await asyncio.sleep(0)
    assert _longest_run(order, "attacker") <= 2, order
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    _consistent(g)


async def test_a_cancelled_unaffordable_request_gives_its_tenant_no_run_of_dispatches(upstream, gateway):
    """Over real sockets, at a 1-slot backend: a tenant's max_tokens 1e15 request waits at the head
    of its queue while a quiet tenant is served, with 60 cheap requests behind it; its client then
    goes away. From then on the two tenants' requests alternate (counted in completions; it was
    all 60 of the tenant's in a row while the quiet tenant's waits grew 20x)."""
    up = await upstream("a", ttft_ms=20, tokens=2)
    gw = await gateway(make_policy(up, max_concurrency=1))
    stop = False
    done: list[tuple[float, str]] = []

    async def quiet_worker(i: int) -> None:
        while not stop:
            a = await chat(http, gw, KEYS["quiet"], content=f"q{i}", max_tokens=1)
            assert a.status == 200, a.body
            done.append((a.done_at, "quiet"))

    async def cheap(i: int) -> None:
        a = await chat(http, gw, KEYS["noisy"], content=f"n{i}", max_tokens=1)
        assert a.status == 200, a.body
        done.append((a.done_at, "noisy"))

    async with session() as http:
        workers = [asyncio.create_task(quiet_worker(i)) for i in range(8)]  # quiet's queue never runs dry
        await wait_for(lambda: queued(gw)["default"] >= 7, 5.0, "quiet queued")
        big = asyncio.create_task(chat(http, gw, KEYS["noisy"], content="big", max_tokens=10**15))
        await wait_for(lambda: queued(gw)["default"] >= 8, 5.0, "the big one queued")
        cheaps = [asyncio.create_task(cheap(i)) for i in range(60)]
        await wait_for(lambda: queued(gw)["default"] >= 68, 5.0, "the cheap ones queued")
        await asyncio.sleep(1.0)  # quiet keeps being served; the big head banks credit
        big.cancel()
        await asyncio.gather(big, return_exceptions=True)
        cut = time.monotonic()
        await asyncio.gather(*cheaps)
        stop = True
        await asyncio.gather(*workers)
    after = [who for at, who in sorted(done) if at > cut]
    assert _longest_run(after, "noisy") <= 4, after
    await assert_all_counts_zero(gw)


# -- the admission gate's service time and its hints ---------------------------------------------------


def test_the_service_time_is_the_median_hold_not_pulled_up_by_a_few_long_ones():
    now = [0.0]
    adm = Admission(2, 100, clock=lambda: now[0])
    assert adm.service_s() == 1.0  # nothing measured yet
    for _ in range(20):
        adm.gate.try_acquire()
        adm.leave(0.015)
    for _ in range(2):  # one tenant's two long answers
        adm.gate.try_acquire()
        adm.leave(5.0)
    assert adm.service_s() == 0.015  # a moving average made it 0.965
    for _ in range(64):  # the load itself changes: the median follows within a window
        adm.gate.try_acquire()
        adm.leave(2.0)
    now[0] += 1.0
    assert adm.service_s() == 2.0
    adm.gate.try_acquire()
    adm.leave(0.001)
    assert adm.service_s() == 2.0  # a full window is sorted again at most every 0.5 s, not per read
    assert adm.gate.used == 0


async def test_queue_full_hints_are_capped_like_the_deadline_shed():
    """Ten requests that held their place 600 s: a queue_full refusal says Retry-After 60 s at
    most, for the newcomer refused and for a waiter a newcomer pushes out alike."""
    adm = Admission(1, 0)
    for _ in range(10):
        adm.gate.try_acquire()
        adm.leave(600.0)
    adm.gate.try_acquire()
    with pytest.raises(Shed) as shed:
        await adm.enter(Ticket("default", "quiet", 300), 3600.0)
    assert shed.value.reason == "queue_full" and shed.value.retry_after_s == MAX_RETRY_AFTER_S
    adm.max_queue = 1
    pushed = asyncio.create_task(adm.enter(Ticket("flex", "mallory", 300), 3600.0))
    await asyncio.sleep(0)
    newcomer = asyncio.create_task(adm.enter(Ticket("default", "quiet", 300), 3600.0))
    with pytest.raises(Shed) as out:
        await pushed
    assert out.value.reason == "queue_full" and out.value.retry_after_s == MAX_RETRY_AFTER_S
    newcomer.cancel()
    await asyncio.gather(newcomer, return_exceptions=True)
    adm.leave(1.0)
    assert adm.gate.used == 0 and adm.gate.queue.sizes == ZERO


async def test_one_tenants_long_answers_do_not_shed_everyone_elses_requests(upstream, gateway):
    """Over real sockets: after two 5 s answers of one tenant, the other tenant's bursts with a
    1.5 s deadline are still answered when they queue (the moving average had made the service
    time 965 ms and shed half of each burst as overloaded)."""
    up = await upstream("a", ttft_ms=10, itl_ms=2, tokens=3000)
    gw = await gateway(make_policy(up, admission={"max_inflight": 2, "max_queue": 100}))
    adm = gw.app[ADMISSION]

    async def burst() -> list[Any]:
        tasks = [chat(http, gw, KEYS["quiet"], content=f"b{i}", max_tokens=2, timeout_ms=1500) for i in range(6)]
        return await asyncio.gather(*tasks)

    async with session() as http:
        for i in range(10):
            assert (await chat(http, gw, KEYS["quiet"], content=f"w{i}", max_tokens=2)).status == 200
        assert all(a.status == 200 for a in await burst())
        long = await asyncio.gather(*[chat(http, gw, KEYS["noisy"], content=f"L{i}", max_tokens=2500) for i in range(2)])
        assert all(a.status == 200 and a.elapsed > 2.0 for a in long)
        assert adm.service_s() < 0.5
        after = await burst()
    assert all(a.status == 200 for a in after), [(a.status, a.body) for a in after]
    await assert_all_counts_zero(gw)


async def test_a_backend_deadline_shed_advertises_at_most_a_minute(upstream, gateway):
    """Both candidates full; admission predicts the wait at `b` (no history: 1 s) and lets the
    request in, the relay queues for `a`, whose measured service time is 600 s, and sheds it: its
    Retry-After is 60, not 600."""
    a_up = await upstream("a", ttft_ms=1500, tokens=2)
    b_up = await upstream("b", ttft_ms=1500, tokens=2)
    gw = await gateway(make_policy(a_up, b_up, max_concurrency=1))
    a = gw.app[LIVE].runtime.backends["a"]
    for _ in range(5):
        a.tracker.duration.add(a.tracker.clock(), 600.0)
    async with session() as http:
        holders = [asyncio.create_task(chat(http, gw, content=f"h{i}")) for i in range(2)]
        await wait_for(lambda: a_up.stats.active == 1 and b_up.stats.active == 1, 5.0, "both backends busy")
        shed = await chat(http, gw, content="late", timeout_ms=10_000)
        assert all(h.status == 200 for h in await asyncio.gather(*holders))
    assert shed.status == 503 and shed.code == "overloaded", (shed.status, shed.body)
    assert "is full" in shed.body["error"]["message"]  # the relay's shed, not admission's
    assert shed.headers["Retry-After"] == "60"
    await assert_all_counts_zero(gw)


# -- departed waiters behind a live head -------------------------------------------------------------


async def test_cancelled_waiters_behind_a_live_head_are_swept_out():
    """A tenant parks one live waiter it cannot afford at its head and cancels 5,000 more behind
    it: its queue holds a bounded number of departed tickets (it held all 5,000), and the queue
    still dispatches in order, pushes out and counts positions right."""
    g = Gate(1)
    assert g.try_acquire()
    park = asyncio.create_task(g.acquire(600, Ticket("default", "attacker", MAX_COST)))
    quiet = asyncio.create_task(g.acquire(600, Ticket("default", "quiet", 300)))
    await asyncio.sleep(0)
    for _ in range(5):
        tasks = [asyncio.create_task(g.acquire(600, Ticket("default", "attacker", 300))) for _ in range(1000)]
        await asyncio.sleep(0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    held = g.queue._q["default"]["attacker"]
    assert len(g.queue) == 2 and len(held) <= 3 * 1 + 16 + 1, len(held)
    _consistent(g)
    live = [asyncio.create_task(g.acquire(600, Ticket("default", "attacker", 300))) for _ in range(3)]
    await asyncio.sleep(0)
    assert g.queue.position("default", "new") == 2 + 1  # two of the attacker's turn, quiet's one
    victim = g.queue.push_out("default", "quiet")
    assert victim is not None and victim.tenant == "attacker" and not victim.fut.done()  # type: ignore[union-attr]
    g.release()  # the slot: quiet's waiter (the attacker's head is unaffordable)
    assert await asyncio.wait_for(quiet, 1.0)
    _consistent(g)
    for t in (park, *live):
        t.cancel()
    await asyncio.gather(park, *live, return_exceptions=True)
    g.release()
    assert g.used == 0 and g.queue.sizes == ZERO
    _consistent(g)
