"""The rescue suite: one row per upstream fault, over real sockets with the official openai SDK.

Every row asserts that the client gets the complete answer, byte-identical to what an unfaulted
backend gives (the fake upstreams are deterministic: w0 w1 ... w11), plus the attempts each
backend saw (and whether they were prefills), the gaps between them, the headers and the usage.
Primary `p`, fallback `s` (route order p, s); `s` takes an assistant prefill unless a row says not.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import openai
import orjson
import pytest

MSG = [{"role": "user", "content": "count"}]
N = 12
ANSWER = "".join(f"w{i} " for i in range(N))  # what an unfaulted backend answers

CONTEXT_LENGTH = orjson.dumps({"error": {"message": "This model's maximum context length is 8192 tokens.",
                                         "type": "invalid_request_error", "param": "messages",
                                         "code": "context_length_exceeded"}}).decode()
CONTENT_FILTER = orjson.dumps({"error": {"message": "The response was filtered due to the prompt triggering the content policy.",
                                         "type": "invalid_request_error", "param": "prompt", "code": "content_filter"}}).decode()


@dataclass(frozen=True)
class Row:
    id: str
    p: dict[str, Any]  # the primary's Behaviour
    backend: str | None  # x-gateway-backend of the answer (None: the client gets an error, `error`)
    p_calls: int
    s_calls: int
    s_prefill: int = 0  # of s's calls, how many were continuations with a prefill
    route: dict[str, Any] = field(default_factory=dict)  # extra keys of the model route
    routing: dict[str, Any] = field(default_factory=dict)
    p_timeouts: dict[str, Any] = field(default_factory=dict)
    s: dict[str, Any] = field(default_factory=dict)  # the fallback's Behaviour
    s_entry: dict[str, Any] = field(default_factory=dict)
    gap: tuple[float, float] | None = None  # seconds between the first and the second upstream call
    within_s: float = 5.0  # the complete answer arrives within this
    continued: str | None = None  # x_gateway "continued" mode on the finish chunk
    error: tuple[int, str] | None = None  # status and code when the right answer is the backend's 400
    header: tuple[str, str] | None = None
    modes: tuple[bool, ...] = (False, True)  # stream?


RETRY = {"retry": {"attempts": 2, "on": [429, 500, 502, 503, "reset"], "max_wait_ms": 3000, "backoff_ms": 200}}
ROWS = [
    Row("429 with Retry-After: 1, retry configured: the primary again after its pause",
        {"mode": "error_429", "retry_after_s": 1, "fault_count": 1}, "p", 2, 0, route=RETRY, gap=(0.9, 2.0)),
    Row("429 with Retry-After: 30 (beyond max_wait_ms): the fallback at once",
        {"mode": "error_429", "retry_after_s": 30}, "s", 1, 1, route=RETRY, gap=(0.0, 0.5)),
    Row("429 without Retry-After: a short default pause, then the primary again",
        {"mode": "error_429", "fault_count": 1}, "p", 2, 0, route=RETRY, gap=(0.9, 2.0)),
    Row("500 once: one retry on the same backend after the back-off",
        {"mode": "error_500", "fault_count": 1}, "p", 2, 0, route=RETRY, gap=(0.1, 0.6)),
    Row("500 persistent: one retry, then the fallback",
        {"mode": "error_500"}, "s", 2, 1, route=RETRY),
    Row("connection reset before headers: one retry (reset), then the fallback",
        {"mode": "reset"}, "s", 2, 1, route=RETRY),
    Row("silent upstream with no latency history: the cold first-token deadline, then the fallback",
        {"mode": "hang"}, "s", 1, 1, routing={"cold_first_token_ms": 400}, gap=(0.35, 1.5)),
    Row("slow first token (3 s) with no history: abandoned at the cold deadline",
        {"ttft_ms": 3000}, "s", 1, 1, routing={"cold_first_token_ms": 400}, gap=(0.35, 1.5), within_s=2.5),
    Row("stream cut mid-answer: continued on the fallback with a prefill",
        {"mode": "cut", "fail_after": 5, "fault_count": 1}, "p", 1, 1, s_prefill=1, continued="prefill", modes=(True,)),
    Row("stream connection dropped mid-answer: continued with a prefill",
        {"mode": "disconnect", "fail_after": 5, "fault_count": 1}, "p", 1, 1, s_prefill=1, continued="prefill", modes=(True,)),
    Row("stream stalls mid-answer: the stall is noticed (cold_idle_ms), continued with a prefill",
        {"mode": "stall_mid", "fail_after": 5, "fault_count": 1}, "p", 1, 1, s_prefill=1, continued="prefill",
        routing={"cold_idle_ms": 500}, modes=(True,), gap=(0.45, 2.0)),
    Row("error event mid-answer: continued with a prefill",
        {"mode": "error_event", "fail_after": 5, "fault_count": 1}, "p", 1, 1, s_prefill=1, continued="prefill", modes=(True,)),
    Row("fallback rejects prefill (prefill: false): restarted, the delivered words skipped",
        {"mode": "cut", "fail_after": 5, "fault_count": 1}, "p", 1, 1, continued="restart", s_entry={"prefill": False},
        modes=(True,)),
    Row("fallback claims prefill but answers 400 to it: restarted on it, never the 400",
        {"mode": "cut", "fail_after": 5, "fault_count": 1}, "p", 1, 2, s_prefill=1, continued="restart",
        s={"prefill": False}, s_entry={"prefill": True}, modes=(True,)),
    Row("malformed chunk mid-stream: dropped, the answer completes",
        {"mode": "malformed", "fail_after": 3}, "p", 1, 0, modes=(True,)),
    Row("missing [DONE]: completed by the gateway",
        {"mode": "no_done"}, "p", 1, 0, modes=(True,)),
    Row("context length exceeded: the larger-context fallback answers",
        {"mode": "error_400", "error_body": CONTEXT_LENGTH}, "s", 1, 1, header=("x-gateway-fallback", "context_length")),
    Row("content filter: the backend's 400 passed back, no failover",
        {"mode": "error_400", "error_body": CONTENT_FILTER}, None, 1, 0, error=(400, "content_filter")),
]


def _policy(p: Any, s: Any, row: Row) -> dict[str, Any]:
    ctx = "error_body" in row.p and "context_length" in str(row.p.get("error_body"))
    route: dict[str, Any] = {"backends": ["p"] if ctx else ["p", "s"], "strategy": "ordered", **row.route}
    if ctx:
        route["context_fallbacks"] = ["s"]
    return {
        "version": 1,
        "cache": {"enabled": False},
        "health": {"probe_interval_ms": 600_000},
        "routing": row.routing,
        "backends": {
            "p": {"url": p.url, "models": ["m"], **({"timeouts": row.p_timeouts} if row.p_timeouts else {})},
            "s": {"url": s.url, "models": {"m": "m-large"}, "prefill": True, **row.s_entry},
        },
        "models": {"m": route},
    }


async def _ask(gw: Any, stream: bool) -> tuple[str, dict[str, str], Any, dict[str, Any] | None, set[str]]:
    client = gw.client()
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(model="m", messages=MSG)
        r = raw.parse()
        return r.choices[0].message.content or "", dict(raw.headers), r.usage, None, {r.id}
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=MSG, stream=True, stream_options={"include_usage": True}
    )
    text, usage, x, ids = "", None, None, set()
    async for chunk in raw.parse():
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        x = (chunk.model_extra or {}).get("x_gateway") or x
    return text, dict(raw.headers), usage, x, ids


def _params() -> list[Any]:
    return [pytest.param(r, st, id=f"{r.id.split(':')[0]} [{'stream' if st else 'json'}]") for r in ROWS for st in r.modes]


@pytest.mark.parametrize(("row", "stream"), _params())
async def test_rescue(upstream, gateway, row: Row, stream: bool):
    p = await upstream("p", tokens=N, **row.p)
    s = await upstream("s", tokens=N, **row.s)
    gw = await gateway(_policy(p, s, row))
    t0 = time.perf_counter()
    if row.error is not None:
        with pytest.raises(openai.APIStatusError) as info:
            await _ask(gw, stream)
        assert info.value.status_code == row.error[0] and info.value.code == row.error[1], info.value
    else:
        text, headers, usage, x, ids = await _ask(gw, stream)
        elapsed = time.perf_counter() - t0
        assert text == ANSWER, f"{text!r} is not the unfaulted answer"
        assert headers.get("x-gateway-backend") == row.backend, headers
        assert elapsed < row.within_s, elapsed
        assert usage is not None and usage.completion_tokens == N, usage  # the whole answer's tokens
        assert len(ids) == 1  # one id for the whole answer, continuations included
        if row.header is not None:
            assert headers.get(row.header[0]) == row.header[1], headers
        if row.continued is not None:
            assert x is not None and x["continued"] == row.continued and x["backends"] == ["p", "s"], x
        else:
            assert x is None, x
    await asyncio.sleep(0.05)
    assert len(p.stats.calls) == row.p_calls, p.stats.calls
    assert len(s.stats.calls) == row.s_calls, s.stats.calls
    assert sum(1 for c in s.stats.calls if c[2]) == row.s_prefill, s.stats.calls
    if row.gap is not None:
        calls = sorted(c[0] for c in p.stats.calls + s.stats.calls)
        gap = calls[1] - calls[0]
        assert row.gap[0] <= gap <= row.gap[1], f"gap {gap:.3f} s between the first two upstream calls"


async def test_a_continued_stream_is_byte_identical_to_an_unfaulted_one(upstream, gateway):
    """The raw SSE bodies: after the cut, the client's bytes continue as if nothing happened
    (same id, model and created on every event; one role event; [DONE] once)."""
    p = await upstream("p", tokens=N, mode="cut", fail_after=4, fault_count=1)
    s = await upstream("s", tokens=N)
    gw = await gateway(_policy(p, s, Row("x", {}, "p", 1, 1)))
    body = orjson.dumps({"model": "m", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=body) as r:
            raw = await r.read()
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"[DONE]") == 1
    assert len({(e["id"], e["model"], e["created"]) for e in events}) == 1
    assert sum(1 for e in events if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == ANSWER


async def test_a_restart_that_answers_differently_ends_with_the_original_error(upstream, gateway):
    """No prefill, and the fallback's answer does not begin with the delivered text: never a
    spliced answer; the error event names the original failure."""
    p = await upstream("p", tokens=N, mode="cut", fail_after=4, fault_count=1)
    s = await upstream("s", tokens=N, model="other")
    gw = await gateway(_policy(p, s, Row("x", {}, "p", 1, 1, s_entry={"prefill": False})))
    s.set(tokens=2)  # its whole answer ("w0 w1 ") is shorter than what was delivered
    parts = []
    with pytest.raises(openai.APIError) as info:
        stream = await gw.client().chat.completions.create(model="m", messages=MSG, stream=True)
        async for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
    assert "".join(parts) == "w0 w1 w2 w3 "
    assert "ended its stream" in info.value.message and "could not be continued" in info.value.message


async def test_a_429_on_one_model_leaves_the_others_of_a_shared_provider_alone(upstream, gateway):
    """One provider backend serving three models: its 429 (Retry-After: 30) on model a cools only
    (provider, a); b and c keep answering from it, and a goes to its fallback."""
    prov = await upstream("prov", tokens=N)
    spare = await upstream("spare", tokens=N)
    policy = {
        "version": 1,
        "cache": {"enabled": False},
        "health": {"probe_interval_ms": 600_000},
        "backends": {
            "prov": {"url": prov.url, "models": ["a", "b", "c"]},
            "spare": {"url": spare.url, "models": ["a"]},
        },
        "models": {"a": {"backends": ["prov", "spare"], "strategy": "ordered"}},
    }
    gw = await gateway(policy)
    client = gw.client()
    prov.set(mode="error_429", retry_after_s=30, fault_count=1)
    raw = await client.chat.completions.with_raw_response.create(model="a", messages=MSG)
    assert raw.headers["x-gateway-backend"] == "spare"
    for model in ("b", "c"):
        raw = await client.chat.completions.with_raw_response.create(model=model, messages=MSG)
        assert raw.headers["x-gateway-backend"] == "prov" and raw.parse().choices[0].message.content == ANSWER
    raw = await client.chat.completions.with_raw_response.create(model="a", messages=MSG)
    assert raw.headers["x-gateway-backend"] == "spare"  # a stays paused on prov
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends") as r:
            models = (await r.json())["backends"]["prov"]["models"]
    assert models["a"]["health"] == "cooling" and 25 < models["a"]["cooling_s"] <= 30
    assert models["b"]["health"] == models["c"]["health"] == "healthy"


async def test_a_flapping_primary_never_costs_an_answer(upstream, gateway):
    """The primary alternates 100 ms healthy / 100 ms failing (500s, streams cut mid-way): every
    request, streamed or not, gets the complete answer."""
    p = await upstream("p", tokens=N, itl_ms=5, mode="disconnect", fail_after=3, flap_ms=100)
    s = await upstream("s", tokens=N)
    gw = await gateway(_policy(p, s, Row("x", {}, "p", 1, 1)))
    for i in range(24):
        text, headers, _, _, _ = await _ask(gw, stream=i % 2 == 1)
        assert text == ANSWER, (i, text)
        if i == 11:
            p.set(mode="error_500")  # the flapping goes on as 500s
        await asyncio.sleep(0.02)
    assert p.stats.faults > 0 and s.stats.requests > 0


async def test_failover_accounting(upstream, gateway):
    """After a retry, a failover, a continuation and a context fallback: attempts, failovers,
    relay events and upstream errors are counted once each, by reason."""
    p = await upstream("p", tokens=N)
    s = await upstream("s", tokens=N)
    row = Row("x", {}, "p", 1, 1, route=RETRY)
    gw = await gateway(_policy(p, s, row))
    p.set(mode="error_500")  # retried once, then s
    assert (await _ask(gw, False))[0] == ANSWER
    p.set(mode="cut", fail_after=5, fault_count=1)  # continued on s
    assert (await _ask(gw, True))[0] == ANSWER
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    expect = [
        'gateway_relay_events_total{event="retry",reason="http_500"} 1.0',
        'gateway_relay_events_total{event="failover",reason="http_500"} 1.0',
        'gateway_relay_events_total{event="continuation",reason="prefill"} 1.0',
        'gateway_upstream_errors_total{backend="p",kind="http_500"} 2.0',
        'gateway_upstream_errors_total{backend="p",kind="cut_mid_stream"} 1.0',
        'gateway_failovers_total{backend="s"} 1.0',
    ]
    for line in expect:
        assert line in text, line
    assert len(p.stats.calls) == 3 and len(s.stats.calls) == 2


async def test_a_context_fallback_may_serve_the_same_model_name_on_another_backend(upstream, gateway):
    """A larger deployment of the same model (say, a longer max_model_len): the same name on another
    backend is another model as far as the context window goes; the same backend is never asked twice."""
    p = await upstream("p", tokens=N, mode="error_400", error_body=CONTEXT_LENGTH)
    s = await upstream("s", tokens=N)
    policy = _policy(p, s, Row("x", {}, "s", 1, 1))
    policy["backends"]["s"]["models"] = ["m"]
    policy["models"]["m"] = {"backends": ["p"], "context_fallbacks": ["p", "s"]}
    policy["backends"]["p"]["models"] = ["m"]
    gw = await gateway(policy)
    raw = await gw.client().chat.completions.with_raw_response.create(model="m", messages=MSG)
    assert raw.headers["x-gateway-backend"] == "s" and raw.headers["x-gateway-fallback"] == "context_length"
    assert raw.parse().choices[0].message.content == ANSWER
    assert len(p.stats.calls) == 1 and len(s.stats.calls) == 1


@pytest.mark.parametrize("prompt", [[101, 102, 103], [[101, 102, 103]], ["Tell me a story: "]],
                         ids=["token ids", "one token array in a list", "one prompt in a list"])
async def test_a_completion_whose_prompt_is_not_one_string_is_continued_by_restart(upstream, gateway, prompt):
    """A prefill appends the delivered text to the prompt: a token-id prompt (or a list) went on as
    its Python text, "[101, 102, 103]w0 w1 w2 ", and the client got an answer spliced onto another
    prompt (review helper's repro). Such a request restarts on the next backend instead."""
    p = await upstream("p", mode="cut", fail_after=3, fault_count=1, tokens=8)
    s = await upstream("s", tokens=8)
    gw = await gateway({
        "version": 1, "cache": {"enabled": False}, "health": {"probe_interval_ms": 600_000},
        "backends": {"p": {"url": p.url, "models": ["m"]}, "s": {"url": s.url, "models": ["m"], "prefill": True}},
        "models": {"m": {"backends": ["p", "s"], "strategy": "ordered"}},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/completions", json={"model": "m", "prompt": prompt, "stream": True, "max_tokens": 8}) as r:
            raw = await r.read()
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(c["text"] for e in events for c in e.get("choices", []))
    assert s.stats.requests == 1 and s.stats.last_body["prompt"] == prompt  # sent as it came
    assert text == " ".join(f"w{i}" for i in range(8)) + " " and raw.endswith(b"data: [DONE]\n\n")


async def test_a_restart_that_regenerates_a_long_answer_is_not_cut_by_the_first_token_deadline(upstream, gateway):
    """A restart regenerates what the client already has before its first new token: those
    events did not move the pump's timer, so the first-token deadline (1 s here) ran over 40
    tokens at 40 ms, cut the answer and counted against the healthy backend continuing it
    (review helper's repro). The backend's output keeps it alive: the stall deadline applies."""
    p = await upstream("p", tokens=60, itl_ms=5, mode="cut", fail_after=40, fault_count=1)
    s = await upstream("s", tokens=60, itl_ms=40)
    gw = await gateway({
        "version": 1, "cache": {"enabled": False}, "health": {"probe_interval_ms": 600000},
        "backends": {"p": {"url": p.url, "models": ["m"]},
                     "s": {"url": s.url, "models": ["m"], "prefill": False, "timeouts": {"first_token_ms": 1000}}},
        "models": {"m": {"backends": ["p", "s"], "strategy": "ordered"}},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "stream": True}) as r:
            raw = await r.read()
        async with http.get(gw.url + "/metrics") as r:
            metrics = await r.text()
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-300:]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == "".join(f"w{i} " for i in range(60))
    assert 'upstream_errors_total{backend="s"' not in metrics


@pytest.mark.parametrize("first", ["fails_before_content", "loses_the_hedge"])
async def test_a_continued_stream_keeps_the_identity_of_the_backend_the_client_saw(upstream, gateway, first):
    """The transcript noted events held before an attempt's first output: an attempt that failed
    before any content (a role chunk, then an error event), or a hedge's loser, gave the continued
    stream its id and model from the cut on (review helper's repro). Only what reached the client counts."""
    if first == "fails_before_content":
        p = await upstream("p", tokens=8, mode="error_event", fail_after=0, model="p-model")
        hedge: dict[str, Any] = {}
    else:
        p = await upstream("p", tokens=8, ttft_ms=1500, model="p-model")
        hedge = {"hedge": {"default_delay_ms": 100, "min_delay_ms": 10, "max_extra_pct": 100}}
    s = await upstream("s", tokens=8, mode="cut", fail_after=3, model="s-model")
    t = await upstream("t", tokens=8, model="t-model")
    gw = await gateway({
        "version": 1, "cache": {"enabled": False}, "health": {"probe_interval_ms": 600000},
        "backends": {n: {"url": u.url, "models": ["m"], "prefill": True} for n, u in (("p", p), ("s", s), ("t", t))},
        "models": {"m": {"backends": ["p", "s", "t"], "strategy": "ordered", **hedge}},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": MSG, "stream": True}) as r:
            raw = await r.read()
    events = [orjson.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
    assert {(e["id"], e["model"]) for e in events} == {(events[0]["id"], "s-model")}
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == "".join(f"w{i} " for i in range(8))
    (backends,) = [e["x_gateway"]["backends"] for e in events if e.get("x_gateway")]
    assert backends[0] == "s" and len(backends) == 2  # s's answer, continued on another: p never reached the client first


@pytest.mark.parametrize("prefix", ["w0 w1 ", [{"type": "text", "text": "w0 "}, {"type": "text", "text": "w1 "}]], ids=["text", "parts"])
async def test_a_clients_own_prefill_is_continued_as_one_assistant_turn(upstream, gateway, prefix):
    """A chat request ending in the client's own assistant turn (its prefill), cut mid-answer:
    the continuation put the delivered text in a second assistant turn after the client's, which
    a backend reads as a closed turn (the fake repeated "w3 w4" at the seam; review helper's
    repro). The delivered text extends the client's turn: the answer is the unfaulted one's."""
    p = await upstream("p", tokens=N, mode="cut", fail_after=5, fault_count=1)
    s = await upstream("s", tokens=N)
    gw = await gateway(_policy(p, s, Row("x", {}, "p", 1, 1)))
    messages = [*MSG, {"role": "assistant", "content": prefix}]
    raw = await gw.client().chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
    text = "".join([c.choices[0].delta.content or "" async for c in raw if c.choices])
    assert text == "".join(f"w{i} " for i in range(2, N))
    sent = s.stats.last_body["messages"]
    assert len(sent) == 2 and sent[-1]["role"] == "assistant"  # one turn: the client's, extended
