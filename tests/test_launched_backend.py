"""A backend with a `launch:` section: the gateway starts the local model server, routes to it,
and stops it on shutdown. The fast tests use the tiny random model; the slow one the real SmolLM2."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest

from gateway.keys import LIVE


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    s = await c.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True)
    chunks = [ch async for ch in s]
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")
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
