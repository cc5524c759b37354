"""Single flight against its own callers: a leader's terms (deadline, band, no-store) must not cut,
delay or starve identical requests that follow it, and a stream missing an event is never stored.

Units of SingleFlight's join rule first, then the gateway over real sockets. Timings are loose:
each test tells a fixed answer from a cut, a 503/504 or a second upstream call, not milliseconds.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.cache.core import SingleFlight, Terms
from gateway.store.core import MemoryStore
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE, RELAY
from tests.conftest import RunningGateway, simple_policy
from tests.procs import redis_server
from tests.test_cache_flight import Delayed

H = {"Authorization": "Bearer sk-acme"}
DEFAULT, FLEX, PRIORITY = Terms(600_000, 1), Terms(600_000, 2), Terms(600_000, 0)


def _policy(up: Any, **extra: Any) -> dict[str, Any]:
    p = simple_policy(up, **extra)
    p["tenants"] = {"acme": {"key_sha256": [hash_key("sk-acme")], "priority": "priority"}}
    return p


def _chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "gpt-test", "messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                path: str = "chat/completions") -> tuple[int, str | None, str]:
    """(status, x-gateway-cache, body text)."""
    async with s.post(f"{url}/v1/{path}", json=body, headers={**H, **(headers or {})}) as r:
        return r.status, r.headers.get("x-gateway-cache"), await r.text()


async def _until(cond: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


# --- units: who joins a flight -----------------------------------------------------------------


def test_terms_cover_a_shorter_or_equal_deadline_in_an_equal_or_lower_band() -> None:
    assert DEFAULT.covers(DEFAULT) and DEFAULT.covers(Terms(700, 1)) and DEFAULT.covers(FLEX)
    assert not Terms(700, 1).covers(DEFAULT)  # the leader's deadline would cut it
    assert not DEFAULT.covers(PRIORITY) and not FLEX.covers(DEFAULT)  # it would wait in a lower band


async def _lead(flight: SingleFlight, terms: Terms, release: asyncio.Event, *, stores: bool = True) -> None:
    async with flight.hold("k", wait_s=5, stream=True, terms=terms, stores=stores) as f:
        assert f.leader
        await release.wait()


async def test_a_caller_joins_only_a_leader_whose_terms_cover_its_own() -> None:
    flight = SingleFlight()
    release = asyncio.Event()
    leader = asyncio.create_task(_lead(flight, DEFAULT, release))
    await asyncio.sleep(0)
    for terms in (DEFAULT, Terms(700, 1), FLEX):  # each waits for the leader: a follower
        async with flight.hold("k", wait_s=0.01, terms=terms) as f:
            assert not f.leader
    async with flight.hold("k", wait_s=5, terms=Terms(700, 0)) as f:  # higher band, shorter deadline: alone
        assert f.leader and f.beside and len(flight) == 1
    async with flight.hold("k", wait_s=5, stream=True, terms=DEFAULT, include_usage=True) as f:
        assert f.leader and f.beside  # a usage chunk its leader's stream lacks: alone, as before
    release.set()
    await leader
    assert len(flight) == 0


async def test_a_caller_the_leader_cannot_serve_takes_the_flight_over_for_later_callers() -> None:
    flight = SingleFlight()
    short_done, long_done = asyncio.Event(), asyncio.Event()
    short = asyncio.create_task(_lead(flight, Terms(700, 1), short_done))
    await asyncio.sleep(0)
    long = asyncio.create_task(_lead(flight, DEFAULT, long_done))  # longer deadline: leads, beside the first
    await asyncio.sleep(0)
    short_done.set()
    await short  # the first flight ends; the one that took over stays
    assert len(flight) == 1
    async with flight.hold("k", wait_s=0.01, terms=DEFAULT) as f:
        assert not f.leader  # later callers like it join it
    long_done.set()
    await long
    assert len(flight) == 0


async def test_a_no_store_caller_never_leads_a_flight_others_join() -> None:
    flight = SingleFlight()
    release = asyncio.Event()
    alone = asyncio.create_task(_lead(flight, DEFAULT, release, stores=False))
    await asyncio.sleep(0)
    assert len(flight) == 0
    async with flight.hold("k", wait_s=5, terms=DEFAULT) as f:  # leads its own flight at once
        assert f.leader and not f.beside and len(flight) == 1
        async with flight.hold("k", wait_s=0.01, terms=DEFAULT, stores=False) as g:
            assert not g.leader  # a no-store caller still follows one
    release.set()
    await alone


async def test_a_stream_that_is_never_stored_is_joined_live_and_waited_for_by_nobody() -> None:
    flight = SingleFlight()
    async with flight.hold("k", wait_s=5, stream=True, terms=DEFAULT, publishes=False) as live:
        assert live.leader and live.stream is not None and not live.publishes and len(flight) == 1
        async with flight.hold("k", wait_s=5, stream=True, terms=DEFAULT) as joined:
            assert not joined.leader and joined.stream is live.stream  # the live stream, shared
        async with asyncio.timeout(1):
            async with flight.hold("k", wait_s=5, terms=DEFAULT) as whole:  # at once, not after the stream
                assert whole.leader and whole.beside and whole.publishes  # it stores: later callers follow it


# --- the gateway -------------------------------------------------------------------------------


async def test_a_leaders_short_deadline_does_not_cut_a_followers_stream(upstream, gateway):
    up = await upstream("a", tokens=20, itl_ms=50)  # about a second of stream
    gw = await gateway(_policy(up))
    body = _chat("a short deadline leads", stream=True)
    async with aiohttp.ClientSession() as s:
        leader = asyncio.create_task(_post(s, gw.url, body, {"x-request-timeout-ms": "500"}))
        await _until(lambda: up.stats.requests == 1)
        follower = await _post(s, gw.url, body)  # the default deadline
        led = await leader
        third = await _post(s, gw.url, _chat("a short deadline leads"))
    assert "deadline of 500 ms passed mid-stream" in led[2]  # the leader's own deadline cuts only it
    assert follower[0] == 200 and follower[2].rstrip().endswith("data: [DONE]") and "error" not in follower[2]
    assert "w19" in follower[2]
    assert third[1] == "hit"  # the follower, which went upstream itself, stored its answer


async def test_requests_on_the_same_terms_still_share_one_upstream_call(upstream, gateway):
    up = await upstream("a", tokens=6, ttft_ms=300)
    gw = await gateway(_policy(up))
    body = _chat("same terms", stream=True)
    async with aiohttp.ClientSession() as s:
        leader = asyncio.create_task(_post(s, gw.url, body))
        await _until(lambda: up.stats.requests == 1)
        rest = await asyncio.gather(
            _post(s, gw.url, body),  # identical
            _post(s, gw.url, body, {"x-request-timeout-ms": "60000"}),  # a shorter deadline
            _post(s, gw.url, body, {"x-priority": "flex"}),  # a lower band
            _post(s, gw.url, body, {"cache-control": "no-store"}),  # stores nothing, may follow
            _post(s, gw.url, {**body, "stream": False}),  # waits for the stored answer
        )
        led = await leader
    assert led[:2] == (200, "miss")
    assert [r[:2] for r in rest] == [(200, "hit")] * 5
    assert up.stats.requests == 1


async def test_longer_deadlines_share_the_flight_that_took_over_from_a_short_one(upstream, gateway):
    up = await upstream("a", tokens=4, ttft_ms=800)
    gw = await gateway(_policy(up))
    body = _chat("taken over")
    async with aiohttp.ClientSession() as s:
        short = asyncio.create_task(_post(s, gw.url, body, {"x-request-timeout-ms": "400"}))
        await _until(lambda: up.stats.requests == 1)
        first = asyncio.create_task(_post(s, gw.url, body))  # goes upstream itself, and takes the key over
        await _until(lambda: up.stats.requests == 2)
        second = await _post(s, gw.url, body)  # joins it
        results = [await short, await first, second]
    assert results[0][0] == 504 and results[1][:2] == (200, "miss") and results[2][:2] == (200, "hit")
    assert up.stats.requests == 2


async def test_a_no_store_leader_does_not_hold_its_followers(upstream, gateway):
    up = await upstream("a", tokens=4, ttft_ms=1500)
    gw = await gateway(_policy(up))
    body = _chat("no-store leads")
    async with aiohttp.ClientSession() as s:
        leader = asyncio.create_task(_post(s, gw.url, body, {"cache-control": "no-store"}))
        await _until(lambda: up.stats.requests == 1)
        # Waiting out the leader's 1.5 s and then its own upstream call would take 3 s.
        follower = await _post(s, gw.url, body, {"x-request-timeout-ms": "2800"})
        led = await leader
        third = await _post(s, gw.url, body)
    assert led[0] == 200 and follower[:2] == (200, "miss"), follower
    assert third[1] == "hit"  # the follower's answer was stored
    assert up.stats.requests == 2


async def test_a_higher_band_follower_does_not_wait_on_a_lower_band_leader(upstream, gateway):
    """One admission slot. A flex leader queues behind default work; an identical priority request
    that would be dispatched first must not wait on it (it was refused: 503)."""
    up = await upstream("a", tokens=2, ttft_ms=1000)
    gw = await gateway(_policy(up, admission={"max_inflight": 1, "starvation_share": 0, "priority_reserve_pct": 0}))
    body = _chat("flex leads")
    async with aiohttp.ClientSession() as s:
        occupant = asyncio.create_task(_post(s, gw.url, _chat("occupant"), {"x-priority": "default"}))
        await _until(lambda: up.stats.requests == 1)
        leader = asyncio.create_task(_post(s, gw.url, body, {"x-priority": "flex"}))
        await asyncio.sleep(0.1)
        blocker = asyncio.create_task(_post(s, gw.url, _chat("blocker"), {"x-priority": "default"}))
        await asyncio.sleep(0.1)
        follower = await _post(s, gw.url, body, {"x-priority": "priority", "x-request-timeout-ms": "2800"})
        await asyncio.gather(occupant, leader, blocker)
    assert follower[:2] == (200, "miss"), follower


def _fake_shared(gw: RunningGateway) -> Delayed:
    """The gateway's cache store, seen as one other processes share (its Redis lock is taken)."""
    cache = gw.app[LIVE].runtime.cache
    assert cache is not None
    store = Delayed(MemoryStore())
    cache.store = store
    return store


async def test_a_no_store_leader_keeps_no_cross_process_lock(upstream, gateway):
    """On a shared store a no-store leader must not hold the lock: the next leader would wait on
    it for an answer never stored, then go upstream (504 here)."""
    up = await upstream("a", tokens=4, ttft_ms=1500)
    gw = await gateway(_policy(up))
    _fake_shared(gw)
    body = _chat("no-store locks")
    async with aiohttp.ClientSession() as s:
        leader = asyncio.create_task(_post(s, gw.url, body, {"cache-control": "no-store"}))
        await _until(lambda: up.stats.requests == 1)
        follower = await _post(s, gw.url, body, {"x-request-timeout-ms": "2800"})
        await leader
    assert follower[:2] == (200, "miss"), follower


async def test_a_leader_beside_a_flight_does_not_wait_on_its_cross_process_lock(upstream, gateway):
    """A request that goes upstream beside a short-deadline flight of this process must not wait
    on that flight's lock: it would start only once the short one gave up."""
    up = await upstream("a", tokens=4, ttft_ms=1500)
    gw = await gateway(_policy(up))
    _fake_shared(gw)
    body = _chat("beside the lock")
    async with aiohttp.ClientSession() as s:
        short = asyncio.create_task(_post(s, gw.url, body, {"x-request-timeout-ms": "1200"}))
        await _until(lambda: up.stats.requests == 1)
        beside = asyncio.create_task(_post(s, gw.url, body))
        # At once, not after the short one's 1.2 s: the wait for the second upstream call is bounded
        # by the short one's own deadline, which has not passed yet.
        await _until(lambda: up.stats.requests == 2 or short.done())
        assert up.stats.requests == 2 and not short.done()
        results = [await short, await beside]
    assert results[0][0] == 504 and results[1][:2] == (200, "miss")


async def test_another_process_does_not_wait_on_a_lock_whose_terms_do_not_cover_its_own(upstream, gateway):
    """Two gateways on one shared store (two replicas on one Redis): a short-deadline leader's lock
    says its terms, and a request on the other replica that it does not cover goes upstream at
    once, not after waiting on the lock (a 504 at its own 3 s before: cache/shared_flight.py)."""
    up = await upstream("a", tokens=4, ttft_ms=1500)
    one, two = await gateway(_policy(up)), await gateway(_policy(up), name="two.yaml")
    store = _fake_shared(one)
    cache = two.app[LIVE].runtime.cache
    assert cache is not None
    cache.store = store  # the same store: the other replica sees the lock
    body = _chat("one lock, two replicas")
    async with aiohttp.ClientSession() as s:
        short = asyncio.create_task(_post(s, one.url, body, {"x-request-timeout-ms": "1200"}))
        await _until(lambda: up.stats.requests == 1)
        other = asyncio.create_task(_post(s, two.url, body, {"x-request-timeout-ms": "3000"}))
        await _until(lambda: up.stats.requests == 2 or short.done())
        assert up.stats.requests == 2 and not short.done()  # at once, beside the short one
        results = [await short, await other]
    assert results[0][0] == 504 and results[1][:2] == (200, "miss")
    # One on the same terms still waits for the stored answer of the lock's holder.
    async with aiohttp.ClientSession() as s:
        first = asyncio.create_task(_post(s, one.url, _chat("same terms")))
        await _until(lambda: up.stats.requests == 3)
        second = await _post(s, two.url, _chat("same terms"))
        assert (await first)[:2] == (200, "miss") and second[:2] == (200, "hit")
    assert up.stats.requests == 3


# --- a stream missing an event is not stored ---------------------------------------------------


@pytest.mark.parametrize("path", ["chat/completions", "responses"])
async def test_a_stream_with_a_malformed_event_is_not_stored(upstream, gateway, path):
    up = await upstream("a", tokens=8, mode="malformed", fail_after=3, fault_count=1)  # the first stream only
    gw = await gateway(simple_policy(up))
    body = _chat("p") if path.startswith("chat") else {"model": "gpt-test", "input": "p", "temperature": 0}
    async with aiohttp.ClientSession() as s:
        first = await _post(s, gw.url, {**body, "stream": True}, path=path)
        second = await _post(s, gw.url, {**body, "stream": True}, path=path)
        third = await _post(s, gw.url, body, path=path)
    assert first[:2] == (200, "miss") and "w7" in first[2]  # the client still gets the rest of the stream
    assert second[:2] == (200, "miss")  # not stored: the dropped event may have carried part of the answer
    assert third[:2] == (200, "hit")  # a whole stream is
    assert up.stats.requests == 2


async def test_followers_on_the_same_terms_go_upstream_at_once_when_their_leader_fails_before_content(upstream, gateway):
    """The leader fails before its first token (the backend's error event) while its followers
    (the same deadline and band) wait on its live stream: they go upstream themselves at once."""
    up = await upstream("a", tokens=5, ttft_ms=600, mode="error_event", fail_after=0, fault_count=1)
    gw = await gateway(_policy(up))
    body = _chat("the leader fails", stream=True)
    flights = gw.app[RELAY].flight
    async with aiohttp.ClientSession() as s:
        leader = asyncio.create_task(_post(s, gw.url, body))
        await _until(lambda: up.stats.requests == 1)
        followers = [asyncio.create_task(_post(s, gw.url, body)) for _ in range(3)]
        await _until(lambda: sum(len(f.stream) for f in flights._flights.values() if f.stream is not None) == 3)
        led, *rest = await asyncio.gather(leader, *followers)
    assert led[0] == 502
    for r in rest:
        assert r[0] == 200 and r[2].rstrip().endswith("data: [DONE]") and "w4" in r[2]
    assert up.stats.requests == 4


# --- a leader whose client does not read ---------------------------------------------------------

def _stalled_client(port: int, body: dict[str, Any]) -> socket.socket:
    """Sends the request and never reads a byte of the answer (a tiny receive window)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    raw = orjson.dumps(body)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme\r\n"
              b"Content-Type: application/json\r\nContent-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return s


async def _behind_a_leader_that_does_not_read(up: Any, leader_port: int, url: str) -> tuple[int, str | None, float]:
    """A leader on `leader_port` whose client reads nothing of its answer, then the same request
    on `url` with an 8 s deadline: (status, x-gateway-cache, seconds it took)."""
    body = _chat("popular question")
    attacker = _stalled_client(leader_port, body)
    try:
        await _until(lambda: up.stats.requests == 1)
        await asyncio.sleep(0.3)  # answered upstream; the leader's client reads nothing
        async with aiohttp.ClientSession() as s:
            started = asyncio.get_running_loop().time()
            status, cache, _ = await _post(s, url, body, {"x-request-timeout-ms": "8000"})
            return status, cache, asyncio.get_running_loop().time() - started
    finally:
        attacker.close()


@pytest.mark.parametrize("stored", [True, False], ids=["stored", "too large to store"])
async def test_a_leader_whose_client_does_not_read_holds_no_follower(upstream, gateway, stored):
    """A whole answer (~4.5 MB, past what the sockets buffer) ready in 50 ms held its flight's
    followers until the leader's client read it, up to the 60 s write bound: a follower with an
    8 s deadline got a 504 (review helper's repro). The flight lands before the client is sent
    the answer: a stored one is a hit for the follower, one too large to store lets it go on alone."""
    up = await upstream(tokens=600_000, ttft_ms=50)
    gw = await gateway(_policy(up, cache={"max_entry_bytes": 8 * 1024 * 1024 if stored else 256 * 1024}))
    status, cache, took = await _behind_a_leader_that_does_not_read(up, gw.port, gw.url)
    assert status == 200 and took < 4, (status, took)
    assert (cache, up.stats.requests) == (("hit", 1) if stored else ("miss", 2))


async def test_a_leader_whose_client_does_not_read_holds_no_other_replica(upstream, gateway):
    """The same across replicas: the leader's lock on the shared store was held until its client
    had read the answer; a request on another replica waited for it (504 at its 8 s deadline)."""
    up = await upstream(tokens=600_000, ttft_ms=50)
    async with redis_server() as url:  # a redis-server of this test's own
        policy = _policy(up, cache={"max_entry_bytes": 8 * 1024 * 1024})
        policy["store"] = {"url": url, "timeout_ms": 500}
        policy["reload"] = {"watch": False, "channel": "t-" + secrets.token_hex(4)}
        a, b = await gateway(policy, "a.yaml"), await gateway(policy, "b.yaml")
        status, cache, took = await _behind_a_leader_that_does_not_read(up, a.port, b.url)
    assert (status, cache, up.stats.requests) == (200, "hit", 1) and took < 4, (status, cache, took)
