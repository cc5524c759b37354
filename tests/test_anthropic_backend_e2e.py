"""`kind: anthropic` backends end to end: a fake Anthropic Messages API upstream (tests/fake_anthropic.py)
behind the gateway, reached natively by the anthropic SDK and through translation by the openai SDK;
an overloaded (529) Anthropic backend fails over to an OpenAI one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import anthropic
import openai
import pytest

from gateway.tenants.auth import hash_key
from tests.fake_anthropic import FakeAnthropic

KEY, UPSTREAM_KEY = "sk-test", "sk-ant-upstream-key"
HELLO = [{"role": "user", "content": "Say something"}]
WORDS = " ".join(f"w{i}" for i in range(6))
TOOLS_A = [{"name": "get_weather", "description": "Weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
TOOLS_OA = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": TOOLS_A[0]["input_schema"]}}]


@pytest.fixture
async def fake_anthropic(monkeypatch) -> AsyncIterator[FakeAnthropic]:
    monkeypatch.setenv("TEST_ANTHROPIC_KEY", UPSTREAM_KEY)
    fake = FakeAnthropic("an", key=UPSTREAM_KEY, words=6, model="claude-fake-1")
    await fake.start()
    yield fake
    await fake.stop()


def _policy(an: FakeAnthropic, *openai_ups, fo: bool = False):
    backends = {"an": {"url": an.url, "kind": "anthropic", "api_key_env": "TEST_ANTHROPIC_KEY", "models": {"a": "claude-fake-1", "fo": "claude-fake-1"}}}
    for u in openai_ups:
        backends[u.name] = {"url": u.url, "models": ["fo"]}
    models = {"a": {"backends": ["an"]}}
    if fo:
        models["fo"] = {"backends": ["an", *(u.name for u in openai_ups)], "strategy": "ordered"}
    return {"backends": backends, "models": models, "reload": {"watch": False}, "cache": {"enabled": False},
            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}}


@pytest.fixture
async def clients():
    """Factory: an anthropic or openai SDK client of the gateway; closed while the loop runs."""
    made: list = []

    def make(gw, kind: str):
        c = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10) if kind == "anthropic" \
            else openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0, timeout=10)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def test_a_messages_client_reaches_an_anthropic_backend_natively(fake_anthropic, gateway, clients):
    gw = await gateway(_policy(fake_anthropic))
    c = clients(gw, "anthropic")
    msg = await c.messages.create(model="a", max_tokens=64, messages=HELLO, system="Be brief.")
    assert msg.content[0].text == WORDS and msg.stop_reason == "end_turn" and msg.usage.input_tokens > 0
    st = fake_anthropic.stats
    assert st.last_auth == "x-api-key" and st.last_headers.get("x-api-key") == UPSTREAM_KEY  # the backend's key, never the caller's
    assert KEY not in repr(st.last_headers) and st.last_headers.get("anthropic-version")
    assert st.last_body["model"] == "claude-fake-1" and st.last_body["system"] == "Be brief."
    async with c.messages.stream(model="a", max_tokens=64, messages=HELLO, extra_body={"top_k": 5}) as stream:
        text = "".join([t async for t in stream.text_stream])  # top_k: native, so not refused
        final = await stream.get_final_message()
    assert text == WORDS and final.stop_reason == "end_turn" and final.usage.output_tokens > 0


async def test_the_clients_beta_headers_and_the_backends_own_headers_reach_it(fake_anthropic, upstream, gateway, clients):
    """`anthropic-beta` (1M context, interleaved thinking: what Claude Code sends) was dropped on
    the way, as was every other client header: beta features went off without a word (review
    helper's repro). The beta headers a backend's API reads go on, after the backend's own
    `headers:`; nothing else of the client's does (not OpenAI-Organization or -Project)."""
    up = await upstream("oa", tokens=2)
    policy = _policy(fake_anthropic, up)
    policy["backends"]["an"]["headers"] = {"Anthropic-Beta": "context-1m-2025-08-07", "X-Proxy-Route": "eu"}
    policy["models"]["fo"] = {"backends": [up.name]}
    gw = await gateway(policy)
    c = clients(gw, "anthropic")
    await c.beta.messages.create(model="a", max_tokens=16, messages=HELLO, betas=["interleaved-thinking-2025-05-14"])
    h = {k.lower(): v for k, v in fake_anthropic.stats.last_headers.items()}
    assert h["anthropic-beta"] == "context-1m-2025-08-07, interleaved-thinking-2025-05-14" and h["x-proxy-route"] == "eu"
    oc = clients(gw, "openai")
    await oc.chat.completions.create(model="a", messages=HELLO, extra_headers={"anthropic-beta": "b1", "OpenAI-Organization": "org-x"})
    h = {k.lower(): v for k, v in fake_anthropic.stats.last_headers.items()}
    assert h["anthropic-beta"] == "context-1m-2025-08-07, b1" and "openai-organization" not in h  # through translation too
    await oc.chat.completions.create(model="fo", messages=HELLO, extra_headers={"anthropic-beta": "b1", "OpenAI-Beta": "assistants=v2",
                                                                               "OpenAI-Project": "proj-x"})
    h = {k.lower(): v for k, v in up.stats.last_headers.items()}
    assert h.get("openai-beta") == "assistants=v2" and "anthropic-beta" not in h and "openai-project" not in h


def test_a_backends_headers_may_not_be_the_gateways_own():
    from gateway.config.policy import PolicyError, parse_policy

    base = "backends:\n  a: {url: 'http://127.0.0.1:1/v1', models: [m], headers: %s}\n"
    assert parse_policy(base % "{X-Team: search}").backends["a"].headers == {"x-team": "search"}
    for bad in ("{Authorization: 'Bearer x'}", "{x-api-key: k}", "{Content-Length: '1'}", "{'bad name': v}", "{X-A: \"a\\nb\"}",
                "{Proxy-Authorization: x}"):
        with pytest.raises(PolicyError, match="headers"):
            parse_policy(base % bad)


def test_a_backends_header_values_are_never_shown_and_secret_ones_come_from_the_environment(monkeypatch):
    """An inline `api-key` (Azure) or `Helicone-Auth` was shown to viewer keys by GET /admin/policy
    (review of the change): header values are hidden there, and `headers_env` reads a secret from
    the environment, as api_key_env does."""
    from gateway.admin.policy_view import env_warnings, redacted
    from gateway.config.policy import PolicyError, parse_policy
    from gateway.routing.backends import Backend, BackendState, Slots

    text = ("backends:\n  az: {url: 'http://127.0.0.1:1/v1', models: [m], headers: {api-key: INLINE-SECRET},"
            " headers_env: {Helicone-Auth: TEST_HELICONE}}\n")
    policy = parse_policy(text)
    view = redacted(policy)
    assert "INLINE-SECRET" not in repr(view) and view["backends"]["az"]["headers"] == {"api-key": "<hidden>"}
    assert view["backends"]["az"]["headers_env"] == {"helicone-auth": "TEST_HELICONE"}  # a variable's name is no secret
    assert env_warnings(policy) == ["backends.az.headers_env.helicone-auth: environment variable TEST_HELICONE is not set here"]
    with pytest.raises(ValueError, match="TEST_HELICONE is not set"):
        Backend("az", policy.backends["az"], BackendState(slots=Slots(4)))
    monkeypatch.setenv("TEST_HELICONE", "Bearer sk-h")
    b = Backend("az", policy.backends["az"], BackendState(slots=Slots(4)))
    assert b.headers["helicone-auth"] == "Bearer sk-h" and b.headers["api-key"] == "INLINE-SECRET"
    with pytest.raises(PolicyError, match="environment variable"):
        parse_policy(text.replace("TEST_HELICONE", "not a var"))


async def test_standard_only_reaches_an_anthropic_backend(fake_anthropic, gateway, clients):
    # The client opts out of Priority Tier capacity: dropping the field would give it Anthropic's `auto`.
    gw = await gateway(_policy(fake_anthropic))
    c = clients(gw, "anthropic")
    await c.messages.create(model="a", max_tokens=16, messages=HELLO, service_tier="standard_only")
    assert fake_anthropic.stats.last_body["service_tier"] == "standard_only"


async def test_a_chat_client_reaches_an_anthropic_backend_through_translation(fake_anthropic, gateway, clients):
    gw = await gateway(_policy(fake_anthropic))
    oc = clients(gw, "openai")
    r = await oc.chat.completions.create(model="a", messages=[{"role": "system", "content": "Be brief."}, *HELLO])
    assert r.choices[0].message.content == WORDS and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    sent = fake_anthropic.stats.last_body
    assert sent["system"] == "Be brief." and sent["max_tokens"] > 0 and sent["messages"] == HELLO
    stream = await oc.chat.completions.create(model="a", messages=HELLO, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(pieces) == WORDS and usage is not None and usage.completion_tokens > 0  # token for token
    with pytest.raises(openai.BadRequestError, match="seed"):  # what Anthropic cannot do: refused, not dropped
        await oc.chat.completions.create(model="a", messages=HELLO, seed=7)


async def test_tool_calls_stream_through_the_translation(fake_anthropic, gateway, clients):
    fake_anthropic.set(tool_call="get_weather", tool_input={"city": "Paris"})
    gw = await gateway(_policy(fake_anthropic))
    oc = clients(gw, "openai")
    stream = await oc.chat.completions.create(model="a", messages=HELLO, tools=TOOLS_OA, stream=True)
    args, name, finish = "", None, None
    async for chunk in stream:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name = tc.function.name or name
            args += tc.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert name == "get_weather" and args.replace(" ", "") == '{"city":"Paris"}' and finish == "tool_calls"
    r = await oc.chat.completions.create(model="a", messages=HELLO, tools=TOOLS_OA)
    call = r.choices[0].message.tool_calls[0]
    follow = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
              {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    fake_anthropic.set(tool_call=None)
    r2 = await oc.chat.completions.create(model="a", messages=follow, tools=TOOLS_OA)
    assert r2.choices[0].message.content == WORDS
    turn = fake_anthropic.stats.last_body["messages"]
    assert turn[-1]["content"][0]["type"] == "tool_result" and turn[-1]["content"][0]["tool_use_id"] == call.id
    # The anthropic SDK natively, tool use streamed in input_json_delta pieces.
    fake_anthropic.set(tool_call="get_weather")
    c = clients(gw, "anthropic")
    async with c.messages.stream(model="a", max_tokens=64, messages=HELLO, tools=TOOLS_A) as s:
        final = await s.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


async def test_an_overloaded_anthropic_backend_fails_over_to_an_openai_one(fake_anthropic, upstream, gateway, clients):
    oa = await upstream("oa", tokens=3)
    fake_anthropic.set(fail_status=529, fail_count=0)
    gw = await gateway(_policy(fake_anthropic, oa, fo=True))
    c = clients(gw, "anthropic")
    raw = await c.messages.with_raw_response.create(model="fo", max_tokens=32, messages=HELLO)
    msg = await raw.parse()
    assert raw.headers["x-gateway-backend"] == "oa" and msg.content[0].text.strip() == "w0 w1 w2"
    assert fake_anthropic.stats.by_status.get(529, 0) >= 1 and oa.stats.requests == 1
    oc = clients(gw, "openai")
    r = await oc.chat.completions.with_raw_response.create(model="fo", messages=HELLO)
    assert r.headers["x-gateway-backend"] == "oa"  # cooling after its 529: the OpenAI backend answers


async def test_the_anthropic_backend_is_probed_with_its_own_headers(fake_anthropic, gateway):
    policy = _policy(fake_anthropic)
    policy["health"] = {"probe_interval_ms": 100}
    gw = await gateway(policy)
    for _ in range(40):
        if fake_anthropic.stats.models_requests:
            break
        await asyncio.sleep(0.05)
    assert fake_anthropic.stats.models_requests >= 1  # GET /v1/models answered: x-api-key and anthropic-version sent
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 200


async def test_tokens_of_anthropic_answers_are_counted(fake_anthropic, gateway, clients):
    """Usage read from an Anthropic backend (whole and streamed, natively and translated) reaches
    the token accounting: quotas and gateway_tokens_total count it."""
    policy = _policy(fake_anthropic)
    policy["tenants"]["t"]["quota"] = {"tpm": 100000}
    gw = await gateway(policy)
    c, oc = clients(gw, "anthropic"), clients(gw, "openai")
    await c.messages.create(model="a", max_tokens=64, messages=HELLO)
    async with c.messages.stream(model="a", max_tokens=64, messages=HELLO) as s:
        await s.get_final_message()
    await oc.chat.completions.create(model="a", messages=HELLO)
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    line = next(ln for ln in text.splitlines() if ln.startswith("gateway_tokens_total{") and 'backend="an"' in ln and 'kind="completion"' in ln)
    assert float(line.rsplit(" ", 1)[1]) == 3 * 6  # six words each, three answers


_CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{**_CALL, "id": ["a"]}]},
     {"role": "tool", "tool_call_id": ["a"], "content": "r"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{**_CALL, "id": "a"}]},
     {"role": "tool", "tool_call_id": {"x": 1}, "content": "r"}],
], ids=["tool_calls-a-number", "a-call-id-a-list", "a-tool_call_id-an-object"])
async def test_tool_fields_of_the_wrong_type_are_a_400_on_the_way_to_an_anthropic_backend(fake_anthropic, gateway, messages):
    # The translation read them as it expected (iterating a number, hashing a list): a 500 with a
    # logged traceback (review helper's repro).
    gw = await gateway(_policy(fake_anthropic))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "a", "messages": messages},
                             headers={"authorization": f"Bearer {KEY}"}) as r:
            body = await r.json()
    assert r.status == 400 and body["error"]["type"] == "invalid_request_error", body
    assert fake_anthropic.stats.requests == 0
