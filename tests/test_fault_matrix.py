"""The fault matrix: one row per upstream fault, over real sockets, with the official openai SDK.

Each row says, for a primary backend `p` with that fault and a healthy spare `s` behind it (route
order p, s; `ordered` strategy):
- what the client sees: an answer (from which backend), an HTTP error (SDK exception, status), or a
  stream that fails after content (the SDK raises APIError: it never ends like a success);
- what the next request sees (the spare, or the same backend again once the fault is over);
- what `p`'s health and tracker recorded (GET /admin/backends, read with an admin key).

A second table makes the health contract explicit: each outcome -> (counts against health?,
TTFT sample?, teaches the prediction?), each row provoked five times on a live gateway.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gateway.tenants.auth import hash_key

MSG = [{"role": "user", "content": "hi"}]
ADMIN_KEY = "sk-admin-" + secrets.token_hex(16)
ACME_KEY = "sk-acme-" + secrets.token_hex(16)
GLOBEX_KEY = "sk-globex-" + secrets.token_hex(16)

P_TEXT = "w0 w1 w2 w3 "  # the primary answers 4 tokens
S_TEXT = "w0 w1 "  # the spare answers 2: who answered shows in the text too

CONTEXT_LENGTH_BODY = orjson.dumps(
    {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
).decode()
CONTENT_FILTER_BODY = orjson.dumps(
    {
        "error": {
            "message": "The response was filtered due to the prompt triggering the content management policy.",
            "type": None,
            "param": "prompt",
            "code": "content_filter",
            "status": 400,
            "innererror": {"code": "ResponsibleAIPolicyViolation", "content_filter_result": {"hate": {"filtered": True, "severity": "high"}}},
        }
    }
).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_policy(
    backends: dict[str, dict[str, Any]],
    route: list[str],
    *,
    health: dict[str, Any] | None = None,
    server: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A policy with two tenants and an admin key; `route` is the ordered candidate list of gpt-test."""
    return {
        "version": 1,
        "server": {"max_attempts": 3, **(server or {})},
        # Probes off for the length of a test: they would race the passive health we assert on
        # (request probes too: an ejection one tenant's requests caused is probed at once, which
        # tests/test_health_blame.py covers).
        "health": {"failures_to_eject": 3, "eject_ms": 10_000, "probe_interval_ms": 600_000, "recovery_probe_interval_ms": 0,
                   **(health or {})},
        "cache": {"enabled": False},
        "backends": backends,
        "models": {"gpt-test": {"backends": route, "strategy": "ordered"}},
        "tenants": {
            "acme": {"key_sha256": [hash_key(ACME_KEY)]},
            "globex": {"key_sha256": [hash_key(GLOBEX_KEY)]},
        },
        "admin": {"key_sha256": [hash_key(ADMIN_KEY)]},
    }


def backend_entry(up: Any, timeouts: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"url": up.url, "models": ["gpt-test"], **extra}
    if timeouts:
        entry["timeouts"] = timeouts
    return entry


async def admin_backends(gw: Any) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["backends"]


async def metrics_text(gw: Any) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200, await r.text()
            return await r.text()


@dataclass
class Seen:
    """What a client saw of one request that got an HTTP 200."""

    backend: str | None
    text: str
    models: set[str]
    usage: Any
    error: openai.APIError | None  # an in-band error event after the 200
    elapsed_s: float
    continued: dict[str, Any] | None = None  # the finish chunk's x_gateway: a stream continued elsewhere


async def ask(gw: Any, *, stream: bool, key: str = ACME_KEY, headers: dict[str, str] | None = None) -> Seen:
    """One chat completion through the SDK. Errors before the 200 raise the SDK's exception."""
    client = gw.client(key)
    t0 = time.perf_counter()
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, extra_headers=headers)
        r = raw.parse()
        return Seen(raw.headers.get("x-gateway-backend"), r.choices[0].message.content or "", {r.model}, r.usage, None, time.perf_counter() - t0)
    raw = await client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=MSG, stream=True, stream_options={"include_usage": True}, extra_headers=headers
    )
    parts: list[str] = []
    models: set[str] = set()
    usage = None
    error = None
    continued = None
    try:
        async for chunk in raw.parse():
            models.add(chunk.model)
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            continued = (chunk.model_extra or {}).get("x_gateway") or continued
    except openai.APIStatusError:
        raise
    except openai.APIError as exc:
        error = exc
    return Seen(raw.headers.get("x-gateway-backend"), "".join(parts), models, usage, error, time.perf_counter() - t0, continued)


# -- outcomes -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ok:
    """HTTP 200 and a complete answer from `backend` (its text; the SDK sees no error)."""

    backend: str

    async def check(self, gw: Any, stream: bool) -> Seen:
        seen = await ask(gw, stream=stream)
        assert seen.error is None, f"an answer was expected, the stream failed: {seen.error}"
        assert seen.backend == self.backend, f"x-gateway-backend {seen.backend!r}, expected {self.backend!r}"
        assert seen.text == (P_TEXT if self.backend == "p" else S_TEXT)
        return seen


@dataclass(frozen=True)
class Fails:
    """An HTTP error before any byte of an answer: the SDK raises `exc` with `status`."""

    exc: type[openai.APIStatusError]
    status: int
    has: str | tuple[str, ...] = ""  # each in the message, or the error's code
    retry_after: tuple[int, int] | None = None  # bounds of the Retry-After header

    async def check(self, gw: Any, stream: bool) -> None:
        with pytest.raises(self.exc) as info:
            await ask(gw, stream=stream)
        err = info.value
        assert err.status_code == self.status, (err.status_code, err.message)
        assert isinstance(err.body, dict) and "message" in err.body, err.body  # OpenAI-shaped
        for part in (self.has,) if isinstance(self.has, str) else self.has:
            assert part in str(err.message) or err.code == part, (err.code, err.message)
        if self.retry_after is not None:
            lo, hi = self.retry_after
            assert lo <= int(err.response.headers["retry-after"]) <= hi


@dataclass(frozen=True)
class Cut:
    """A 200 stream that fails after content: `partial` arrived, then an error event; the SDK raises
    APIError (a cut stream never ends like a success)."""

    partial: str
    has: str = ""

    async def check(self, gw: Any, stream: bool) -> None:
        assert stream
        seen = await ask(gw, stream=True)
        assert seen.error is not None, f"the stream ended like a success after {seen.text!r}"
        assert seen.text == self.partial
        assert seen.backend == "p"
        if self.has:
            assert self.has in str(seen.error.message), seen.error.message


@dataclass(frozen=True)
class Continued:
    """A 200 stream that broke after content and was continued on the spare: one answer, one
    model name, no error; the spare (no prefill) restarted, and its answer's beginning matched
    what was delivered (the fake upstreams are deterministic)."""

    text: str
    after: str = ""

    async def check(self, gw: Any, stream: bool) -> None:
        assert stream
        seen = await ask(gw, stream=True)
        assert seen.error is None, f"a continued answer was expected, the stream failed: {seen.error}"
        assert seen.text == self.text
        assert seen.backend == "p" and seen.models == {"p-upstream"}  # the first stream's headers and model name
        assert seen.continued is not None and seen.continued["backends"] == ["p", "s"], seen.continued
        assert seen.continued["continued"] == "restart"
        assert self.after in seen.continued["after"], seen.continued


Outcome = Ok | Fails | Cut | Continued


@dataclass(frozen=True)
class Recorded:
    """What /admin/backends shows for `p` after the first phase (None: not asserted)."""

    health: str | tuple[str, ...]
    failures: int  # consecutive_failures
    errors: int | None = None  # tracker errors in the window
    timeouts: int | None = None
    ttft_sample: bool | None = None  # a TTFT sample (ttft_p50_ms set)
    cooling_max_s: float | None = None  # cooling_s in (0, this]; None: cooling_s == 0 unless health says cooling


@dataclass(frozen=True)
class Fault:
    id: str
    primary: dict[str, Any]  # the primary's Behaviour
    client: Outcome  # what each of the first `repeat` requests sees
    recorded: Recorded
    then: Outcome  # the next request, after `between` and `wait_s`
    modes: tuple[str, ...] = ("nonstream", "stream")
    timeouts: dict[str, Any] = field(default_factory=dict)  # the primary's policy timeouts
    spare: bool = True
    repeat: int = 1
    between: dict[str, Any] | None = None  # primary.set(**between) before the next request: the fault is over
    wait_s: float = 0.0
    warmup: bool = False  # one good request through p first (its connection is then pooled)
    p_calls_first: int | None = None  # requests p saw after the first phase (warm-up included)
    p_calls: int | None = None  # requests p saw in all
    min_elapsed_s: float = 0.0  # the first request took at least this long (it waited for a deadline)


FAULTS = [
    Fault(
        "429 with Retry-After: cools, fails over, not asked again meanwhile",
        {"mode": "error_429", "retry_after_s": 30},
        client=Ok("s"),
        recorded=Recorded(health="cooling", failures=0, cooling_max_s=30),
        then=Ok("s"),
        p_calls=1,
    ),
    Fault(
        "429 without Retry-After: a short default pause, then asked again",
        {"mode": "error_429"},
        client=Ok("s"),
        recorded=Recorded(health="cooling", failures=0, cooling_max_s=1.0),
        then=Ok("s"),
        wait_s=1.1,
        p_calls=2,
    ),
    Fault(
        "429 on the only backend: the client gets 429 with its Retry-After",
        {"mode": "error_429", "retry_after_s": 7},
        spare=False,
        client=Fails(openai.RateLimitError, 429, retry_after=(1, 7)),
        recorded=Recorded(health="cooling", failures=0, cooling_max_s=7),
        then=Fails(openai.RateLimitError, 429, retry_after=(1, 7)),
        p_calls=1,
    ),
    *[
        Fault(
            f"{status} once: fails over, then the same backend answers again",
            {"mode": f"error_{status}", "fault_count": 1, **({"retry_after_s": 0.2} if status == 503 else {})},
            client=Ok("s"),
            recorded=Recorded(health=("cooling", "healthy") if status == 503 else "healthy", failures=1, errors=1, ttft_sample=False),
            then=Ok("p"),
            wait_s=0.3 if status == 503 else 0.0,
            p_calls=2,
        )
        for status in (500, 502, 503)
    ],
    *[
        Fault(
            f"{status} persistent: ejected after failures_to_eject, then left alone",
            {"mode": f"error_{status}", **({"retry_after_s": 0} if status == 503 else {})},
            repeat=3,
            client=Ok("s"),
            recorded=Recorded(health="ejected", failures=3, errors=3, ttft_sample=False),
            then=Ok("s"),
            p_calls=3,
        )
        for status in (500, 502, 503)
    ],
    Fault(
        "500 on the only backend: 502 naming the backend's failure",
        {"mode": "error_500"},
        spare=False,
        client=Fails(openai.InternalServerError, 502, has=("p:", "HTTP 500")),  # the message lists each backend's failure
        recorded=Recorded(health="healthy", failures=1, errors=1),
        then=Ok("p"),
        between={"mode": "ok"},
    ),
    Fault(
        "connection reset before headers (fresh connection): fails over, never resent",
        {"mode": "reset"},
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1, ttft_sample=False),
        then=Ok("s"),
        p_calls_first=1,
        p_calls=2,
    ),
    Fault(
        "connection reset before headers (pooled connection): the POST is not resent",
        {"mode": "reset"},
        warmup=True,
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1),
        then=Ok("p"),
        between={"mode": "ok"},
        p_calls_first=2,  # the warm-up and the one that was reset: the provider saw (and bills) it once
        p_calls=3,
    ),
    Fault(
        "connection closed before headers (pooled connection): the POST is not resent",
        {"mode": "close"},
        warmup=True,
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1),
        then=Ok("p"),
        between={"mode": "ok"},
        p_calls_first=2,
        p_calls=3,
    ),
    Fault(
        "accepts and stays silent: abandoned at first_token_ms, fails over",
        {"mode": "hang"},
        timeouts={"first_token_ms": 300, "total_ms": 300},
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1, timeouts=1, ttft_sample=False),
        then=Ok("s"),
        p_calls=2,
        min_elapsed_s=0.3,
    ),
    Fault(
        "slow first token beyond first_token_ms: fails over, then answers again when fast",
        {"ttft_ms": 1500},
        timeouts={"first_token_ms": 300},
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1, timeouts=1, ttft_sample=False),
        then=Ok("p"),
        between={"ttft_ms": 0},
        p_calls=2,
        min_elapsed_s=0.3,
    ),
    *[
        Fault(
            f"stream {what} mid-way: continued on the spare, one answer, never a duplicate",
            {"mode": mode, "fail_after": 2, "fault_count": 1},
            modes=("stream",),
            client=Continued("w0 w1 "),  # the spare's whole answer is the two words p had sent
            recorded=Recorded(health="healthy", failures=1, errors=1),
            then=Ok("p"),
            p_calls=2,
        )
        for what, mode in (("cut (EOF before the finish reason)", "cut"), ("connection dropped", "disconnect"), ("error event", "error_event"))
    ],
    Fault(
        "stream stalls mid-way beyond idle_ms: continued on the spare after the stall",
        {"mode": "stall_mid", "fail_after": 2, "fault_count": 1},
        timeouts={"idle_ms": 300},
        modes=("stream",),
        client=Continued("w0 w1 ", after="stalled"),
        recorded=Recorded(health="healthy", failures=1, errors=1),
        then=Ok("p"),
        p_calls=2,
    ),
    *[
        Fault(
            f"stream {what} mid-way on the only backend: content, then an error event, never a success",
            {"mode": mode, "fail_after": 2, "fault_count": 1},
            modes=("stream",),
            spare=False,
            client=Cut("w0 w1 ", has=has),
            recorded=Recorded(health="healthy", failures=1, errors=1),
            then=Ok("p"),
            p_calls=2,
        )
        for what, mode, has in (("cut (EOF before the finish reason)", "cut", "ended its stream"),
                                ("connection dropped", "disconnect", "lost its connection"),
                                ("error event", "error_event", "error event"))
    ],
    Fault(
        "malformed chunk mid-stream: dropped, the answer completes, not a failure",
        {"mode": "malformed", "fail_after": 1},
        modes=("stream",),
        client=Ok("p"),
        recorded=Recorded(health="healthy", failures=0, errors=0, ttft_sample=True),
        then=Ok("p"),
    ),
    Fault(
        "200 with a malformed body: fails over, counted",
        {"mode": "garbage"},
        modes=("nonstream",),
        client=Ok("s"),
        recorded=Recorded(health="healthy", failures=1, errors=1),
        then=Ok("s"),
        p_calls=2,
    ),
    Fault(
        "missing [DONE] after the finish reason: completed by the gateway, a success",
        {"mode": "no_done"},
        modes=("stream",),
        client=Ok("p"),
        recorded=Recorded(health="healthy", failures=0, errors=0, ttft_sample=True),
        then=Ok("p"),
    ),
    Fault(
        "context length 400: passed back as the backend said it, no failover, no health hit",
        {"mode": "error_400", "error_body": CONTEXT_LENGTH_BODY},
        client=Fails(openai.BadRequestError, 400, has="context_length_exceeded"),
        recorded=Recorded(health="healthy", failures=0, errors=0, ttft_sample=False),
        then=Ok("p"),
        between={"mode": "ok", "error_body": None},
        p_calls=2,
    ),
    Fault(
        "content filter 400: passed back, no failover, no health hit",
        {"mode": "error_400", "error_body": CONTENT_FILTER_BODY},
        client=Fails(openai.BadRequestError, 400, has="content_filter"),
        recorded=Recorded(health="healthy", failures=0, errors=0, ttft_sample=False),
        then=Ok("p"),
        between={"mode": "ok", "error_body": None},
        p_calls=2,
    ),
]


def _params() -> list[Any]:
    out = []
    for f in FAULTS:
        for mode in f.modes:
            out.append(pytest.param(f, mode == "stream", id=f"{f.id.split(':')[0]} [{mode}]"))
    return out


@pytest.mark.parametrize(("fault", "stream"), _params())
async def test_fault_matrix(upstream, gateway, fault: Fault, stream: bool):
    p = await upstream("p", tokens=4, model="p-upstream")
    s = await upstream("s", tokens=2, model="s-upstream")
    backends = {"p": backend_entry(p, fault.timeouts), "s": backend_entry(s)}
    gw = await gateway(make_policy(backends, ["p", "s"] if fault.spare else ["p"]))
    if fault.warmup:
        await Ok("p").check(gw, stream)
    p.set(**fault.primary)
    s_before = s.stats.requests

    # (a) what the client sees
    t0 = time.perf_counter()
    for _ in range(fault.repeat):
        await fault.client.check(gw, stream)
    assert time.perf_counter() - t0 >= fault.min_elapsed_s * fault.repeat * 0.95
    if isinstance(fault.client, (Fails, Cut)) and fault.spare:
        assert s.stats.requests == s_before, "a request that failed (or was cut) for the client was also sent to the spare"
    if isinstance(fault.client, Fails) and fault.client.status == 400:
        assert s.stats.requests == s_before, "a backend's 400 must not fail over"
    if fault.p_calls_first is not None:
        assert p.stats.requests == fault.p_calls_first, "the primary saw the request more than once (resent)"

    # (c) what p's health and tracker recorded
    await asyncio.sleep(0.05)  # an abandoned attempt reports as it unwinds
    rec = fault.recorded
    snap = (await admin_backends(gw))["p"]
    healths = (rec.health,) if isinstance(rec.health, str) else rec.health
    assert snap["health"] in healths, snap
    assert snap["consecutive_failures"] == rec.failures, snap
    if rec.errors is not None:
        assert snap["errors"] == rec.errors, snap
    if rec.timeouts is not None:
        assert snap["timeouts"] == rec.timeouts, snap
    if rec.ttft_sample is not None:
        assert (snap["ttft_p50_ms"] is not None) == rec.ttft_sample, snap
    if rec.cooling_max_s is not None:
        assert 0 < snap["cooling_s"] <= rec.cooling_max_s, snap
    elif "cooling" not in healths:
        assert snap["cooling_s"] == 0, snap
    assert snap["inflight"] == 0, snap
    assert (await admin_backends(gw))["s"]["health"] == "healthy"

    # (b) what the next request sees
    if fault.between is not None:
        p.set(**fault.between)
    if fault.wait_s:
        await asyncio.sleep(fault.wait_s)
    await fault.then.check(gw, stream)
    if fault.p_calls is not None:
        assert p.stats.requests == fault.p_calls, p.stats  # a warm-up request included
    after = await admin_backends(gw)
    assert after["p"]["inflight"] == 0 and after["s"]["inflight"] == 0
    if isinstance(fault.then, Ok) and fault.then.backend == "p":
        assert after["p"]["health"] == "healthy" and after["p"]["consecutive_failures"] == 0, after["p"]


# -- failover accounting ---------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
async def test_failover_accounting_names_the_backend_that_answered(upstream, gateway, stream):
    """After a failover, the `model`, `usage` and x-gateway-backend are the spare's, never a mix:
    the primary's held role chunk (sent before it failed) never reaches the client."""
    # The primary sends its role chunk (model p-upstream), then fails before the first token.
    p = await upstream("p", tokens=4, model="p-upstream", mode="error_event" if stream else "error_500", fail_after=0)
    s = await upstream("s", tokens=2, model="s-upstream")
    gw = await gateway(make_policy({"p": backend_entry(p), "s": backend_entry(s)}, ["p", "s"]))
    seen = await ask(gw, stream=stream)
    assert seen.error is None
    assert seen.backend == "s"
    assert seen.models == {"s-upstream"}, seen.models
    assert seen.text == S_TEXT
    assert seen.usage is not None and seen.usage.completion_tokens == 2, seen.usage
    assert p.stats.requests == 1 and s.stats.requests == 1
    tokens = [line for line in (await metrics_text(gw)).splitlines() if line.startswith("gateway_tokens_total{")]
    assert any('backend="s"' in line and 'kind="completion"' in line and line.endswith(" 2.0") for line in tokens), tokens
    assert not any('backend="p"' in line for line in tokens), tokens
    requests = [line for line in (await metrics_text(gw)).splitlines() if line.startswith("gateway_requests_total{")]
    assert any('backend="s"' in line for line in requests) and not any('backend="p"' in line for line in requests), requests


# -- a flapping primary ------------------------------------------------------------------------------


async def test_a_flapping_primary_never_fails_a_client_and_is_used_again_when_it_settles(upstream, gateway):
    """The primary alternates 400 ms healthy / 400 ms answering 500 for ~2.4 s. Every client request
    is answered (from p or the spare, consistently labelled); once p settles, it is healthy and
    answers again within a couple of seconds."""
    p = await upstream("p", tokens=4, model="p-upstream")
    s = await upstream("s", tokens=2, model="s-upstream")
    gw = await gateway(
        make_policy(
            {"p": backend_entry(p), "s": backend_entry(s)},
            ["p", "s"],
            health={"failures_to_eject": 2, "eject_ms": 300, "max_eject_ms": 600},
        )
    )
    p.set(mode="error_500", flap_ms=400)
    who: list[str] = []
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < 2.4:
        seen = await ask(gw, stream=i % 2 == 1)
        assert seen.error is None
        assert seen.backend in ("p", "s")
        assert seen.text == (P_TEXT if seen.backend == "p" else S_TEXT), seen
        assert seen.models == {f"{seen.backend}-upstream"}, seen
        who.append(seen.backend)
        i += 1
        await asyncio.sleep(0.02)
    assert "p" in who and "s" in who, who
    assert p.stats.faults > 0
    # p settles: within ~2 s it is tried (half-open), succeeds, and is healthy for everyone.
    p.set(mode="ok", flap_ms=0)
    deadline = time.monotonic() + 2.5
    while True:
        seen = await ask(gw, stream=False, key=GLOBEX_KEY)
        if seen.backend == "p":
            break
        assert time.monotonic() < deadline, "the primary was not used again after it settled"
        await asyncio.sleep(0.05)
    snap = (await admin_backends(gw))["p"]
    assert snap["health"] == "healthy" and snap["consecutive_failures"] == 0, snap
    assert snap["inflight"] == 0


# -- the health contract: what counts against a backend, and what feeds its tracker ---------------------


@dataclass(frozen=True)
class HealthRow:
    outcome: str
    counts: bool  # counts against health (5 such outcomes eject the backend)
    ttft_sample: bool  # a TTFT sample in the tracker's window
    learns: bool  # teaches the TTFT prediction (predicted_ttft_ms set)
    behaviour: dict[str, Any] = field(default_factory=dict)
    timeouts: dict[str, Any] = field(default_factory=dict)
    stream: bool = True
    headers: dict[str, str] | None = None
    client_status: int | None = None  # what each caller gets (None: not asserted here)
    next_backend: str = "b"  # who answers a normal request from another tenant afterwards
    health: tuple[str, ...] = ("healthy",)  # b's state afterwards
    tracker_errors: int | None = None  # tracker errors for b afterwards
    n: int = 5


HEALTH_TABLE = [
    HealthRow("a streamed success (control)", counts=False, ttft_sample=True, learns=True, tracker_errors=0, client_status=200),
    HealthRow("backend 5xx", counts=True, ttft_sample=False, learns=False, behaviour={"mode": "error_500"}, next_backend="s", health=("ejected",)),
    HealthRow("connection refused", counts=True, ttft_sample=False, learns=False, next_backend="s", health=("ejected",)),
    HealthRow(
        "timeout by the backend's own first_token_ms",
        counts=True,
        ttft_sample=False,
        learns=True,  # a censored sample: the timeout is a lower bound that raises the prediction
        behaviour={"ttft_ms": 800},
        timeouts={"first_token_ms": 150},
        next_backend="s",
        health=("ejected",),
    ),
    HealthRow(
        "timeout by the caller's x-request-timeout-ms (stream)",
        counts=False,
        ttft_sample=False,
        learns=False,
        behaviour={"ttft_ms": 300},
        headers={"x-request-timeout-ms": "50"},
        client_status=504,
        tracker_errors=0,
    ),
    HealthRow(
        "timeout by the caller's x-request-timeout-ms (non-stream)",
        counts=False,
        ttft_sample=False,
        learns=False,
        stream=False,
        behaviour={"ttft_ms": 300},
        headers={"x-request-timeout-ms": "50"},
        client_status=504,
        tracker_errors=0,
    ),
    HealthRow("client disconnect before the first token", counts=False, ttft_sample=False, learns=False, behaviour={"ttft_ms": 3000}, tracker_errors=0),
    HealthRow("upstream 404 for the path", counts=False, ttft_sample=False, learns=False, behaviour={"mode": "error_404", "error_body": "404: Not Found"}),
    HealthRow(
        "upstream 405 for the path",
        counts=False,
        ttft_sample=False,
        learns=False,
        behaviour={"mode": "error_405", "error_body": "405: Method Not Allowed"},
    ),
    HealthRow(
        "429 (cooling, not ejection)",
        counts=False,
        ttft_sample=False,
        learns=False,
        behaviour={"mode": "error_429", "retry_after_s": 30},
        next_backend="s",
        health=("cooling",),
    ),
    HealthRow(
        "400 (passed back, not counted)",
        counts=False,
        ttft_sample=False,
        learns=False,
        behaviour={"mode": "error_400", "error_body": CONTEXT_LENGTH_BODY},
        client_status=400,
        tracker_errors=0,
    ),
]


async def _provoke(gw: Any, b: Any, row: HealthRow) -> str | None:
    """One occurrence of the row's outcome on backend b; the error message the client got, if any."""
    if row.outcome.startswith("client disconnect"):
        body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
        async with aiohttp.ClientSession() as http:
            before = b.stats.cancelled
            task = asyncio.create_task(
                http.post(gw.url + "/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {ACME_KEY}"})
            )
            end = time.monotonic() + 2
            while b.stats.active == 0:
                assert time.monotonic() < end, "the request never reached the backend"
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        end = time.monotonic() + 2
        while b.stats.cancelled == before:
            assert time.monotonic() < end, "the upstream request was not cancelled"
            await asyncio.sleep(0.005)
        return None
    message = None
    try:
        seen = await ask(gw, stream=row.stream, headers=row.headers)
        status = 200
        assert seen.error is None or row.client_status is None, seen.error
    except openai.APIStatusError as exc:
        status = exc.status_code
        message = exc.message
        assert isinstance(exc.body, dict) and "message" in exc.body, exc.body
    if row.client_status is not None:
        assert status == row.client_status, (status, message)
    return message


@pytest.mark.parametrize("row", HEALTH_TABLE, ids=[r.outcome for r in HEALTH_TABLE])
async def test_health_contract(upstream, gateway, row: HealthRow):
    """Each outcome, five times on backend b (route b, s): does it count against b's health, is it a
    TTFT sample, does it teach the prediction; and does a normal request from another tenant still
    reach b afterwards?"""
    b = await upstream("b", tokens=4, model="b-upstream")
    s = await upstream("s", tokens=2, model="s-upstream")
    entry = backend_entry(b, row.timeouts)
    if row.outcome == "connection refused":
        entry["url"] = f"http://127.0.0.1:{_free_port()}/v1"
    gw = await gateway(make_policy({"b": entry, "s": backend_entry(s)}, ["b", "s"]))
    b.set(**row.behaviour)
    n = 3 if row.counts else row.n  # failures_to_eject: 3
    messages = [await _provoke(gw, b, row) for _ in range(n)]
    await asyncio.sleep(0.05)
    snap = (await admin_backends(gw))["b"]
    assert snap["inflight"] == 0, snap
    if row.counts:
        assert snap["consecutive_failures"] >= 3 and snap["health"] == "ejected", snap
    else:
        assert snap["consecutive_failures"] == 0, snap
        assert snap["health"] in row.health, snap
    assert (snap["ttft_p50_ms"] is not None) == row.ttft_sample, snap
    assert (snap["predicted_ttft_ms"] is not None) == row.learns, snap
    if row.tracker_errors is not None:
        assert snap["errors"] == row.tracker_errors and snap["timeouts"] == 0, snap
    # A normal request from another tenant: b still answers unless its own failures took it out.
    b.set(mode="ok", ttft_ms=0, error_body=None)
    seen = await ask(gw, stream=False, key=GLOBEX_KEY)
    assert seen.error is None and seen.backend == row.next_backend, (seen.backend, snap)
    if row.headers and "x-request-timeout-ms" in row.headers:
        # the 504 says what the caller's deadline was (not "within 0 ms" or a rounded-down figure)
        asked = row.headers["x-request-timeout-ms"]
        assert all(m is not None and f"{asked} ms" in m for m in messages), messages


# -- endpoints a route cannot serve ------------------------------------------------------------------------


async def test_embeddings_on_a_route_without_embeddings_is_a_4xx_before_any_upstream_call(upstream, gateway):
    """Backends serve chat and completions unless their `endpoints:` says more: embeddings on such a
    route are refused from the policy, no backend is called, and nothing is counted against one
    (the SDK's own retries of it included)."""
    # Like most chat servers (the local model server among them), these have no /v1/embeddings route.
    a = await upstream("a", tokens=2, endpoints=("chat", "completions", "models"))
    b = await upstream("b", tokens=2, endpoints=("chat", "completions", "models"))
    gw = await gateway(make_policy({"a": backend_entry(a), "b": backend_entry(b)}, ["a", "b"]))
    client = gw.client(ACME_KEY)
    for _ in range(5):
        with pytest.raises(openai.APIStatusError) as info:
            await client.embeddings.create(model="gpt-test", input="hello")
        assert 400 <= info.value.status_code < 500, (info.value.status_code, info.value.message)
        assert isinstance(info.value.body, dict) and "message" in info.value.body
    assert a.stats.by_path.get("/v1/embeddings", 0) == 0 and b.stats.by_path.get("/v1/embeddings", 0) == 0
    snaps = await admin_backends(gw)
    for name in ("a", "b"):
        assert snaps[name]["health"] == "healthy" and snaps[name]["consecutive_failures"] == 0, snaps[name]
        assert snaps[name]["requests"] == 0, snaps[name]
    r = await client.chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 w1 "


async def test_embeddings_go_only_to_backends_that_list_them(upstream, gateway):
    chat_only = await upstream("chat_only", tokens=2)
    embed = await upstream("embed", tokens=2)
    backends = {
        "chat_only": backend_entry(chat_only),
        "embed": backend_entry(embed, endpoints=["chat", "completions", "embeddings"]),
    }
    gw = await gateway(make_policy(backends, ["chat_only", "embed"]))
    client = gw.client(ACME_KEY)
    raw = await client.embeddings.with_raw_response.create(model="gpt-test", input=["a", "b"])
    assert len(raw.parse().data) == 2
    assert raw.headers["x-gateway-backend"] == "embed"
    assert chat_only.stats.by_path.get("/v1/embeddings", 0) == 0 and embed.stats.embeddings == 1
    snap = (await admin_backends(gw))["chat_only"]
    assert snap["health"] == "healthy" and snap["consecutive_failures"] == 0
