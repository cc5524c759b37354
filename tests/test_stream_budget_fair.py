"""The process's stream Budget (broadcast.py) is fair across flights and tenants: past its limit,
the owner holding the most gives back (its client furthest behind, or its largest history), so
one tenant's clients that read nothing never cut another tenant's stream that keeps up.

Before, the Broadcast that happened to publish while the budget was passed cut its own follower
furthest behind, however little that was (and dropped its own history): one tenant's stalled
streams got every other tenant's shared streams cut mid-answer with "fell too far behind"
(review helper's repro). Units without sockets first, then the gateway.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from typing import Any

import aiohttp
import orjson

from gateway.cache.broadcast import Broadcast, TeeSink, follow
from gateway.cache.budget import Budget
from gateway.web.keys import RELAY
from tests.conftest import simple_policy
from tests.test_single_flight_stream import ListSink, SlowSink, _call, _chunk

PIECE = b"data: " + b"x" * 92 + b"\n\n"  # 100 bytes


def _lagging(budget: Budget, owner: str, size: int) -> tuple[Broadcast, Any]:
    """A stream nobody joins whose own client fell `size` bytes behind (a decoupled stream)."""
    bc = Broadcast(budget=budget, owner=owner, history=False)
    tap = bc.lag()
    bc.publish(b"x" * size)
    return bc, tap


async def test_idle_followers_of_one_flight_do_not_cut_the_live_follower_of_another() -> None:
    """The review's repro: flight A's 4 followers read nothing and hold the budget nearly full;
    flight B's follower reads every chunk as it comes. B's stream passes the limit: A's followers
    pay, B's follower gets its whole stream."""
    budget = Budget(limit=10_000)
    a = Broadcast(budget=budget)
    a_tee = TeeSink(ListSink(), a)
    await a_tee.write(PIECE)
    idle = [a.join() for _ in range(4)]
    a.release()
    for _ in range(22):
        await a_tee.write(PIECE)  # 4 x 2,200 held
    assert budget.used == 8_800 and not any(t is not None and t.overflow for t in idle)

    b = Broadcast(budget=budget)
    b_tee = TeeSink(ListSink(), b)
    reader, call = ListSink(), _call()
    task = asyncio.create_task(follow(b, call, reader))
    await asyncio.sleep(0)
    for i in range(30):
        await b_tee.write(_chunk(f"w{i} "))
        await asyncio.sleep(0)  # the follower writes each chunk at once
        assert budget.used <= budget.limit
    await b_tee.write(b"data: [DONE]\n\n")
    await b_tee.end()
    assert await task is True
    assert call.out.finish == "ok" and reader.body.count(b'"content"') == 30 and reader.failed is None
    assert b.joinable  # nor was B's history dropped for bytes A held
    assert any(t is not None and t.overflow for t in idle)  # A's followers paid


def test_the_tenant_holding_the_most_gives_back_even_where_another_client_is_further_behind() -> None:
    """Tenant a: 10 streams whose clients read nothing, 500 bytes behind each; tenant b: one
    client 2,000 behind. Past the limit, a (5,000 held) gives back its client furthest behind, not b's."""
    budget = Budget(limit=6_500)
    _, b_tap = _lagging(budget, "b", 2_000)
    a = [_lagging(budget, "a", 500) for _ in range(9)]
    assert budget.used == 6_500 and not any(t.overflow for _, t in a)
    bc, last = _lagging(budget, "a", 500)  # 7,000: over
    a.append((bc, last))
    assert not b_tap.overflow
    assert sum(t.overflow for _, t in a) == 1 and budget.used == 6_500


def test_a_history_larger_than_the_owners_backlogs_goes_first_and_a_backlog_on_a_tie() -> None:
    budget = Budget(limit=1_000)
    bc = Broadcast(budget=budget, owner="t")
    bc.publish(b"h" * 700)  # a history of 700
    tap = bc.join("t")
    assert tap is not None
    bc.publish(b"x" * 200)  # history 900, the tap 200 behind: 1,100
    assert not bc.joinable and not tap.overflow  # the larger (the history) went
    assert budget.used == 200 and budget.histories == 0

    budget = Budget(limit=1_000)
    bc = Broadcast(budget=budget, owner="t")
    tap = bc.join("t")
    assert tap is not None
    bc.publish(b"x" * 501)  # history 501, the tap 501 behind: 1,002, a tie
    assert tap.overflow and bc.joinable  # the backlog went; the history stays for later joiners


def test_the_publishing_flight_gives_its_history_on_a_tie() -> None:
    budget = Budget(limit=100)
    a, b = Broadcast(budget=budget), Broadcast(budget=budget)
    a.publish(b"x" * 60)
    b.publish(b"y" * 60)
    assert a.joinable and not b.joinable and budget.used == 60


def test_a_follower_that_keeps_up_is_never_cut_for_its_own_flights_idle_followers() -> None:
    budget = Budget(limit=1_000)
    bc = Broadcast(budget=budget)
    reader = bc.join()
    idle = [bc.join() for _ in range(5)]
    bc.release()
    assert reader is not None
    for _ in range(40):
        bc.publish(PIECE)
        reader.take()  # it writes what came at once
        assert budget.used <= 1_000
    assert not reader.overflow and all(t is not None and t.overflow for t in idle)


def test_everything_given_back_leaves_the_budget_empty() -> None:
    budget = Budget(limit=1_000)
    flights = []
    for owner in ("a", "b", None):
        bc = Broadcast(budget=budget, owner=owner)
        bc.publish(PIECE)
        taps = [bc.join(owner) for _ in range(3)]
        for _ in range(5):
            bc.publish(PIECE)
        flights.append((bc, taps))
    own_bc, own = _lagging(budget, "a", 300)
    assert budget.used > 0
    for bc, taps in flights:
        for t in taps:
            assert t is not None
            bc.leave(t)
        bc.release()
    own_bc.leave(own)
    assert budget.used == 0 and budget.histories == 0
    assert budget._holders == {}


class _Counting(Budget):
    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.searches = 0

    def reclaim(self, first: Any = None) -> None:
        self.searches += 1
        super().reclaim(first)


def test_a_publish_under_the_limit_looks_at_no_other_flight() -> None:
    """The hot path: under the limit a publish touches its own taps only (no search)."""
    budget = _Counting(limit=1 << 30)
    others = [Broadcast(budget=budget, owner=str(i)) for i in range(100)]
    for o in others:
        o.join()
        o.publish(PIECE)
    bc = Broadcast(budget=budget)
    bc.join()
    for _ in range(100):
        bc.publish(PIECE)
    assert budget.searches == 0


# --- a stream decoupled from its client (cache/stage.py), as a unit -----------------------------


async def test_a_decoupled_stream_never_waits_on_its_client_and_the_client_gets_it_all_later() -> None:
    budget = Budget()
    client = SlowSink()
    tee = TeeSink(client, Broadcast(budget=budget, owner="t", history=False))
    await tee.write(_chunk("one "))
    client.full = True
    async with asyncio.timeout(1):  # the relay (and its backend's slot) never waits on it
        for i in range(200):
            await tee.write(_chunk(f"w{i} "))
        await tee.write(b"data: [DONE]\n\n")
        await tee.end()
    assert budget.used > 0 and not client.ended
    client.resume.set()
    await tee.settle()
    assert client.ended and client.failed is None and client.body.endswith(_chunk("w199 ") + b"data: [DONE]\n\n")
    assert budget.used == 0 and budget._holders == {}


async def test_a_decoupled_client_past_its_deadline_gets_an_error_event() -> None:
    client = SlowSink()
    loop = asyncio.get_running_loop()
    tee = TeeSink(client, Broadcast(history=False), deadline=loop.time() + 0.2)
    await tee.write(_chunk("one "))
    client.full = True
    await tee.write(_chunk("two "))
    await tee.write(b"data: [DONE]\n\n")
    await tee.end()
    await asyncio.sleep(0.3)
    client.full = False
    client.resume.set()
    async with asyncio.timeout(2):
        await tee.settle()
    assert tee.lost == "cut" and tee.detached and b"deadline" in client.body and b"[DONE]" not in client.body


# --- the gateway ----------------------------------------------------------------------------------

KA = "sk-tenant-a-0123456789abcdef0123456789"
KB = "sk-tenant-b-0123456789abcdef0123456789"


def _digest(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def _body(prompt: str, n: int, temperature: float = 0) -> bytes:
    return orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": prompt}], "temperature": temperature,
                         "stream": True, "max_tokens": n})


async def _stalled_socket(port: int, key: str, body: bytes) -> socket.socket:
    req = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    await loop.sock_sendall(s, req)
    return s


async def test_one_tenants_stalled_streams_do_not_cut_another_tenants_shared_streams(upstream, gateway):
    """Tenant a opens a cacheable stream from a socket that reads nothing every 0.25 s; tenant
    b's 4 identical streams (a leader and 3 followers) read as fast as they can. The budget
    (lowered to 10 MB) fills with a's backlogs: a's clients are cut, b's never."""
    up = await upstream("a", tokens=40000, ttft_ms=200, itl_ms=0)
    p = simple_policy(up)
    p["tenants"] = {"a": {"key_sha256": [_digest(KA)]}, "b": {"key_sha256": [_digest(KB)]}}
    gw = await gateway(p)
    flight = gw.app[RELAY].flight
    flight.budget.limit = 10_000_000

    async def b_round(prompt: str) -> list[str]:
        async def one() -> str:
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/chat/completions", data=_body(prompt, 20000),
                                     headers={"Authorization": f"Bearer {KB}", "Content-Type": "application/json"}) as r:
                    raw = await r.read()
            if b"fell too far behind" in raw:
                return "cut"
            return "ok" if raw.endswith(b"data: [DONE]\n\n") else "other"

        return list(await asyncio.gather(*(one() for _ in range(4))))

    socks: list[socket.socket] = []

    async def tenant_a() -> None:
        i = 0
        while True:
            socks.append(await _stalled_socket(gw.port, KA, _body(f"A question {i}", 30000)))
            i += 1
            await asyncio.sleep(0.25)

    a_task = asyncio.create_task(tenant_a())
    try:
        async with asyncio.timeout(60):
            await asyncio.sleep(2.0)
            assert flight.budget.used > 5_000_000  # a's backlogs hold the budget
            results = []
            for i in range(4):
                results += await b_round(f"B question {i}")
    finally:
        a_task.cancel()
        for s in socks:
            s.close()
    assert results == ["ok"] * 16, results
