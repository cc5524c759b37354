"""The pipeline (pipeline.Pipeline) and the relay (relay.Relay) without sockets: a real Runtime
built from a small policy, a scripted upstream pool (tests/scripted.py) in place of the HTTP
client, and a recording sink in place of the aiohttp response. Each test checks what the client
got, what went upstream, and what the call and the metrics say about it."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from gateway.admission.gate import Admission
from gateway.routing.backends import BackendState
from gateway.pipeline.call import CacheResult, Call, Finish
from gateway.wire.endpoints import ENDPOINTS
from gateway.errors import AllBackendsFailed
from gateway.observe.metrics import Metrics
from gateway.observe.observer import Observer
from gateway.pipeline.core import Pipeline
from gateway.config.policy import StorePolicy, parse_policy
from gateway.relay.core import Relay
from gateway.relay.context import RelayContext
from gateway.config.runtime import Runtime, build_runtime
from gateway.pipeline.intake import intake
from gateway.store.core import Store
from gateway.upstream.client import UpstreamConnectError, UpstreamDisconnected
from gateway.wire.openai_wire import SSE_DONE
from tests.scripted import Answer, RecordingSink, ScriptedPool, chat_answer, chat_chunk

KEY = "sk-unit-test-key"
MSG = [{"role": "user", "content": "hi"}]
BACKENDS = """
backends:
  a: {url: 'http://a.invalid/v1', models: [m]}
  b: {url: 'http://b.invalid/v1', models: [m]}
"""
# `ordered`: a then b, so failover is predictable; the cache off unless a test turns it on.
TWO = BACKENDS + "models:\n  m: {backends: [a, b], strategy: ordered}\ncache: {enabled: false}\n"
_ids = itertools.count(1)


@dataclass
class Gateway:
    """One process's pipeline over a scripted pool, with the runtime built from one policy."""

    rt: Runtime
    pool: ScriptedPool
    metrics: Metrics
    ctx: RelayContext
    pipeline: Pipeline

    def call(self, body: dict[str, Any], *, key: str | None = None, timeout_s: float = 10.0) -> Call:
        raw = orjson.dumps(body)
        return Call(f"req-{next(_ids)}", ENDPOINTS["chat"], raw, key, time.monotonic() + timeout_s)

    async def ask(self, body: dict[str, Any], **kw: Any) -> tuple[Call, RecordingSink]:
        call, sink = self.call(body, **kw), RecordingSink()
        await self.pipeline.run(call, self.rt, sink)
        return call, sink

    async def relay(self, body: dict[str, Any]) -> tuple[Call, RecordingSink, Relay]:
        """The relay alone, after intake (what the pipeline runs once a request is admitted)."""
        call, sink = self.call(body), RecordingSink()
        route, _tenant = await intake(call, self.rt)
        relay = Relay(call, route, self.ctx, sink)
        await relay.run(shed=False)
        return call, sink, relay

    def count(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    def total(self, name: str) -> float:
        """A counter summed over all its label values."""
        return sum(s.value for f in self.metrics.registry.collect() for s in f.samples if s.name == name)


@pytest.fixture
async def gateway() -> AsyncIterator[Callable[..., Gateway]]:
    """Factory: `gateway(policy_yaml, a=[Answer...], b=[...])` (hosts `<name>.invalid`)."""
    made: list[Gateway] = []

    def make(policy_yaml: str, **script: list[Answer]) -> Gateway:
        policy = parse_policy(policy_yaml)
        states: dict[str, BackendState] = {}
        stores: dict[StorePolicy, Store] = {}
        rt = build_runtime(policy, states, 1, stores)
        rt.activate(states, stores)  # once, after the build: the backends' limits in force (as app.activate)
        ap = policy.admission
        admission = Admission(ap.max_inflight, ap.max_queue)
        admission.configure(ap.max_inflight, ap.max_queue, ap.starvation_share, ap.enabled, ap.priority_reserve_pct, ap.standing())
        pool = ScriptedPool({f"{host}.invalid": answers for host, answers in script.items()})
        metrics = Metrics()
        ctx = RelayContext(pool, metrics, admission=admission)  # type: ignore[arg-type]
        gw = Gateway(rt, pool, metrics, ctx, Pipeline(ctx, Observer(metrics)))
        made.append(gw)
        return gw

    yield make
    for gw in made:
        if gw.rt.quota is not None:
            await gw.rt.quota.drain()  # the settles run in tasks of their own
        for resp in gw.pool.responses:
            assert resp.released or resp.closed, "an upstream response was left open"


def _ok(content: str = "Hello", **kw: Any) -> Answer:
    return Answer(200, [chat_answer(content, **kw)], {"Content-Type": "application/json"})


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _events(stream: bytes) -> list[bytes]:
    """The data of each SSE event in a stream."""
    return [ev.removeprefix(b"data: ") for ev in stream.split(b"\n\n") if ev]


# ---- the pipeline -------------------------------------------------------------------------------


async def test_a_whole_chat_answer_passes_through_with_its_backend_named_and_counted(gateway):
    gw = gateway(TWO, a=[_ok("Hi there")])
    body = {"model": "m", "messages": MSG}
    call, sink = await gw.ask(body)
    assert sink.status == 200 and sink.json["choices"][0]["message"]["content"] == "Hi there"
    assert sink.body == chat_answer("Hi there")  # the backend's bytes, as they came
    assert sink.headers["x-gateway-backend"] == "a" and sink.headers["x-gateway-cache"] == CacheResult.BYPASS
    assert call.out.finish is Finish.OK and call.out.status == 200 and call.out.backend == "a"
    assert call.out.attempts == ["a"] and call.out.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    [posted] = gw.pool.posts
    assert posted.url == "http://a.invalid/v1/chat/completions" and posted.json == body
    assert posted.headers["X-Request-Id"] == call.request_id
    labels = {"model": "m", "backend": "a", "class": "none", "cache": "bypass", "code": "200"}
    assert gw.count("gateway_requests_total", **labels) == 1
    assert call.tenant is not None and call.tenant.name == "default" and gw.count("gateway_tokens_total", tenant="default", backend="a", kind="completion") == 2
    assert gw.pool.responses[0].released  # a whole answer's connection goes back to the pool


async def test_a_backend_that_answers_500_fails_over_to_the_next_before_anything_is_sent(gateway):
    gw = gateway(TWO, a=[Answer(500, [b'{"error": {"message": "boom"}}'])], b=[_ok("from b")])
    call, sink = await gw.ask({"model": "m", "messages": MSG})
    assert sink.status == 200 and sink.json["choices"][0]["message"]["content"] == "from b"
    assert sink.headers["x-gateway-backend"] == "b"
    assert call.out.attempts == ["a", "b"] and call.out.backend == "b" and call.out.finish is Finish.OK
    assert [p.url for p in gw.pool.posts] == ["http://a.invalid/v1/chat/completions", "http://b.invalid/v1/chat/completions"]
    assert gw.pool.responses[0].closed  # the failed answer is not pooled
    assert gw.count("gateway_failovers_total", backend="b") == 1
    assert gw.count("gateway_requests_total", model="m", backend="b", **{"class": "none"}, cache="bypass", code="200") == 1


async def test_a_stream_is_held_until_its_first_token_then_relayed_and_ended_with_done(gateway):
    gw = gateway(TWO)
    role, hel, lo, stop = chat_chunk(role=True), chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(None, "stop")
    # A keep-alive before the first token (dropped), an event split across two reads, the [DONE].
    gw.pool.add("a.invalid", Answer(200, [b": keep-alive\n\n", role, hel[:20], hel[20:], 0.01, lo + stop, b"data: [DONE]\n\n"],
                                    {"Content-Type": "text/event-stream"}))
    call, sink = await gw.ask({"model": "m", "messages": MSG, "stream": True})
    assert sink.committed and sink.ended and sink.status == 200
    assert sink.chunks[0] == role + hel  # the role event is released with the first token, not before
    assert sink.streamed == role + hel + lo + stop + SSE_DONE and sink.chunks[-1] == SSE_DONE
    assert _events(sink.streamed)[-1] == b"[DONE]"
    # The first content event claimed the client for a: header, owner, TTFT.
    assert sink.headers["x-gateway-backend"] == "a" and call.out.backend == "a" and call.out.attempts == ["a"]
    assert call.timing.ttft_s is not None and call.out.streamed_tokens == 2 and call.out.finish is Finish.OK
    assert gw.count("gateway_ttft_seconds_count", backend="a") == 1


async def test_a_stream_that_breaks_mid_answer_ends_with_an_error_event_and_no_done(gateway):
    policy = BACKENDS + "models:\n  m: {backends: [a], strategy: ordered}\ncache: {enabled: false}\nrouting: {continuation: false}\n"
    gw = gateway(policy, a=[Answer(200, [chat_chunk("Hel"), UpstreamDisconnected("reset by peer")])])
    call, sink = await gw.ask({"model": "m", "messages": MSG, "stream": True})
    assert sink.chunks[0] == chat_chunk("Hel")
    error = orjson.loads(_events(sink.streamed)[-1])["error"]
    assert error["code"] == "upstream_error" and "mid-stream" in error["message"]
    assert SSE_DONE not in sink.streamed and sink.ended and call.out.finish is Finish.CUT
    assert sink.status == 200  # already committed: the status cannot change


async def test_a_deterministic_request_is_answered_from_the_cache_the_second_time(gateway):
    gw = gateway(BACKENDS + "models:\n  m: {backends: [a, b], strategy: ordered}\ncache: {enabled: true}\n", a=[_ok("cached")])
    body = {"model": "m", "messages": MSG, "temperature": 0}
    first_call, first = await gw.ask(body)
    assert first.headers["x-gateway-cache"] == CacheResult.MISS and first_call.cache.result is CacheResult.MISS
    call, sink = await gw.ask(body)
    assert len(gw.pool.posts) == 1  # nothing went upstream the second time
    assert sink.status == 200 and sink.headers["x-gateway-cache"] == CacheResult.HIT and sink.headers["x-gateway-backend"] == "cache"
    assert sink.json["choices"][0]["message"]["content"] == "cached"
    assert call.cache.result is CacheResult.HIT and call.out.backend == "cache" and call.out.finish is Finish.OK
    assert gw.count("gateway_cache_lookups_total", result="hit") == 1
    assert gw.count("gateway_requests_total", model="m", backend="cache", **{"class": "none"}, cache="hit", code="200") == 1
    # Asked as a stream, the same answer is replayed as one.
    stream_call, streamed = await gw.ask({**body, "stream": True})
    assert len(gw.pool.posts) == 1 and streamed.ended and streamed.chunks[-1].endswith(SSE_DONE)
    assert b'"content":"cached"' in streamed.streamed and stream_call.cache.result is CacheResult.HIT


async def test_a_sampled_request_bypasses_the_cache(gateway):
    gw = gateway(BACKENDS + "models:\n  m: {backends: [a], strategy: ordered}\n", a=[_ok(), _ok()])
    for _ in range(2):
        call, sink = await gw.ask({"model": "m", "messages": MSG, "temperature": 0.7})
        assert sink.headers["x-gateway-cache"] == CacheResult.BYPASS and call.out.backend == "a"
    assert len(gw.pool.posts) == 2


async def test_a_tenant_over_its_rpm_gets_a_429_in_openai_shape_and_nothing_is_posted(gateway):
    policy = TWO + f"tenants:\n  acme: {{key_sha256: ['{_digest(KEY)}'], quota: {{rpm: 1}}}}\n"
    gw = gateway(policy, a=[_ok()])
    call, sink = await gw.ask({"model": "m", "messages": MSG}, key=KEY)
    assert sink.status == 200 and call.tenant is not None and call.tenant.name == "acme" and sink.headers["x-ratelimit-limit-requests"] == "1"
    call, sink = await gw.ask({"model": "m", "messages": MSG}, key=KEY)
    assert sink.status == 429 and call.out.status == 429 and call.out.finish is Finish.ERROR
    error = sink.json["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded" and "rpm" in error["message"]
    assert 1 <= int(sink.headers["Retry-After"]) <= 61 and sink.headers["x-ratelimit-remaining-requests"] == "0"
    assert len(gw.pool.posts) == 1
    assert gw.count("gateway_quota_rejections_total", tenant="acme", limit="rpm") == 1


async def test_an_unknown_key_is_refused_before_anything_else(gateway):
    gw = gateway(TWO + f"tenants:\n  acme: {{key_sha256: ['{_digest(KEY)}']}}\n")
    call, sink = await gw.ask({"model": "m", "messages": MSG}, key="sk-wrong")
    assert sink.status == 401 and sink.json["error"]["code"] == "invalid_api_key" and call.out.status == 401
    assert gw.pool.posts == []


async def test_admission_sheds_at_once_when_its_queue_is_full(gateway):
    gw = gateway(TWO + "admission: {max_inflight: 1, max_queue: 0}\n")
    gate = gw.ctx.admission.gate
    assert gate.try_acquire("default")  # the process's one place is taken
    try:
        started = time.perf_counter()
        call, sink = await gw.ask({"model": "m", "messages": MSG})
    finally:
        gate.release("default")
    assert time.perf_counter() - started < 0.5  # refused now, not after a wait
    assert sink.status == 503 and call.out.status == 503
    assert sink.json["error"]["code"] == "overloaded" and "queue is full" in sink.json["error"]["message"]
    assert int(sink.headers["Retry-After"]) >= 1
    assert gw.pool.posts == []
    assert gw.count("gateway_shed_total", reason="queue_full", priority="default") == 1


async def test_a_request_whose_deadline_has_passed_is_never_sent(gateway):
    gw = gateway(TWO, a=[_ok()])
    call, sink = await gw.ask({"model": "m", "messages": MSG}, timeout_s=-0.001)
    assert sink.status == 504 and call.out.status == 504 and call.out.finish is Finish.ERROR
    assert sink.json["error"]["code"] == "upstream_timeout" and "deadline" in sink.json["error"]["message"]
    assert gw.pool.posts == []


async def test_every_backend_failing_answers_502_naming_each_failure_but_no_address(gateway):
    gw = gateway(TWO, a=[Answer(raises=UpstreamConnectError("connect to 10.1.2.3:443 refused"))],
                 b=[Answer(500, [b"internal secret detail"])])
    call, sink = await gw.ask({"model": "m", "messages": MSG})
    assert sink.status == 502 and call.out.status == 502 and call.out.finish is Finish.ERROR
    error = sink.json["error"]
    assert error["code"] == "upstream_error" and error["type"] == "api_error"
    assert "a: connect failed" in error["message"] and "b: HTTP 500" in error["message"]
    assert "10.1.2.3" not in error["message"] and "secret" not in error["message"]  # the log has them, not the client
    assert call.out.attempts == ["a", "b"] and call.out.error == error["message"]
    assert gw.count("gateway_requests_total", model="m", backend="b", **{"class": "none"}, cache="bypass", code="502") == 1


async def test_every_backend_busy_answers_503_with_the_soonest_retry_after(gateway):
    gw = gateway(TWO, a=[Answer(503, [b"busy"], {"Retry-After": "7"})], b=[Answer(503, [b"busy"], {"Retry-After": "2"})])
    call, sink = await gw.ask({"model": "m", "messages": MSG})
    assert sink.status == 503 and call.out.status == 503
    assert sink.json["error"]["code"] == "backends_busy" and sink.headers["Retry-After"] == "2"
    assert gw.rt.backends["a"].health_for("m").cooling_for() > 5  # each cools down as it asked


async def test_a_4xx_about_the_request_is_passed_back_and_never_tried_elsewhere(gateway):
    rejection = b'{"error": {"message": "content filtered", "type": "invalid_request_error", "code": "content_filter"}}'
    gw = gateway(TWO, a=[Answer(400, [rejection])])
    call, sink = await gw.ask({"model": "m", "messages": MSG})
    assert sink.status == 400 and sink.body == rejection and call.out.status == 400
    assert [p.url for p in gw.pool.posts] == ["http://a.invalid/v1/chat/completions"]


async def test_a_malformed_200_fails_over(gateway):
    gw = gateway(TWO, a=[Answer(200, [b"<html>not json</html>"])], b=[_ok("from b")])
    call, sink = await gw.ask({"model": "m", "messages": MSG})
    assert sink.status == 200 and call.out.backend == "b" and call.out.attempts == ["a", "b"]


async def test_explain_shows_the_stages_view_and_posts_nothing(gateway):
    policy = BACKENDS + "models:\n  m: {simple: [a], complex: [b]}\ncache: {enabled: true}\n"
    gw = gateway(policy)
    call = gw.call({"model": "m", "messages": MSG, "temperature": 0})
    view = await gw.pipeline.explain(call, gw.rt)
    assert gw.pool.posts == []
    assert view["model"] == "m" and view["endpoint"] == "chat" and view["class"] in ("simple", "complex")
    assert view["cache"] == CacheResult.MISS and view["cache_reason"] is None
    assert view["band"] == "default" and view["queue"]["admission_position"] == 0
    expected = "a" if view["class"] == "simple" else "b"  # the class's own list
    assert [c["backend"] for c in view["candidates"]] == [expected] and view["chosen"] == expected
    assert view["candidates"][0]["health"] and view["candidates"][0]["skipped"] is None
    # Nothing taken or counted: no place in admission, no backend slot, no request, no cache lookup.
    assert gw.ctx.admission.gate.used == 0 and all(b.slots.used == 0 for b in gw.rt.backends.values())
    assert gw.total("gateway_requests_total") == 0 and gw.total("gateway_cache_lookups_total") == 0


async def test_explain_says_why_a_request_is_not_cached(gateway):
    gw = gateway(BACKENDS + "models:\n  m: {backends: [a, b], strategy: ordered}\n")
    view = await gw.pipeline.explain(gw.call({"model": "m", "messages": MSG, "temperature": 1}), gw.rt)
    assert view["cache"] == CacheResult.BYPASS and "temperature" in view["cache_reason"]
    assert view["chosen"] == "a" and [c["backend"] for c in view["candidates"]] == ["a", "b"]
    assert gw.pool.posts == []


# ---- the relay ----------------------------------------------------------------------------------


async def test_the_route_s_retry_tries_the_same_backend_again_before_failing_over(gateway):
    policy = BACKENDS + (
        "models:\n  m: {backends: [a, b], strategy: ordered, retry: {attempts: 2, on: [500], backoff_ms: 1}}\n"
        "cache: {enabled: false}\n"
    )
    gw = gateway(policy, a=[Answer(500, [b"oops"]), _ok("second try")])
    call, sink, relay = await gw.relay({"model": "m", "messages": MSG})
    assert sink.status == 200 and sink.json["choices"][0]["message"]["content"] == "second try"
    assert call.out.attempts == ["a", "a"] and relay.tries.count == 2 and gw.pool.to("b.invalid") == []
    assert gw.count("gateway_relay_events_total", event="retry", reason="http_500") == 1
    assert gw.count("gateway_failovers_total", backend="a") == 0  # a retry is not a failover


async def test_a_status_outside_retry_on_fails_over_at_once(gateway):
    policy = BACKENDS + "models:\n  m: {backends: [a, b], strategy: ordered, retry: {attempts: 3, on: [429], backoff_ms: 1}}\n"
    gw = gateway(policy, a=[Answer(502, [b"bad gateway"])], b=[_ok()])
    call, sink, relay = await gw.relay({"model": "m", "messages": MSG})
    assert call.out.attempts == ["a", "b"] and relay.tries.count == 2 and sink.status == 200


async def test_the_relay_raises_all_backends_failed_with_each_failure(gateway):
    gw = gateway(TWO, a=[Answer(raises=UpstreamConnectError("refused"))], b=[Answer(raises=UpstreamConnectError("refused"))])
    with pytest.raises(AllBackendsFailed) as failed:
        await gw.relay({"model": "m", "messages": MSG})
    assert [name for name, _ in failed.value.failures] == ["a", "b"] and failed.value.status == 502


async def test_a_late_first_backend_is_hedged_and_the_faster_answer_wins(gateway):
    policy = BACKENDS + (
        "models:\n  m: {backends: [a, b], strategy: ordered, hedge: {min_delay_ms: 0, default_delay_ms: 20}}\n"
        "cache: {enabled: false}\n"
    )
    gw = gateway(policy, a=[Answer(200, [chat_answer("slow")], delay_s=0.5)], b=[_ok("fast")])
    started = time.perf_counter()
    call, sink, relay = await gw.relay({"model": "m", "messages": MSG})
    assert time.perf_counter() - started < 0.4  # the slow one was not waited for
    assert sink.json["choices"][0]["message"]["content"] == "fast" and sink.headers["x-gateway-backend"] == "b"
    assert relay.progress.owner == "b" and call.out.backend == "b" and sorted(call.out.attempts) == ["a", "b"]
    assert gw.count("gateway_hedges_total", result="started") == 1 and gw.count("gateway_hedges_total", result="won") == 1
    assert gw.rt.backends["a"].slots.used == 0 and gw.rt.backends["b"].slots.used == 0  # both slots given back


async def test_a_context_length_refusal_falls_back_to_a_larger_backend(gateway):
    policy = """
backends:
  a: {url: 'http://a.invalid/v1', models: [m]}
  big: {url: 'http://big.invalid/v1', models: {m: m-large}}
models:
  m: {backends: [a], context_fallbacks: [big]}
cache: {enabled: false}
"""
    too_long = b'{"error": {"message": "maximum context length is 8192 tokens", "code": "context_length_exceeded"}}'
    gw = gateway(policy, a=[Answer(400, [too_long])], big=[_ok("it fits", model="m-large")])
    call, sink, _relay = await gw.relay({"model": "m", "messages": MSG})
    assert sink.status == 200 and sink.json["choices"][0]["message"]["content"] == "it fits"
    assert sink.headers["x-gateway-fallback"] == "context_length" and sink.headers["x-gateway-backend"] == "big"
    assert call.out.attempts == ["a", "big"]
    [sent] = gw.pool.to("big.invalid")
    assert sent.json["model"] == "m-large"  # the larger backend's own name for the model


async def test_a_stream_cut_mid_answer_is_continued_on_the_next_backend(gateway):
    gw = gateway(TWO)
    gw.pool.add("a.invalid", Answer(200, [chat_chunk("Hel"), UpstreamDisconnected("reset by peer")]))
    # b restarts the answer (it takes no prefill): the text the client already has is skipped.
    gw.pool.add("b.invalid", Answer(200, [chat_chunk("Hel"), chat_chunk("lo"), chat_chunk(None, "stop"), b"data: [DONE]\n\n"]))
    call, sink = await gw.ask({"model": "m", "messages": MSG, "stream": True})
    text = "".join(
        (orjson.loads(ev)["choices"][0]["delta"].get("content") or "") for ev in _events(sink.streamed) if ev != b"[DONE]"
    )
    assert text == "Hello" and sink.chunks[-1] == SSE_DONE and call.out.finish is Finish.OK
    assert call.out.attempts == ["a", "b"]
