"""Bad input gets a clear OpenAI-shaped error naming the field; nothing crashes, nothing is sent upstream."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from gateway.tenants.auth import hash_key
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


def _tenant_policy(up, **tenant):
    policy = simple_policy(up)
    policy["backends"][up.name]["models"] = ["gpt-test", "secret-model"]
    policy["tenants"] = {"acme": {"key_sha256": [hash_key("sk-acme")], **tenant}}
    return policy


async def test_missing_and_wrong_keys_are_401_authentication_errors(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_tenant_policy(up))
    with pytest.raises(openai.AuthenticationError) as exc:
        await gw.client("sk-wrong").chat.completions.create(model="gpt-test", messages=MSG)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-test", "messages": MSG}) as r:
            assert r.status == 401
            err = (await r.json())["error"]
            assert set(err) == {"message", "type", "param", "code"} and "missing API key" in err["message"]
    assert up.stats.requests == 0


async def test_a_model_the_tenant_may_not_use_is_403(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_tenant_policy(up, models=["gpt-test"]))
    with pytest.raises(openai.PermissionDeniedError) as exc:
        await gw.client("sk-acme").chat.completions.create(model="secret-model", messages=MSG)
    assert "secret-model" in exc.value.message
    r = await gw.client("sk-acme").chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content


async def test_a_key_sent_twice_reaches_the_backend_once_as_the_gateway_read_it(upstream, gateway):
    # The gateway reads the last of a duplicated key; a backend whose parser kept the first would
    # get a model the tenant may not use and more max_tokens than its quota reserved.
    up = await upstream("a", tokens=1)
    gw = await gateway(_tenant_policy(up, models=["gpt-test"]))
    raw = (b'{"model": "secret-model", "max_tokens": 100000, "messages": [{"role": "user", "content": "hi"}],'
           b' "model": "gpt-test", "max_tokens": 5}')
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"}
        async with http.post(gw.url + "/v1/chat/completions", data=raw, headers=headers) as r:
            assert r.status == 200, await r.text()
    sent = up.stats.last_raw
    assert sent.count('"model"') == 1 and sent.count('"max_tokens"') == 1, sent
    assert orjson.loads(sent)["model"] == "gpt-test" and orjson.loads(sent)["max_tokens"] == 5


async def test_unknown_model_is_404(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    with pytest.raises(openai.NotFoundError) as exc:
        await gw.client().chat.completions.create(model="nope", messages=MSG)
    assert exc.value.code == "model_not_found" and "'nope'" in exc.value.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": MSG}, "model"),
        ({"model": "gpt-test"}, "messages"),
        ({"model": "gpt-test", "messages": []}, "messages"),
        ({"model": "gpt-test", "messages": "hi"}, "messages"),
        ({"model": "gpt-test", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "gpt-test", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "gpt-test", "messages": MSG, "stream": "yes please"}, "stream"),
        ({"model": "gpt-test", "messages": MSG, "stream": "yes"}, "stream"),  # strict: no "yes"/"1"/1
        ({"model": "gpt-test", "messages": MSG, "stream": 1}, "stream"),
        ({"model": "gpt-test", "messages": MSG, "service_tier": "ultra"}, "service_tier"),
        ({"model": "gpt-test", "messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"model": "gpt-test", "messages": MSG, "temperature": 7}, "temperature"),
        # Numbers strict: the backend would get the string the gateway read as a number.
        ({"model": "gpt-test", "messages": MSG, "max_tokens": "5"}, "max_tokens"),
        ({"model": "gpt-test", "messages": MSG, "max_tokens": True}, "max_tokens"),
        ({"model": "gpt-test", "messages": MSG, "max_tokens": 5.5}, "max_tokens"),
        ({"model": "gpt-test", "messages": MSG, "max_completion_tokens": True}, "max_completion_tokens"),
        ({"model": "gpt-test", "messages": MSG, "temperature": "0"}, "temperature"),
        ({"model": "gpt-test", "messages": MSG, "top_p": "1"}, "top_p"),
        ({"model": "gpt-test", "messages": MSG, "n": "2"}, "n"),
        ({"model": 42, "messages": MSG}, "model"),
    ],
)
async def test_invalid_bodies_are_400_naming_the_field(upstream, gateway, body, field):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    with pytest.raises(openai.BadRequestError) as exc:
        await _post(gw, body)
    assert exc.value.body["param"] == field, exc.value.body  # type: ignore[index]
    assert field in exc.value.message
    assert up.stats.requests == 0


async def test_numbers_in_their_json_types_pass(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    body = {"model": "gpt-test", "messages": MSG, "max_tokens": 5, "temperature": 0, "top_p": 1, "n": 1}
    await _post(gw, body)
    await _post(gw, {**body, "temperature": 0.5, "top_p": 0.9, "max_tokens": None})
    await _post(gw, {**body, "max_tokens": 100.0, "n": 1.0})  # whole floats are integers in JSON
    assert up.stats.requests == 3


async def _post(gw, body):
    # The SDK would refuse some of these bodies itself; send them raw and map like the SDK does.
    return await gw.client().post("/chat/completions", cast_to=object, body=body)


async def test_a_body_nested_deeper_than_can_be_re_encoded_is_a_400_and_no_backends_fault(upstream, gateway):
    # orjson reads 1024 levels and writes ~255: every backend gets a re-encoded body.
    up = await upstream("a")
    policy = simple_policy(up)
    policy["backends"]["a"]["models"] = {"gpt-test": "upstream-name"}
    gw = await gateway(policy)
    raw = b'{"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "x_vendor": ' + b"[" * 300 + b"]" * 300 + b"}"
    # Cacheable too (temperature 0): its cache key is the canonical JSON of the body, which was a
    # 500 with a traceback logged (review helper's repro).
    cacheable = raw[:-1] + b', "temperature": 0}'
    async with aiohttp.ClientSession() as http:
        for body in (raw, raw, cacheable, cacheable):
            async with http.post(gw.url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 400
                assert "nested too deeply" in (await r.json())["error"]["message"]
        async with http.get(gw.url + "/admin/backends") as r:
            backend = (await r.json())["backends"]["a"]
    assert up.stats.requests == 0 and backend["health"] == "healthy" and backend["consecutive_failures"] == 0


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"", b'"text"'])
async def test_non_json_or_non_object_bodies_are_400(upstream, gateway, raw):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


async def test_bodies_over_the_limit_are_413(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up, server={"max_body_bytes": 1000}))
    big = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "x" * 5000}]})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=big) as r:
            assert r.status == 413
            assert (await r.json())["error"]["code"] == "request_too_large"

        async def chunked():  # no Content-Length: the limit still holds while reading
            for _ in range(10):
                yield b"x" * 500

        async with http.post(gw.url + "/v1/chat/completions", data=chunked()) as r:
            assert r.status == 413
    assert up.stats.requests == 0


async def test_a_body_of_more_items_than_server_max_items_is_a_400_on_every_endpoint(upstream, gateway):
    """Messages, their content parts and tools count together (server.max_items): validating and
    classifying cost the event loop per item, and 4 MiB of empty messages (145,000) took ~0.5 s of
    it. Counted before validation; in each endpoint's own error shape; nothing sent upstream."""
    up = await upstream("a")
    gw = await gateway(simple_policy(up, server={"max_items": 10}))
    parts = [{"type": "text", "text": "hi"}] * 4
    fits = [{"role": "user", "content": parts}, {"role": "user", "content": "and"}] + [{"role": "user", "content": "x"}] * 4
    client = gw.client()
    await client.chat.completions.create(model="gpt-test", messages=fits)  # 6 messages + 4 parts
    for messages, tools in ((fits + [{"role": "user", "content": "one more"}], None), (fits, [{"type": "function", "function": {"name": "f"}}])):
        with pytest.raises(openai.BadRequestError) as exc:
            await client.chat.completions.create(model="gpt-test", messages=messages, **({"tools": tools} if tools else {}))
        assert "server.max_items" in exc.value.message and exc.value.body["param"] in ("messages", "tools")
    with pytest.raises(openai.BadRequestError) as exc:
        await client.responses.create(model="gpt-test", input=[{"role": "user", "content": "x"}] * 11)
    assert exc.value.body["param"] == "input"
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {"model": "gpt-test", "messages": [{"role": "user", "content": "x"}] * 11}
            async with http.post(gw.url + path, json={**body, **({"max_tokens": 5} if path == "/v1/messages" else {})}) as r:
                err = await r.json()
                assert r.status == 400 and err["type"] == "error" and "server.max_items" in err["error"]["message"], (path, err)
    assert up.stats.requests == 1


async def test_bad_headers_are_400(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    for headers, param in (({"x-request-timeout-ms": "soon"}, "x-request-timeout-ms"), ({"x-priority": "urgent"}, "x-priority")):
        with pytest.raises(openai.BadRequestError) as exc:
            await gw.client().chat.completions.create(model="gpt-test", messages=MSG, extra_headers=headers)
        assert exc.value.body["param"] == param  # type: ignore[index]


async def test_every_openai_service_tier_is_accepted(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    for tier in ("auto", "default", "flex", "priority", "scale"):
        r = await _post(gw, {"model": "gpt-test", "messages": MSG, "service_tier": tier})
        assert r["choices"], tier  # type: ignore[index]
    assert up.stats.requests == 5


async def test_unknown_paths_are_404_in_openai_shape(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/v1/nothing-here") as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "invalid_request_error"


async def test_odd_bodies_never_crash_the_gateway(upstream, gateway):
    """A seeded spray of odd-but-JSON bodies: every answer is a 200 or an OpenAI-shaped 4xx."""
    import random

    up = await upstream("a", tokens=1)
    policy = simple_policy(up)
    policy["models"]["auto"] = {"simple": ["a"], "complex": ["a"]}  # the classifier sees every body too
    gw = await gateway(policy)
    rng = random.Random(7)
    values = [None, 0, -1, 1.5, 10**30, "", "x" * 3000, [], {}, [1, "a"], {"k": [None]}, True, "\u202e\U0001f600"]

    def odd():
        msg = {"role": rng.choice(["user", "system", "assistant", "tool", "developer", 5, None]), "content": rng.choice(values)}
        if rng.random() < 0.3:
            msg["content"] = [{"type": rng.choice(["text", "image_url", "x"]), "text": rng.choice(values)}]
        body = {"model": rng.choice(["gpt-test", "auto", "", None, 3]), "messages": [msg] * rng.randint(0, 3)}
        for key in rng.sample(["stream", "max_tokens", "temperature", "tools", "response_format", "n", "stop"], 3):
            body[key] = rng.choice(values)
        return body

    async with aiohttp.ClientSession() as http:
        for _ in range(150):
            async with http.post(gw.url + "/v1/chat/completions", json=odd()) as r:
                raw = await r.read()
                assert r.status in (200, 400, 404), (r.status, raw[:300])
                if r.status != 200:
                    assert set(orjson.loads(raw)["error"]) == {"message", "type", "param", "code"}
            async with http.post(gw.url + "/v1/route/explain", json=odd()) as r:
                assert r.status in (200, 400, 404), (r.status, await r.text())


@pytest.mark.parametrize("allowed", [None, ["gpt-test"]])
async def test_a_huge_model_name_comes_back_cut_in_the_error(upstream, gateway, allowed):
    """404 (no such model) or 403 (not the tenant's): the message quotes the name, cut."""
    up = await upstream("a")
    gw = await gateway(_tenant_policy(up, **({} if allowed is None else {"models": allowed})))
    model = "m" * 1_000_000
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": model, "messages": MSG},
                             headers={"Authorization": "Bearer sk-acme"}) as r:
            raw = await r.read()
    assert r.status == (404 if allowed is None else 403) and len(raw) < 1000
    assert "(1000000 characters)" in orjson.loads(raw)["error"]["message"]


async def test_a_body_of_more_json_objects_than_the_gateway_holds_is_a_413(upstream, gateway):
    """A field the gateway passes on, filled with 4 MiB of `{}`: ~100 MB decoded, held for the
    whole upstream call (five in flight took the process from 68 to 612 MB; review helper's
    repro). More than MAX_CONTAINERS objects and arrays is a 413 before validation; a body whose
    strings hold many braces (code) is counted exactly, not refused on its bytes."""
    from gateway.wire.openai_wire import MAX_CONTAINERS

    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    bomb = orjson.dumps({"model": "gpt-test", "messages": MSG, "metadata_x": [{}] * (MAX_CONTAINERS + 1)})
    code = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "{[" * (MAX_CONTAINERS + 1)}]})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=bomb, headers={"Content-Type": "application/json"}) as r:
            err = await r.json()
            assert r.status == 413 and "JSON objects and arrays" in err["error"]["message"], err
        async with http.post(gw.url + "/v1/chat/completions", data=code, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200, await r.text()
    assert up.stats.requests == 1
