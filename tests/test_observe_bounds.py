"""What a hostile caller can make the observation cost: the access log and the spans keep a cut
model name; the access log's queue is bounded (drops counted), its shutdown does not wait for a
stdout nobody reads, and `--workers N` lines on one pipe stay whole. Real gateways on loopback
(in process, and `gateway serve` with its stdout on a pipe), a fake OTLP collector."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from gateway.observe.observer import MODEL_CHARS, AccessLog
from gateway.tenants.auth import hash_key
from gateway.web.keys import OBSERVER
from tests.conftest import simple_policy
from tests.procs import ROOT, free_port, wait_http
from tests.test_observe import _flush, _otlp_collector

HUGE = "m" + "A" * (1024 * 1024)  # a cheap 404: the model does not exist


async def _post_model(url: str, model: str, headers: dict[str, str] | None = None) -> int:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}]}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
            await r.read()
            return r.status


@pytest.fixture
def captured_stdout(capsys):
    """The access log's stdout (capsys's, which has no descriptor: written with write())."""
    yield capsys


async def test_the_access_log_line_of_a_huge_model_name_stays_small(gateway, upstream, captured_stdout):
    up = await upstream("a")
    gw = await gateway(simple_policy(up, log={"access": True}))
    assert await _post_model(gw.url, HUGE) == 404
    gw.app[OBSERVER].close()
    lines = [line for line in captured_stdout.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and len(lines[0]) < 4096, len(lines[0])
    entry = orjson.loads(lines[0])
    assert entry["status"] == 404 and entry["model"] == HUGE[:MODEL_CHARS]


@pytest.mark.parametrize(
    "content",
    ["\x01" * 1500, "表" * 1900, "\U0001f600" * 1200, "é\n" * 700],
    ids=["control-characters", "cjk", "emoji", "short-escapes"],
)
async def test_with_prompts_logged_a_line_stays_one_atomic_write(gateway, upstream, captured_stdout, content):
    # 2,000 characters of JSON text escape to up to 12 KB: past PIPE_BUF, where --workers N
    # writers on one pipe cut into one another's lines. The cut is by bytes as well.
    up = await upstream("a", tokens=1)
    gw = await gateway(simple_policy(up, log={"access": True, "prompts": True}))
    messages = [{"role": "user", "content": content}]
    async with aiohttp.ClientSession() as http:
        for model in ("gpt-test", "\x01" * 1000):  # a 200 and a 404 quoting a model of escapes
            body = {"model": model, "messages": messages}
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
    gw.app[OBSERVER].close()
    lines = [line for line in captured_stdout.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 2
    for line in lines:
        assert len(line.encode()) < 4096, len(line.encode())
        entry = orjson.loads(line)
        text = orjson.dumps(messages).decode()
        assert entry["prompt_truncated"] is True and text.startswith(entry["prompt"])
        assert len(entry["prompt"]) > 300, len(entry["prompt"])  # cut to fit, not dropped
    assert [orjson.loads(line)["status"] for line in lines] == [200, 404]


async def test_with_prompts_logged_a_short_prompt_is_kept_as_sent(gateway, upstream, captured_stdout):
    up = await upstream("a", tokens=1)
    gw = await gateway(simple_policy(up, log={"access": True, "prompts": True}))
    messages = [{"role": "user", "content": "é" * 900}]  # 1,800 bytes: within the line
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-test", "messages": messages}) as r:
            assert r.status == 200
    gw.app[OBSERVER].close()
    (line,) = [line for line in captured_stdout.readouterr().out.splitlines() if line.startswith("{")]
    entry = orjson.loads(line)
    assert entry["prompt"] == messages and "prompt_truncated" not in entry


async def test_a_span_keeps_a_cut_model_name_and_the_provider_cuts_long_attributes(gateway, upstream):
    async with _otlp_collector() as (url, spans):
        up = await upstream("a")
        gw = await gateway(simple_policy(up, tracing={"otlp_endpoint": url, "sample_ratio": 1.0}))
        assert await _post_model(gw.url, HUGE) == 404
        await _flush(gw)
        assert len(spans) == 1
        attrs = {a.key: a.value.string_value for a in spans[0].attributes}
        assert attrs["gen_ai.request.model"] == HUGE[:MODEL_CHARS]
        assert len(spans[0].name) < MODEL_CHARS + 32, len(spans[0].name)
    from gateway.config.policy import TracingPolicy
    from gateway.observe import otel

    provider = otel.provider(TracingPolicy(otlp_endpoint=url))
    try:
        span = provider.get_tracer("t").start_span("s", attributes={"long": "x" * 100_000})
        assert len(span.attributes["long"]) == otel.MAX_ATTRIBUTE_CHARS
        span.end()
    finally:
        provider.shutdown()


def test_the_queue_is_bounded_drops_are_counted_and_close_does_not_wait_for_a_stalled_stdout():
    r, w = os.pipe()  # nobody reads r: the pipe fills, then the writer thread blocks in write()
    drops: dict[str, int] = {}
    out = os.fdopen(w, "w")
    log = AccessLog(out, on_drop=lambda reason, n: drops.__setitem__(reason, drops.get(reason, 0) + n), max_queued=100)
    try:
        line = b"{" + b"x" * 1000 + b"}"
        for _ in range(400):  # 400 KB: far past the pipe's 64 KiB and the queue's 100 lines
            log.write(line)
            time.sleep(0.0005)
        time.sleep(0.2)
        assert drops.get("queue_full", 0) > 0, drops
        started = time.monotonic()
        log.close(wait_s=0.5)
        assert time.monotonic() - started < 2, "close() waited for a stdout nobody reads"
    finally:
        os.close(r)  # the blocked writer gets EPIPE and ends
        out.close() if not out.closed else None


def test_each_write_is_whole_lines_of_at_most_pipe_buf_bytes():
    # SOCK_SEQPACKET keeps each write() a message of its own: the test sees the writes' bounds.
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    out = os.fdopen(os.dup(a.fileno()), "w")
    a.close()
    log = AccessLog(out)
    sent = [b'{"n":%d,"pad":"%s"}' % (i, b"p" * (i * 37 % 1500)) for i in range(300)]
    got: list[bytes] = []
    reader = threading.Thread(target=_read_lines, args=(b, len(sent), got), daemon=True)
    reader.start()
    for line in sent:
        log.write(line)
    log.close()
    reader.join(5)
    out.close()
    b.close()
    assert got and all(len(m) <= 4096 and m.endswith(b"\n") for m in got), [len(m) for m in got]
    assert b"".join(got).split(b"\n")[:-1] == sent


def _read_lines(sock: socket.socket, lines: int, into: list[bytes]) -> None:
    """Messages from `sock` until they hold `lines` lines."""
    while sum(m.count(b"\n") for m in into) < lines:
        into.append(sock.recv(1 << 16))


# ---- `gateway serve` with its stdout on a pipe ---------------------------------------------------

KEY = "sk-observe-bounds-key"


def _policy(up_url: str) -> dict[str, Any]:
    return {
        "version": 1,
        "backends": {"a": {"url": up_url, "models": ["m"]}},
        "log": {"access": True},
        "reload": {"watch": False},
        "server": {"drain_delay_ms": 0, "shutdown_timeout_ms": 2000},
        "tenants": {"t": {"key_sha256": [hash_key(KEY)]}},
    }


@asynccontextmanager
async def _serve_to_pipe(policy: dict[str, Any], tmp: Path, *args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, int]]:
    """`gateway serve` whose stdout is a pipe: yields the process, its URL and the pipe's read end
    (the test reads it, or not)."""
    port = free_port()
    path = tmp / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with (tmp / "gateway.log").open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", str(port), *args,
            cwd=ROOT, env=env, stdout=w, stderr=err,
        )  # fmt: skip
    os.close(w)
    try:
        try:
            await wait_http(f"http://127.0.0.1:{port}/healthz", 60)
        except AssertionError:
            raise AssertionError(f"gateway did not start: {(tmp / 'gateway.log').read_text()[-3000:]}") from None
        yield proc, f"http://127.0.0.1:{port}", r
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(r)


async def _load(url: str, n: int, conc: int, model: str) -> list[int]:
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=conc, force_close=True)) as http:

        async def one(i: int) -> int:
            async with sem:
                body = {"model": f"{model}{i}", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
                    await r.read()
                    return r.status

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def test_sigterm_stops_a_gateway_whose_stdout_nobody_reads(upstream, tmp_path):
    up = await upstream("a")
    async with _serve_to_pipe(_policy(up.url), tmp_path) as (proc, url, _unread):
        # 400 lines of ~600 bytes: the pipe (64 KiB) is full, the writer thread blocked in write().
        assert set(await _load(url, 400, 8, "x" * 400)) == {404}
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            assert 'gateway_access_log_dropped_total{reason="queue_full"}' in await r.text()
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        # the drain (0 + 2 s of shutdown budget, nothing in flight) and the access log's 2 s
        assert await asyncio.wait_for(proc.wait(), 10) == 0


async def test_two_workers_access_log_lines_on_one_pipe_stay_whole(upstream, tmp_path):
    up = await upstream("a")
    async with _serve_to_pipe(_policy(up.url), tmp_path, "--workers", "2") as (proc, url, r):
        # Nobody reads while the load runs: the pipe fills and both workers' writers block on it,
        # where a write of more than PIPE_BUF bytes goes in parts that the other's writes split.
        n = 600
        assert set(await _load(url, n, 8, "m-" + "x" * 3000)) == {404}  # long names: lines past 3 KB before the cut
        await asyncio.sleep(0.3)
        out = bytearray()
        loop = asyncio.get_running_loop()
        os.set_blocking(r, False)
        loop.add_reader(r, lambda: out.extend(os.read(r, 1 << 16)))
        try:
            end = loop.time() + 10
            while out.count(b"\n") < n and loop.time() < end:
                await asyncio.sleep(0.05)
        finally:
            loop.remove_reader(r)
        lines = bytes(out).split(b"\n")[:-1]
        bad = 0
        for line in lines:
            try:
                assert orjson.loads(line)["status"] == 404
            except (orjson.JSONDecodeError, KeyError, AssertionError):
                bad += 1
        assert (len(lines), bad) == (n, 0)


FORGED = "2031-01-01 00:00:00,000 WARNING gateway.admin: admin key revoked for tenant acme\x1b[2K"


async def test_a_callers_bytes_quoted_in_the_log_stay_in_their_own_record(tmp_path):
    """A backend whose 500 page quotes the prompt (a proxy, a WAF, a debug page): the gateway logs
    that page's start, and the caller's newline began a forged line of the gateway's own (time,
    level, logger) with an ANSI escape (review helper's repro). Through `gateway serve`'s stderr:
    each record one line, its control characters written escaped."""
    from aiohttp import web

    from tests.procs import serve
    from tests.servers import serve_app

    async def echo_500(request: web.Request) -> web.Response:
        body = await request.json()
        return web.Response(status=500, text="upstream error while handling: " + body["messages"][-1]["content"])

    app = web.Application()
    app.router.add_post("/v1/chat/completions", echo_500)
    runner, port = await serve_app(app)
    key = "sk-alice-log"
    policy = {"version": 1, "backends": {"a": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]}},
              "models": {"m": {"backends": ["a"]}}, "tenants": {"alice": {"key_sha256": [hash_key(key)]}}}
    try:
        async with serve(policy, tmp_path) as gw, aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi\n" + FORGED}]}) as r:
                assert r.status == 502 and FORGED not in await r.text()
            await asyncio.sleep(0.2)
            text = gw.log.read_text()
    finally:
        await runner.cleanup()
    quoted = [line for line in text.splitlines() if "upstream error while handling" in line]
    assert quoted and all("\\n2031-01-01" in line and "\\x1b[2K" in line for line in quoted), quoted
    assert not [line for line in text.splitlines() if line.startswith("2031-01-01")] and "\x1b" not in text
