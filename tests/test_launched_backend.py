"""A backend with a `launch:` section: the gateway starts the local model server, routes to it,
and stops it on shutdown. The fast tests use the tiny random model; the slow one the real SmolLM2."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import aiohttp
import pytest

from gateway.web.keys import LIVE


_RESERVED: list[socket.socket] = []


def _free_port() -> int:
    """A port for a launched model, kept reserved until the test ends: bound with SO_REUSEADDR and
    never listening, so the launcher's look finds nothing there and the model server binds and
    listens on it all the same, while no other process's ephemeral port (a bind to port 0, an
    outgoing connection) can land on it meanwhile. A port merely found free was anyone's until the
    child bound it (its interpreter's start, seconds on a loaded machine); a server of the parallel
    suite that took it would answer the launcher's /healthz in the child's place (one bound there
    on purpose: "healthy after 0.2 s", then the child could not listen and the requests got 503s)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    _RESERVED.append(s)
    return s.getsockname()[1]


@pytest.fixture(autouse=True)
def _release_reserved_ports() -> Iterator[None]:
    yield
    while _RESERVED:
        _RESERVED.pop().close()


def _policy(port: int, model: str, served: str) -> dict:
    return {
        "backends": {
            "local": {
                "url": f"http://127.0.0.1:{port}/v1",
                "launch": {"model": model, "quantize": "none" if model == "tiny-random" else "auto", "threads": 1},
                "models": [served],
                "timeouts": {"first_token_ms": 60000},
            }
        },
        "models": {"auto": {"simple": ["local"], "complex": ["local"]}},
        "reload": {"watch": False},
        # launching is what these test: each gateway process spares the encoder's 2-3 s of loading
        "classifier": {"encoder": {"enabled": False}},
    }


async def _wait_ready(gw, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(gw.url + "/readyz") as r:
                if r.status == 200:
                    return
            assert loop.time() < end, "the launched backend never became ready"
            await asyncio.sleep(0.1)


async def test_the_gateway_launches_routes_to_and_stops_the_local_backend(gateway):
    port = _free_port()
    gw = await gateway(_policy(port, "tiny-random", "tiny-random"))
    backend = gw.app[LIVE].runtime.backends["local"]
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 503  # still starting: not ready, and says so
    await _wait_ready(gw, 90)
    assert backend.health.state() == "healthy"
    c = gw.client()
    raw = await c.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    r = raw.parse()
    assert raw.headers["x-gateway-backend"] == "local" and r.usage.completion_tokens <= 4
    # No temperature: the launched model decodes it greedily (launch.default_temperature 0, passed
    # to it as --default-temperature), so the gateway caches it.
    assert raw.headers["x-gateway-cache"] == "miss"
    again = await c.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert again.headers["x-gateway-cache"] == "hit" and again.parse().choices[0].message.content == r.choices[0].message.content
    s = await c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
    chunks = [ch async for ch in s]
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
    # Log probabilities pass through the gateway, whole and streamed, and such answers are not cached.
    asked = {"model": "auto", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "logprobs": True, "top_logprobs": 2}
    for _ in range(2):
        lp = await c.chat.completions.with_raw_response.create(**asked)  # type: ignore[call-overload]
        assert lp.headers["x-gateway-cache"] != "hit"
        content = lp.parse().choices[0].logprobs.content
        assert content and len(content) == lp.parse().usage.completion_tokens and len(content[0].top_logprobs) == 2
    streamed = [t async for ch in await c.chat.completions.create(**asked, stream=True)  # type: ignore[call-overload]
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content or []]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    # Several choices, whole and streamed, pass through as the model server gives them.
    many = {"model": "auto", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 5}
    whole = await c.chat.completions.create(**many)  # type: ignore[call-overload]
    assert [ch.index for ch in whole.choices] == [0, 1]
    parts = [ch async for ch in await c.chat.completions.create(**many, stream=True)]  # type: ignore[call-overload]
    assert {i: "".join(p.choices[0].delta.content or "" for p in parts if p.choices and p.choices[0].index == i) for i in (0, 1)} \
        == {i: whole.choices[i].message.content for i in (0, 1)}
    await gw.runner.cleanup()  # shutdown stops the child: the port is free again
    gw.clients.clear()
    for _ in range(50):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            await asyncio.sleep(0.1)
        except OSError:
            break  # nothing listens there any more
    else:
        raise AssertionError("the launched backend still serves after shutdown")


async def test_requests_while_the_local_backend_starts_get_a_clear_503(gateway):
    port = _free_port()
    gw = await gateway(_policy(port, "tiny-random", "tiny-random"))
    import openai

    with pytest.raises(openai.APIStatusError) as exc:
        await gw.client().chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.status_code == 503 and "starting" in exc.value.message
    assert "retry-after" in exc.value.response.headers
    await _wait_ready(gw, 90)


async def _readyz(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.get(url + "/readyz") as r:
        return r.status, await r.json()


async def test_a_launch_blocked_by_a_taken_port_says_why_and_comes_up_once_it_is_free(gateway):
    import openai

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        gw = await gateway(_policy(port, "tiny-random", "tiny-random"))
        taken = f"could not be launched: 127.0.0.1:{port} is already in use (another process listens there); retrying"
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while taken not in (await _readyz(gw.url))[1]["backends_not_ready"].get("local", ""):
            assert loop.time() < end, "readyz never said why the backend is not ready"
            await asyncio.sleep(0.1)
        status, body = await _readyz(gw.url)
        assert status == 503 and sorted(body["models_without_backend"]) == ["auto", "tiny-random"]
        assert body["backends_not_ready"]["local"].startswith(f"the backend {taken}")
        assert f"local: the backend {taken}" in body["detail"]
        with pytest.raises(openai.APIStatusError) as exc:
            await gw.client().chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}])
        # a tenant hears that the launch failed and when it is retried, not the address (/readyz has it)
        assert exc.value.status_code == 503 and "could not be launched (/readyz says why); retrying" in exc.value.message
        assert f"127.0.0.1:{port}" not in exc.value.message
        assert 1 <= float(exc.value.response.headers["retry-after"]) <= 30  # when the launcher tries again
    finally:
        holder.close()
    await _wait_ready(gw, 90)  # the next try finds the port free
    status, body = await _readyz(gw.url)
    assert status == 200 and body["backends_not_ready"] == {}
    r = await gw.client().chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert r.usage.completion_tokens <= 2


async def test_with_workers_readyz_and_503s_carry_the_supervisors_launch_failure(tmp_path):
    """With --workers N the supervisor launches and the workers only watch: they ask it, through
    the control socket, why a launched model is not ready."""
    from tests.procs import serve

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    taken = f"could not be launched: 127.0.0.1:{port} is already in use (another process listens there); retrying"
    try:
        async with serve(_policy(port, "tiny-random", "tiny-random"), tmp_path, "--workers", "2") as gw:
            loop = asyncio.get_running_loop()
            end = loop.time() + 20
            async with aiohttp.ClientSession() as http:
                # Every worker's own view (loopback open mode: /admin needs no key), through the supervisor.
                while True:
                    async with http.get(gw.url + "/admin/backends") as r:
                        views = (await r.json())["workers"]
                    reasons = [w.get("backends", {}).get("local", {}).get("not_ready", "") for w in views]
                    if len(reasons) == 2 and all(taken in why for why in reasons):
                        break
                    assert loop.time() < end, f"the workers never said why: {views}"
                    await asyncio.sleep(0.2)
                status, body = await _readyz(gw.url)
                assert status == 503 and taken in body["backends_not_ready"]["local"]
                chat = {"model": "auto", "messages": [{"role": "user", "content": "Hi"}]}
                async with http.post(gw.url + "/v1/chat/completions", json=chat) as r:
                    message = (await r.json())["error"]["message"]
                    assert r.status == 503 and "could not be launched (/readyz says why)" in message and str(port) not in message
            holder.close()
            # Ready in every worker (each learns it from the supervisor in turn): a /readyz on a
            # connection of its own may reach either.
            end = loop.time() + 90
            async with aiohttp.ClientSession() as http:
                while True:
                    async with http.get(gw.url + "/admin/backends") as r:
                        views = (await r.json())["workers"]
                    if len(views) == 2 and not any(w.get("backends", {}).get("local", {}).get("not_ready") for w in views):
                        break
                    assert loop.time() < end, f"the launched backend never became ready in every worker: {views}"
                    await asyncio.sleep(0.2)
            for _ in range(4):
                status, body = await _readyz(gw.url)
                assert status == 200 and body["backends_not_ready"] == {}
    finally:
        holder.close()


@pytest.mark.slow
async def test_smollm2_answers_paris_through_the_gateway_stream_and_not(gateway):
    port = _free_port()
    gw = await gateway(_policy(port, "smollm2-135m-instruct", "smollm2-135m-instruct"))
    await _wait_ready(gw, 300)
    c = gw.client()
    q = [{"role": "user", "content": "What is the capital of France?"}]
    raw = await c.chat.completions.with_raw_response.create(model="auto", messages=q, max_tokens=24, temperature=0)
    assert raw.headers["x-gateway-class"] == "simple"
    assert "Paris" in raw.parse().choices[0].message.content
    s = await c.chat.completions.create(model="auto", messages=q, max_tokens=24, temperature=0, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])
    assert "Paris" in text


async def _prefix_hits(port: int) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total"))


async def test_tenants_do_not_share_the_launched_models_prefix_cache(gateway):
    """A caller could time another tenant's cached prompt (a hit answers ~9x faster): requests to
    a launched model carry their tenant's cache namespace as vLLM's `cache_salt`."""
    from gateway.tenants.auth import hash_key

    port = _free_port()
    policy = _policy(port, "tiny-random", "tiny-random")
    policy["tenants"] = {"a": {"key_sha256": [hash_key("sk-a")]}, "b": {"key_sha256": [hash_key("sk-b")]}}
    policy["cache"] = {"enabled": False}
    gw = await gateway(policy)
    await _wait_ready(gw, 90)
    secret = [{"role": "user", "content": "My PIN is 7316. " + "A long private preamble that fills blocks. " * 60}]
    hits = [await _prefix_hits(port)]
    for key in ("sk-a", "sk-a", "sk-b"):
        await gw.client(key).chat.completions.create(model="tiny-random", messages=secret, max_tokens=2)
        hits.append(await _prefix_hits(port))
    assert hits[2] > hits[1] == hits[0]  # tenant a's second ask hits its own blocks
    assert hits[3] == hits[2]  # tenant b asks the same: nothing of a's is found

    # The Responses and Messages APIs reach the model as a chat request the gateway translates:
    # the same salt (it was missing from translated requests).
    for api in ("responses", "messages"):
        text = f"{api}: my PIN is 2024. " + "Another private preamble that fills blocks. " * 60
        hits = [await _prefix_hits(port)]
        for key in ("sk-a", "sk-a", "sk-b"):
            if api == "responses":
                await gw.client(key).responses.create(model="tiny-random", input=text, max_output_tokens=2)
            else:
                body = {"model": "tiny-random", "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
                async with aiohttp.ClientSession() as http:
                    async with http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": key, "anthropic-version": "2023-06-01"}) as r:
                        assert r.status == 200, await r.text()
            hits.append(await _prefix_hits(port))
        assert hits[2] > hits[1] == hits[0], (api, hits)
        assert hits[3] == hits[2], (api, hits)
