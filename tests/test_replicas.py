"""More than one process: three replicas on one Redis, and `gateway serve --workers 2`.

Real `gateway serve` processes on loopback ports, a redis-server of the test's own, the fake
upstream served by the test's event loop, the official openai SDK as the client."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import yaml

from tests.procs import both_workers, free_port, redis_server, serve, wait_http

KEY = "sk-" + secrets.token_urlsafe(24)
ADMIN = "sk-" + secrets.token_urlsafe(24)
ADM = {"Authorization": f"Bearer {ADMIN}"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _policy(up_url: str, redis_url: str | None = None, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {
        "version": 1,
        "cache": {"ttl_s": 600},
        "reload": {"watch": False, "channel": "test-reload-" + secrets.token_hex(4)},
        "backends": {"up": {"url": up_url, "models": ["m"], "max_concurrency": 4}},
        "tenants": {"t": {"key_sha256": [_sha(KEY)]}},
        "admin": {"key_sha256": [_sha(ADMIN)]},
    }
    if redis_url:
        # 10 ms (the default) makes a slow store a miss; on a loaded CI machine a replica's Redis
        # reply can take longer, and single flight across replicas then fails open (two misses).
        p["store"] = {"url": redis_url, "timeout_ms": 500}
    p.update(extra)
    return p


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def _add_model(path: Path, name: str) -> None:
    p = yaml.safe_load(path.read_text())
    p["backends"]["up"]["models"].append(name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(p))
    tmp.replace(path)


async def _fresh_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes, Any]:
    """One request on a connection of its own (SO_REUSEPORT spreads them over the workers)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(url, json=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})}) as r:
            return r.status, await r.read(), r.headers


def _chat(model: str = "m", content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


async def test_three_replicas_share_the_cache_and_a_reload_through_one_reaches_all(upstream, tmp_path):
    up = await upstream("up", tokens=3)
    async with redis_server() as redis_url:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path) as g2, serve(path, tmp_path) as g3:
            gws = (g1, g2, g3)
            seen = []
            for g in gws:
                raw = await _client(g.url).chat.completions.with_raw_response.create(
                    model="m", messages=[{"role": "user", "content": "shared?"}], temperature=0
                )
                seen.append(raw.headers["x-gateway-cache"])
            assert seen == ["miss", "hit", "hit"]
            assert up.stats.requests == 1

            _add_model(path, "m2")  # file watching is off: only the announcement can bring it
            started = time.monotonic()
            async with aiohttp.ClientSession() as http:
                async with http.post(g1.url + "/admin/reload", headers=ADM) as r:
                    body = await r.json()
                    assert r.status == 200, body
            statuses = [(await _fresh_post(g.url + "/v1/chat/completions", _chat("m2")))[0] for g in gws]
            elapsed = time.monotonic() - started
            assert statuses == [200, 200, 200]
            assert [w["ok"] for w in body["workers"]] == [True]
            assert len(body["replicas"]) == 2 and all(r["ok"] for r in body["replicas"]), body
            assert elapsed < 5.0, f"the reload took {elapsed:.2f} s to reach all three (within a second when idle)"


async def test_the_same_miss_on_two_replicas_calls_upstream_once(upstream, tmp_path):
    up = await upstream("up", ttft_ms=400, tokens=3)
    async with redis_server() as redis_url:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path) as g2:
            body = _chat("m", "the same question", temperature=0)
            got = await asyncio.gather(*(
                _fresh_post(g.url + "/v1/chat/completions", {**body, "stream": stream})
                for g, stream in ((g1, False), (g2, True))
            ))  # fmt: skip
            assert [g[0] for g in got] == [200, 200]
            assert sorted(g[2]["x-gateway-cache"] for g in got) == ["hit", "miss"]
            assert got[1][1].rstrip().endswith(b"data: [DONE]")  # a streamed follower gets the answer as a stream
            assert up.stats.requests == 1


async def test_killing_one_replica_mid_stream_loses_only_its_own_streams(upstream, tmp_path):
    up = await upstream("up", ttft_ms=20, itl_ms=60, tokens=25)
    async with redis_server() as redis_url:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path) as g2, serve(path, tmp_path) as g3:
            first = [asyncio.Event() for _ in range(6)]

            async def stream(i: int, url: str) -> str:
                c = _client(url)
                try:
                    s = await c.chat.completions.create(
                        model="m", messages=[{"role": "user", "content": f"s{i}"}], stream=True, temperature=1
                    )
                    text = ""
                    async for chunk in s:
                        if chunk.choices and chunk.choices[0].delta.content:
                            text += chunk.choices[0].delta.content
                            first[i].set()
                    return text
                finally:
                    first[i].set()
                    await c.close()

            urls = [g.url for g in (g1, g1, g2, g2, g3, g3)]
            tasks = [asyncio.create_task(stream(i, u)) for i, u in enumerate(urls)]
            await asyncio.gather(*(e.wait() for e in first))
            g1.signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            full = " ".join(f"w{i}" for i in range(25)) + " "
            assert all(isinstance(r, Exception) for r in results[:2]), results[:2]  # the killed one's streams
            assert results[2:] == [full] * 4, results[2:]  # the others' streams finish whole


async def test_two_workers_reload_together_share_max_concurrency_and_drain_on_sigterm(upstream, tmp_path):
    up = await upstream("up", ttft_ms=30, itl_ms=40, tokens=10)
    policy = _policy(up.url, server={"drain_delay_ms": 1500, "shutdown_timeout_ms": 20000})
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    async with serve(path, tmp_path, "--workers", "2") as gw:
        view = await both_workers(gw.url, ADM)
        shares = sorted(w["backends"]["up"]["max_concurrency_this_worker"] for w in view["workers"])
        assert shares == [2, 2] and view["backends"]["up"]["max_concurrency"] == 4
        assert sorted(w["worker"] for w in view["workers"]) == [0, 1]

        # A reload through either worker reaches both, and answers with both results.
        _add_model(path, "m2")
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/admin/reload", headers=ADM) as r:
                body = await r.json()
                assert r.status == 200, body
        assert sorted(w["worker"] for w in body["workers"]) == [0, 1] and all(w["ok"] for w in body["workers"])
        statuses = [(await _fresh_post(gw.url + "/v1/chat/completions", _chat("m2", f"r{i}")))[0] for i in range(10)]
        assert statuses == [200] * 10

        # max_concurrency: 4 holds across both workers.
        up.stats.peak_active = 0
        got = await asyncio.gather(*(
            _fresh_post(gw.url + "/v1/chat/completions", _chat("m", f"c{i}", stream=True, temperature=1)) for i in range(16)
        ))  # fmt: skip
        assert [g[0] for g in got] == [200] * 16
        assert up.stats.peak_active <= 4, up.stats.peak_active

        # SIGTERM with a stream in flight: /readyz turns 503, the stream finishes, then it exits.
        up.set(tokens=30, itl_ms=50)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            async with http.post(gw.url + "/v1/chat/completions", json=_chat("m", "long", stream=True, temperature=1),
                                 headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200
                await r.content.readline()  # the first event: the stream is under way
                gw.signal(signal.SIGTERM)
                await wait_http(gw.url + "/readyz", 5, status=503)
                rest = await r.read()
        assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        assert await asyncio.wait_for(gw.proc.wait(), 30) == 0
        log = gw.log.read_text()
        assert "draining" in log


@pytest.mark.slow
async def test_two_workers_with_a_launched_local_model_answer_every_request_once_ready(tmp_path):
    port = free_port()
    policy = {
        "version": 1,
        "reload": {"watch": False},
        "backends": {
            "local": {
                "url": f"http://127.0.0.1:{port}/v1",
                "launch": {"model": "tiny-random", "quantize": "none", "threads": 1},
                "models": ["tiny-random"],
                "timeouts": {"first_token_ms": 60000},
            }
        },
    }
    async with serve(policy, tmp_path, "--workers", "2", ready="/readyz", wait_s=180) as gw:
        for _ in range(120):  # readiness is one worker's view; the first answer proves the model is up
            status, _, _ = await _fresh_post(gw.url + "/v1/chat/completions", _chat("tiny-random", "up?", max_tokens=2))
            if status == 200:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(0.5)  # the other worker's readiness poll (every 0.2 s while starting)
        statuses = [
            (await _fresh_post(gw.url + "/v1/chat/completions", _chat("tiny-random", f"q{i}", max_tokens=4)))[0] for i in range(20)
        ]
        assert statuses == [200] * 20
        assert await gw.stop() == 0
    log = gw.log.read_text()
    assert log.count("[local] started pid") == 1, "launched once, by the supervisor"


@pytest.mark.slow
async def test_a_reload_a_worker_rejects_leaves_the_launched_model_where_the_workers_route(tmp_path):
    """The supervisor parses a policy; a worker checks more (here: an API key variable that is not
    set). A policy that moves the launched model but that the workers reject must not move it."""
    port, moved = free_port(), free_port()

    def policy(at: int, extra: bool) -> dict[str, Any]:
        p: dict[str, Any] = {
            "version": 1,
            "reload": {"watch": False},
            "admin": {"key_sha256": [_sha(ADMIN)]},
            "tenants": {"t": {"key_sha256": [_sha(KEY)]}},
            "backends": {"local": {"url": f"http://127.0.0.1:{at}/v1", "models": ["tiny-random"],
                                   "launch": {"model": "tiny-random", "quantize": "none", "threads": 1}}},
        }
        if extra:
            p["backends"]["paid"] = {"url": "http://127.0.0.1:9/v1", "models": ["gpt-x"], "api_key_env": "GATEWAY_TEST_UNSET_KEY"}
        return p

    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy(port, False)))
    os.environ.pop("GATEWAY_TEST_UNSET_KEY", None)
    async with serve(path, tmp_path, "--workers", "2", ready="/readyz", wait_s=180) as gw:
        await both_workers(gw.url, ADM)
        for _ in range(120):  # readiness is one worker's view; answers from both prove the model is up
            got = [(await _fresh_post(gw.url + "/v1/chat/completions", _chat("tiny-random", f"up {i}?", max_tokens=2)))[0]
                   for i in range(4)]
            if got == [200] * 4:
                break
            await asyncio.sleep(0.5)
        path.write_text(yaml.safe_dump(policy(moved, True)))
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/admin/reload", headers=ADM) as r:
                body = await r.json()
        assert r.status == 400 and body["error"]["code"] == "invalid_policy", body
        assert "GATEWAY_TEST_UNSET_KEY" in body["error"]["message"]
        status, _, _ = await _fresh_post(gw.url + "/v1/chat/completions", _chat("tiny-random", "still there?", max_tokens=2))
        assert status == 200
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", moved)) != 0  # never started where the workers do not route
        assert await gw.stop() == 0
    assert gw.log.read_text().count("[local] started pid") == 1
