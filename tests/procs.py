"""Helpers for tests that run real gateway processes: free ports, a private redis-server, a
`gateway serve` subprocess that is always stopped (by its PID) when the test ends."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["free_port", "redis_server", "serve", "wait_http", "Proc"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def both_workers(url: str, headers: dict[str, str], workers: int = 2) -> dict[str, Any]:
    """/admin/backends once every worker of `gateway serve --workers N` answers on its control
    socket (a reload needs every one)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 60
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(url + "/admin/backends", headers=headers) as r:
                body: dict[str, Any] = await r.json()
            if len(body.get("workers", [])) == workers and all("backends" in w for w in body["workers"]):
                return body
            assert loop.time() < end, body
            await asyncio.sleep(0.2)


async def wait_http(url: str, timeout_s: float, status: int = 200) -> None:
    """Poll `url` until it answers `status`; AssertionError after `timeout_s`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            try:
                async with http.get(url) as r:
                    if r.status == status:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                pass
            assert loop.time() < end, f"{url} did not answer {status} within {timeout_s} s"
            await asyncio.sleep(0.1)


def redis_missing(why: str) -> NoReturn:
    """Redis (the service, or redis-server to start one) is not there: a skip on a developer's machine,
    a failure under CI (`CI` set), where a green run must not hide the store, quota and single-flight tests."""
    if os.environ.get("CI"):
        pytest.fail(f"{why}: these tests need it, and CI is set", pytrace=False)
    pytest.skip(why)


def shared_redis(db: int) -> redis.Redis:
    """A client of the machine's Redis (127.0.0.1:6379) on database `db`; redis_missing() when
    it does not answer."""
    client = redis.Redis(host="127.0.0.1", port=6379, db=db)
    try:
        client.ping()
    except redis.ConnectionError:
        redis_missing("no Redis at 127.0.0.1:6379")
    return client


def needs_redis_server() -> str:
    """The path of redis-server; redis_missing() when it is not installed."""
    return needs_tool("redis-server")


def needs_tool(name: str) -> str:
    """The path of the program `name` (redis-server, redis-cli, openssl); redis_missing() (a skip,
    or a failure under CI) when it is not installed."""
    exe = shutil.which(name)
    if exe is None:
        redis_missing(f"{name} is not installed")
    return exe


@asynccontextmanager
async def redis_server() -> AsyncIterator[str]:
    """A redis-server of our own on a free port (no persistence); yields its URL."""
    async with redis_process() as (url, _proc):
        yield url


@asynccontextmanager
async def redis_process() -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """redis_server, also yielding its process: a test may kill it (a store outage)."""
    exe = needs_redis_server()
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        if proc.returncode is None:
            proc.terminate()
        await proc.wait()


class Proc:
    """A running `gateway serve`; `log` is its stderr (a file, so a chatty process never blocks)."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)

    async def stop(self, timeout_s: float = 30.0) -> int:
        self.signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            self.proc.kill()
            return await self.proc.wait()


@asynccontextmanager
async def serve(policy: dict[str, Any] | Path, tmp: Path, *args: str, ready: str = "/healthz", wait_s: float = 60) -> AsyncIterator[Proc]:
    """Run `gateway serve` on a free port with `policy` (a dict is written to a file in `tmp`)."""
    port = free_port()
    if isinstance(policy, Path):
        path = policy
    else:
        path = tmp / f"policy-{port}.yaml"
        path.write_text(yaml.safe_dump(policy))
    log = tmp / f"gateway-{port}.log"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(path), "--host", "127.0.0.1", "--port", str(port), *args,
            cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    p = Proc(proc, port, log)
    try:
        try:
            await wait_http(p.url + ready, wait_s)
        except AssertionError:
            raise AssertionError(f"gateway did not start: {log.read_text()[-3000:]}") from None
        yield p
    finally:
        if proc.returncode is None:
            proc.kill()  # a test that wanted a graceful stop did it itself
            await proc.wait()
