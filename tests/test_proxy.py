"""End to end through the gateway to fake upstreams, with the official openai SDK as the client."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "Say hello"}]


async def test_async_client_non_stream_gets_the_whole_answer(upstream, gateway):
    up = await upstream("a", tokens=6)
    gw = await gateway(simple_policy(up))
    r = await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 w1 w2 w3 w4 w5 "
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 6


async def test_async_client_stream_arrives_complete_and_in_order(upstream, gateway):
    up = await upstream("a", tokens=40, itl_ms=1)
    gw = await gateway(simple_policy(up))
    stream = await gw.client().chat.completions.create(
        model="gpt-test", messages=MSG, stream=True, stream_options={"include_usage": True}
    )
    parts, finish, usage = [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == "".join(f"w{i} " for i in range(40))
    assert finish == "stop"
    assert usage is not None and usage.completion_tokens == 40


async def test_sync_client_stream_and_non_stream(upstream, gateway):
    up = await upstream("a", tokens=5)
    gw = await gateway(simple_policy(up))

    def use_sync_client() -> tuple[str, str]:
        client = gw.sync_client()
        whole = client.chat.completions.create(model="gpt-test", messages=MSG).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(model="gpt-test", messages=MSG, stream=True)
            if c.choices
        )
        return whole, streamed

    whole, streamed = await asyncio.to_thread(use_sync_client)
    assert whole == streamed == "w0 w1 w2 w3 w4 "


async def test_legacy_completions_stream_and_non_stream(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up))
    c = gw.client()
    r = await c.completions.create(model="gpt-test", prompt="Once upon")
    assert r.choices[0].text == "w0 w1 w2 "
    s = await c.completions.create(model="gpt-test", prompt="Once upon", stream=True)
    assert "".join([ch.choices[0].text async for ch in s if ch.choices]) == "w0 w1 w2 "


async def test_embeddings_pass_through(upstream, gateway):
    up = await upstream("a")
    policy = simple_policy(up, model="embed-test")
    policy["backends"]["a"]["endpoints"] = ["embeddings"]
    gw = await gateway(policy)
    r = await gw.client().embeddings.create(model="embed-test", input=["a", "b"])
    assert len(r.data) == 2 and r.data[1].embedding == [0.1, 0.2, 0.3]


async def test_public_model_name_is_mapped_to_the_upstream_name(upstream, gateway):
    up = await upstream("a")
    policy = {"backends": {"a": {"url": up.url, "models": {"fast": "vendor-model-2025"}}}}
    gw = await gateway(policy)
    await gw.client().chat.completions.create(model="fast", messages=MSG)
    assert up.stats.models == ["vendor-model-2025"]


async def test_response_headers_follow_the_contract(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    raw = await gw.client().chat.completions.with_raw_response.create(
        model="gpt-test", messages=MSG, extra_headers={"x-request-id": "req-123"}
    )
    h = raw.headers
    assert h["x-request-id"] == "req-123"
    assert h["x-gateway-backend"] == "a"
    assert "x-gateway-class" not in h  # this model does not route by class: not classified
    assert h["x-gateway-cache"] in ("hit", "miss", "bypass")
    assert float(h["x-gateway-queue-ms"]) >= 0
    # the request id reaches the backend too, and the client's own key never does
    sent = {k.lower(): v for k, v in up.stats.last_headers.items()}
    assert sent["x-request-id"] == "req-123"
    assert sent["accept-encoding"] == "identity"  # we parse what comes back: no compression upstream
    assert "sk-test" not in str(up.stats.last_headers)


async def test_backend_api_key_comes_from_the_environment(upstream, gateway, monkeypatch):
    monkeypatch.setenv("FAKE_A_KEY", "sk-upstream-secret")
    up = await upstream("a")
    policy = simple_policy(up)
    policy["backends"]["a"]["api_key_env"] = "FAKE_A_KEY"
    gw = await gateway(policy)
    await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert up.stats.last_headers["Authorization"] == "Bearer sk-upstream-secret"


async def test_unknown_fields_pass_through_untouched(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    await gw.client().chat.completions.create(
        model="gpt-test", messages=MSG, extra_body={"vendor_knob": {"x": [1, 2]}}, seed=7
    )
    assert up.stats.last_body["vendor_knob"] == {"x": [1, 2]} and up.stats.last_body["seed"] == 7


async def test_models_lists_what_the_tenant_may_use(upstream, gateway):
    up = await upstream("a")
    policy = {
        "backends": {"a": {"url": up.url, "models": ["m1", "m2", "m3"]}},
        "tenants": {
            "acme": {"key_sha256": [_sha("sk-acme")], "models": ["m1", "m3"]},
            "all": {"key_sha256": [_sha("sk-all")]},
        },
    }
    gw = await gateway(policy)
    ids = [m.id async for m in gw.client("sk-acme").models.list()]
    assert ids == ["m1", "m3"]
    ids = [m.id async for m in gw.client("sk-all").models.list()]
    assert ids == ["m1", "m2", "m3"]
    # models.retrieve (GET /v1/models/{id}) was an "unknown path" 404 (review helper's repro)
    got = await gw.client("sk-acme").models.retrieve("m3")
    assert got.id == "m3" and got.object == "model"
    for key, model in (("sk-acme", "m2"), ("sk-all", "nope"), ("sk-all", "org/m1")):
        with pytest.raises(openai.NotFoundError) as exc:
            await gw.client(key).models.retrieve(model)
        assert exc.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        await gw.client("sk-wrong").models.retrieve("m1")


async def test_a_null_stream_is_not_streamed(upstream, gateway):
    """OpenAI's schema allows `"stream": null` (clients that write out None send it): it was a 400
    on every endpoint (review helper's repro). It reads as false, and the backend never sees it."""
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up))
    c = gw.client()
    got = await c.post("/chat/completions", cast_to=object, body={"model": "gpt-test", "messages": MSG, "stream": None})
    assert got["object"] == "chat.completion" and "stream" not in up.stats.last_body
    got = await c.post("/completions", cast_to=object, body={"model": "gpt-test", "prompt": "hi", "stream": None})
    assert got["object"] == "text_completion"
    with pytest.raises(openai.BadRequestError):
        await c.post("/chat/completions", cast_to=object, body={"model": "gpt-test", "messages": MSG, "stream": "yes"})


async def test_health_ready_metrics_and_admin_endpoints(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up))
    c = gw.client()
    s = await c.chat.completions.create(model="gpt-test", messages=MSG, stream=True)
    async for _ in s:
        pass
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/healthz") as r:
            assert r.status == 200
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 200 and (await r.json())["healthy_backends"] == ["a"]
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
        for name in (
            "gateway_requests_total",
            "gateway_request_duration_seconds",
            "gateway_ttft_seconds",
            "gateway_inter_token_seconds",
            "gateway_backend_inflight",
            "gateway_backend_healthy",
        ):
            assert name in text, name
        assert 'gateway_requests_total{backend="a",cache="bypass",class="none",code="200",model="gpt-test"} 1.0' in text
        async with http.get(gw.url + "/admin/backends") as r:
            body = await r.json()
        a = body["backends"]["a"]
        assert a["health"] == "healthy" and a["inflight"] == 0 and a["requests"] == 1
        assert a["ttft_p50_ms"] is not None and a["errors"] == 0


async def test_route_explain_calls_no_backend(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json={"model": "gpt-test", "messages": MSG}) as r:
            body = await r.json()
    assert up.stats.requests == 0
    assert body["class"] in ("simple", "complex") and body["chosen"] == "a"
    assert body["cache"] in ("hit", "miss", "bypass")
    assert body["candidates"][0]["health"] == "healthy" and "predicted_ttft_ms" in body["candidates"][0]
    assert body["reasons"]


def _sha(key: str) -> str:
    from gateway.tenants.auth import hash_key

    return hash_key(key)


async def test_raw_sse_bytes_are_forwarded_unchanged(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up))
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=body) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            raw = await r.read()
    events = raw.split(b"\n\n")
    assert events[-2] == b"data: [DONE]" and events[-1] == b""
    first = orjson.loads(events[0][6:])
    assert first["choices"][0]["delta"]["role"] == "assistant"


def _auto_policy(small, big, **classifier):
    return {
        "backends": {
            "small": {"url": small.url, "models": ["tiny"]},
            "big": {"url": big.url, "models": ["large"]},
        },
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "classifier": classifier,
    }


async def test_auto_sends_simple_prompts_to_the_simple_list_and_hard_ones_elsewhere(upstream, gateway):
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_auto_policy(small, big))
    c = gw.client()
    easy = await c.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "What is the capital of France?"}]
    )
    assert easy.headers["x-gateway-class"] == "simple" and easy.headers["x-gateway-backend"] == "small"
    hard = await c.chat.completions.with_raw_response.create(
        model="auto",
        messages=[{"role": "user", "content": "Write a Python function that merges two sorted linked lists, with tests."}],
    )
    assert hard.headers["x-gateway-class"] == "complex" and hard.headers["x-gateway-backend"] == "big"
    # each backend got its own model name
    assert small.stats.models == ["tiny"] and big.stats.models == ["large"]


async def test_tools_force_complex_and_explain_says_why(upstream, gateway):
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_auto_policy(small, big))
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json=body) as r:
            out = await r.json()
    assert out["class"] == "complex" and out["rule"] and out["chosen"] == "big"
    assert out["features"]["prompt_tokens"] >= 1 and 0 <= out["score"] <= 1
    assert out["threshold"] is not None
    body.pop("tools")
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json=body) as r:
            out = await r.json()
    assert out["class"] == "simple" and out["rule"] is None and out["chosen"] == "small"


async def test_a_threshold_of_zero_sends_everything_to_the_complex_list(upstream, gateway):
    small, big = await upstream("small"), await upstream("big")
    policy = _auto_policy(small, big)
    policy["models"]["auto"]["threshold"] = 0.0
    gw = await gateway(policy)
    raw = await gw.client().chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-gateway-class"] == "complex"


async def test_classify_all_labels_requests_to_fixed_routes_too(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up, classifier={"classify_all": True}))
    raw = await gw.client().chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
    assert raw.headers["x-gateway-class"] in ("simple", "complex")
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            assert "gateway_classified_total{class=" in await r.text()


async def test_a_request_hashes_its_key_once(upstream, gateway, monkeypatch):
    """The edge authenticates the key before it reads the body and hands the tenant to the
    pipeline, which does not hash it again; a wrong key is still a 401 with nothing sent upstream."""
    import openai
    import pytest

    from gateway.tenants import auth

    up = await upstream("a", tokens=2)
    gw = await gateway({**simple_policy(up), "tenants": {"acme": {"key_sha256": [auth.hash_key("sk-acme")]}}})
    hashed: list[str] = []
    real = auth.hash_key
    monkeypatch.setattr(auth, "hash_key", lambda key: hashed.append(key) or real(key))
    r = await gw.client("sk-acme").chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 w1 " and hashed == ["sk-acme"]
    with pytest.raises(openai.AuthenticationError):
        await gw.client("sk-wrong").chat.completions.create(model="gpt-test", messages=MSG)
    assert up.stats.requests == 1
