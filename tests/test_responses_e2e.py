"""The Responses API through the gateway, over real sockets, with the official SDK (sync and async)."""

from __future__ import annotations

import asyncio
import time
import uuid

import aiohttp
import openai
import pytest

from gateway.tenants.auth import hash_key
from tests.conftest import simple_policy
from tests.procs import shared_redis

REDIS_DB = 13  # shared with the store tests: these use unique upstream names and delete their keys
WORDS8 = "w0 w1 w2 w3 w4 w5 w6 w7 "


def _name(base: str) -> str:
    return f"{base}{uuid.uuid4().hex[:8]}"  # response ids (resp_<name>_<n>) unique across runs


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        yield {}
        return
    client = shared_redis(REDIS_DB)
    marks: list[str] = []
    yield {"url": f"redis://127.0.0.1:6379/{REDIS_DB}", "timeout_ms": 200, "_marks": marks}
    for mark in marks:  # this test's affinity records and cache entries
        keys = list(client.scan_iter(match=f"gwr:v1:*{mark}*"))
        if keys:
            client.delete(*keys)
    client.close()


def _policy(*ups, store=None, strategy="ordered", **extra):
    p = simple_policy(*ups, **extra)
    p["models"]["gpt-test"]["strategy"] = strategy
    if store:
        marks = store.get("_marks")
        if marks is not None:
            marks += [u.name for u in ups]
        p["store"] = {k: v for k, v in store.items() if k != "_marks"}
        if marks is not None:  # on the shared Redis: short-lived entries (the affinity ones are also deleted)
            p["cache"] = {"ttl_s": 30}
            p["responses"] = {**p.get("responses", {}), "affinity_ttl_s": 60}
    return p


async def _stream_text(stream) -> tuple[str, list[str]]:
    text, kinds = "", []
    async for ev in stream:
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
    return text, kinds


async def _metric(gw, needle: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            total = 0.0
            for line in (await r.text()).splitlines():
                if line.startswith(needle):
                    total += float(line.rsplit(" ", 1)[1])
            return total


async def test_create_answers_whole_and_streamed_with_the_async_sdk(upstream, gateway):
    up = await upstream(_name("a"), tokens=8)
    gw = await gateway(_policy(up))
    c = gw.client()
    raw = await c.responses.with_raw_response.create(model="gpt-test", input="Say hi", instructions="Be brief.")
    r = raw.parse()
    assert r.output_text == WORDS8 and r.status == "completed" and r.usage.output_tokens == 8
    assert raw.headers["x-gateway-backend"] == up.name and raw.headers["x-gateway-cache"] == "bypass"
    assert up.stats.last_body["instructions"] == "Be brief."  # the body goes through untouched
    text, kinds = await _stream_text(await c.responses.create(model="gpt-test", input="Say hi", stream=True))
    assert text == WORDS8 and kinds[0] == "response.created" and kinds[-1] == "response.completed"
    # The SDK's stream helper assembles the same answer from the events.
    async with c.responses.stream(model="gpt-test", input="Say hi") as s:
        final = await s.get_final_response()
    assert final.output_text == WORDS8
    assert await _metric(gw, "gateway_ttft_seconds_count") == 2  # the two streams
    assert await _metric(gw, 'gateway_tokens_total{backend="%s",kind="completion"' % up.name) == 24


async def test_the_sync_sdk_gets_the_same_answers(upstream, gateway):
    up = await upstream(_name("a"), tokens=8)
    gw = await gateway(_policy(up))

    def run() -> tuple[str, str]:
        with gw.sync_client() as c:
            whole = c.responses.create(model="gpt-test", input=[{"role": "user", "content": "Say hi"}]).output_text
            streamed = "".join(e.delta for e in c.responses.create(model="gpt-test", input="Say hi", stream=True)
                               if e.type == "response.output_text.delta")
            return whole, streamed

    assert await asyncio.to_thread(run) == (WORDS8, WORDS8)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_backend_that_fails_before_the_first_delta_is_failed_over(upstream, gateway, stream):
    bad = await upstream(_name("bad"), mode="error_500")
    good = await upstream(_name("good"), tokens=8)
    gw = await gateway(_policy(bad, good))
    c = gw.client()
    raw = await c.responses.with_raw_response.create(model="gpt-test", input="hi", stream=stream)
    if stream:
        text, _ = await _stream_text(raw.parse())
    else:
        text = raw.parse().output_text
    assert text == WORDS8 and raw.headers["x-gateway-backend"] == good.name
    assert bad.stats.requests == 1
    # A stream that fails after response.created but before its first delta: the held events are
    # dropped and the next backend answers, so the client sees one clean stream.
    for mode in ("failed", "error_event", "cut", "disconnect"):
        bad.set(mode=mode, fail_after=0)
        text, kinds = await _stream_text(await c.responses.create(model="gpt-test", input="hi", stream=True))
        assert text == WORDS8 and kinds.count("response.created") == 1, mode


async def test_a_stream_cut_after_its_first_delta_ends_with_an_error_event_and_the_sdk_raises(upstream, gateway):
    up = await upstream(_name("a"), tokens=8, mode="cut", fail_after=3)
    other = await upstream(_name("b"), tokens=8)
    gw = await gateway(_policy(up, other))
    c = gw.client()
    seen: list[str] = []
    with pytest.raises(openai.APIError) as exc:
        async for ev in await c.responses.create(model="gpt-test", input="hi", stream=True):
            seen.append(ev.type)
    assert "mid-stream" in str(exc.value) or "ended before" in str(exc.value)
    assert seen.count("response.output_text.delta") == 3 and "response.completed" not in seen
    assert other.stats.requests == 0  # nothing is retried once a delta reached the client
    async with aiohttp.ClientSession() as http:  # on the wire: an `error` event, numbered, and nothing after it
        async with http.post(gw.url + "/v1/responses", json={"model": "gpt-test", "input": "hi", "stream": True}) as r:
            body = await r.read()
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    assert last.startswith(b"event: error\ndata: ") and b'"type":"error"' in last and b'"sequence_number":' in last
    assert b"event: response.completed" not in body


async def test_a_slow_first_delta_gets_heartbeats_that_the_sdk_ignores(upstream, gateway):
    up = await upstream(_name("a"), tokens=4, ttft_ms=400)
    gw = await gateway(_policy(up, server={"heartbeat_after_ms": 100, "heartbeat_interval_ms": 100}))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", json={"model": "gpt-test", "input": "hi", "stream": True}) as r:
            body = await r.read()
    assert body.startswith(b": keep-alive\n\n") and body.count(b"event: response.output_text.delta") == 4
    text, _ = await _stream_text(await gw.client().responses.create(model="gpt-test", input="hi", stream=True))
    assert text == "w0 w1 w2 w3 "


async def test_cache_hits_answer_from_the_stored_response_and_replay_streams(upstream, gateway, store):
    up = await upstream(_name("a"), tokens=30)
    gw = await gateway(_policy(up, store=store))
    c = gw.client()
    ask = {"model": "gpt-test", "input": f"cache me {uuid.uuid4().hex}", "temperature": 0}
    first = await c.responses.with_raw_response.create(**ask)
    second = await c.responses.with_raw_response.create(**ask)
    assert first.headers["x-gateway-cache"] == "miss" and second.headers["x-gateway-cache"] == "hit"
    assert second.parse().output_text == first.parse().output_text and second.parse().id == first.parse().id
    # A streamed request hits the same entry, replayed as events the SDK assembles.
    raw = await c.responses.with_raw_response.create(**ask, stream=True)
    assert raw.headers["x-gateway-cache"] == "hit" and raw.headers["x-gateway-backend"] == "cache"
    text, kinds = await _stream_text(raw.parse())
    assert text == first.parse().output_text and kinds[-1] == "response.completed"
    # A streamed miss is stored from its response.completed, and served whole next time.
    ask2 = {**ask, "input": ask["input"] + " again"}
    text, _ = await _stream_text(await c.responses.create(**ask2, stream=True))
    hit = await c.responses.with_raw_response.create(**ask2)
    assert hit.headers["x-gateway-cache"] == "hit" and hit.parse().output_text == text
    async with c.responses.stream(**ask2) as s:  # the SDK's helper over a replayed hit
        assert (await s.get_final_response()).output_text == text
    assert up.stats.requests == 2
    # Follow-ups and sampled requests are never cached.
    fu = await c.responses.with_raw_response.create(**ask, previous_response_id=first.parse().id)
    assert fu.headers["x-gateway-cache"] == "bypass"


async def test_a_hit_never_hands_out_values_the_answer_echoes_from_another_request(upstream, gateway):
    # A Response object repeats `store`, `metadata`, `user`, ... back: a store:false answer (whose id
    # the backend does not keep) must not answer a store:true request, nor one caller's `user` another's.
    up = await upstream(_name("a"), tokens=3)
    gw = await gateway(_policy(up))
    c = gw.client()
    ask = {"model": "gpt-test", "input": f"echo {uuid.uuid4().hex}", "temperature": 0}
    kept = await c.responses.with_raw_response.create(**ask, store=False)
    stored = await c.responses.with_raw_response.create(**ask, store=True)
    assert kept.headers["x-gateway-cache"] == stored.headers["x-gateway-cache"] == "miss"
    assert stored.parse().store is True and stored.parse().id != kept.parse().id
    again = await c.responses.with_raw_response.create(**ask, store=True)
    assert again.headers["x-gateway-cache"] == "hit" and again.parse().id == stored.parse().id
    other = await c.responses.with_raw_response.create(**ask, store=True, user="end-user-2")
    assert other.headers["x-gateway-cache"] == "miss"
    assert up.stats.requests == 3


async def test_a_deleted_response_is_not_handed_out_again_by_the_cache(upstream, gateway, store):
    # On Redis the deleted id came back: the miss looked the key up again under the cross-process
    # lock and replayed the stale entry (review helper's repro). The entry is deleted first.
    up = await upstream(_name("a"), tokens=3)
    gw = await gateway(_policy(up, store=store))
    c = gw.client()
    ask = {"model": "gpt-test", "input": f"delete me {uuid.uuid4().hex}", "temperature": 0}
    first = (await c.responses.create(**ask)).id
    assert (await c.responses.with_raw_response.create(**ask)).headers["x-gateway-cache"] == "hit"
    await c.responses.delete(first)
    again = await c.responses.with_raw_response.create(**ask)
    assert again.headers["x-gateway-cache"] == "miss" and again.parse().id != first
    follow_up = await c.responses.create(model="gpt-test", input="and then?", previous_response_id=again.parse().id)
    assert follow_up.previous_response_id == again.parse().id
    assert (await c.responses.with_raw_response.create(**ask)).parse().id == again.parse().id  # stored anew


async def test_auto_is_classified_from_instructions_and_input(upstream, gateway):
    small = await upstream(_name("small"), tokens=2)
    big = await upstream(_name("big"), tokens=2)
    policy = {
        "version": 1,
        "backends": {small.name: {"url": small.url, "models": ["m"]}, big.name: {"url": big.url, "models": ["m"]}},
        "models": {"auto": {"simple": [small.name], "complex": [big.name]}},
    }
    gw = await gateway(policy)
    c = gw.client()
    easy = await c.responses.with_raw_response.create(model="auto", input="What is the capital of France?")
    hard = await c.responses.with_raw_response.create(
        model="auto",
        instructions="You are a senior engineer.",
        input=[{"role": "user", "content": [{"type": "input_text", "text":
               "Design a distributed rate limiter in Python with Redis, prove its correctness under clock skew, "
               "analyse its complexity step by step, and write the full implementation with tests."}]}],
    )
    assert (easy.headers["x-gateway-class"], easy.headers["x-gateway-backend"]) == ("simple", small.name)
    assert (hard.headers["x-gateway-class"], hard.headers["x-gateway-backend"]) == ("complex", big.name)
    async with aiohttp.ClientSession() as http:  # /v1/route/explain takes a Responses body too
        async with http.post(gw.url + "/v1/route/explain", json={"model": "auto", "input": "What is the capital of France?"}) as r:
            ex = await r.json()
    assert ex["endpoint"] == "responses" and ex["class"] == "simple" and ex["chosen"] == small.name


async def test_follow_ups_reach_the_backend_holding_the_previous_response(upstream, gateway, store):
    a = await upstream(_name("a"), tokens=3)
    b = await upstream(_name("b"), tokens=3)
    gw = await gateway(_policy(a, b, store=store, strategy="round_robin"))
    c = gw.client()
    held_by: dict[str, str] = {}
    for i in range(8):
        raw = await c.responses.with_raw_response.create(model="gpt-test", input=f"turn one {i}", stream=bool(i % 2))
        if i % 2:
            rid = None
            async for ev in raw.parse():
                if ev.type == "response.created":
                    rid = ev.response.id
        else:
            rid = raw.parse().id
        held_by[rid] = raw.headers["x-gateway-backend"]
    assert set(held_by.values()) == {a.name, b.name}  # round robin spread the first turns
    for rid, backend in held_by.items():
        for stream in (False, True):
            raw = await c.responses.with_raw_response.create(model="gpt-test", input="and then?", previous_response_id=rid, stream=stream)
            if stream:
                await _stream_text(raw.parse())
            else:
                raw.parse()
            assert raw.headers["x-gateway-backend"] == backend
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json={"model": "gpt-test", "input": "x", "previous_response_id": rid}) as r:
            ex = await r.json()
    assert ex["affinity"] == {"field": "previous_response_id", "id": rid, "backend": held_by[rid]} and ex["chosen"] == held_by[rid]

    def sync_follow_ups() -> set[str]:
        with gw.sync_client() as sc:
            out = set()
            for rid, backend in held_by.items():
                raw = sc.responses.with_raw_response.create(model="gpt-test", input="more", previous_response_id=rid)
                raw.parse()
                out.add(str(raw.headers["x-gateway-backend"] == backend))
            return out

    assert await asyncio.to_thread(sync_follow_ups) == {"True"}


async def test_a_follow_up_whose_backend_is_down_fails_clearly(upstream, gateway):
    a = await upstream(_name("a"), tokens=3)
    b = await upstream(_name("b"), tokens=3)
    gw = await gateway(_policy(a, b))
    c = gw.client()
    first = await c.responses.create(model="gpt-test", input="hi")  # ordered: a holds it
    a.set(mode="error_500")
    with pytest.raises(openai.APIStatusError) as exc:
        await c.responses.create(model="gpt-test", input="more", previous_response_id=first.id)
    assert exc.value.status_code == 502 and f"held by backend '{a.name}'" in exc.value.message
    assert b.stats.requests == 0  # no other backend has it: never tried there
    for _ in range(3):  # eject a
        with pytest.raises(openai.APIStatusError):
            await c.responses.create(model="gpt-test", input="more", previous_response_id=first.id)
    with pytest.raises(openai.InternalServerError) as exc:
        await c.responses.create(model="gpt-test", input="more", previous_response_id=first.id)
    assert exc.value.status_code == 503 and "ejected" in exc.value.message
    assert exc.value.response.headers.get("Retry-After")
    # An id the gateway never saw is nobody's: a 404 at once, no backend asked.
    with pytest.raises(openai.NotFoundError) as exc:
        await c.responses.create(model="gpt-test", input="more", previous_response_id="resp_nowhere_1")
    assert exc.value.body["code"] == "previous_response_not_found"
    assert b.stats.requests == 0


async def test_an_id_unknown_to_the_map_is_a_404_and_found_only_in_the_migration_mode(upstream, gateway):
    """Changed with issue 23: an id without a record used to be searched for and adopted by
    whoever asked first; now it is nobody's unless `responses.adopt_unknown_ids` is on."""
    a = await upstream(_name("a"), tokens=3)
    b = await upstream(_name("b"), tokens=3)
    direct = openai.AsyncOpenAI(base_url=b.url, api_key="x", max_retries=0)
    made_elsewhere = await direct.responses.create(model="gpt-test", input="hi")  # not through the gateway
    await direct.close()
    gw = await gateway(_policy(a, b))
    with pytest.raises(openai.NotFoundError):
        await gw.client().responses.create(model="gpt-test", input="more", previous_response_id=made_elsewhere.id)
    with pytest.raises(openai.NotFoundError):
        await gw.client().responses.retrieve(made_elsewhere.id)
    assert a.stats.requests == 0 and b.stats.requests == 1
    gw = await gateway(_policy(a, b, responses={"adopt_unknown_ids": True}), "migrating.yaml")
    c = gw.client()
    raw = await c.responses.with_raw_response.create(model="gpt-test", input="more", previous_response_id=made_elsewhere.id)
    assert raw.headers["x-gateway-backend"] == b.name and raw.parse().output_text
    got = await c.responses.with_raw_response.retrieve(made_elsewhere.id)  # and learned for later
    assert got.headers["x-gateway-backend"] == b.name


async def test_another_tenants_response_is_not_found(upstream, gateway):
    up = await upstream(_name("a"), tokens=3)
    policy = _policy(up)
    policy["tenants"] = {"t1": {"key_sha256": [hash_key("sk-one")]}, "t2": {"key_sha256": [hash_key("sk-two")]}}
    gw = await gateway(policy)
    mine = await gw.client("sk-one").responses.create(model="gpt-test", input="secret")
    other = gw.client("sk-two")
    with pytest.raises(openai.NotFoundError):
        await other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await other.responses.create(model="gpt-test", input="more", previous_response_id=mine.id)
    assert (await gw.client("sk-one").responses.retrieve(mine.id)).id == mine.id


async def test_by_id_endpoints_reach_the_holder_for_background_responses(upstream, gateway, store):
    a = await upstream(_name("a"), tokens=4, itl_ms=50)
    b = await upstream(_name("b"), tokens=4, itl_ms=50)
    gw = await gateway(_policy(a, b, store=store, strategy="round_robin"))
    c = gw.client()
    started = [await c.responses.create(model="gpt-test", input=f"job {i}", background=True) for i in range(4)]
    assert {r.status for r in started} == {"queued"}
    held = {r.id: r.id.split("_")[1] for r in started}  # the fake names its ids after itself
    assert set(held.values()) == {a.name, b.name}
    keep, cancel, delete, _ = started
    deadline = time.monotonic() + 10
    while (got := await c.responses.retrieve(keep.id)).status != "completed" and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert got.output_text == "w0 w1 w2 w3 "
    raw = await c.responses.with_raw_response.retrieve(keep.id)
    assert raw.headers["x-gateway-backend"] == held[keep.id]
    items = await c.responses.input_items.list(keep.id)
    assert items.data[0].content[0].text == "job 0"
    assert (await c.responses.cancel(cancel.id)).status == "cancelled"
    await c.responses.delete(delete.id)
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(delete.id)
    # A finished response's events, streamed again by its backend (GET ?stream=true), pass through.
    text = ""
    async for ev in await c.responses.retrieve(keep.id, stream=True):
        if ev.type == "response.output_text.delta":
            text += ev.delta
    assert text == "w0 w1 w2 w3 "


async def test_quotas_count_the_usage_of_response_completed(upstream, gateway):
    up = await upstream(_name("a"), tokens=8)
    policy = _policy(up)
    policy["tenants"] = {"acme": {"key_sha256": [hash_key("sk-acme")], "quota": {"tpm": 100000}}}
    policy["admin"] = {"key_sha256": [hash_key("sk-admin")]}
    gw = await gateway(policy)
    c = gw.client("sk-acme")
    whole = await c.responses.create(model="gpt-test", input="hi")
    streamed = None
    async for ev in await c.responses.create(model="gpt-test", input="hi", stream=True):
        if ev.type == "response.completed":
            streamed = ev.response
    assert up.stats.last_body.get("stream_options") is None  # nothing added: a Responses stream ends with its usage
    expected = whole.usage.total_tokens + streamed.usage.total_tokens
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 5
        while True:
            async with http.get(gw.url + "/admin/tenants", headers={"Authorization": "Bearer sk-admin"}) as r:
                used = (await r.json())["tenants"]["acme"]["use"]["tenant"]["tokens_60s"]
            if used == expected or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert used == expected


async def test_streamed_followers_of_a_cut_stream_end_with_the_same_error_event(upstream, gateway):
    up = await upstream(_name("a"), tokens=8, itl_ms=30, mode="cut", fail_after=4)
    gw = await gateway(_policy(up))
    body = {"model": "gpt-test", "input": "same", "temperature": 0, "stream": True}

    async def one() -> tuple[str | None, bytes]:
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/responses", json=body) as r:
                return r.headers.get("x-gateway-cache"), await r.read()

    results = await asyncio.gather(one(), one())
    assert sorted(str(h) for h, _ in results) == ["hit", "miss"]  # one upstream call, shared live
    for _, data in results:
        last = data.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
        assert last.startswith(b"event: error\ndata: ") and b"event: response.completed" not in data
    assert up.stats.requests == 1


@pytest.mark.parametrize(
    ("field", "value"), [("max_output_tokens", "16"), ("max_output_tokens", 1.5), ("background", "true"), ("temperature", "0")]
)
async def test_numbers_and_flags_of_the_wrong_json_type_are_400_naming_the_field(upstream, gateway, field, value):
    up = await upstream(_name("a"), tokens=8)
    gw = await gateway(_policy(up))
    with pytest.raises(openai.BadRequestError) as exc:
        await gw.client().post("/responses", cast_to=object, body={"model": "gpt-test", "input": "hi", field: value})
    assert exc.value.body["param"] == field, exc.value.body  # type: ignore[index]
    assert up.stats.requests == 0


async def test_a_replayed_stream_ends_at_the_requests_deadline_and_frees_its_lease(upstream, gateway):
    # GET /v1/responses/{id}?stream=true bounded only each upstream read: a slow replay ran 14 s
    # past a 1 s deadline, and its concurrency lease (the deadline + 10 s) expired under it
    # (review helper's repro).
    up = await upstream(_name("a"), tokens=40)
    up.responses.replay_itl_ms = 100  # a 4 s replay
    policy = _policy(up)
    policy["server"] = {**policy.get("server", {}), "request_timeout_ms": 1000}
    policy["tenants"] = {"acme": {"key_sha256": [hash_key("sk-acme")], "quota": {"concurrency": 1}}}
    gw = await gateway(policy)
    headers = {"Authorization": "Bearer sk-acme"}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", json={"model": "gpt-test", "input": "hi"}, headers=headers) as r:
            rid = (await r.json())["id"]
        started = time.monotonic()
        async with http.get(gw.url + f"/v1/responses/{rid}?stream=true", headers=headers) as r:
            body = await r.read()
        assert r.status == 200 and time.monotonic() - started < 2.5  # cut at its deadline
        assert b"response.output_text.delta" in body and b"response.completed" not in body  # a cut, not a success
        async with http.get(gw.url + f"/v1/responses/{rid}", headers=headers) as r:
            assert r.status == 200  # its lease went back with it


async def test_a_backend_without_the_responses_api_says_how_to_reach_it(gateway):
    """A chat-only server (vLLM, TGI) left at the default endpoints answered /v1/responses with a
    404, and the client read "all backends failed (vllm: HTTP 404)" (review helper's repro): the
    error says what the 404 likely means, and how to have the gateway translate."""
    from aiohttp import web

    from tests.servers import serve_app

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    try:
        gw = await gateway({"version": 1, "backends": {"vllm": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]}}})
        with pytest.raises(openai.APIStatusError) as exc:
            await gw.client().responses.create(model="m", input="hi")
        assert "HTTP 404 on /responses" in exc.value.message and "endpoints: [chat, completions]" in exc.value.message
        gw2 = await gateway({"version": 1, "backends": {"vllm": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"],
                                                                 "endpoints": ["chat", "completions"]}}})
        assert (await gw2.client().responses.create(model="m", input="hi")).output_text == "hello"  # translated
    finally:
        await runner.cleanup()
