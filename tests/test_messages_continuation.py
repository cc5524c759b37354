"""Continuing a stream from a `kind: anthropic` backend that broke mid-answer (relay/continuation.py,
messages/monitor.py, messages/as_chat.py): end to end with the official SDKs against the gateway and
fake upstreams (tests/fake_anthropic.py, tests/fake_upstream.py), then the monitors alone, fed
scripted events."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest

from gateway.messages.as_chat import AnthropicToChatMonitor, ResumedMessageMonitor
from gateway.messages.codec import CHAT_VIA_MESSAGES, MESSAGES
from gateway.messages.monitor import AnthropicMonitor
from gateway.messages.stream import ChatToMessagesStream
from gateway.wire.codec import continue_final_turn as continue_message
from gateway.relay.continuation import Mismatch, Resume, Transcript
from gateway.tenants.auth import hash_key
from gateway.wire.monitor import Verdict
from tests.fake_anthropic import FakeAnthropic, Invalid, validate
from tests.test_messages_translate import grammar, sse

KEY = "sk-test"
HELLO = [{"role": "user", "content": "Say something"}]
WORDS = " ".join(f"w{i}" for i in range(8))  # a fake Anthropic backend's answer (words=8)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]
A_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]


@pytest.fixture
async def claude(monkeypatch) -> AsyncIterator[Callable[..., Any]]:
    """Factory: `await claude("a", cut_after=3)` starts a FakeAnthropic (8 words) on a free port."""
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-upstream")
    started: list[FakeAnthropic] = []

    async def make(name: str, **behaviour: Any) -> FakeAnthropic:
        fake = await FakeAnthropic(name, **{"words": 8, **behaviour}).start()
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


def _policy(*ups: Any, prefill: bool | None = None) -> dict[str, Any]:
    """Model `m` on `ups` in order; `prefill` for every backend after the first."""
    backends: dict[str, Any] = {}
    for n, u in enumerate(ups):
        b: dict[str, Any] = {"url": u.url, "models": ["m"]}
        if isinstance(u, FakeAnthropic):
            b.update(kind="anthropic", api_key_env="TEST_ANTHROPIC_KEY", models={"m": "claude-fake-1"})
        if n and prefill is not None:
            b["prefill"] = prefill
        backends[u.name] = b
    return {"backends": backends, "models": {"m": {"backends": [u.name for u in ups], "strategy": "ordered"}},
            "reload": {"watch": False}, "cache": {"enabled": False}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}}


async def _chat(gw: Any, **extra: Any) -> tuple[str, set[str], list[str], dict[str, Any] | None, Any]:
    """(text, chunk ids, finish reasons, x_gateway, usage) as the openai SDK reads a stream."""
    stream = await gw.client().chat.completions.create(model="m", messages=HELLO, stream=True,
                                                       stream_options={"include_usage": True}, **extra)
    text, ids, finishes, x, usage = "", set(), [], None, None
    async for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                finishes.append(c.finish_reason)
                x = (chunk.model_extra or {}).get("x_gateway")
    return text, ids, finishes, x, usage


async def _message(gw: Any) -> tuple[list[Any], anthropic.types.Message]:
    """(the events, the final message) as the anthropic SDK reads a stream (its accumulator
    refuses a delta for a block that was never started)."""
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10)
    try:
        async with client.messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
            events = [e async for e in stream]
            return events, await stream.get_final_message()
    finally:
        await client.close()


async def _post(gw: Any, path: str, body: dict[str, Any]) -> bytes:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, json=body, headers={"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200
            return await r.read()


def _kinds(events: list[Any]) -> list[str]:
    return [e.type for e in events if e.type in ("message_start", "content_block_start", "content_block_stop",
                                                 "message_delta", "message_stop")]


# ---- a chat client --------------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [True, False])
async def test_a_chat_stream_cut_on_an_anthropic_backend_goes_on_on_another(claude, gateway, prefill):
    a = await claude("a", cut_after=3)
    b = await claude("b")
    gw = await gateway(_policy(a, b, prefill=prefill))
    text, ids, finishes, x, usage = await _chat(gw)
    assert text == WORDS and len(ids) == 1 and finishes == ["stop"], (text, ids, finishes)
    assert x == {"backends": ["a", "b"], "continued": "prefill" if prefill else "restart", "after": x["after"]}
    assert "a" in x["after"]
    assert usage is not None and usage.completion_tokens == 8  # 3 delivered + 5 prefilled, or 8 restarted
    last = b.stats.last_body["messages"][-1]
    assert last == ({"role": "assistant", "content": "w0 w1 w2"} if prefill else HELLO[0]), last
    assert a.stats.requests == b.stats.requests == 1


async def test_a_chat_stream_cut_on_an_anthropic_backend_goes_on_on_an_openai_one(claude, upstream, gateway):
    a = await claude("a", cut_after=3)
    o = await upstream("o", tokens=8)  # w0 w1 ... each with a trailing space: its restart begins as a's answer did
    gw = await gateway(_policy(a, o))
    text, ids, finishes, x, usage = await _chat(gw)
    assert text.split() == WORDS.split() and len(ids) == 1 and finishes == ["stop"], (text, ids)
    assert x is not None and x["backends"] == ["a", "o"] and x["continued"] == "restart"
    assert usage is not None and usage.completion_tokens == 8 and o.stats.requests == 1


async def test_a_chat_stream_cut_on_an_openai_backend_goes_on_on_an_anthropic_one(claude, upstream, gateway):
    """The delivered text ends in a space, which Anthropic refuses at the end of a prefill: it goes
    without it, and the continuation's leading space is not doubled."""
    o = await upstream("o", tokens=8, mode="cut", fail_after=3)
    b = await claude("b")
    gw = await gateway(_policy(o, b, prefill=True))
    text, ids, finishes, x, usage = await _chat(gw)
    assert text == WORDS and len(ids) == 1 and finishes == ["stop"], text
    assert x is not None and x["continued"] == "prefill" and x["backends"] == ["o", "b"]
    assert b.stats.last_body["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2"}
    assert b.stats.by_status == {200: 1} and usage is not None and usage.completion_tokens == 8


# ---- a Messages client ----------------------------------------------------------------------


@pytest.mark.parametrize("prefill", [True, False])
async def test_a_native_message_cut_goes_on_on_another_anthropic_backend_as_one_message(claude, gateway, prefill):
    a = await claude("a", cut_after=3)
    b = await claude("b")
    gw = await gateway(_policy(a, b, prefill=prefill))
    events, final = await _message(gw)
    assert _kinds(events) == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == WORDS  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 8
    assert {e.index for e in events if e.type == "content_block_delta"} == {0}  # the open block went on
    last = b.stats.last_body["messages"][-1]
    assert last == ({"role": "assistant", "content": "w0 w1 w2"} if prefill else HELLO[0])
    raw = await _post(gw, "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    seq = grammar(raw)  # the legal order, one message_start, indexes in step
    assert "".join(d["delta"]["text"] for d in seq if d["type"] == "content_block_delta") == WORDS


async def test_a_native_message_cut_goes_on_on_an_openai_backend(claude, upstream, gateway):
    a = await claude("a", cut_after=3)
    o = await upstream("o", tokens=8)
    gw = await gateway(_policy(a, o))
    events, final = await _message(gw)
    assert _kinds(events) == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text.split() == WORDS.split() and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert final.usage.output_tokens == 8 and o.stats.requests == 1
    assert final.id.startswith("msg_") and a.stats.requests == 1


async def test_a_message_cut_on_an_openai_backend_goes_on_natively_on_an_anthropic_one(claude, upstream, gateway):
    o = await upstream("o", tokens=8, mode="cut", fail_after=3)
    b = await claude("b")
    gw = await gateway(_policy(o, b, prefill=True))
    events, final = await _message(gw)
    assert _kinds(events) == ["message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == WORDS and final.usage.output_tokens == 8  # type: ignore[union-attr]
    assert b.stats.last_body["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2"}


async def test_an_error_event_mid_message_is_continued_not_passed_on(claude, gateway):
    a = await claude("a", error_event_after=2)
    b = await claude("b")
    gw = await gateway(_policy(a, b, prefill=True))
    raw = await _post(gw, "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    seq = grammar(raw)
    assert "".join(d["delta"]["text"] for d in seq if d["type"] == "content_block_delta") == WORDS
    assert b"event: error" not in raw and not any(d["type"] == "error" for d in seq) and b.stats.requests == 1
    delta = [d for d in seq if d["type"] == "message_delta"]
    assert len(delta) == 1 and delta[0]["x_gateway"]["backends"] == ["a", "b"]  # the failure is named there only
    assert "overloaded_error" in delta[0]["x_gateway"]["after"]


async def test_a_second_cut_goes_on_from_the_first_continuation(claude, gateway):
    a = await claude("a", cut_after=2)
    b = await claude("b", cut_after=5)  # prefilled with w0 w1: cut after w2 .. w6
    c = await claude("c")
    gw = await gateway(_policy(a, b, c, prefill=True))
    events, final = await _message(gw)
    assert _kinds(events).count("message_start") == 1 and final.content[0].text == WORDS  # type: ignore[union-attr]
    assert c.stats.last_body["messages"][-1]["content"] == "w0 w1 w2 w3 w4 w5 w6"


# ---- what is not continued ------------------------------------------------------------------


@pytest.mark.parametrize("client", ["chat", "messages"])
async def test_a_restart_that_begins_differently_ends_with_an_error_event_never_a_splice(claude, gateway, client):
    a = await claude("a", cut_after=3)
    b = await claude("b", word="v")  # answers v0 v1 ...: not what the client has
    gw = await gateway(_policy(a, b, prefill=False))
    if client == "chat":
        raw = await _post(gw, "/v1/chat/completions", {"model": "m", "messages": HELLO, "stream": True})
        data = [d for _, d in sse(raw)]
        assert "[DONE]" not in data and "error" in data[-1], data[-1]
        text = "".join(c["delta"].get("content") or "" for d in data[:-1] for c in d["choices"])
    else:
        raw = await _post(gw, "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
        data = [d for _, d in sse(raw)]
        assert data[-1]["type"] == "error" and not any(d["type"] in ("message_delta", "message_stop") for d in data)
        text = "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta")
    assert text == "w0 w1 w2" and b"v0" not in raw and b.stats.requests == 1
    assert b"could not be continued" in raw


@pytest.mark.parametrize("client", ["chat", "messages"])
async def test_a_tool_use_stream_cut_is_not_continued(claude, gateway, client):
    a = await claude("a", tool_call="get_weather", cut_after=20)  # cut after the tool_use block, before its stop reason
    b = await claude("b")
    gw = await gateway(_policy(a, b, prefill=True))
    if client == "chat":
        raw = await _post(gw, "/v1/chat/completions", {"model": "m", "messages": HELLO, "stream": True, "tools": TOOLS})
        data = [d for _, d in sse(raw)]
        assert "[DONE]" not in data and "error" in data[-1]
        assert any(c["delta"].get("tool_calls") for d in data[:-1] for c in d["choices"])
    else:
        raw = await _post(gw, "/v1/messages", {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True,
                                               "tools": A_TOOLS})
        data = [d for _, d in sse(raw)]
        assert data[-1]["type"] == "error" and not any(d["type"] == "message_stop" for d in data)
    assert b.stats.requests == 0


# ---- the monitors, fed scripted events --------------------------------------------------------


def _ev(kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"type": kind, **fields})


def _stream(words: list[str], *, msg_id: str = "msg_a", stop: str | None = "end_turn", output: int = 0) -> list[bytes]:
    """A text answer's events (to message_stop, or cut after the words when `stop` is None)."""
    usage = {"input_tokens": 10, "output_tokens": 1}
    out = [_ev("message_start", message={"id": msg_id, "type": "message", "role": "assistant", "model": "claude-x",
                                          "content": [], "usage": usage}),
           _ev("content_block_start", index=0, content_block={"type": "text", "text": ""}), _ev("ping")]
    out += [_ev("content_block_delta", index=0, delta={"type": "text_delta", "text": w}) for w in words]
    if stop is None:
        return out
    return out + [_ev("content_block_stop", index=0),
                  _ev("message_delta", delta={"stop_reason": stop, "stop_sequence": None}, usage={"output_tokens": output or len(words)}),
                  _ev("message_stop")]


def _deliver(mon: Any, events: list[bytes], transcript: Transcript, backend: str = "a") -> tuple[list[Verdict], bytes]:
    """Feed events as the pump does: the verdicts, and what the client got (an event's own bytes, or `out`)."""
    verdicts, sent = [], []
    for data in events:
        v = mon.feed(data)
        verdicts.append(v)
        if v in (Verdict.HELD, Verdict.CONTENT):
            sent.append(mon.out if mon.out is not None else b"event: " + orjson.loads(data)["type"].encode() + b"\ndata: " + data + b"\n\n")
            if mon.event is not None:
                transcript.note(mon.event, backend)
    return verdicts, b"".join(sent)


def test_a_native_stream_shows_the_transcript_chat_chunks_and_leaves_its_translator():
    t = Transcript()
    mon = AnthropicMonitor(t)
    assert not mon.relays_failure  # while the answer can be continued, the relay decides
    verdicts, _ = _deliver(mon, _stream(["w0", " w1"], stop=None), t)
    assert verdicts == [Verdict.HELD, Verdict.HELD, Verdict.NOISE, Verdict.CONTENT, Verdict.CONTENT] and mon.out is None
    assert t.text == "w0 w1" and t.tokens == 2 and t.continuable and t.id == "chatcmpl-msg_a"
    assert isinstance(t.carry, ChatToMessagesStream) and t.carry.message_id == "msg_a"
    assert AnthropicMonitor().relays_failure  # no transcript: the backend's error event is the client's


def test_a_native_stream_with_a_tool_or_thinking_is_not_continuable():
    for delta in ({"type": "input_json_delta", "partial_json": "{"}, {"type": "thinking_delta", "thinking": "hm"}):
        t = Transcript()
        mon = AnthropicMonitor(t)
        _deliver(mon, [*_stream([], stop=None), _ev("content_block_delta", index=0, delta=delta)], t)
        assert not t.continuable and mon.relays_failure


def test_a_native_continuation_goes_on_with_the_open_block_of_the_message_the_client_has():
    t = Transcript()
    first, sent = AnthropicMonitor(t), []
    _, raw = _deliver(first, _stream(["w0", " w1"], stop=None), t)
    sent.append(raw)
    resume = Resume(t, "restart", "b", "cut")
    mon = ResumedMessageMonitor(rewrite=resume.rewrite, transcript=t)
    verdicts, raw = _deliver(mon, _stream(["w0", " w1", " w2"], msg_id="msg_b", output=3), t, "b")
    assert verdicts == [Verdict.DROP, Verdict.DROP, Verdict.DROP, Verdict.DROP, Verdict.DROP, Verdict.CONTENT,
                        Verdict.DROP, Verdict.HELD, Verdict.DONE]
    assert mon.finished and mon.usage is not None and mon.usage["completion_tokens"] == 3
    sent += [raw, mon.ending]
    seq = grammar(b"".join(sent))
    assert [d["type"] for d in seq if d["type"] == "message_start"] == ["message_start"]
    assert "".join(d["delta"]["text"] for d in seq if d["type"] == "content_block_delta") == "w0 w1 w2"
    assert seq[-2]["delta"]["stop_reason"] == "end_turn" and seq[-2]["usage"]["output_tokens"] == 3


def test_a_prefilled_native_continuation_counts_the_delivered_tokens():
    t = Transcript()
    _deliver(AnthropicMonitor(t), _stream(["w0", " w1"], stop=None), t)
    mon = ResumedMessageMonitor(rewrite=Resume(t, "prefill", "b", "cut").rewrite, transcript=t)
    _, raw = _deliver(mon, _stream([" w2"], msg_id="msg_b", stop="max_tokens"), t, "b")
    seq = [d for _, d in sse(raw + mon.ending)]
    assert [d["type"] for d in seq] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert seq[0]["index"] == 0 and seq[2]["delta"]["stop_reason"] == "max_tokens" and seq[2]["usage"]["output_tokens"] == 3
    # the message_delta says which backends answered and how, as a chat client's finish chunk does
    assert seq[2]["x_gateway"] == {"backends": ["a", "b"], "continued": "prefill", "after": "cut"}


def test_a_chat_clients_continuation_from_an_anthropic_stream_is_rewritten():
    t = Transcript()
    first = AnthropicToChatMonitor(include_usage=True, transcript=t)
    _deliver(first, _stream(["w0", " w1"], stop=None), t)
    assert t.text == "w0 w1" and t.carry is None  # a chat client needs no translator carried
    mon = AnthropicToChatMonitor(include_usage=True, rewrite=Resume(t, "prefill", "b", "cut here").rewrite, transcript=t)
    verdicts, raw = _deliver(mon, _stream([" w2"], msg_id="msg_b"), t, "b")
    assert verdicts == [Verdict.DROP, Verdict.DROP, Verdict.DROP, Verdict.CONTENT, Verdict.DROP, Verdict.HELD, Verdict.DONE]
    chunks = [d for _, d in sse(raw + mon.ending)]
    assert {c["id"] for c in chunks[:-1]} == {"chatcmpl-msg_a"} and chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"] == {"content": " w2"}
    assert chunks[1]["x_gateway"] == {"backends": ["a", "b"], "continued": "prefill", "after": "cut here"}
    assert chunks[2]["usage"]["completion_tokens"] == 3 and mon.usage == chunks[2]["usage"]  # 2 delivered + 1


def test_a_restart_that_differs_raises_mismatch_before_anything_is_sent():
    t = Transcript()
    _deliver(AnthropicToChatMonitor(include_usage=False, transcript=t), _stream(["w0", " w1"], stop=None), t)
    for mon in (AnthropicToChatMonitor(include_usage=False, rewrite=Resume(t, "restart", "b", "cut").rewrite, transcript=t),
                ResumedMessageMonitor(rewrite=Resume(t, "restart", "b", "cut").rewrite, transcript=t)):
        events = _stream(["w0", " v1"], msg_id="msg_b")
        for data in events[:4]:
            assert mon.feed(data) in (Verdict.DROP, Verdict.NOISE)
        with pytest.raises(Mismatch):
            mon.feed(events[4])


def test_a_chat_client_never_gets_an_anthropic_ping():
    mon = AnthropicToChatMonitor(include_usage=False)
    mon.feed(_stream([])[0])
    assert mon.feed(_ev("ping")) is Verdict.DROP


def test_a_prefill_to_anthropic_goes_without_trailing_whitespace_and_its_repeat_is_skipped():
    t = Transcript()
    t.note({"id": "c", "choices": [{"index": 0, "delta": {"content": "Title.\n\n"}}]}, "a")
    r = Resume(t, "prefill", "b", "cut")
    body = orjson.loads(r.body(MESSAGES.upstream_request({"model": "m", "max_tokens": 9, "messages": HELLO}), "c1",
                               MESSAGES.prefill, trim=MESSAGES.prefill_trims))
    assert body["messages"][-1] == {"role": "assistant", "content": "Title."} and body["model"] == "c1"
    assert r.rewrite({"choices": [{"index": 0, "delta": {"content": "\n"}}]}) is None  # held back: the client has it
    out = r.rewrite({"choices": [{"index": 0, "delta": {"content": "\nBody"}}]})
    assert out is not None and out["choices"][0]["delta"]["content"] == "Body"
    r2 = Resume(t, "prefill", "b", "cut")
    r2.body({"messages": []}, "m", MESSAGES.prefill, trim=True)
    out = r2.rewrite({"choices": [{"index": 0, "delta": {"content": "Body"}}]})  # no repeat: nothing skipped
    assert out is not None and out["choices"][0]["delta"]["content"] == "Body"


def test_a_chat_request_continued_on_anthropic_is_sent_as_messages_with_the_prefill():
    t = Transcript()
    t.note({"id": "c", "choices": [{"index": 0, "delta": {"content": "w0 w1"}}]}, "a")
    chat = {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *HELLO], "stream": True,
            "stream_options": {"include_usage": True}}
    body = orjson.loads(Resume(t, "prefill", "b", "cut").body(CHAT_VIA_MESSAGES.upstream_request(chat), "claude-1",
                                                              CHAT_VIA_MESSAGES.prefill, trim=True))
    # the translation's default limit (4096), less what was delivered: one event, two tokens by its text
    assert body["system"] == "Be brief." and body["max_tokens"] == 4094 and body["stream"] is True
    assert "stream_options" not in body and body["messages"] == [*HELLO, {"role": "assistant", "content": "w0 w1"}]


def test_a_prefill_goes_on_from_the_clients_own_prefill():
    ask = {"messages": [*HELLO, {"role": "assistant", "content": "The answer is"}]}
    assert continue_message(ask, " 42")["messages"][-1] == {"role": "assistant", "content": "The answer is 42"}
    blocks = {"messages": [*HELLO, {"role": "assistant", "content": [{"type": "text", "text": "A:"}]}]}
    assert continue_message(blocks, " b")["messages"][-1]["content"] == [{"type": "text", "text": "A: b"}]
    assert continue_message({"messages": HELLO}, "x")["messages"] == [*HELLO, {"role": "assistant", "content": "x"}]


def test_messages_requests_with_tools_or_thinking_are_not_continuable():
    assert MESSAGES.continuable({"messages": HELLO})
    assert not MESSAGES.continuable({"messages": HELLO, "tools": A_TOOLS})
    assert not MESSAGES.continuable({"messages": HELLO, "thinking": {"type": "enabled", "budget_tokens": 1024}})


def test_the_fake_refuses_a_prefill_that_ends_in_whitespace_as_the_api_does():
    base = {"model": "m", "max_tokens": 5}
    validate({**base, "messages": [*HELLO, {"role": "assistant", "content": "w0 w1"}]})
    for content in ("w0 w1 ", [{"type": "text", "text": "w0\n"}]):
        with pytest.raises(Invalid, match="trailing whitespace"):
            validate({**base, "messages": [*HELLO, {"role": "assistant", "content": content}]})


@pytest.mark.parametrize("api", ["messages", "chat"])
async def test_a_prefill_continuation_gets_what_is_left_of_the_answers_limit(claude, gateway, api):
    """The continuation was sent the client's max_tokens unchanged: with max_tokens 5, a cut
    after 3 words came back with 8, each cut another whole limit (past a quota's bound too;
    review helper's repro). It gets what is left: the answer stays within the limit."""
    a = await claude("a", words=20, cut_after=3)
    b = await claude("b", words=20)
    gw = await gateway(_policy(a, b, prefill=True))
    async with aiohttp.ClientSession() as http:
        if api == "messages":
            async with http.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": HELLO, "stream": True},
                                 headers={"x-api-key": KEY}) as r:
                raw = await r.read()
            text = "".join(d["delta"].get("text", "") for _, d in sse(raw) if d["type"] == "content_block_delta")
        else:
            async with http.post(gw.url + "/v1/chat/completions", json={"model": "m", "max_tokens": 5, "messages": HELLO, "stream": True},
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                raw = await r.read()
            text = "".join(c["delta"].get("content") or "" for _, d in sse(raw) if d != "[DONE]" for c in d["choices"])
    assert b.stats.last_body["max_tokens"] == 2  # 5, of which 3 were delivered
    assert len(text.split()) == 5, text


async def test_a_clients_own_prefill_cut_on_an_openai_backend_goes_on_as_one_assistant_turn(upstream, gateway):
    """A Messages request ending in the client's own prefill, answered as chat by OpenAI backends
    that continue one, cut mid-answer: the delivered text went in a second assistant turn after
    the client's (the fake repeated words at the seam; review helper's repro). It extends it."""
    o = await upstream("o", tokens=12, mode="cut", fail_after=5, fault_count=1)
    s = await upstream("s", tokens=12)
    policy = _policy(o, s, prefill=True)
    policy["backends"]["o"]["prefill"] = True
    gw = await gateway(policy)
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10)
    try:
        async with client.messages.stream(model="m", max_tokens=64, messages=[*HELLO, {"role": "assistant", "content": "w0 w1"}]) as stream:
            final = await stream.get_final_message()
    finally:
        await client.close()
    assert final.content[0].text.split() == [f"w{i}" for i in range(2, 12)]  # type: ignore[union-attr]
    sent = s.stats.last_body["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant"] and sent[-1]["content"].startswith("w0 w1 w2")
