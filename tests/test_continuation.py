"""Unit tests of the rescue parts without sockets: relay/continuation.py, per-model health, the retry
rule, context-length detection and the policy keys (`prefill`, `retry`, `context_fallbacks`)."""

from __future__ import annotations

import orjson
import pytest

from gateway.wire.chat import CHAT, COMPLETIONS
from gateway.relay.refusal import context_length as _context_length
from gateway.relay.continuation import Mismatch, Resume, Transcript
from gateway.routing.health import Health
from gateway.config.policy import PolicyError, parse_policy


def _chunk(text: str | None = None, *, role: bool = False, finish: str | None = None, usage: dict | None = None,
           cid: str = "c1", model: str = "m1") -> dict:
    delta: dict = {}
    if role:
        delta["role"] = "assistant"
    if text is not None:
        delta["content"] = text
    choices = [] if usage is not None and text is None and not finish else [{"index": 0, "delta": delta, "finish_reason": finish}]
    out = {"id": cid, "object": "chat.completion.chunk", "created": 7, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


def _delivered(*parts: str) -> Transcript:
    t = Transcript()
    t.note(_chunk("", role=True), "p")
    for part in parts:
        t.note(_chunk(part), "p")
    return t


def test_a_transcript_keeps_the_text_and_the_first_streams_identity():
    t = _delivered("Hel", "lo ", "wor")
    assert t.text == "Hello wor" and t.tokens == 3 and t.continuable
    assert (t.id, t.model, t.created, t.backends) == ("c1", "m1", 7, ["p"])


def test_a_long_transcript_is_kept_in_chunks_not_a_string_a_piece():
    """A str per 3-character piece cost ~20 bytes a character (84 MB at MAX_CHARS; review
    helper's repro): pieces are joined 64 at a time, the text the same."""
    pieces = [f"w{i % 10} " for i in range(1000)]
    t = _delivered(*pieces)
    assert t.text == "".join(pieces) and t.chars == 3000 and t.tokens == 1000
    assert len(t.parts) == 1000 // 64


@pytest.mark.parametrize("choice", [
    {"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}},
    {"index": 1, "delta": {"content": "second choice"}},
])
def test_a_transcript_with_anything_but_one_texts_is_not_continuable(choice):
    t = _delivered("a")
    t.note({"id": "c1", "choices": [choice]}, "p")
    assert not t.continuable


def test_prefill_sends_the_delivered_text_as_an_assistant_turn_and_rewrites_the_continuation():
    t = _delivered("w0 ", "w1 ")
    r = Resume(t, "prefill", "s", "backend 'p' lost its connection mid-stream")
    body = orjson.loads(r.body({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}, "big", CHAT.prefill))
    assert body["model"] == "big" and body["messages"][-1] == {"role": "assistant", "content": "w0 w1 "}
    assert r.rewrite(_chunk("", role=True, cid="other", model="big")) is None  # the client had its role event
    out = r.rewrite(_chunk("w2 ", cid="other", model="big"))
    assert out is not None and (out["id"], out["model"], out["created"]) == ("c1", "m1", 7)
    assert out["choices"][0]["delta"] == {"content": "w2 "}
    fin = r.rewrite(_chunk(finish="stop", cid="other"))
    assert fin is not None and fin["x_gateway"] == {"backends": ["p", "s"], "continued": "prefill",
                                                   "after": "backend 'p' lost its connection mid-stream"}
    usage = r.rewrite(_chunk(usage={"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}))
    assert usage is not None and usage["usage"] == {"prompt_tokens": 12, "completion_tokens": 7, "total_tokens": 19}


def test_a_prefill_counts_events_of_several_tokens_by_their_text():
    """One event may carry several tokens (Anthropic's text deltas): 12 tokens in 4 events left a
    limit of 20 with 16 to go (review helper's repro). The text's estimate counts when it says more."""
    t = _delivered(*["word word word word " * 3] * 4)  # 240 characters: ~60 tokens in 4 events
    body = orjson.loads(Resume(t, "prefill", "s", "cut").body({"model": "m", "messages": [], "max_tokens": 100}, "m", CHAT.prefill))
    assert body["max_tokens"] == 40


def test_a_prefill_whose_limit_was_used_up_ends_at_its_limit_with_nothing_more():
    """Cut after its last token, before its finish: the continuation was asked for one more token,
    and the client got max_tokens + 1 (review helper's repro). It gets the finish, `length`, and
    usage of what it has."""
    t = _delivered("t0 ", "t1 ", "t2 ")
    r = Resume(t, "prefill", "s", "cut")
    body = orjson.loads(r.body({"model": "m", "messages": [], "max_tokens": 3}, "m", CHAT.prefill))
    assert body["max_tokens"] == 1  # the backend is asked for something it may answer
    assert r.rewrite(_chunk("u0 ")) is None
    fin = r.rewrite(_chunk(finish="stop"))
    assert fin is not None and fin["choices"][0]["finish_reason"] == "length" and fin["choices"][0]["delta"].get("content", "") == ""
    usage = r.rewrite(_chunk(usage={"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}))
    assert usage is not None and usage["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def test_completions_prefill_appends_the_text_to_the_prompt():
    t = Transcript()
    t.note({"id": "x", "choices": [{"index": 0, "text": "Once upon"}]}, "p")
    body = orjson.loads(Resume(t, "prefill", "s", "cut").body({"model": "m", "prompt": "Tell: "}, "m", COMPLETIONS.prefill))
    assert body["prompt"] == "Tell: Once upon"


def test_restart_skips_exactly_the_delivered_text_across_chunk_boundaries():
    t = _delivered("Hello ", "wor")
    r = Resume(t, "restart", "s", "cut")
    body = orjson.loads(r.body({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "m", CHAT.prefill))
    assert body["messages"][-1]["role"] == "user"  # the original request, unchanged
    assert r.rewrite(_chunk("Hel")) is None
    assert r.rewrite(_chunk("lo w")) is None
    out = r.rewrite(_chunk("orld!"))
    assert out is not None and out["choices"][0]["delta"]["content"] == "ld!"
    more = r.rewrite(_chunk(" More"))
    assert more is not None and more["choices"][0]["delta"]["content"] == " More"


def test_a_restart_keeps_the_logprobs_of_only_what_it_passes_on():
    """A chunk partly skipped kept all its logprobs: the client's tokens spelled "Hello wor world"
    where its text said "Hello world" (review helper's repro). Its tokens are cut where they meet
    the cut; a cut inside a token leaves that chunk without logprobs."""
    def chunk(*tokens: str) -> dict:
        out = _chunk("".join(tokens))
        out["choices"][0]["logprobs"] = {"content": [{"token": t, "logprob": -0.1, "bytes": list(t.encode()), "top_logprobs": []}
                                                     for t in tokens]}
        return out

    r = Resume(_delivered("Hello ", "wor"), "restart", "s", "cut")
    assert r.rewrite(chunk("Hello", " ")) is None
    out = r.rewrite(chunk("wor", "ld", "!"))  # the cut falls between tokens: the rest keep theirs
    assert out is not None and out["choices"][0]["delta"]["content"] == "ld!"
    assert [t["token"] for t in out["choices"][0]["logprobs"]["content"]] == ["ld", "!"]
    r = Resume(_delivered("Hello ", "wor"), "restart", "s", "cut")
    out = r.rewrite(chunk("Hello", " world", "!"))  # inside " world": no logprobs rather than wrong ones
    assert out is not None and out["choices"][0]["delta"]["content"] == "ld!" and out["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("chunks", [["Help"], ["Hello"]])
def test_restart_refuses_an_answer_that_begins_differently_or_ends_short(chunks):
    r = Resume(_delivered("Hello ", "wor"), "restart", "s", "cut")
    with pytest.raises(Mismatch):
        for c in chunks:
            r.rewrite(_chunk(c))
        r.rewrite(_chunk(finish="stop"))


def test_a_models_health_includes_its_backends_but_not_its_siblings():
    now = [100.0]
    backend = Health(clock=lambda: now[0])
    a, b = Health(clock=backend.clock, parent=backend), Health(clock=backend.clock, parent=backend)
    a.cool_down(30)
    assert a.state() == "cooling" and b.state() == "healthy" and a.cooling_for() == 30
    backend.ready = False
    assert b.state() == "starting" and not b.is_ready() and not b.clear(now[0])
    backend.ready = True
    for _ in range(3):
        backend.report_failure()  # refused connections: the backend as a whole
    assert backend.state() == "ejected" and b.state() == "ejected" and not b.healthy and b.available_in() > 0
    now[0] += 60
    assert b.state() == "probing" and b.probing


@pytest.mark.parametrize(("status", "body", "expected"), [
    (400, {"error": {"message": "x", "code": "context_length_exceeded"}}, True),
    (400, {"error": {"message": "This model's maximum context length is 4096 tokens", "code": None}}, True),
    (400, {"error": {"message": "prompt is too long: 210000 tokens > 200000 maximum", "type": "invalid_request_error"}}, True),
    (413, {"error": {"message": "Input too long: too many tokens"}}, True),
    (400, {"error": {"message": "content filtered", "code": "content_filter"}}, False),
    (500, {"error": {"message": "maximum context length", "code": "context_length_exceeded"}}, False),
])
def test_context_length_errors_are_recognised_by_code_or_wording(status, body, expected):
    assert _context_length(status, orjson.dumps(body)) is expected


def _policy(route: str, backends: str = "") -> str:
    return f"""
version: 1
backends:
  p: {{url: "http://127.0.0.1:1/v1", models: [m]}}
  big: {{url: "http://127.0.0.1:2/v1", prefill: true, models: {{m: m-128k}}}}
{backends}
models:
  m: {route}
"""


def test_the_policy_keys_of_the_issue_validate_with_yaml_on_as_a_key():
    p = parse_policy(_policy("{backends: [p], context_fallbacks: [big], retry: {attempts: 2, on: [429, 500, reset], max_wait_ms: 3000, backoff_ms: 100}}"))
    r = p.models["m"]
    assert r.context_fallbacks == ("big",) and r.retry is not None
    assert (r.retry.attempts, r.retry.on, r.retry.max_wait_ms, r.retry.backoff_ms) == (2, (429, 500, "reset"), 3000, 100)
    assert p.backends["big"].prefill is True and p.backends["p"].prefill is None


@pytest.mark.parametrize(("route", "problem"), [
    ("{backends: [p], context_fallbacks: [nope]}", "unknown backend 'nope'"),
    ("{backends: [p], retry: {on: [400]}}", "not a retryable HTTP status"),
    ("{backends: [p], retry: {on: [sometimes]}}", "'reset', 'connect' or 'timeout'"),
    ("{backends: [p], retry: {attempts: 0}}", "greater than or equal to 1"),
])
def test_bad_rescue_keys_name_their_path(route, problem):
    with pytest.raises(PolicyError) as info:
        parse_policy(_policy(route))
    assert "models.m." in str(info.value) and problem in str(info.value)


# -- timing.retry_wait: the pause before trying the same backend again -------------------------

def _retry(**kw):
    from gateway.config.policy import RetryPolicy
    return RetryPolicy.model_validate({"attempts": 3, "on": [429, 500, "reset"], "max_wait_ms": 3000, "backoff_ms": 200, **kw})


def _wait(rp, kind, **kw):
    import random

    from gateway.relay.timing import retry_wait
    args = {"tries_here": 1, "tries_total": 1, "max_attempts": 5, "cooling_s": 0.0, "remaining_s": 60.0, "rng": random.Random(1)}
    return retry_wait(rp, kind, **{**args, **kw})


def test_a_retry_waits_for_retry_after_on_429_and_backs_off_otherwise():
    rp = _retry()
    assert _wait(rp, "http_429", cooling_s=2.0) == 2.0
    first, second = _wait(rp, "http_500"), _wait(rp, "http_500", tries_here=2)
    assert 0.15 <= first <= 0.25 and 0.3 <= second <= 0.5  # doubles, +-25 % jitter
    assert _wait(rp, "reset_before_headers") is not None and _wait(rp, "disconnect") is not None


@pytest.mark.parametrize(("kind", "kw"), [
    ("http_502", {}),  # not in `on`
    ("http_429", {"cooling_s": 30.0}),  # past max_wait_ms: fail over instead
    ("http_500", {"tries_here": 3}),  # attempts used up on this backend
    ("http_500", {"tries_total": 5}),  # server.max_attempts used up
    ("http_429", {"cooling_s": 2.0, "remaining_s": 1.5}),  # the deadline comes first
    (None, {}),
])
def test_no_retry_when_the_rule_says_fail_over(kind, kw):
    assert _wait(_retry(), kind, **kw) is None
    assert _wait(None, "http_500") is None  # no `retry`: fail over at once


def test_a_retry_never_loops_tightly():
    assert _wait(_retry(), "http_429", cooling_s=0.001) == 0.05  # Retry-After: 0.001
    assert _wait(_retry(backoff_ms=1), "http_500") == 0.05
