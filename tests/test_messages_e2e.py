"""/v1/messages end to end: the official anthropic SDK against the gateway, answered by OpenAI-kind
fake upstreams through translation (the same pipeline as chat: auth, quota, cache, failover)."""

from __future__ import annotations

import aiohttp
import anthropic
import orjson
import pytest

from gateway.tenants.auth import hash_key

KEY = "sk-test"
HELLO = [{"role": "user", "content": "Say something"}]
WORDS = " ".join(f"w{i}" for i in range(6))


def _policy(*ups, **extra):
    p = {
        "backends": {u.name: {"url": u.url, "models": ["m"]} for u in ups},
        "models": {"m": {"backends": [u.name for u in ups], "strategy": "ordered"}},
        "reload": {"watch": False},
        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}},
    }
    p.update(extra)
    return p


_CLIENTS: list[anthropic.AsyncAnthropic] = []


@pytest.fixture(autouse=True)
async def _close_clients():
    yield
    while _CLIENTS:  # while the test's loop still runs
        await _CLIENTS.pop().close()


def _client(gw, key: str = KEY) -> anthropic.AsyncAnthropic:
    c = anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=10)
    _CLIENTS.append(c)
    return c


async def _post(gw, body, headers=None) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages", json=body, headers=headers or {"x-api-key": KEY}) as r:
            return r.status, dict(r.headers), await r.read()


def _events(raw: bytes) -> list[tuple[str | None, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = orjson.loads(line[5:].strip())
        if data is not None:
            out.append((name, data))
    return out


async def test_a_message_from_an_openai_backend(upstream, gateway):
    up = await upstream("a", tokens=6)
    gw = await gateway(_policy(up))
    msg = await _client(gw).messages.create(model="m", max_tokens=64, messages=HELLO, system="Be brief.")
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "end_turn"
    assert msg.content[0].type == "text" and msg.content[0].text.strip() == WORDS
    assert msg.usage.input_tokens > 0 and msg.usage.output_tokens > 0
    sent = up.stats.last_body  # what the backend got: a chat request, the system prompt first
    assert sent["messages"][0] == {"role": "system", "content": "Be brief."} and sent["max_tokens"] == 64
    assert "system" not in sent


async def test_a_streamed_message_in_anthropics_event_order(upstream, gateway):
    up = await upstream("a", tokens=6)
    gw = await gateway(_policy(up))
    async with _client(gw).messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text.strip() == WORDS and final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    status, headers, raw = await _post(gw, {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    evs = _events(raw)
    assert all(name == data["type"] for name, data in evs), evs  # every event names its type
    kinds = [d["type"] for _, d in evs if d["type"] != "ping"]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds


async def test_errors_are_anthropic_shaped(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up))
    with pytest.raises(anthropic.AuthenticationError):
        await _client(gw, "sk-wrong").messages.create(model="m", max_tokens=8, messages=HELLO)
    status, _, raw = await _post(gw, {"model": "m", "messages": HELLO})  # no max_tokens
    body = orjson.loads(raw)
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        await _client(gw).messages.create(model="nope", max_tokens=8, messages=HELLO)
    # A feature chat cannot express: a 400 naming it, and no backend called.
    n = up.stats.requests
    with pytest.raises(anthropic.BadRequestError, match="top_k"):
        await _client(gw).messages.create(model="m", max_tokens=8, messages=HELLO, extra_body={"top_k": 5})
    assert up.stats.requests == n
    status, _, raw = await _post(gw, {"model": "m", "max_tokens": 8, "messages": "x"})
    assert status == 400 and orjson.loads(raw)["error"]["type"] == "invalid_request_error"


async def test_the_sdk_reads_the_gateways_request_id(upstream, gateway):
    # Anthropic's SDK reads `request-id` (message._request_id, APIStatusError.request_id): the
    # gateway's id, the one its logs and request log use, as x-request-id carries it.
    up = await upstream("a", tokens=2)
    gw = await gateway(_policy(up))
    c = _client(gw)
    msg = await c.messages.create(model="m", max_tokens=8, messages=HELLO, extra_headers={"x-request-id": "trace-1"})
    assert msg._request_id == "trace-1"
    async with c.messages.stream(model="m", max_tokens=8, messages=HELLO) as stream:
        await stream.get_final_message()
    assert stream.request_id and stream.request_id == stream.response.headers["x-request-id"]
    for call in (c.messages.create(model="nope", max_tokens=8, messages=HELLO),
                 _client(gw, "sk-wrong").messages.create(model="m", max_tokens=8, messages=HELLO),
                 c.messages.count_tokens(model="nope", messages=HELLO)):
        with pytest.raises(anthropic.APIStatusError) as exc:
            await call
        assert exc.value.request_id and exc.value.request_id == exc.value.response.headers["x-request-id"]
    count = await c.messages.with_raw_response.count_tokens(model="m", messages=HELLO, extra_headers={"x-request-id": "trace-2"})
    assert count.request_id == "trace-2"
    async with aiohttp.ClientSession() as http:  # other endpoints keep only x-request-id
        async with http.post(gw.url + "/v1/messages", json={"model": "m", "max_tokens": 8, "messages": HELLO},
                             headers={"x-api-key": KEY}) as r:
            assert r.status == 200 and r.headers["request-id"] == r.headers["x-request-id"]
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "m", "messages": HELLO},
                             headers={"authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200 and r.headers["x-request-id"] and "request-id" not in r.headers


async def test_a_failing_backend_fails_over_and_a_dead_route_is_an_api_error(upstream, gateway):
    bad = await upstream("bad", mode="error_500")
    good = await upstream("good", tokens=3)
    gw = await gateway(_policy(bad, good))
    msg = await _client(gw).messages.create(model="m", max_tokens=16, messages=HELLO)
    assert msg.content[0].text.strip() == "w0 w1 w2" and good.stats.requests == 1
    good.set(mode="error_503")
    with pytest.raises(anthropic.APIStatusError) as exc:
        await _client(gw).messages.create(model="m", max_tokens=16, messages=HELLO)
    assert exc.value.status_code >= 500 and exc.value.body["type"] == "error"  # type: ignore[index]


async def test_a_stream_cut_mid_answer_ends_with_an_error_event(upstream, gateway):
    up = await upstream("a", tokens=8, mode="cut", fail_after=3)
    gw = await gateway(_policy(up, routing={"continuation": False}))
    status, _, raw = await _post(gw, {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    evs = _events(raw)
    assert status == 200 and evs[-1][0] == "error" and evs[-1][1]["type"] == "error", evs[-3:]
    assert "message_stop" not in [d["type"] for _, d in evs]  # a cut stream never looks complete


async def test_cached_answers_replay_as_messages_and_events(upstream, gateway):
    up = await upstream("a", tokens=4)
    gw = await gateway(_policy(up))
    body = {"model": "m", "max_tokens": 32, "messages": HELLO, "temperature": 0}
    s1, h1, r1 = await _post(gw, body)
    s2, h2, r2 = await _post(gw, body)
    assert (s1, s2) == (200, 200) and h2["x-gateway-cache"] == "hit" and up.stats.requests == 1
    assert orjson.loads(r2)["content"] == orjson.loads(r1)["content"]
    s3, h3, r3 = await _post(gw, {**body, "stream": True})
    evs = _events(r3)
    assert h3["x-gateway-cache"] == "hit" and up.stats.requests == 1
    text = "".join(d["delta"].get("text", "") for _, d in evs if d["type"] == "content_block_delta")
    assert text == orjson.loads(r1)["content"][0]["text"] and evs[-1][1]["type"] == "message_stop"
    # The SDK reads the replayed stream as a whole message.
    async with _client(gw).messages.stream(model="m", max_tokens=32, messages=HELLO, extra_body={"temperature": 0}) as st:
        final = await st.get_final_message()
    assert final.content[0].text == text


async def test_quotas_count_a_messages_requests_tokens(upstream, gateway):
    up = await upstream("a", tokens=5)
    policy = _policy(up)
    policy["tenants"]["t"]["quota"] = {"rpm": 2}
    gw = await gateway(policy)
    c = _client(gw)
    for _ in range(2):
        await c.messages.create(model="m", max_tokens=8, messages=HELLO)
    with pytest.raises(anthropic.RateLimitError) as exc:
        await c.messages.create(model="m", max_tokens=8, messages=HELLO)
    assert exc.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


async def test_count_tokens_estimates_without_calling_a_backend(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up))
    small = await _client(gw).messages.count_tokens(model="m", messages=HELLO)
    big = await _client(gw).messages.count_tokens(model="m", messages=HELLO, system="x" * 4000)
    assert 0 < small.input_tokens < big.input_tokens and big.input_tokens >= 1000 and up.stats.requests == 0
    with pytest.raises(anthropic.AuthenticationError):
        await _client(gw, "sk-wrong").messages.count_tokens(model="m", messages=HELLO)
    with pytest.raises(anthropic.NotFoundError):
        await _client(gw).messages.count_tokens(model="nope", messages=HELLO)
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages/count_tokens", headers={"x-api-key": KEY},
                             json={"model": "m", "messages": HELLO, "max_tokens": 5}) as r:
            body = await r.json()
    assert r.status == 400 and body["error"]["type"] == "invalid_request_error" and "max_tokens" in body["error"]["message"]


async def test_the_key_may_come_as_x_api_key_or_bearer(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(_policy(up))
    body = {"model": "m", "max_tokens": 8, "messages": HELLO}
    assert (await _post(gw, body, {"x-api-key": KEY, "anthropic-version": "2023-06-01"}))[0] == 200
    assert (await _post(gw, body, {"authorization": f"Bearer {KEY}"}))[0] == 200
    status, _, raw = await _post(gw, body, {"x-api-key": "sk-nope"})
    assert status == 401 and orjson.loads(raw)["error"]["type"] == "authentication_error"
    assert "sk-nope" not in raw.decode() and KEY not in repr(up.stats.last_headers)  # keys never travel on


@pytest.mark.parametrize("prefill", [False, True])
async def test_a_cut_stream_is_continued_as_one_message(upstream, gateway, prefill):
    """A Messages stream answered through chat that breaks mid-answer is continued on the next
    backend (restarted and the delivered text skipped, or prefilled): one message, whole."""
    a = await upstream("a", tokens=8, mode="cut", fail_after=3)
    b = await upstream("b", tokens=8)
    policy = _policy(a, b)
    policy["backends"]["b"]["prefill"] = prefill
    gw = await gateway(policy)
    status, _, raw = await _post(gw, {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    evs = _events(raw)
    kinds = [d["type"] for _, d in evs if d["type"] != "ping"]
    assert status == 200 and kinds.count("message_start") == 1 and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert kinds.count("content_block_start") == 1 and "error" not in kinds
    text = "".join(d["delta"].get("text", "") for _, d in evs if d["type"] == "content_block_delta")
    if prefill:  # b went on from the delivered text: its own words follow (the fake restarts its count)
        assert text.startswith("w0 w1 w2") and len(text.split()) > 3, text
    else:
        assert text.strip() == " ".join(f"w{i}" for i in range(8)), text
    assert b.stats.requests == 1
    async with _client(gw).messages.stream(model="m", max_tokens=64, messages=HELLO) as stream:
        final = await stream.get_final_message()
    assert final.stop_reason == "end_turn" and final.content[0].text.startswith("w0 w1 w2")


async def test_a_failover_before_the_first_token_starts_a_fresh_message(upstream, gateway):
    """The first backend's stream fails before any content (its role chunk held, then an error
    event): the next one answers, and the client's stream still opens with its message_start."""
    a = await upstream("a", tokens=8, mode="error_event", fail_after=0)
    b = await upstream("b", tokens=4)
    gw = await gateway(_policy(a, b))
    status, _, raw = await _post(gw, {"model": "m", "max_tokens": 64, "messages": HELLO, "stream": True})
    kinds = [d["type"] for _, d in _events(raw) if d["type"] != "ping"]
    assert status == 200 and kinds[0] == "message_start" and kinds.count("message_start") == 1, kinds
    assert kinds[-1] == "message_stop" and a.stats.requests == 1 and b.stats.requests == 1


# ---- a final assistant turn (Anthropic's prefill) -----------------------------------------------

PREFILLED = [{"role": "user", "content": "Give me JSON"}, {"role": "assistant", "content": "w0 w1"}]


async def test_a_prefill_goes_only_to_chat_backends_that_continue_one(upstream, gateway):
    """A final assistant turn was a 400 on every chat backend, `prefill: true` or not (review
    helper's repro). It goes to the ones that continue it, past a first candidate that would
    start a new turn; a request without one still goes to that first candidate."""
    new_turn, continues = await upstream("a", tokens=6, prefill=False), await upstream("b", tokens=6)
    policy = _policy(new_turn, continues)
    policy["backends"]["b"]["prefill"] = True
    gw = await gateway(policy)
    c = _client(gw)
    msg = await c.messages.with_raw_response.create(model="m", max_tokens=64, messages=PREFILLED)
    assert msg.headers["x-gateway-backend"] == "b" and new_turn.stats.requests == 0
    assert continues.stats.last_body["messages"][-1] == {"role": "assistant", "content": "w0 w1"}
    assert (await msg.parse()).content[0].text.strip() == "w2 w3 w4 w5"  # what follows the prefill
    async with c.messages.stream(model="m", max_tokens=64, messages=PREFILLED) as s:
        assert (await s.get_final_text()).strip() == "w2 w3 w4 w5"
    plain = await c.messages.with_raw_response.create(model="m", max_tokens=64, messages=HELLO)
    assert plain.headers["x-gateway-backend"] == "a"
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages/count_tokens", json={"model": "m", "messages": PREFILLED},
                             headers={"x-api-key": KEY}) as r:
            assert r.status == 200, await r.text()


async def test_a_prefill_no_backend_continues_is_a_clear_400_before_any_call(upstream, gateway):
    up = await upstream("a", tokens=6, prefill=False)
    gw = await gateway(_policy(up))
    status, _, raw = await _post(gw, {"model": "m", "max_tokens": 16, "messages": PREFILLED})
    err = orjson.loads(raw)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert "prefill" in err["error"]["message"] and "continues" in err["error"]["message"]
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/messages/count_tokens", json={"model": "m", "messages": PREFILLED},
                             headers={"x-api-key": KEY}) as r:
            assert r.status == 400 and "prefill" in (await r.json())["error"]["message"]
    assert up.stats.requests == 0
