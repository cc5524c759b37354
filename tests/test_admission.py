"""FairQueue, Gate and Admission as plain objects: bands, the starvation guard, deficit round robin
across tenants, predicted waits, deadline-aware shedding, and nothing left behind by cancellation."""

from __future__ import annotations

import asyncio
import collections

import pytest

from gateway.admission.gate import MAX_COST, Admission, FairQueue, Gate, Shed, Ticket


def _drain(q: FairQueue) -> list[Ticket]:
    out = []
    while (t := q.pop()) is not None:
        out.append(t)
    return out


def test_a_higher_band_is_always_dispatched_first_without_a_guard():
    q = FairQueue(starvation_share=0)
    for band in ("flex", "default", "priority", "flex", "priority"):
        q.push(Ticket(band, "t"))
    assert [t.band for t in _drain(q)] == ["priority", "priority", "default", "flex", "flex"]


def test_the_starvation_guard_keeps_a_share_for_a_waiting_lower_band():
    q = FairQueue(starvation_share=0.25)
    for _ in range(40):
        q.push(Ticket("priority", "p"))
    for _ in range(10):
        q.push(Ticket("flex", "f"))
    first20 = [t.band for t in _drain(q)][:20]
    assert first20.count("flex") == 5  # one dispatch in four while flex waits


def test_inside_a_band_tenants_take_turns_whatever_their_backlog():
    q = FairQueue()
    for _ in range(50):
        q.push(Ticket("default", "noisy", cost=300))
    for _ in range(3):
        q.push(Ticket("default", "quiet", cost=300))
    order = [t.tenant for t in _drain(q)][:8]
    assert order.count("quiet") == 3  # all three of quiet's within the first eight dispatches


def _drr(tickets: list[Ticket]) -> list[Ticket]:
    """Deficit round robin as written down: one quantum (256 x weight) a visit, one visit at a time."""
    queues: dict[str, collections.deque[Ticket]] = {}
    for t in tickets:
        queues.setdefault(t.tenant, collections.deque()).append(t)
    rr, deficit, out = collections.deque(queues), dict.fromkeys(queues, 0.0), []
    while rr:
        tenant = rr[0]
        q = queues[tenant]
        if deficit[tenant] < q[0].cost:
            deficit[tenant] += 256 * q[0].weight
            if deficit[tenant] < q[0].cost:
                rr.rotate(-1)
                continue
        head = q.popleft()
        deficit[tenant] -= head.cost
        out.append(head)
        if not q:
            del deficit[tenant]
            rr.popleft()
        elif deficit[tenant] < q[0].cost:
            rr.rotate(-1)
    return out


def test_rounds_that_dispatch_nobody_are_skipped_in_one_step_in_the_same_order():
    # A waiter's cost / 256 visits, one by one: a max_tokens of 2.5 billion stalled the event
    # loop 2.3 s; of 2^63, for good. Skipped at once, the order stays deficit round robin's.
    import random
    import time

    rng = random.Random(3)
    for _ in range(200):
        tickets = [Ticket("default", rng.choice("abcd"), cost=rng.choice((1, 300, 700, 5000, 40_000)),
                          weight=rng.choice((1.0, 1.0, 0.5, 3.0))) for _ in range(rng.randint(1, 40))]
        for t in tickets:
            t.weight = {"a": 1.0, "b": 0.5, "c": 3.0, "d": 1.0}[t.tenant]  # a tenant's weight is one
        q = FairQueue(starvation_share=0)
        for t in tickets:
            q.push(t)
        assert [id(t) for t in _drain(q)] == [id(t) for t in _drr(tickets)]
    q = FairQueue(starvation_share=0)
    huge = Ticket("default", "greedy", cost=MAX_COST)
    q.push(huge)
    q.push(Ticket("default", "other", cost=300))
    started = time.perf_counter()
    assert [t.tenant for t in _drain(q)] == ["other", "greedy"]
    assert time.perf_counter() - started < 0.5  # 2^40 / 256 turns otherwise (hours)


def test_turns_are_weighted_by_tokens_and_tenant_weight():
    q = FairQueue()
    for _ in range(60):
        q.push(Ticket("default", "big", cost=2000))  # long requests
        q.push(Ticket("default", "small", cost=250))
    first = collections.Counter(t.tenant for t in _drain(q)[:40])
    assert first["small"] > 4 * first["big"]  # the same tokens, not the same requests
    q = FairQueue()
    for _ in range(60):
        q.push(Ticket("default", "gold", cost=500, weight=3.0))
        q.push(Ticket("default", "std", cost=500, weight=1.0))
    first = collections.Counter(t.tenant for t in _drain(q)[:40])
    assert first["gold"] >= 2 * first["std"]


def test_cancelled_waiters_are_skipped_and_not_counted():
    q = FairQueue()
    a, b, c = Ticket("default", "x"), Ticket("default", "x"), Ticket("flex", "y")
    for t in (a, b, c):
        q.push(t)
    q.leave(a)
    q.leave(c)
    assert len(q) == 1 and q.sizes["flex"] == 0
    assert _drain(q) == [b] and len(q) == 0


def test_position_counts_higher_bands_and_round_robin_turns():
    q = FairQueue()
    for _ in range(10):
        q.push(Ticket("default", "noisy"))
    q.push(Ticket("priority", "vip"))
    # the priority one, then noisy's turn (up to two of its requests: a turn spends a quantum of tokens)
    assert q.position("default", "quiet") == 1 + 2
    assert q.position("default", "noisy") == 1 + 10
    assert q.position("priority", "vip2") == 1


async def test_a_gate_hands_slots_over_in_fair_order_and_leaks_nothing_on_cancel():
    g = Gate(1)
    assert g.try_acquire() and not g.free()
    order: list[str] = []

    async def wait(t: Ticket) -> None:
        if await g.acquire(2.0, t):
            order.append(t.tenant)
            g.release()

    tasks = [asyncio.create_task(wait(Ticket("default", "noisy"))) for _ in range(3)]
    tasks.append(asyncio.create_task(wait(Ticket("priority", "vip"))))
    doomed = asyncio.create_task(g.acquire(2.0, Ticket("priority", "gone")))
    await asyncio.sleep(0.01)
    doomed.cancel()
    await asyncio.gather(doomed, return_exceptions=True)
    g.release()
    await asyncio.gather(*tasks)
    assert order[0] == "vip" and g.used == 0 and len(g.queue) == 0


async def test_admission_refuses_at_once_when_the_predicted_wait_misses_the_deadline():
    adm = Admission(max_inflight=1, max_queue=10)
    assert await adm.enter(Ticket(), 5.0) == 0.0
    adm.leave(1.0)  # teaches a 1 s service time
    assert await adm.enter(Ticket(), 5.0) == 0.0  # the gate is free again: admitted
    with pytest.raises(Shed) as exc:
        await adm.enter(Ticket(), 0.5)  # the one place is taken: ~1 s wait > 0.6 x 0.5 s
    assert exc.value.reason == "deadline" and exc.value.retry_after_s > 0
    waiter = asyncio.create_task(adm.enter(Ticket(), 10.0))  # ~1 s wait fits a 10 s deadline: queued
    await asyncio.sleep(0.01)
    assert len(adm.gate.queue) == 1
    adm.leave(1.0)
    assert await waiter >= 0
    adm.leave(1.0)
    assert adm.gate.used == 0


async def test_admission_sheds_when_the_queue_is_full_and_drops_a_request_whose_deadline_comes():
    adm = Admission(max_inflight=1, max_queue=1)
    adm._service_s = 0.01  # a fast backend: the waits fit any deadline
    await adm.enter(Ticket(), 5.0)
    queued = asyncio.create_task(adm.enter(Ticket(), 0.2))
    await asyncio.sleep(0.01)
    with pytest.raises(Shed) as exc:
        await adm.enter(Ticket(), 5.0)
    assert exc.value.reason == "queue_full"
    with pytest.raises(TimeoutError):  # nobody left: its deadline came in the queue
        await queued
    assert len(adm.gate.queue) == 0
    adm.leave(0.01)
    assert adm.gate.used == 0


async def test_lower_bands_leave_the_reserve_free_while_priority_traffic_is_recent():
    g = Gate(4, reserve=1)
    for _ in range(4):  # no priority traffic yet: nothing is held back
        assert g.try_acquire("default")
    for _ in range(4):
        g.release()
    assert g.try_acquire("priority")  # priority seen: from now on default fills at most 3
    g.release("priority")
    assert [g.try_acquire("default") for _ in range(4)] == [True, True, True, False]
    assert g.free("priority") and g.try_acquire("priority")  # the reserved slot is there at once
    waiter = asyncio.create_task(g.acquire(1.0, Ticket("default", "t")))
    await asyncio.sleep(0.01)
    g.release("priority")  # the priority one ends: its slot stays free for priority, not handed to default
    await asyncio.sleep(0.01)
    assert not waiter.done() and g.used == 3
    g.release()  # a default one ends: its slot passes to the waiting default request
    assert await waiter and g.used == 3
    for _ in range(3):
        g.release()
    assert g.used == 0 and len(g.queue) == 0 and g.priority_held == 0


async def test_the_reserve_never_counts_priority_holders_against_lower_bands():
    g = Gate(8, reserve=1)
    assert g.try_acquire("priority")  # one priority request in flight
    assert sum(g.try_acquire("default") for _ in range(8)) == 7  # lower bands still get their 7
    g.release("priority")
    assert g.priority_held == 0 and g.used == 7 and not g.free("default") and g.free("priority")


async def test_a_waiter_cancelled_as_a_slot_is_released_leaves_no_count_behind():
    gate = Gate(1)
    assert gate.try_acquire()
    waiter = asyncio.create_task(gate.acquire(30))
    await asyncio.sleep(0)
    waiter.cancel()  # the client goes away...
    gate.release()  # ...in the same loop iteration as the holder finishes
    await asyncio.gather(waiter, return_exceptions=True)
    assert gate.queue.sizes == {"priority": 0, "default": 0, "flex": 0} and gate.used == 0
    assert await gate.acquire(0.5)  # the free slot is taken at once


async def test_a_slot_handed_over_as_the_wait_times_out_is_not_leaked():
    loop = asyncio.get_running_loop()
    for _ in range(20):  # the handover lands before, at or after the timeout
        gate = Gate(1)
        assert gate.try_acquire()
        waiter = asyncio.create_task(gate.acquire(0.02))
        await asyncio.sleep(0.0195)
        loop.call_soon(gate.release)
        if await waiter:
            gate.release()
        assert gate.used == 0 and len(gate.queue) == 0


async def test_raising_the_limit_lets_waiters_in_at_once():
    gate = Gate(1)
    assert gate.try_acquire()
    waiters = [asyncio.create_task(gate.acquire(5)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.limit = 4
    gate.dispatch()
    assert all(await asyncio.gather(*waiters)) and gate.used == 4


async def test_a_standing_queue_sheds_the_newest_of_the_lowest_band():
    g = Gate(1)
    g.standing_target_s, g.standing_interval_s = 0.03, 0.05
    assert g.try_acquire()
    waiters = [asyncio.create_task(g.acquire(5, Ticket("default", f"d{i}"))) for i in range(6)]
    await asyncio.sleep(0)
    flex = asyncio.create_task(g.acquire(5, Ticket("flex", "f")))
    await asyncio.sleep(0)
    for _ in range(5):  # each dispatch has waited longer than the 30 ms target
        await asyncio.sleep(0.04)
        g.release()
        await asyncio.sleep(0)
    with pytest.raises(Shed) as exc:
        await flex
    assert exc.value.reason == "standing_queue"  # the lowest band's newest went first
    for w in waiters:
        w.cancel()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert sum(r is True for r in results) >= 4  # the default waiters kept being dispatched
    for _ in range(1 + sum(r is True for r in results) - 5):
        g.release()  # the holders that are left
    assert len(g.queue) == 0 and g.used == 0


def test_a_standing_queue_sheds_from_the_tenant_whose_backlog_made_it_stand():
    """The newest waiter across tenants was shed: a tenant with one request waiting lost it as
    often as the tenant that queued thirty (review helper's repro). Now the newest of the tenant
    with the most waiting for its weight goes; a tenant of twice the weight may hold twice as many."""
    q = FairQueue()
    flood = [Ticket("default", "mallory", enqueued=float(i)) for i in range(30)]
    for t in flood:
        q.push(t)
    quiet = Ticket("default", "alice", enqueued=100.0)
    q.push(quiet)  # the newest of all
    shed = [q.pop_newest_lowest() for _ in range(29)]
    assert shed == flood[:0:-1] and not quiet.gone  # mallory's, newest first, down to one each
    assert q.pop_newest_lowest() is quiet  # one each: the newest then
    heavy = [Ticket("default", "big", weight=2.0, enqueued=200.0 + i) for i in range(5)]
    light = [Ticket("default", "small", enqueued=300.0 + i) for i in range(3)]
    for t in heavy + light:
        q.push(t)
    assert q.pop_newest_lowest() is light[-1]  # 3 for a weight of 1 against 5 for 2
    assert q.pop_newest_lowest() is heavy[-1]  # then 2.5 against 2


async def test_a_queue_that_drains_below_the_target_sheds_nothing():
    g = Gate(1)
    g.standing_target_s, g.standing_interval_s = 0.05, 0.05
    assert g.try_acquire()
    for i in range(6):
        w = asyncio.create_task(g.acquire(5, Ticket("flex", f"f{i}")))
        await asyncio.sleep(0.01)
        g.release()  # each waiter is dispatched within ~10 ms
        assert await w
    g.release()
    assert g.used == 0


async def test_the_starvation_guard_never_leaves_a_slot_idle_that_a_waiting_priority_request_may_take():
    """Limit 10, 2 reserved for priority; lower bands hold their 8. When the guard's turn comes
    round (every 10th dispatch) its lower band has no room: the freed slot goes to priority,
    not nowhere (it once stayed free until a lower-band request ended)."""
    from gateway.admission.gate import reserve_slots

    g = Gate(10, starvation_share=0.1, reserve=reserve_slots(10, 20))
    for band in ["priority"] * 2 + ["default"] * 8:
        assert g.try_acquire(band)
    lower = asyncio.create_task(g.acquire(30, Ticket("default", "b", 512)))
    waiters = [asyncio.create_task(g.acquire(30, Ticket("priority", "a", 512))) for _ in range(12)]
    await asyncio.sleep(0)
    for step in range(12):  # a priority holder ends; its slot goes to the next priority waiter
        g.release("priority")
        await asyncio.sleep(0)
        assert sum(w.done() for w in waiters) == step + 1, f"step {step}: a free slot idles while priority waits"
    assert g.counter.inflight == 10 and not lower.done()
    g.release("default")  # a lower-band slot frees: the lower waiter takes it
    await asyncio.sleep(0)
    assert lower.done()


def test_a_full_queue_pushes_out_the_heaviest_tenants_newest_for_a_lighter_one():
    """A full queue refused every newcomer: one tenant that filled it locked the others out. Now a
    newcomer displaces the newest waiter of a lower band, or of the tenant holding more of its
    own band for its weight than the newcomer's tenant would with it; else it is refused."""
    q = FairQueue()
    flood = [Ticket("default", "mallory", enqueued=float(i)) for i in range(4)]
    for t in flood:
        q.push(t)
    assert q.push_out("default", "mallory") is None  # its own backlog: refused
    assert q.push_out("default", "alice") is flood[-1] and flood[-1].gone  # 4 against 1
    q.push(Ticket("default", "alice", enqueued=10.0))
    assert q.push_out("default", "alice") is flood[-2]  # 3 against 2
    alice = Ticket("default", "alice", enqueued=11.0)
    q.push(alice)
    assert q.push_out("default", "alice") is None  # 2 against 3: alice would hold more
    assert q.push_out("default", "bob") is alice  # 2 each: the later newest goes
    assert q.push_out("default", "big", weight=4.0) is flood[-3]  # mallory's 2 against 1 / 4
    assert q.push_out("flex", "carol") is None  # a lower band displaces nobody above it
    low = Ticket("flex", "mallory", enqueued=20.0)
    q.push(low)
    assert q.push_out("default", "mallory") is low  # a higher band displaces a lower one first
    assert q.position("default", "zed") == len(q)  # the counts follow what was taken out


async def test_a_newcomer_that_pushes_a_waiter_out_takes_its_place():
    adm = Admission(max_inflight=1, max_queue=2)
    adm._service_s = 0.01
    await adm.enter(Ticket(tenant="m"), 5.0)
    waiting = [asyncio.create_task(adm.enter(Ticket(tenant="m"), 5.0)) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(Shed):
        await adm.enter(Ticket(tenant="m"), 5.0)  # its own tenant fills the queue: refused
    quiet = asyncio.create_task(adm.enter(Ticket(tenant="a"), 5.0))
    await asyncio.sleep(0.01)
    with pytest.raises(Shed) as exc:
        await waiting[1]  # the newest of the tenant holding the queue gave its place up
    assert exc.value.reason == "queue_full" and "its place went to" in str(exc.value)
    assert len(adm.gate.queue) == 2
    adm.leave(0.01)  # round robin: m's older waiter, then the quiet tenant
    await waiting[0]
    adm.leave(0.01)
    await quiet
    adm.leave(0.01)
    assert adm.gate.used == 0 and len(adm.gate.queue) == 0
