"""Streamed single flight: followers share the leader's live stream (a tee), over real sockets.

The Broadcast / TeeSink / follow() units first, then the gateway with a fake upstream and the
official openai SDK.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import yaml
from aiohttp import web

from gateway.cache.core import SingleFlight
from gateway.pipeline.call import Call
from gateway.wire.endpoints import ENDPOINTS
from gateway.errors import UpstreamError
from gateway.tenants.auth import hash_key
from gateway.cache.broadcast import Broadcast, TeeSink, follow
from gateway.cache.budget import Budget
from gateway.web.keys import RELAY
from gateway.wire.openai_wire import SSE_DONE, SSE_HEARTBEAT, sse_event
from gateway.web.app import create_app
from gateway.web.edge import EdgeRunner
from tests.conftest import RunningGateway, simple_policy

MSG = [{"role": "user", "content": "Tell me a story about a tee."}]


# --- units -------------------------------------------------------------------------------------


class ListSink:
    """A Sink that records what it was given."""

    def __init__(self, *, reset_after: int | None = None) -> None:
        self.committed = False
        self.headers: dict[str, str] = {}
        self.data: list[bytes] = []
        self.ended = False
        self.sent: tuple[int, bytes] | None = None
        self.failed: Any = None
        self._reset_after = reset_after

    def set_header(self, name: str, value: str) -> None:
        if not self.committed:
            self.headers[name] = value

    async def commit(self) -> None:
        self.committed = True

    async def write(self, data: bytes) -> None:
        if self._reset_after is not None and len(self.data) >= self._reset_after:
            raise ConnectionResetError("client gone")
        self.committed = True
        self.data.append(data)

    async def end(self) -> None:
        self.ended = True

    def would_wait(self, size: int) -> bool:
        return False

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.sent = (status, body)

    async def fail(self, err: Any) -> None:
        self.failed = err
        if self.committed:  # as HttpSink: once streaming, the error travels as an event that ends the stream
            self.data.append(sse_event(err.to_dict()))
            self.ended = True

    @property
    def body(self) -> bytes:
        return b"".join(self.data)


def _call(stream_options: dict[str, Any] | None = None, timeout_s: float = 5.0) -> Call:
    call = Call("rid", ENDPOINTS["chat"], b"{}", None, time.monotonic() + timeout_s)
    call.stream = True
    if stream_options is not None:
        call.body = {"stream_options": stream_options}
    return call


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": text}}]}) + b"\n\n"


USAGE = b"data: " + orjson.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}) + b"\n\n"


async def test_a_follower_gets_what_was_sent_then_the_rest_live() -> None:
    bc = Broadcast()
    leader = ListSink()
    tee = TeeSink(leader, bc)
    tee.set_header("x-gateway-backend", "a")
    await tee.write(SSE_HEARTBEAT)  # heartbeats before content stay the leader's
    await tee.write(_chunk("one "))
    sink = ListSink()
    task = asyncio.create_task(follow(bc, _call(), sink))
    await asyncio.sleep(0.01)
    assert sink.body == _chunk("one ")  # the history at once
    # A hit like any: `cache` as its backend (the leader's is in the leader's own records).
    assert sink.headers["x-gateway-cache"] == "hit" and sink.headers["x-gateway-backend"] == "cache"
    await tee.write(_chunk("two"))
    await asyncio.sleep(0.01)
    assert sink.body == _chunk("one ") + _chunk("two")  # then live
    await tee.write(SSE_DONE)
    await tee.end()
    assert await task is True
    assert sink.ended and sink.body == _chunk("one ") + _chunk("two") + SSE_DONE
    assert leader.body == SSE_HEARTBEAT + sink.body
    assert len(bc) == 0


async def test_a_failure_before_content_sends_followers_upstream_and_after_content_ends_them_with_the_error() -> None:
    for started in (False, True):
        bc = Broadcast()
        tee = TeeSink(ListSink(), bc)
        sink = ListSink()
        task = asyncio.create_task(follow(bc, _call(), sink))
        await tee.write(SSE_HEARTBEAT)
        if started:
            await tee.write(_chunk("one"))
        await asyncio.sleep(0.01)
        await tee.fail(UpstreamError("cut mid-stream"))
        answered = await task
        if started:
            assert answered is True and b"cut mid-stream" in sink.body and SSE_DONE not in sink.body
        else:
            assert answered is False and sink.data == [] and not sink.committed  # free to go upstream


async def test_a_leader_that_goes_away_releases_its_followers() -> None:
    flight = SingleFlight()
    leader_in = asyncio.Event()

    async def leader(content: bool) -> None:
        async with flight.hold("k", wait_s=5, stream=True) as f:
            assert f.leader and f.stream is not None
            if content:
                await TeeSink(ListSink(), f.stream).write(_chunk("one"))
            leader_in.set()
            await asyncio.sleep(10)

    for content in (False, True):
        leader_in.clear()
        lead = asyncio.create_task(leader(content))
        await leader_in.wait()
        sink = ListSink()

        async def follower() -> bool:
            async with flight.hold("k", wait_s=5, stream=True) as f:
                assert not f.leader and f.stream is not None  # let in at once, not after the leader
                return await follow(f.stream, _call(), sink)

        fol = asyncio.create_task(follower())
        await asyncio.sleep(0.01)
        lead.cancel()  # its client went away
        started = time.monotonic()
        answered = await fol
        assert time.monotonic() - started < 0.1  # promptly
        assert answered is content
        if content:
            assert b"went away" in sink.body and SSE_DONE not in sink.body
        await asyncio.gather(lead, return_exceptions=True)
        assert len(flight) == 0


async def test_a_follower_whose_client_goes_away_does_not_disturb_the_leader() -> None:
    bc = Broadcast()
    leader = ListSink()
    tee = TeeSink(leader, bc)
    gone, stays = ListSink(reset_after=1), ListSink()
    call = _call()
    tasks = [asyncio.create_task(follow(bc, call, gone)), asyncio.create_task(follow(bc, _call(), stays))]
    for i in range(3):
        await tee.write(_chunk(str(i)))
        await asyncio.sleep(0.005)
    await tee.write(SSE_DONE)
    await tee.end()
    assert await asyncio.gather(*tasks) == [True, True]
    assert call.out.finish == "client_disconnect"
    assert leader.body == stays.body == b"".join(_chunk(str(i)) for i in range(3)) + SSE_DONE


async def test_the_usage_chunk_reaches_only_followers_that_asked_for_it() -> None:
    bc = Broadcast(include_usage=True)
    tee = TeeSink(ListSink(), bc)
    plain, wants = ListSink(), ListSink()
    tasks = [
        asyncio.create_task(follow(bc, _call(), plain)),
        asyncio.create_task(follow(bc, _call({"include_usage": True}), wants)),
    ]
    await tee.write(_chunk("a") + _chunk("b"))
    await tee.write(USAGE + SSE_DONE)
    await tee.end()
    await asyncio.gather(*tasks)
    assert plain.body == _chunk("a") + _chunk("b") + SSE_DONE
    assert wants.body == _chunk("a") + _chunk("b") + USAGE + SSE_DONE


async def test_the_history_is_bounded_and_a_follower_that_falls_behind_is_cut_off() -> None:
    bc = Broadcast(max_bytes=100)
    tee = TeeSink(ListSink(), bc)
    slow = ListSink()
    call = _call()
    task = asyncio.create_task(follow(bc, call, slow))
    await tee.write(b"data: " + b"x" * 40 + b"\n\n")
    await asyncio.sleep(0.01)  # the follower takes it
    await tee.write(b"data: " + b"y" * 120 + b"\n\n")  # more than it may fall behind by, before it runs
    assert await task is True and call.out.finish == "cut"
    assert isinstance(slow.failed, UpstreamError)
    assert not bc.joinable  # the history passed max_bytes: later requests go upstream themselves
    assert await follow(bc, _call(), ListSink()) is False


async def test_all_histories_together_stay_within_one_budget() -> None:
    budget = Budget(limit=100)
    a, b = Broadcast(budget=budget), Broadcast(budget=budget)
    a.publish(b"x" * 60)
    b.publish(b"y" * 60)  # over the shared budget: b keeps no history
    assert a.joinable and not b.joinable and budget.used == 60
    a.release()  # the flight ended
    assert budget.used == 0 and not a.joinable


async def test_non_streamed_followers_still_wait_for_the_stored_answer() -> None:
    flight = SingleFlight()
    leader_in = asyncio.Event()

    async def leader() -> None:
        async with flight.hold("k", wait_s=5, stream=True):
            leader_in.set()
            await asyncio.sleep(0.05)

    lead = asyncio.create_task(leader())
    await leader_in.wait()
    started = time.monotonic()
    async with flight.hold("k", wait_s=5) as f:  # stream=False
        assert not f.leader and f.stream is None
    assert time.monotonic() - started > 0.03
    await lead


# --- over real sockets ---------------------------------------------------------------------------


async def _stream(gw: Any, *, timeout_ms: int | None = None, include_usage: bool = False, t0: float | None = None,
                  quit_at_first: bool = False) -> dict[str, Any]:
    """One streamed request through the SDK: headers, text, first-token time, how it ended."""
    headers = {"x-request-timeout-ms": str(timeout_ms)} if timeout_ms else {}
    kw: dict[str, Any] = {"stream_options": {"include_usage": True}} if include_usage else {}
    t0 = time.perf_counter() if t0 is None else t0
    out: dict[str, Any] = {"text": "", "first": None, "error": None, "finish": None, "usage": None, "chunks": 0}
    c = gw.clients[0] if gw.clients else gw.client()  # one client: its creation is not what is measured
    try:
        raw = await c.chat.completions.with_raw_response.create(
            model="gpt-test", messages=MSG, temperature=0, stream=True, extra_headers=headers, **kw
        )
        out["cache"], out["backend"] = raw.headers["x-gateway-cache"], raw.headers.get("x-gateway-backend")
        stream = raw.parse()
        async for ch in stream:
            out["chunks"] += 1
            out["usage"] = ch.usage or out["usage"]
            for choice in ch.choices:
                if choice.delta.content and out["first"] is None:
                    out["first"] = time.perf_counter() - t0
                out["text"] += choice.delta.content or ""
                out["finish"] = choice.finish_reason or out["finish"]
            if quit_at_first and out["first"] is not None:
                await stream.close()  # the client goes away mid-stream
                break
    except openai.APIError as exc:
        out["error"] = exc
    out["end"] = time.perf_counter() - t0
    return out


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.002)


def _following(gw: Any) -> int:
    """Streamed followers attached to the live flights of this gateway."""
    flights = gw.app[RELAY].flight._flights.values()
    return sum(len(f.stream) for f in flights if f.stream is not None)


def _text(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


async def test_concurrent_streamed_requests_share_the_leaders_first_token(upstream, gateway):
    up = await upstream("a", tokens=40, ttft_ms=50, itl_ms=20)
    gw = await gateway(simple_policy(up))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_stream(gw, t0=t0) for _ in range(5)))
    assert up.stats.requests == 1
    firsts = [r["first"] for r in results]
    assert max(firsts) - min(firsts) < 0.15, firsts  # before: the followers waited for the whole answer (~0.85 s)
    assert all(r["text"] == _text(40) and r["finish"] == "stop" and r["error"] is None for r in results)
    assert sorted(r["cache"] for r in results) == ["hit"] * 4 + ["miss"]
    assert sorted(r["backend"] for r in results) == ["a"] + ["cache"] * 4  # the leader's, then its followers' hits
    assert len(gw.app[RELAY].flight) == 0 and gw.app[RELAY].flight.budget.used == 0  # nothing held afterwards
    again = await _stream(gw)  # the leader stored the answer as usual
    assert again["cache"] == "hit" and again["text"] == _text(40) and up.stats.requests == 1


async def test_a_follower_that_joins_mid_stream_gets_it_from_the_start_at_once(upstream, gateway):
    up = await upstream("a", tokens=50, ttft_ms=20, itl_ms=20)
    gw = await gateway(simple_policy(up))
    t0 = time.perf_counter()
    lead = asyncio.create_task(_stream(gw, t0=t0))
    await asyncio.sleep(0.25)  # the leader is ~10 tokens in
    late = await _stream(gw, t0=t0)
    leader = await lead
    assert late["first"] < leader["end"] - 0.4  # the history at once, not at the leader's end (~1 s)
    assert late["text"] == leader["text"] == _text(50) and late["cache"] == "hit"
    assert abs(late["end"] - leader["end"]) < 0.15  # then live, ending with the leader
    assert up.stats.requests == 1


async def test_requests_a_short_deadline_leader_cannot_serve_go_upstream_themselves(upstream, gateway):
    # A leader whose own deadline (400 ms) is shorter than theirs (5 s) would end their answers
    # with its own 504: they do not join it (cache/core.py Terms); the first takes the flight over
    # and the others join that one: two upstream calls in all.
    # (Followers on the same terms of a leader that fails before content: test_cache_flight_hostile.py.)
    up = await upstream("a", tokens=5, ttft_ms=600)
    gw = await gateway(simple_policy(up))
    lead = asyncio.create_task(_stream(gw, timeout_ms=400))  # the leader's own deadline: a 504 for it alone
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    tasks = [asyncio.create_task(_stream(gw, timeout_ms=5000)) for _ in range(3)]
    followers = await asyncio.gather(*tasks)
    leader = await lead
    assert isinstance(leader["error"], openai.APIStatusError) and leader["error"].status_code == 504
    for f in followers:
        assert f["error"] is None and f["text"] == _text(5) and f["finish"] == "stop"
        assert f["end"] < 2.0  # right after the leader's failure, not at their own deadline (5 s)
    assert up.stats.requests == 2


async def test_followers_of_a_leader_whose_client_leaves_before_its_first_token_go_upstream_promptly(upstream, gateway):
    up = await upstream("a", tokens=5, ttft_ms=300)
    gw = await gateway(simple_policy(up))
    body = {"model": "gpt-test", "messages": MSG, "temperature": 0, "stream": True}

    async def leader() -> None:
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.content.read()

    lead = asyncio.create_task(leader())
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    t0 = time.perf_counter()
    followers = [asyncio.create_task(_stream(gw, t0=t0)) for _ in range(3)]
    await _until(lambda: _following(gw) == 3)
    lead.cancel()  # the leader's client goes away; its handler (and upstream call) is cancelled
    await asyncio.gather(lead, return_exceptions=True)
    for f in await asyncio.gather(*followers):
        assert f["error"] is None and f["text"] == _text(5) and f["cache"] == "miss"
        assert f["end"] < 2.0  # their own upstream call started when the leader left, not at their deadline


async def test_a_mid_stream_failure_reaches_every_follower_as_an_error_never_as_a_success(upstream, gateway):
    up = await upstream("a", tokens=10, ttft_ms=200, itl_ms=10, mode="cut", fail_after=3)
    gw = await gateway(simple_policy(up))
    lead = asyncio.create_task(_stream(gw))
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    tasks = [asyncio.create_task(_stream(gw)) for _ in range(3)]
    await _until(lambda: _following(gw) == 3)
    results = await asyncio.gather(lead, *tasks)
    assert up.stats.requests == 1
    for r in results:
        assert isinstance(r["error"], openai.APIError) and r["finish"] is None
        assert r["text"] == _text(3)


async def test_a_follower_that_disconnects_leaves_the_leader_and_the_others_whole(upstream, gateway):
    up = await upstream("a", tokens=20, ttft_ms=200, itl_ms=15)
    gw = await gateway(simple_policy(up))
    t0 = time.perf_counter()
    lead = asyncio.create_task(_stream(gw, t0=t0))
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    quitter = asyncio.create_task(_stream(gw, t0=t0, quit_at_first=True))
    other = asyncio.create_task(_stream(gw, t0=t0))
    await _until(lambda: _following(gw) == 2)
    gone = await quitter
    leader, follower = await lead, await other
    assert gone["cache"] == "hit" and gone["end"] < leader["end"] - 0.1
    assert leader["text"] == follower["text"] == _text(20) and leader["error"] is None and follower["error"] is None
    assert up.stats.requests == 1 and up.stats.cancelled == 0


async def _metric(gw: Any, needle: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as r:
        return sum(float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines() if line.startswith(needle))


async def _leader_that_leaves(gw: Any, followers: int, *, they_quit: bool = False) -> tuple[Any, list[Any], float]:
    """A streamed leader whose client leaves at its first token, with `followers` streamed followers
    attached before it does (each leaving at its first token too with `they_quit`)."""
    t0 = time.perf_counter()
    lead = asyncio.create_task(_stream(gw, t0=t0, quit_at_first=True))
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    tasks = [asyncio.create_task(_stream(gw, t0=t0, quit_at_first=they_quit)) for _ in range(followers)]
    await _until(lambda: _following(gw) == followers)
    return lead, tasks, t0


async def test_followers_keep_their_stream_when_the_leaders_client_leaves_mid_stream(upstream, gateway):
    up = await upstream("a", tokens=30, ttft_ms=200, itl_ms=15)
    gw = await gateway(simple_policy(up))
    lead, followers, _ = await _leader_that_leaves(gw, 3)
    leader = await lead
    assert leader["text"] and leader["text"] != _text(30)  # it left after its first token
    for f in await asyncio.gather(*followers):
        # Before: an error event "the stream this request shared ended early" after the first words.
        assert f["error"] is None and f["text"] == _text(30) and f["finish"] == "stop" and f["cache"] == "hit"
    assert up.stats.requests == 1 and up.stats.cancelled == 0
    await _until(lambda: len(gw.app[RELAY].flight) == 0)
    # The leader counts as a disconnect; its slot is back; the answer was stored as usual.
    assert await _metric(gw, "gateway_client_disconnects_total") == 1
    assert await _metric(gw, 'gateway_backend_inflight{backend="a"}') == 0
    again = await _stream(gw)
    assert again["cache"] == "hit" and again["text"] == _text(30) and up.stats.requests == 1


async def _slow_reader(gw: Any) -> socket.socket:
    """A streamed request sent from a socket with a 4 KiB receive buffer, nothing read yet."""
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "temperature": 0, "stream": True})
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", gw.port))
    await loop.sock_sendall(sock, request)
    return sock


async def test_followers_keep_their_stream_when_a_slow_leaders_connection_is_reset(upstream, gateway):
    # A leader that reads slowly: the gateway's write to it waits on a full buffer; then its
    # connection is reset, which aiohttp reports as a plain ConnectionError ("Connection lost").
    up = await upstream("a", tokens=30000, ttft_ms=150, itl_ms=0)
    gw = await gateway(simple_policy(up))
    loop = asyncio.get_running_loop()
    sock = await _slow_reader(gw)
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    t0 = time.perf_counter()
    followers = [asyncio.create_task(_stream(gw, t0=t0)) for _ in range(2)]
    await _until(lambda: _following(gw) == 2)
    got = b""
    while b"w0 " not in got:  # the leader reads its first content, then stops reading
        got += await loop.sock_recv(sock, 1024)
    await asyncio.sleep(0.5)  # the relay now waits on the leader's full buffer
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, not a FIN
    for f in await asyncio.gather(*followers):
        assert f["error"] is None and f["text"] == _text(30000) and f["finish"] == "stop"
    assert up.stats.requests == 1


async def test_a_shutdown_out_of_time_ends_the_relays_carried_for_followers(upstream, gateway):
    up = await upstream("a", tokens=400, ttft_ms=150, itl_ms=10)  # a 4 s answer
    gw = await gateway(simple_policy(up))
    lead, (follower,), t0 = await _leader_that_leaves(gw, 1)
    await lead
    await _until(lambda: len(gw.app[RELAY].carried) == 1)  # going on for the follower alone
    await gw.app[RELAY].cancel_carried()  # what process/serve.py does when the drain runs out of time
    f = await follower
    assert isinstance(f["error"], openai.APIError) and f["finish"] is None and f["text"] != _text(400)
    await _until(lambda: up.stats.cancelled == 1)
    assert not gw.app[RELAY].carried and time.perf_counter() - t0 < 3.0


async def test_the_apps_own_cleanup_ends_the_relays_carried_for_followers(upstream, gateway, tmp_path):
    """Not only `gateway serve`: any runner's cleanup ends them before the upstream pool closes."""
    up = await upstream("a", tokens=400, ttft_ms=150, itl_ms=10)  # a 4 s answer
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(simple_policy(up)))
    app = create_app(path)
    runner = EdgeRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    gw = RunningGateway(app, runner, site._server.sockets[0].getsockname()[1], path)  # type: ignore[union-attr]
    try:
        lead, (follower,), t0 = await _leader_that_leaves(gw, 1)
        await lead
        await _until(lambda: len(app[RELAY].carried) == 1)  # going on for the follower alone
    finally:
        for c in gw.clients:
            await c.close()
        await asyncio.wait_for(runner.cleanup(), 5)
    assert not app[RELAY].carried  # ended by the cleanup itself, not left to die on a closed pool
    f = await follower
    assert f["finish"] is None and f["text"] != _text(400)  # cut, not finished after the cleanup
    await _until(lambda: up.stats.cancelled == 1)
    assert not app[RELAY].carried and time.perf_counter() - t0 < 3.0


async def test_the_upstream_call_stops_when_the_leader_and_every_follower_have_left(upstream, gateway):
    up = await upstream("a", tokens=200, ttft_ms=200, itl_ms=15)
    gw = await gateway(simple_policy(up))
    lead, (follower,), t0 = await _leader_that_leaves(gw, 1, they_quit=True)
    await asyncio.gather(lead, follower)
    await _until(lambda: up.stats.cancelled == 1)  # long before the answer's 3 s end
    assert time.perf_counter() - t0 < 2.0 and up.stats.completed == 0
    await _until(lambda: len(gw.app[RELAY].flight) == 0)
    assert await _metric(gw, 'gateway_backend_inflight{backend="a"}') == 0


async def test_a_lone_leader_that_leaves_mid_stream_stops_its_upstream_call(upstream, gateway):
    up = await upstream("a", tokens=200, ttft_ms=100, itl_ms=15)
    gw = await gateway(simple_policy(up))
    t0 = time.perf_counter()
    leader = await _stream(gw, t0=t0, quit_at_first=True)
    assert leader["text"]
    await _until(lambda: up.stats.cancelled == 1)
    assert time.perf_counter() - t0 < 2.0 and up.stats.completed == 0


@pytest.mark.parametrize("quota", [False, True])
async def test_followers_get_usage_only_when_they_asked_for_it(upstream, gateway, quota):
    # With a token quota every stream's backend is asked for usage (dropped for a client that
    # did not ask): the body a follower holds then says include_usage, its client did not.
    up = await upstream("a", tokens=8, ttft_ms=200, itl_ms=5)
    tenants = {"acme": {"key_sha256": [hash_key("sk-acme")], "quota": {"tpm": 1_000_000}}} if quota else None
    gw = await gateway(simple_policy(up, **({"tenants": tenants} if tenants else {})))
    gw.client("sk-acme" if quota else "sk-test")  # _stream's client
    lead = asyncio.create_task(_stream(gw, include_usage=True))
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    tasks = [asyncio.create_task(_stream(gw)), asyncio.create_task(_stream(gw, include_usage=True))]
    await _until(lambda: _following(gw) == 2)
    plain, wants = await asyncio.gather(*tasks)
    leader = await lead
    assert up.stats.requests == 1 and plain["cache"] == wants["cache"] == "hit"
    assert leader["usage"] is not None and wants["usage"] is not None and plain["usage"] is None
    assert plain["chunks"] == leader["chunks"] - 1  # no chunk with empty choices for a client that did not ask


async def test_a_follower_that_asks_for_usage_of_a_leader_without_it_goes_upstream_itself(upstream, gateway):
    up = await upstream("a", tokens=8, ttft_ms=200, itl_ms=5)
    gw = await gateway(simple_policy(up))
    lead = asyncio.create_task(_stream(gw))
    await _until(lambda: len(gw.app[RELAY].flight) == 1)
    wants = await _stream(gw, include_usage=True)
    leader = await lead
    assert leader["usage"] is None and wants["usage"] is not None  # the usage it asked for
    assert wants["cache"] == "miss" and wants["text"] == leader["text"] and up.stats.requests == 2


async def test_a_non_streamed_follower_of_a_streamed_leader_gets_the_stored_answer(upstream, gateway):
    up = await upstream("a", tokens=6, ttft_ms=50, itl_ms=10)
    gw = await gateway(simple_policy(up))
    lead = asyncio.create_task(_stream(gw))
    await asyncio.sleep(0.02)
    raw = await gw.client().chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
    assert raw.headers["x-gateway-cache"] == "hit" and raw.parse().choices[0].message.content == _text(6)
    assert (await lead)["text"] == _text(6) and up.stats.requests == 1


@pytest.mark.parametrize("n", [3])
async def test_many_distinct_prompts_never_grow_the_flight_map_past_its_cap(upstream, gateway, n):
    up = await upstream("a", tokens=2, ttft_ms=100)
    gw = await gateway(simple_policy(up))
    flight = gw.app[RELAY].flight
    flight.max_flights = n
    c = gw.client()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, len(flight))
            await asyncio.sleep(0.005)

    w = asyncio.create_task(watch())
    answers = await asyncio.gather(
        *(c.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": f"q{i}"}], temperature=0) for i in range(8))
    )
    w.cancel()
    assert all(a.choices[0].message.content == _text(2) for a in answers)  # beyond the cap: answered, without single flight
    assert peak == n and flight.overflows == 8 - n and len(flight) == 0


async def test_followers_that_read_nothing_are_held_to_the_shared_budget() -> None:
    # Each follower may fall max_bytes behind; without the budget, 10 that read nothing held 10
    # copies of the stream. Past the budget the one furthest behind is cut off; one that reads
    # goes on, and everything is given back when they leave.
    budget = Budget(limit=1000)
    bc = Broadcast(budget=budget)
    tee = TeeSink(ListSink(), bc)
    reader, call = ListSink(), _call()
    task = asyncio.create_task(follow(bc, call, reader))
    idle = [bc.join() for _ in range(10)]
    for i in range(20):
        await tee.write(b"data: " + bytes([97 + i]) * 94 + b"\n\n")  # 102 bytes
        assert budget.used <= 1000
        await asyncio.sleep(0)  # the reader takes what came
    assert all(t is not None and t.overflow for t in idle)  # cut off, their backlog given back
    await tee.end()
    assert await task is True and call.out.finish == "ok" and reader.body.count(b"data: ") == 20
    for t in idle:
        assert t is not None
        bc.leave(t)
    bc.release()
    assert budget.used == 0


# --- a leader's client that falls behind holds nobody ------------------------------------------


class SlowSink(ListSink):
    """A leader's client that stops reading: its buffer is full until `resume` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.resume = asyncio.Event()
        self.full = False

    def would_wait(self, size: int) -> bool:
        return self.full

    async def write(self, data: bytes) -> None:
        if self.full:
            await self.resume.wait()
        await super().write(data)


async def _falling_behind() -> tuple[Broadcast, SlowSink, TeeSink, ListSink, asyncio.Task[bool]]:
    """A leader's client that got one chunk, then stops reading; a follower reading along."""
    bc = Broadcast()
    leader = SlowSink()
    tee = TeeSink(leader, bc)
    await tee.write(_chunk("one "))
    follower = ListSink()
    task = asyncio.create_task(follow(bc, _call(), follower))
    await asyncio.sleep(0.01)
    leader.full = True  # from here its writes would wait
    return bc, leader, tee, follower, task


async def test_a_leaders_client_that_falls_behind_gets_its_stream_later_while_followers_read_on() -> None:
    bc, leader, tee, follower, task = await _falling_behind()
    async with asyncio.timeout(1):  # the relay never waits on it: before, the first of these hung
        for word in ("two ", "three"):
            await tee.write(_chunk(word))
        await tee.write(SSE_DONE)
        await tee.end()
        assert await task is True
    assert follower.ended and follower.body == _chunk("one ") + _chunk("two ") + _chunk("three") + SSE_DONE
    assert len(bc) == 0  # the leader's own backlog is not a follower
    assert not leader.ended
    leader.resume.set()
    await tee.settle()
    assert leader.ended and leader.body == follower.body and tee.lost is None


async def test_a_leaders_client_too_far_behind_is_cut_off_and_stops_a_stream_nobody_else_reads() -> None:
    bc = Broadcast(max_bytes=1000)
    leader = SlowSink()
    tee = TeeSink(leader, bc)
    await tee.write(_chunk("one "))
    leader.full = True
    async with asyncio.timeout(1):  # the relay never waits on it
        await tee.write(b"x" * 600)
        with pytest.raises(ConnectionResetError):  # 1,200 bytes behind: cut off, and nobody else reads: the relay stops
            await tee.write(b"y" * 600)
    leader.resume.set()
    await tee.settle()
    assert tee.lost == "cut" and leader.ended and leader.failed is not None
    assert b"y" * 600 not in leader.body and b"fell too far behind" in leader.body
    assert bc._budget.used == 0


async def test_a_leader_that_reads_nothing_holds_neither_its_followers_nor_the_stored_answer(upstream, gateway):
    # 30,000 chunks (~4 MB): more than the sockets' buffers hold, so the leader's writes would wait.
    up = await upstream("a", tokens=30000, ttft_ms=150, itl_ms=0)
    gw = await gateway(simple_policy(up))
    loop = asyncio.get_running_loop()
    sock = await _slow_reader(gw)
    try:
        await _until(lambda: len(gw.app[RELAY].flight) == 1)
        t0 = time.perf_counter()
        streamed = asyncio.create_task(_stream(gw, t0=t0))
        await _until(lambda: _following(gw) == 1)
        async with aiohttp.ClientSession() as s:  # a non-streamed follower waits for the stored answer
            plain = asyncio.create_task(s.post(f"{gw.url}/v1/chat/completions", json={
                "model": "gpt-test", "messages": MSG, "temperature": 0}, headers={"x-request-timeout-ms": "5000"}))
            # Before: both waited on the leader's client (the streamed follower until it read, which
            # it does only after this: forever; the non-streamed one to a 504 at its deadline). The
            # bound is not a speed: the SDK alone parses the 30,000 chunks in 2-8 s, by machine.
            async with asyncio.timeout(60):
                f = await streamed
            r = await plain
            assert f["error"] is None and f["text"] == _text(30000) and f["finish"] == "stop"
            assert r.status == 200 and r.headers["x-gateway-cache"] == "hit"
            assert (await r.json())["choices"][0]["message"]["content"] == _text(30000)
        # The leader's client then reads its whole stream, at its own pace.
        got = bytearray()
        async with asyncio.timeout(20):
            while not (b"[DONE]" in got[-64:] and got.endswith(b"\r\n0\r\n\r\n")):  # the chunked body's end
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    break
                got += chunk
        assert b"w29999 " in got and b"[DONE]" in got and b'"error"' not in got
    finally:
        sock.close()
    assert up.stats.requests == 1


def test_a_followers_backlog_goes_out_a_slice_at_a_time_and_its_own_bytes_leave_the_budget():
    """Joined whole, a follower's history (up to 8 MiB) was a copy of its own, and another in its
    socket's buffer while it read nothing: 40 such followers held 550 MB over a 64 MiB budget
    (review helper's repro; now +45 MB). A take is at most 64 KiB (or one piece); the bytes a tap
    holds beyond the history leave the budget as they are taken."""
    budget = Budget()
    bc = Broadcast(budget=budget)
    piece = b"x" * 1000
    for _ in range(300):  # 300 KB of history
        bc.publish(piece)
    tap = bc.join()
    assert tap is not None
    used = budget.used
    for _ in range(100):  # 100 KB more, this tap's own
        bc.publish(piece)
    assert budget.used == used + 100_000 + 100_000  # the history grew, and the tap counts what it holds beyond it
    sizes = []
    while tap.pending:
        sizes.append(len(tap.take()))
    assert sum(sizes) == 400_000 and max(sizes) <= 64 << 10 and len(sizes) == 7
    assert budget.used == used + 100_000 and tap.counted == 0  # the history's stays counted until it is released


# --- a leader whose key stops working hands its stream to its followers -------------------------


async def test_a_leader_that_loses_its_key_mid_stream_hands_the_stream_to_its_followers() -> None:
    """A revoked key ended its request's stream at the next read, and with it the stream of every
    request that shared its flight (the same tenant's other keys): their answers were cut too.
    The leader's client gets the error; its followers read on to the end."""
    bc = Broadcast()
    leader = ListSink()
    tee = TeeSink(leader, bc)
    await tee.write(_chunk("one "))
    assert await tee.hand_off(UpstreamError("key gone")) is False  # nobody shares it yet: the relay cuts it
    follower = ListSink()
    task = asyncio.create_task(follow(bc, _call(), follower))
    await asyncio.sleep(0.01)
    assert await tee.hand_off(UpstreamError("key gone")) is True
    await tee.settle()  # its client's error is written by a task of its own (a slow client holds nobody)
    assert leader.ended and leader.failed is not None and tee.lost == "cut" and tee.detached
    await tee.write(_chunk("two"))  # the relay reads on for the follower
    await tee.write(SSE_DONE)
    await tee.end()
    assert await task is True
    assert follower.body == _chunk("one ") + _chunk("two") + SSE_DONE
    assert leader.body == _chunk("one ") + sse_event(leader.failed.to_dict())  # nothing after its error
    assert await tee.hand_off(UpstreamError("key gone")) is False  # over: nobody reads it any more


async def test_a_leader_behind_its_stream_that_loses_its_key_gets_the_error_instead_of_its_backlog() -> None:
    bc, leader, tee, follower, task = await _falling_behind()
    await tee.write(_chunk("two "))  # queued for the leader's client
    assert await tee.hand_off(UpstreamError("key gone")) is True
    await tee.write(_chunk("three"))
    await tee.write(SSE_DONE)
    await tee.end()
    assert await task is True and follower.body.endswith(_chunk("three") + SSE_DONE)
    leader.resume.set()
    await tee.settle()
    assert leader.ended and b"key gone" in leader.body and b"three" not in leader.body and tee.lost == "cut"
    bc.release()
    assert bc._budget.used == 0


def test_followers_read_the_history_in_place_not_a_copy_each():
    """Each follower joined with a copy of the history's list (8 bytes an event): 200 followers of
    a 54,000-event stream held 85 MiB that no budget counted (review helper's repro). They read
    the Broadcast's own list in place, each from its own position."""
    import tracemalloc

    bc = Broadcast()
    events = [_chunk(f"w{i} ") for i in range(54_000)]
    for ev in events:
        bc.publish(ev)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        taps = [bc.join() for _ in range(200)]
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 1 << 20, held  # ~100 KB of taps; the copies were 85 MiB
    first, last = taps[0], taps[-1]
    assert first is not None and last is not None
    bc.publish(_chunk("late"))
    got = b""
    while first.pending:
        got += first.take()
    assert got == b"".join(events) + _chunk("late")
    bc.release()  # nobody joins now; a tap still reads what it joined with
    rest = b""
    while last.pending:
        rest += last.take()
    assert rest == got


def test_a_follower_that_joined_before_the_first_byte_holds_no_released_history():
    """A follower reading the history in place held the Broadcast's list from its join: one that
    joined before the first byte kept a released history (up to 8 MiB a flight) outside the
    budget (review of the change)."""
    budget = Budget()
    bc = Broadcast(max_bytes=1000, budget=budget)
    tap = bc.join()
    assert tap is not None
    for _ in range(20):
        bc.publish(b"x" * 100)  # past max_bytes: the history is released
        while tap.pending:
            tap.take()  # the follower keeps up
    assert bc._history is None and budget.used == 0 and tap._hist is None
