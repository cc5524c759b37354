"""The streaming pump (relay/pump.py) over scripted upstream reads, without sockets: the same rules for
every wire format (held bytes, the first-output claim, the stall deadline, the cut)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
import pytest

from gateway.relay.attempt import MAX_HELD_BYTES, Attempt, AttemptFailed, Cut, Progress
from gateway.routing.backends import Backend, BackendState
from gateway.pipeline.call import Call, Finish, Timing
from gateway.relay.continuation import Transcript
from gateway.wire.endpoints import ENDPOINTS
from gateway.errors import GatewayError
from gateway.routing.health import Kind
from gateway.observe.metrics import Metrics
from gateway.config.policy import BackendPolicy, RoutingPolicy
from gateway.relay.pump import Pump
from gateway.wire.openai_wire import SSE_DONE


class Reads:
    """An upstream body: each item is bytes to hand out, or seconds to wait before the next."""

    status = 200

    def __init__(self, *items: bytes | float) -> None:
        self.items = list(items)

    async def readany(self) -> bytes:
        while self.items:
            item = self.items.pop(0)
            if isinstance(item, (int, float)):
                await asyncio.sleep(item)
                continue
            return item
        return b""


class Sink:
    committed = False

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.ended = False
        self.headers: dict[str, str] = {}

    async def write(self, data: bytes) -> None:
        self.committed = True
        self.out.append(data)

    async def end(self) -> None:
        self.ended = True

    def would_wait(self, size: int) -> bool:
        return False

    async def hand_off(self, err: Any) -> bool:
        return False  # nobody shares this stream

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        raise AssertionError("a stream is never sent whole")

    async def fail(self, err: GatewayError) -> None:
        raise AssertionError("the pump writes no failure: the relay does")

    def set_header(self, name: str, value: str) -> None:
        self.headers[name] = value


class Ctx:
    def __init__(self) -> None:
        self.metrics = Metrics()


class Req:
    """What an attempt shares with its request (attempt.Requester)."""

    def __init__(self, endpoint: str, **call: Any) -> None:
        now = time.monotonic()
        self.call = Call("r1", ENDPOINTS[endpoint], b"{}", None, now + call.pop("timeout_s", 10), timing=Timing(t0_monotonic=now),
                         model="m", stream=True, **call)
        self.ctx, self.sink, self.progress = Ctx(), Sink(), Progress()


def _attempt(req: Req, live: RoutingPolicy | None = None, **timeouts: int) -> Attempt:
    backend = Backend("b", BackendPolicy(url="http://127.0.0.1:9/v1", models=["m"], timeouts=timeouts or {}), BackendState())
    return Attempt(req, backend, req.ctx.metrics.for_backend("b"), live=live)  # type: ignore[arg-type]


def _chat(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    return b"data: " + orjson.dumps({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"


def _resp(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
CREATED = _resp("response.created", response={"id": "resp_1"})
DELTA = _resp("response.output_text.delta", delta="Hi")
COMPLETED = _resp("response.completed", response={"id": "resp_1", "usage": {"input_tokens": 1, "output_tokens": 1}})


async def test_a_chat_stream_is_held_until_its_first_token_then_passed_through_and_ended_with_done():
    req = Req("chat")
    att = _attempt(req)
    kind = await Pump(att, Reads(b": keep-alive\n\n", ROLE, _chat("Hi"), _chat(None, "stop"), b"data: [DONE]\n\n")).run()  # type: ignore[arg-type]
    assert kind is Kind.OK and req.call.out.finish is Finish.OK and req.sink.ended
    # The keep-alive before the first token is dropped; the role event is released with the token.
    assert req.sink.out == [ROLE + _chat("Hi"), _chat(None, "stop"), SSE_DONE]
    assert req.progress.owner == "b" and req.progress.first_sent and req.call.out.streamed_tokens == 1
    assert req.call.timing.ttft_s is not None


async def test_a_responses_stream_goes_through_the_same_pump():
    req = Req("responses")
    kind = await Pump(_attempt(req), Reads(CREATED, DELTA, COMPLETED)).run()  # type: ignore[arg-type]
    assert kind is Kind.OK and req.sink.out == [CREATED + DELTA, COMPLETED]  # no [DONE] of its own
    assert req.call.out.usage == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}


@pytest.mark.parametrize("endpoint,before", [("chat", ROLE), ("responses", CREATED)])
async def test_a_failure_before_the_first_output_fails_over_without_a_byte_sent(endpoint, before):
    req = Req(endpoint)
    with pytest.raises(AttemptFailed) as failed:
        await Pump(_attempt(req), Reads(before, b'data: {"error": {"message": "boom"}}\n\n')).run()  # type: ignore[arg-type]
    assert failed.value.kind is Kind.ERROR_EVENT and "boom" in failed.value.err.message
    assert req.sink.out == [] and req.progress.owner is None


@pytest.mark.parametrize("endpoint,first", [("chat", _chat("Hi")), ("responses", DELTA)])
async def test_a_stream_that_ends_mid_answer_is_cut_after_its_output_was_written(endpoint, first):
    req = Req(endpoint)
    with pytest.raises(Cut) as cut:
        await Pump(_attempt(req), Reads(first)).run()  # type: ignore[arg-type]
    assert cut.value.kind is Kind.CUT_MID_STREAM and req.sink.out == [first] and not req.sink.ended


async def test_an_error_event_mid_stream_cuts_a_chat_stream_after_what_came_with_it():
    req = Req("chat")
    with pytest.raises(Cut) as cut:
        await Pump(_attempt(req), Reads(_chat("a") + _chat("b") + b'data: {"error": "gone"}\n\n')).run()  # type: ignore[arg-type]
    assert cut.value.kind is Kind.ERROR_EVENT_MID_STREAM and req.sink.out == [_chat("a") + _chat("b")]


async def test_the_responses_failure_event_mid_stream_is_passed_on_and_ends_the_stream():
    req = Req("responses")
    failed = _resp("response.failed", response={"error": {"message": "overloaded"}})
    kind = await Pump(_attempt(req), Reads(DELTA, failed)).run()  # type: ignore[arg-type]
    assert kind is Kind.ERROR_EVENT_MID_STREAM and req.call.out.finish is Finish.ERROR
    assert req.sink.out == [DELTA, failed] and req.sink.ended


async def test_too_much_before_the_first_output_fails_over():
    req = Req("chat")
    with pytest.raises(AttemptFailed) as failed:
        await Pump(_attempt(req), Reads(*[ROLE] * (MAX_HELD_BYTES // len(ROLE) + 2))).run()  # type: ignore[arg-type]
    assert failed.value.kind is Kind.TOO_LARGE and req.sink.out == []


@pytest.mark.parametrize("endpoint,first", [("chat", _chat("Hi")), ("responses", DELTA)])
async def test_a_stall_mid_stream_is_cut_at_the_backends_idle_timeout(endpoint, first):
    req = Req(endpoint)
    with pytest.raises(Cut) as cut:
        await Pump(_attempt(req, idle_ms=50), Reads(first, 5.0)).run()  # type: ignore[arg-type]
    assert cut.value.kind is Kind.CUT_MID_STREAM and "stalled for more than 50 ms" in cut.value.err.message
    assert not cut.value.live  # at the backend's own idle_ms: the backend's failure


@pytest.mark.parametrize("endpoint,first", [("chat", _chat("Hi")), ("responses", DELTA)])
async def test_a_rescuable_stall_is_noticed_from_live_data_whatever_the_format(endpoint, first):
    req = Req(endpoint, transcript=Transcript())  # a stall another backend could rescue
    live = RoutingPolicy(idle_floor_ms=50, cold_idle_ms=60)
    started = time.perf_counter()
    with pytest.raises(Cut) as cut:
        await Pump(_attempt(req, live, idle_ms=30_000), Reads(first, 5.0)).run()  # type: ignore[arg-type]
    assert time.perf_counter() - started < 2  # the live deadline, not the 30 s idle timeout
    assert cut.value.live  # blamed on the live deadline (health.LIVE_DEADLINE): its ejection waits for a probe


async def test_no_first_output_before_the_deadline_fails_over():
    req = Req("responses")
    with pytest.raises(AttemptFailed) as failed:
        await Pump(_attempt(req, first_token_ms=50), Reads(CREATED, 5.0)).run()  # type: ignore[arg-type]
    assert failed.value.kind is Kind.FIRST_TOKEN_TIMEOUT and "no first output within" in failed.value.err.message


async def test_the_callers_deadline_mid_stream_is_the_callers_not_the_backends():
    req = Req("chat", timeout_s=0.2)
    with pytest.raises(Cut) as cut:
        await Pump(_attempt(req), Reads(_chat("Hi"), 5.0)).run()  # type: ignore[arg-type]
    assert cut.value.kind is Kind.CALLER_DEADLINE


async def test_a_client_that_stops_reading_is_not_timed_as_the_backends_gaps(upstream, gateway):
    # The backend sends every token at once; a client that stopped reading for 1.5 s had its
    # pause fed to the backend's inter-token figures (a 1.45 s gap: a few such set everyone's
    # P99, and the stall and whole-answer deadlines from it) and to its duration (review helper's repro).
    import socket

    import orjson

    from gateway.web.keys import LIVE
    from tests.conftest import simple_policy

    up = await upstream("a", tokens=20000, itl_ms=0)
    gw = await gateway(simple_policy(up, model="m"))
    tracker = gw.app[LIVE].runtime.backends["a"].tracker
    gaps: list[float] = []
    tracker.observe_itl = lambda s, f=tracker.observe_itl: (gaps.append(s), f(s))[1]  # type: ignore[method-assign]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", gw.port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    body = orjson.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    await reader.read(600)
    await asyncio.sleep(1.5)  # the client stops reading
    while await reader.read(65536):
        pass
    writer.close()
    assert gaps and max(gaps) < 0.5, max(gaps)
    assert tracker.duration.sorted(tracker.clock(), 0)[-1] < 1.0  # nor in its duration
