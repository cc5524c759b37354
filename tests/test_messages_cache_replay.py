"""A native Anthropic backend's whole Message is cached only when a stream hit can replay every
block as it was (message_events: text and tool_use): one with thinking, a server tool or citations
is asked of the backend again, while a plain text answer is still a hit. A chat backend's answer is
stored as the Message a hit gives back (its stop sequence kept), and only one a lookup accepts."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.messages.codec import MESSAGES
from gateway.tenants.auth import hash_key
from tests.servers import serve_app

KEY = "sk-test"
PLAIN = [{"type": "text", "text": "Answer"}, {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]
RICH = {
    "thinking": [{"type": "thinking", "thinking": "Let me think...", "signature": "sig=="}, {"type": "text", "text": "Answer"}],
    "server_tool_use": [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "x"}},
                        {"type": "text", "text": "Answer"}],
    "citations": [{"type": "text", "text": "Answer", "citations": [{"type": "web_search_result_location", "url": "u",
                                                                     "title": "t", "encrypted_index": "e", "cited_text": "c"}]}],
}


def _message(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": content,
            "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2}}


@pytest.mark.parametrize("name", list(RICH))
def test_a_message_the_replay_would_alter_makes_no_entry(name):
    assert MESSAGES.whole(orjson.dumps(_message(RICH[name])), 1 << 20).entry is None
    assert MESSAGES.whole(orjson.dumps(_message(PLAIN)), 1 << 20).entry is not None


@pytest.mark.parametrize("name", list(RICH))
async def test_a_rich_message_is_not_a_hit_but_a_plain_one_is(monkeypatch, gateway, name):
    asked: list[str] = []

    async def messages(request: web.Request) -> web.Response:
        body = await request.json()
        text = body["messages"][0]["content"]
        asked.append(text)
        return web.json_response(_message(RICH[name] if text == "rich" else PLAIN))

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    runner, port = await serve_app(app)
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-ant-up")
    try:
        gw = await gateway({"backends": {"an": {"url": f"http://127.0.0.1:{port}/v1", "kind": "anthropic",
                                                "api_key_env": "TEST_ANTHROPIC_KEY", "models": {"a": "claude-x"}}},
                            "reload": {"watch": False}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        async with aiohttp.ClientSession() as http:
            for prompt in ("rich", "plain"):
                body = {"model": "a", "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": prompt}]}
                caches = []
                for _ in range(2):
                    async with http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
                        assert r.status == 200, await r.text()
                        caches.append(r.headers.get("x-gateway-cache"))
                        got = await r.json()
                    assert got["content"] == (RICH[name] if prompt == "rich" else PLAIN)  # whole, as the backend said
                assert caches[1] == ("hit" if prompt == "plain" else "miss"), (prompt, caches)
        assert asked == ["rich", "rich", "plain"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stop", ["refusal", "pause_turn", "model_context_window_exceeded"])
def test_a_message_a_hit_could_not_replay_is_not_captured(stop: str) -> None:
    # Stored, it read back as corrupt at the next lookup (a warning and gateway_cache_errors_total
    # {op="corrupt"} per request a caller could provoke); only what is_complete replays is kept.
    def message(stop_reason: str) -> bytes:
        return orjson.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                             "content": [{"type": "text", "text": "hi"}], "stop_reason": stop_reason,
                             "usage": {"input_tokens": 3, "output_tokens": 1}})

    assert MESSAGES.whole(message("end_turn"), 1 << 20).entry is not None
    assert MESSAGES.whole(message(stop), 1 << 20).entry is None


async def test_a_stream_that_is_never_stored_is_shared_live_and_waited_for_by_nobody(monkeypatch, gateway):
    """A streamed Message is not stored (only a whole one is), yet it led a flight: an identical
    whole request waited out its ~4 s stream, found nothing stored and then asked the backend
    itself (7.5 s; review helper's repro). It goes on at once; an identical stream still shares
    the live one (one upstream call for both), and the whole answer is stored for later."""
    import asyncio
    import time

    from tests.fake_anthropic import FakeAnthropic

    monkeypatch.setenv("TEST_ANTHROPIC_KEY", "sk-up")
    an = await FakeAnthropic("an", key="sk-up", words=40, itl_ms=50, model="claude-fake-1").start()  # ~2 s a stream
    try:
        gw = await gateway({"backends": {"an": {"url": an.url, "kind": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY",
                                                "models": {"a": "claude-fake-1"}}},
                            "reload": {"watch": False}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        body = {"model": "a", "max_tokens": 100, "temperature": 0, "messages": [{"role": "user", "content": "hi there"}]}
        headers = {"Authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
        async with aiohttp.ClientSession() as http:
            async def post(b: dict[str, Any]) -> tuple[int, str | None, float]:
                started = time.monotonic()
                async with http.post(f"{gw.url}/v1/messages", json=b, headers=headers) as r:
                    await r.read()
                    return r.status, r.headers.get("x-gateway-cache"), time.monotonic() - started
            leader = asyncio.create_task(post({**body, "stream": True}))
            await asyncio.sleep(0.3)
            streamed, whole = await asyncio.gather(post({**body, "stream": True}), post(body))
            led = await leader
            again = await post(body)
        assert led[:2] == (200, "miss") and streamed[:2] == (200, "hit")  # the live stream, shared
        assert whole[:2] == (200, "miss") and whole[2] < led[2], (whole, led)  # not after the leader's stream
        assert an.stats.requests == 2 and again[:2] == (200, "hit")
    finally:
        await an.stop()


# ---- answers from a chat backend, stored as Messages -----------------------------------------


async def _chat_backend(message: dict[str, Any], finish: str, **choice: Any) -> tuple[web.AppRunner, str, list[dict[str, Any]]]:
    """A chat backend giving one answer, whole or streamed (`choice`: extra fields of its choice,
    on the finish chunk of a stream, as vLLM sends its `stop_reason`): (runner, url, bodies asked)."""
    asked: list[dict[str, Any]] = []
    usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    head = {"id": "chatcmpl-1", "created": 1, "model": "up"}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked.append(body)
        if not body.get("stream"):
            return web.json_response({**head, "object": "chat.completion", "usage": usage,
                                      "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        deltas = [{"role": "assistant", "content": ""}, {k: v for k, v in message.items() if k != "role" and v}]
        chunks = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish, **choice}]}, {"choices": [], "usage": usage}]
        for c in chunks:
            await resp.write(b"data: " + orjson.dumps({**head, "object": "chat.completion.chunk", **c}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}/v1", asked


def _over_chat(url: str) -> dict[str, Any]:
    return {"backends": {"c": {"url": url, "models": ["m"]}}, "reload": {"watch": False}, "cache": {"enabled": True},
            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}}


async def test_a_hit_keeps_the_stop_sequence_a_streamed_answer_matched(gateway):
    # vLLM names the matched stop string in the choice's `stop_reason`; the entry captured from a
    # stream dropped it, and a hit said end_turn / stop_sequence null (review helper's repro).
    import anthropic

    runner, url, asked = await _chat_backend({"role": "assistant", "content": "one two"}, "stop", stop_reason="END")
    try:
        gw = await gateway(_over_chat(url))
        ask: dict[str, Any] = {"model": "m", "max_tokens": 32, "stop_sequences": ["END"], "extra_body": {"temperature": 0},
                               "messages": [{"role": "user", "content": "count"}]}
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0) as c:
            async with c.messages.stream(**ask) as s:
                live = await s.get_final_message()
            raw = await c.messages.with_raw_response.create(**ask)
            hit = await raw.parse()
        assert raw.headers["x-gateway-cache"] == "hit" and len(asked) == 1
        assert (live.stop_reason, live.stop_sequence) == (hit.stop_reason, hit.stop_sequence) == ("stop_sequence", "END")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_refusal_from_a_chat_backend_is_not_stored_to_be_read_back_as_corrupt(gateway, caplog, stream):
    # A refusal (message.refusal, finish "stop") was stored as a Message with stop_reason refusal,
    # which a lookup rejects: deleted as corrupt, warned and counted at every request.
    import anthropic

    runner, url, asked = await _chat_backend({"role": "assistant", "content": None, "refusal": "I can't help."}, "stop")
    try:
        gw = await gateway(_over_chat(url))
        caplog.set_level(logging.WARNING, logger="gateway.cache")
        ask: dict[str, Any] = {"model": "m", "max_tokens": 32, "extra_body": {"temperature": 0},  # this SDK takes no temperature
                               "messages": [{"role": "user", "content": "x"}]}
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0) as c:
            for _ in range(3):
                if stream:
                    async with c.messages.stream(**ask) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await c.messages.create(**ask)
                assert msg.stop_reason == "refusal"
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/metrics") as r:
            corrupt = [line for line in (await r.text()).splitlines() if line.startswith('gateway_cache_errors_total{op="corrupt"}')]
        assert len(asked) == 3  # never stored, never a hit
        assert not [rec.getMessage() for rec in caplog.records if "corrupt" in rec.getMessage()]
        assert all(float(line.split()[-1]) == 0 for line in corrupt), corrupt
    finally:
        await runner.cleanup()
