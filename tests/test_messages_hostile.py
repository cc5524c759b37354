"""A hostile or careless caller of /v1/messages: every bad body is a clear Anthropic-shaped 400
(413 for a body over the limit), nothing reaches a backend, and the gateway keeps answering."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from gateway.tenants.auth import hash_key

KEY = "sk-test"
OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
DEEP = b"[" * 300 + b"]" * 300

BAD = [
    (b"{not json", "JSON"),
    (b"[1, 2]", "object"),
    (orjson.dumps({**OK, "max_tokens": 0}), "max_tokens"),
    (orjson.dumps({**OK, "max_tokens": "8"}), "max_tokens"),
    (orjson.dumps({**OK, "messages": []}), "messages"),
    (orjson.dumps({**OK, "messages": [{"role": "robot", "content": "hi"}]}), "role"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}), "tool_use"),
    (orjson.dumps({**OK, "stream": "yes"}), "stream"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}), "document"),
    (orjson.dumps({**OK, "thinking": {"type": "enabled", "budget_tokens": 1024}}), "thinking"),
    # nesting orjson reads but cannot write back (its recursion limit): a 400 naming the field, not a 500
    (b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":[{"type":"tool_use",'
     b'"id":"t","name":"f","input":{"x":' + DEEP + b'}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"ok"}]}]}',
     "messages[1].content[0].input: nested too deeply"),
    (b'{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"tools":[{"name":"f","input_schema":{"x":' + DEEP + b'}}]}',
     "tools[0].input_schema: nested too deeply"),
    # Anthropic's tool pairing, which a lenient chat backend would not check
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                                      {"role": "user", "content": "never mind"}]}), "tool_use ids were found without tool_result"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "x"}]}]}),
     "tool_result block(s) for ids"),
    (orjson.dumps({**OK, "tool_choice": {"type": "any"}}), "tool_choice: 'any' needs tools"),
    (orjson.dumps({**OK, "tool_choice": {"type": "tool", "name": "f"}}), "tool_choice: 'tool' needs tools"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": []}]}), "messages[0].content: empty"),
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": ""}]}), "messages[0].content: empty"),
    # What Anthropic refuses and translation would have sent on
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}),
     "messages[0].content[0]': a text block's 'text' is empty"),
    # pasted into a data URL: "image/png;base64,AAAA#" made another URL of it
    (orjson.dumps({**OK, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png;base64,AAAA#", "data": "x"}}]}]}),
     "messages[0].content[0]': a base64 image source's 'media_type' is one of"),
    # "no" read as true: an "Error: " prefix
    (orjson.dumps({**OK, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x", "is_error": "no"}]}]}),
     "messages[2].content[0]': a tool_result's 'is_error' is a boolean"),
    # a backend following it answered arguments no Message holds: a 502 charged to that backend (ejected after 3)
    (orjson.dumps({**OK, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}),
     "tools[0].input_schema': a custom tool's input_schema has type 'object'"),
    (orjson.dumps({**OK, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}] * 2},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}),
     "messages[1].content[1].id: tool_use id 't1' is used twice"),
]


@pytest.mark.parametrize("raw,word", BAD, ids=[w.split(":")[0] for _, w in BAD])
async def test_bad_bodies_are_anthropic_400s_and_reach_no_backend(upstream, gateway, raw, word):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages", data=raw, headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
            body = await r.json(content_type=None)
            assert r.status == 400, body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert word.lower() in body["error"]["message"].lower(), body
        async with http.post(gw.url + "/v1/messages", json=OK, headers={"x-api-key": KEY}) as r:
            assert r.status == 200  # and the next caller is answered
    assert up.stats.requests == 1


async def test_a_body_over_the_limit_is_refused_unread_in_anthropics_shape(upstream, gateway):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "server": {"max_body_bytes": 4096}, "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    big = orjson.dumps({**OK, "messages": [{"role": "user", "content": "x" * 100_000}]})
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            async with http.post(gw.url + path, data=big, headers={"x-api-key": KEY, "content-type": "application/json"}) as r:
                body = await r.json(content_type=None)
                assert r.status == 413 and body["type"] == "error", (path, body)
        async with http.post(gw.url + "/v1/messages", data=big, headers={"x-api-key": "wrong"}) as r:
            assert r.status == 401  # no key, nothing read
    assert up.stats.requests == 0


# ---- a tool call cut by the caller's own max_tokens, from an OpenAI backend ----------------------

_TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


def _chunk(choice: dict) -> bytes:
    return b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}) + b"\n\n"


async def _cutting_backend():
    """A chat backend whose tool call's arguments stop mid-object at finish_reason `length`."""
    from aiohttp import web

    from tests.servers import serve_app

    fn = {"name": "get_weather", "arguments": '{"city": "Pa'}

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
        if not body.get("stream"):
            msg = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": fn}]}
            return web.json_response({"id": "c1", "object": "chat.completion", "created": 1, "model": "m",
                                      "choices": [{"index": 0, "message": msg, "finish_reason": "length"}], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}))
        await resp.write(_chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": fn}]}}))
        await resp.write(_chunk({"index": 0, "delta": {}, "finish_reason": "length"}))
        await resp.write(b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                                   "choices": [], "usage": usage}) + b"\n\n" + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return await serve_app(app)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_tool_call_cut_by_max_tokens_ends_as_max_tokens_and_blames_no_backend(gateway, stream):
    # Whole: "cannot be read as a Message", a 502 counted against the backend (a few callers asking
    # for tools with a small max_tokens took it out of rotation). Streamed with the cache on: the
    # stream ended in an `error` event ("internal error") before message_stop.
    from gateway.web.keys import LIVE

    runner, port = await _cutting_backend()
    try:
        gw = await gateway({"backends": {"b": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]}},
                            "reload": {"watch": False}, "cache": {"enabled": True},
                            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        body = {"model": "m", "max_tokens": 4, "temperature": 0, "tools": _TOOLS, "stream": stream,
                "messages": [{"role": "user", "content": "weather in Paris?"}]}
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
                    text = await r.text()
                    assert r.status == 200, text
                    if stream:
                        assert "event: message_stop" in text and "event: error" not in text, text
                        assert '"stop_reason":"max_tokens"' in text and '{\\"city\\": \\"Pa' in text  # the partial input, as sent
                    else:
                        msg = orjson.loads(text)
                        assert msg["stop_reason"] == "max_tokens" and msg["content"][0]["type"] == "tool_use", msg
                        assert msg["content"][0]["input"] == {}  # what was cut cannot be an object
        assert gw.app[LIVE].runtime.backends["b"].health_for("m").state() == "healthy"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/messages"), ("POST", "/v1/messages/batches")])
async def test_a_path_nothing_serves_under_v1_messages_is_an_anthropic_shaped_404(upstream, gateway, method, path):
    up = await upstream("a")
    gw = await gateway({"backends": {"a": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False},
                        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
    async with aiohttp.ClientSession() as http, http.request(method, gw.url + path, json=OK, headers={"x-api-key": KEY}) as r:
        body = await r.json()
    assert r.status == 404 and body["type"] == "error" and body["error"]["type"] == "not_found_error", body
