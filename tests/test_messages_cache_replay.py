"""A native Anthropic backend's whole Message is cached only when a stream hit can replay every
block as it was (message_events: text and tool_use): one with thinking, a server tool or citations
is asked of the backend again, while a plain text answer is still a hit."""

from __future__ import annotations

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
