"""Quotas across real gateway processes: three `gateway serve` on one redis-server of the test's own,
many concurrent clients over the limits, then Redis killed mid-run. Bounded: ~15 s."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from tests.conftest import simple_policy
from tests.procs import needs_redis_server
from tests.test_cli import ROOT, _free_port

KEY = "sk-q-" + secrets.token_hex(16)
ADMIN = "sk-admin-" + secrets.token_hex(16)
MSG = [{"role": "user", "content": "hello"}]



def _digest(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


@contextlib.asynccontextmanager
async def _redis() -> AsyncIterator[tuple[int, subprocess.Popen[bytes]]]:
    port = _free_port()
    proc = subprocess.Popen(
        [needs_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@contextlib.asynccontextmanager
async def _gateways(policy: Path, n: int) -> AsyncIterator[list[int]]:
    ports = [_free_port() for _ in range(n)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(p),
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        for p in ports
    ]
    try:
        for proc in procs:
            async with asyncio.timeout(30):
                while "serving on" not in (line := (await proc.stderr.readline()).decode()):  # type: ignore[union-attr]
                    assert line, "a gateway exited"
        yield ports
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            await asyncio.wait_for(proc.communicate(), 20)


async def test_limits_hold_across_three_processes_and_a_dead_redis_is_no_5xx(upstream, tmp_path):
    up = await upstream("a", tokens=5, ttft_ms=20)
    async with _redis() as (rport, redis_proc):
        policy = simple_policy(up, cache={"enabled": False}, store={"url": f"redis://127.0.0.1:{rport}/0", "quota_timeout_ms": 2000})
        policy["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": {"rpm": 60, "concurrency": 5}}}
        policy["admin"] = {"key_sha256": [_digest(ADMIN)]}
        path = tmp_path / "p.yaml"
        path.write_text(yaml.safe_dump(policy))
        async with _gateways(path, 3) as ports, aiohttp.ClientSession() as http:
            auth = {"Authorization": f"Bearer {KEY}"}
            codes: list[int] = []
            peak = 0

            async def client(i: int, until: float) -> None:
                nonlocal peak
                url = f"http://127.0.0.1:{ports[i % 3]}/v1/chat/completions"
                while time.monotonic() < until:
                    async with http.post(url, json={"model": "gpt-test", "messages": MSG}, headers=auth) as r:
                        await r.read()
                        codes.append(r.status)
                    peak = max(peak, up.stats.active)
                    if r.status == 429:
                        await asyncio.sleep(0.02)

            end = time.monotonic() + 4
            await asyncio.gather(*[client(i, end) for i in range(60)])
            assert codes.count(200) == 60  # exactly the limit across three processes (a fresh window)
            assert set(codes) == {200, 429}
            assert up.stats.requests == 60 and peak <= 5  # concurrency 5, sampled as requests end
            # every lease given back
            async with http.get(f"http://127.0.0.1:{ports[0]}/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                use = (await r.json())["tenants"]["acme"]["use"]["tenant"]
            assert use["inflight"] == 0 and use["requests_60s"] == 60
            # Redis dies: answers keep coming from each replica's own counters, never a 5xx
            redis_proc.kill()
            redis_proc.wait()
            codes.clear()
            end = time.monotonic() + 2
            await asyncio.gather(*[client(i, end) for i in range(12)])
            assert codes and all(c < 500 for c in codes) and 200 in codes
            degraded = 0.0
            for p in ports:
                async with http.get(f"http://127.0.0.1:{p}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("gateway_quota_degraded_total "):
                            degraded += float(line.split()[1])
            assert degraded > 0


async def test_memory_quotas_with_several_workers_say_so_at_start(tmp_path):
    path = tmp_path / "p.yaml"
    policy = {
        "backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
        "tenants": {"t": {"key_sha256": [_digest(KEY)], "quota": {"rpm": 10}}},
        "reload": {"watch": False},
    }
    path.write_text(yaml.safe_dump(policy))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--port", str(_free_port()), "--workers", "2",
        cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(30):
            while "per worker" not in (line := (await proc.stderr.readline()).decode()):  # type: ignore[union-attr]
                assert line, "the gateway exited"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.communicate(), 20)
