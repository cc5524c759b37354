"""The fake vLLM replica (tests/fake_replica.py) behaves as its model says: prefix cache, TTFT,
FIFO queueing under a capacity, /metrics, /stats and /reset. Real sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.fake_replica import REPLICA, FakeReplica, block_keys, prompt_text, start

ROOT = Path(__file__).resolve().parents[1]

# Small blocks and fast timings keep every test well under a second.
FAST = {"block_chars": 100, "cache_blocks": 4, "base_ms": 20, "prefill_ms_per_kchar": 200, "tokens": 3, "itl_ms": 5}


@pytest.fixture
async def rep() -> AsyncIterator[FakeReplica]:
    runner, _ = await start(**FAST)
    try:
        yield runner.app[REPLICA]
    finally:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


def _msgs(system: str, user: str = "q") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def _stream(http: aiohttp.ClientSession, rep: FakeReplica, messages: list[dict], **extra) -> tuple[float, list[dict], list[bytes]]:
    """(seconds to the first content delta, the JSON chunks, the raw data lines)."""
    body = {"model": "m", "messages": messages, "stream": True, **extra}
    t0 = time.monotonic()
    first = None
    chunks, lines = [], []
    async with http.post(rep.url + "/chat/completions", json=body) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if not line:
                continue
            lines.append(line)
            assert line.startswith(b"data: ")
            if line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            chunks.append(obj)
            if first is None and obj["choices"] and obj["choices"][0]["delta"].get("content"):
                first = time.monotonic() - t0
    assert first is not None
    return first, chunks, lines


async def _stats(http: aiohttp.ClientSession, rep: FakeReplica) -> dict:
    async with http.get(f"http://127.0.0.1:{rep.port}/stats") as r:
        return await r.json()


def test_prompt_text_and_chained_keys() -> None:
    msgs = [{"role": "system", "content": "abc"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert prompt_text(msgs) == "systemabc" + "user" + json.dumps([{"type": "text", "text": "x"}])
    text = "a" * 250
    keys = block_keys(text, 100)
    assert len(keys) == 2  # the partial third block has no key
    k0 = hashlib.blake2b(b"" + b"a" * 100, digest_size=16).digest()
    assert keys[0] == k0
    assert keys[1] == hashlib.blake2b(k0 + b"a" * 100, digest_size=16).digest()
    # Chained: the same block text after a different prefix is a different key.
    assert block_keys("b" * 100 + "a" * 100, 100)[1] != keys[1]


@pytest.fixture
async def slow_prefill() -> AsyncIterator[FakeReplica]:
    """A replica whose prefill dwarfs scheduling noise: a loaded CI machine adds tens of ms to a
    wall-clock TTFT, which a 5 ms vs 82 ms contrast cannot absorb (a warm TTFT read 75 ms once)."""
    runner, _ = await start(**{**FAST, "prefill_ms_per_kchar": 1000})
    try:
        yield runner.app[REPLICA]
    finally:
        await runner.cleanup()


async def test_cache_hit_shortens_ttft_and_counts(slow_prefill: FakeReplica, http: aiohttp.ClientSession) -> None:
    rep = slow_prefill
    system = "s" * 394  # "system" + 394 = 400 chars: 4 full blocks, then the user turn
    cold, chunks, lines = await _stream(http, rep, _msgs(system, "first"))
    # 20 ms + 1000 ms x 0.409 kchar = ~429 ms (a sleep never ends early)
    assert 0.42 < cold < 1.0, cold
    assert lines[-1] == b"data: [DONE]"
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:4]] == ["w0 ", "w1 ", "w2 "]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    warm, _, _ = await _stream(http, rep, _msgs(system, "second, a different question"))
    # 4 blocks (400 chars) cached; 28 uncached: 20 + 28 ms = ~48 ms; uncached it would be ~457 ms
    assert warm < 0.2, warm
    assert warm < cold / 2
    st = await _stats(http, rep)
    assert st["requests"] == 2
    n1, n2 = len("systemSuserfirst".replace("S", system)), len("systemSusersecond, a different question".replace("S", system))
    assert st["prompt_chars"] == n1 + n2
    assert st["cached_chars"] == 400
    assert st["peak_running"] == 1 and st["peak_waiting"] == 0  # one at a time: nobody queued


async def test_lru_evicts_and_lookup_touches(rep: FakeReplica, http: aiohttp.ClientSession) -> None:
    a, b, c = "a" * 194, "b" * 194, "c" * 194  # "system" + 194: 2 blocks each; the cache holds 4
    for s in (a, b):
        await _stream(http, rep, _msgs(s), max_tokens=1)
    await _stream(http, rep, _msgs(a), max_tokens=1)  # touches a's blocks: b's are now the oldest
    await _stream(http, rep, _msgs(c), max_tokens=1)  # evicts b
    before = (await _stats(http, rep))["cached_chars"]
    await _stream(http, rep, _msgs(a), max_tokens=1)
    mid = (await _stats(http, rep))["cached_chars"]
    assert mid - before == 200  # a survived
    await _stream(http, rep, _msgs(b), max_tokens=1)
    assert (await _stats(http, rep))["cached_chars"] == mid  # b was evicted
    assert len(rep.cache) == 4


async def test_max_tokens_usage_and_non_stream(rep: FakeReplica, http: aiohttp.ClientSession) -> None:
    _, chunks, _ = await _stream(http, rep, _msgs("x"), max_tokens=2, stream_options={"include_usage": True})
    contents = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert [x for x in contents if x] == ["w0 ", "w1 "]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
    body = {"model": "m", "messages": _msgs("x"), "max_tokens": 1}
    async with http.post(rep.url + "/chat/completions", json=body) as r:
        assert r.status == 200
        obj = await r.json()
    assert obj["object"] == "chat.completion" and obj["choices"][0]["message"]["content"] == "w0 "
    async with http.get(rep.url + "/models") as r:
        assert (await r.json())["data"][0]["id"] == "m"
    async with http.post(rep.url + "/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


async def test_capacity_queues_fifo_and_metrics(http: aiohttp.ClientSession) -> None:
    runner, port = await start(capacity=2, base_ms=100, prefill_ms_per_kchar=0, tokens=2, itl_ms=50, report_waiting=5)
    rep = runner.app[REPLICA]
    try:
        order: list[int] = []
        t_first = time.monotonic()

        async def one(i: int) -> tuple[float, float]:
            sent = time.monotonic() - t_first
            t, _, _ = await _stream(http, rep, _msgs(f"{i}"))
            order.append(i)
            return t, sent + t  # from its own arrival, and from the first request's

        tasks = []
        for i in range(5):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.01)  # a known arrival order
        await asyncio.sleep(0.05)
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            assert r.status == 200
            text = await r.text()
        times = await asyncio.gather(*tasks)
        ttfts, at = [t for t, _ in times], [a for _, a in times]
        # Slots: 2 at once, each held 100 ms + 50 ms (2 tokens): waves at 0, 150, 300 ms. The
        # queued ones are timed from the first arrival: a slow machine's later arrivals (the 10 ms
        # sleeps stretched) waited less from their own.
        assert max(ttfts[:2]) < 0.14, times
        assert 0.2 < at[2] < 0.35 and 0.2 < at[3] < 0.35, times
        assert 0.35 < at[4] < 0.55, times
        assert order[:2] == sorted(order[:2]) and order[4] == 4
        vals = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                vals[name] = float(value)
        assert vals['vllm:num_requests_running{model_name="m"}'] == 2
        assert vals['vllm:num_requests_waiting{model_name="m"}'] == 3 + 5  # real queue + report_waiting
        assert vals['vllm:gpu_cache_usage_perc{model_name="m"}'] == vals['vllm:kv_cache_usage_perc{model_name="m"}'] == 0
        st = await _stats(http, rep)
        assert st["peak_running"] == 2 and st["peak_waiting"] >= 3
    finally:
        await runner.cleanup()


async def test_metrics_cache_usage_reset_and_fail(rep: FakeReplica, http: aiohttp.ClientSession) -> None:
    await _stream(http, rep, _msgs("z" * 294), max_tokens=1)  # 3 full blocks of 4
    async with http.get(f"http://127.0.0.1:{rep.port}/metrics") as r:
        text = await r.text()
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.75' in text
    assert 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75' in text
    async with http.post(f"http://127.0.0.1:{rep.port}/reset") as r:
        assert r.status == 200
    st = await _stats(http, rep)
    assert (st["requests"], st["prompt_chars"], st["cached_chars"], st["peak_running"], st["cache_blocks_used"]) == (0, 0, 0, 0, 0)
    await _stream(http, rep, _msgs("z" * 294), max_tokens=1)
    assert (await _stats(http, rep))["cached_chars"] == 0  # the cache was emptied
    rep.options.fail_metrics = True
    async with http.get(f"http://127.0.0.1:{rep.port}/metrics") as r:
        assert r.status == 500


def test_script_runs_and_exits_by_itself() -> None:
    """`python -m tests.fake_replica --port 0 --max-seconds ...` serves, then exits on its own."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_replica", "--port", "0", "--max-seconds", "1.5", "--fail-metrics"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode()  # type: ignore[union-attr]
        assert "fake replica" in line and "http://127.0.0.1:" in line
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
