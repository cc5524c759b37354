"""A stream still running when a SIGTERM's `server.shutdown_timeout_ms` runs out ends with its
endpoint's error event naming the shutdown (as any stream cut mid-answer does), never with a bare
connection close: the official openai SDK raises an APIError that says so, a Responses stream gets
its `error` event, a Messages stream Anthropic's `event: error`; each request is accounted as a cut
(the access log's line says `finish: cut` and why). A real `gateway serve` in front of a fake
upstream that streams slowly for minutes."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import yaml

from tests.procs import ROOT, free_port, wait_http

_SHUTDOWN_MS = 1000


@asynccontextmanager
async def _serve(policy: dict[str, Any], tmp: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, Path, Path]]:
    """`gateway serve` with its stdout (the access log) and stderr in files; yields the process,
    its URL and the two files. Killed (by its PID) if the test left it running."""
    port = free_port()
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    out, err = tmp / "access.log", tmp / "gateway.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with out.open("wb") as o, err.open("wb") as e:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--host", "127.0.0.1", "--port", str(port),
            cwd=ROOT, env=env, stdout=o, stderr=e,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            await wait_http(url + "/healthz", 60)
        except AssertionError:
            raise AssertionError(f"gateway did not start: {err.read_text()[-3000:]}") from None
        yield proc, url, out, err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _chat(url: str, started: asyncio.Event) -> BaseException | None:
    """A chat stream through the openai SDK, read to its end: what the SDK raised, if anything."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=60)
    try:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                started.set()
    except BaseException as exc:  # noqa: BLE001 (what ended the stream is the test's subject)
        return exc
    finally:
        await client.close()
    return None


async def _waiting(url: str, *, stream: bool) -> BaseException | None:
    """A chat request to the model whose backend never sends its first token: what the SDK raised."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-none", max_retries=0, timeout=60)
    try:
        if stream:
            async for _ in await client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "go"}], stream=True):
                pass
        else:
            await client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "go"}])
    except BaseException as exc:  # noqa: BLE001
        return exc
    finally:
        await client.close()
    return None


async def _raw(url: str, path: str, body: dict[str, Any], started: asyncio.Event) -> tuple[bytes, BaseException | None]:
    """A raw SSE read of `path` to the connection's end: the bytes, and the client's error (a
    connection closed mid-body) if any."""
    got = bytearray()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        try:
            async with http.post(url + path, json=body) as r:
                assert r.status == 200, await r.read()
                async for data in r.content.iter_any():
                    got += data
                    if b"w1" in got:  # the fake's second word: content is flowing
                        started.set()
        except aiohttp.ClientError as exc:
            return bytes(got), exc
    return bytes(got), None


def _events(raw: bytes) -> list[tuple[str | None, Any]]:
    out: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
        if data is not None:
            out.append((name, orjson.loads(data) if data.startswith("{") else data))
    return out


async def test_streams_cut_by_the_shutdown_timeout_end_with_their_error_event(upstream: Any, tmp_path: Path) -> None:
    up = await upstream("up", itl_ms=100, tokens=10_000)  # about 17 minutes a stream: only the shutdown ends it
    slow = await upstream("slow", ttft_ms=600_000)  # never a first token before the shutdown
    policy = {"version": 1, "reload": {"watch": False}, "log": {"access": True},
              "backends": {"up": {"url": up.url, "models": ["m"]},
                           "slow": {"url": slow.url, "models": ["slow"], "timeouts": {"first_token_ms": 600_000}}},
              # heartbeat: the stream still waiting for its first token has begun (SSE comments)
              "server": {"drain_delay_ms": 0, "shutdown_timeout_ms": _SHUTDOWN_MS, "heartbeat_after_ms": 200}}
    async with _serve(policy, tmp_path) as (proc, url, access, stderr):
        flowing = [asyncio.Event() for _ in range(3)]
        chat = asyncio.create_task(_chat(url, flowing[0]))
        responses = asyncio.create_task(_raw(url, "/v1/responses", {"model": "m", "input": "go", "stream": True}, flowing[1]))
        messages = asyncio.create_task(_raw(url, "/v1/messages", {"model": "m", "max_tokens": 100_000, "stream": True,
                                                                   "messages": [{"role": "user", "content": "go"}]}, flowing[2]))
        waiting = [asyncio.create_task(_waiting(url, stream=True)), asyncio.create_task(_waiting(url, stream=False))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 30)
        for _ in range(600):
            if slow.stats.active == 2:
                break
            await asyncio.sleep(0.05)
        assert slow.stats.active == 2, slow.stats
        await asyncio.sleep(0.4)  # the waiting stream's heartbeat has begun it
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(chat, responses, messages, *waiting), 20)
        sdk_error, (r_raw, r_err), (m_raw, m_err) = chat.result(), responses.result(), messages.result()
        w_stream, w_whole = waiting[0].result(), waiting[1].result()
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    log = stderr.read_text()

    # chat/completions: the SDK raises on the error chunk (a bare close is httpx's RemoteProtocolError)
    assert isinstance(sdk_error, openai.APIError) and not isinstance(sdk_error, openai.APIConnectionError), (repr(sdk_error), log[-2000:])
    assert "shutting down" in sdk_error.message, sdk_error.message
    assert isinstance(sdk_error.body, dict) and sdk_error.body.get("code") == "service_unavailable", sdk_error.body

    # Responses: its `error` event, numbered after the last event, and no response.completed
    assert r_err is None, (repr(r_err), r_raw[-300:])
    name, last = _events(r_raw)[-1]
    assert name == "error" and last["type"] == "error" and "shutting down" in last["message"], r_raw[-400:]
    assert last["code"] == "service_unavailable" and isinstance(last["sequence_number"], int), last
    assert b"response.completed" not in r_raw

    # Messages: Anthropic's `event: error`, no message_stop
    assert m_err is None, (repr(m_err), m_raw[-300:])
    name, last = _events(m_raw)[-1]
    assert name == "error" and last["type"] == "error" and "shutting down" in last["error"]["message"], m_raw[-400:]
    assert b"message_stop" not in m_raw

    # Nothing had reached the client yet: the stream begun by its heartbeat gets an error event, the
    # whole answer a 503; neither sees its connection closed.
    assert isinstance(w_stream, openai.APIError) and not isinstance(w_stream, openai.APIConnectionError), repr(w_stream)
    assert "shutting down" in w_stream.message, w_stream.message
    assert isinstance(w_whole, openai.APIStatusError) and w_whole.status_code == 503, repr(w_whole)
    assert "shutting down" in w_whole.message, w_whole.message

    # Accounted as streams cut mid-answer (or refused), with the reason, not as clients that left.
    lines = [orjson.loads(x) for x in access.read_text().splitlines() if x.startswith("{")]
    cut = {x["endpoint"]: x for x in lines if x.get("stream") and x["model"] == "m"}
    assert len(cut) == 3, lines
    for line in cut.values():
        assert line["finish"] == "cut" and "shutting down" in line.get("error", ""), line
    refused = [x for x in lines if x["model"] == "slow"]
    assert len(refused) == 2 and all(x["finish"] == "error" and x["status"] == 503 for x in refused), refused
    assert "requests still in flight" in log and "cutting them" in log, log[-2000:]


async def test_a_shared_stream_cut_by_the_shutdown_ends_with_the_error_event_for_its_leader_and_followers(
        upstream: Any, tmp_path: Path) -> None:
    """A cacheable stream (temperature 0) is one flight: its leader's relay runs in a task of its
    own and its followers read the leader's stream. Cut at the shutdown timeout, each client gets
    its endpoint's error event (the leader's relay writes it into the shared stream; a follower
    writes its own), not a bare close."""
    up = await upstream("up", itl_ms=100, tokens=10_000)
    policy = {"version": 1, "reload": {"watch": False}, "log": {"access": True},
              "backends": {"up": {"url": up.url, "models": ["m"]}},
              "server": {"drain_delay_ms": 0, "shutdown_timeout_ms": _SHUTDOWN_MS}}
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "temperature": 0, "stream": True}
    async with _serve(policy, tmp_path) as (proc, url, access, stderr):
        flowing = [asyncio.Event() for _ in range(3)]
        leader = asyncio.create_task(_raw(url, "/v1/chat/completions", body, flowing[0]))
        await asyncio.wait_for(flowing[0].wait(), 30)
        followers = [asyncio.create_task(_raw(url, "/v1/chat/completions", body, e)) for e in flowing[1:]]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 30)
        assert up.stats.requests == 1, up.stats  # one flight: the followers share the leader's stream
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.wait_for(asyncio.gather(leader, *followers), 20)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    for raw, err in results:
        assert err is None, (repr(err), raw[-300:], stderr.read_text()[-2000:])
        name, last = _events(raw)[-1]
        assert isinstance(last, dict) and "shutting down" in last["error"]["message"], raw[-400:]
        assert last["error"]["code"] == "service_unavailable", last
        assert b"[DONE]" not in raw
    lines = [orjson.loads(x) for x in access.read_text().splitlines() if x.startswith("{")]
    assert len(lines) == 3 and all(x["finish"] == "cut" and "shutting down" in x.get("error", "") for x in lines), [(x["finish"], x.get("error"), x["cache"]) for x in lines]
