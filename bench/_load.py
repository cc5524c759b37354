"""Load generators shared by the benchmarks: wrk for throughput, an open-loop client for latency."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]


def lua_post(body: bytes, headers: dict[str, str] | None = None) -> str:
    """A wrk script that POSTs `body` as JSON."""
    lines = ['wrk.method = "POST"', "wrk.body = '%s'" % body.decode(), 'wrk.headers["Content-Type"] = "application/json"']
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in (headers or {}).items()]
    return "\n".join(lines) + "\n"


def lua_post_unique(template: str, headers: dict[str, str] | None = None) -> str:
    """A wrk script that POSTs a JSON body made from `template` with `{n}` replaced by a token
    unique to each request (the wrk run, its thread and a counter): every request a cache miss,
    in a warm-up and the measured run after it too (`wrk()` gives each run its own id)."""
    head, tail = template.split("{n}")
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"']
    lines += [f'wrk.headers["{k}"] = "{v}"' for k, v in (headers or {}).items()]
    lines += [
        "local counter = 1",
        "local run = os.getenv('WRK_RUN') or ''",
        "function setup(thread) thread:set('tid', run .. '-' .. counter); counter = counter + 1 end",
        "local n = 0",
        "request = function()",
        "  n = n + 1",
        f"  return wrk.format(nil, nil, nil, '{head}' .. tid .. '-' .. n .. '{tail}')",
        "end",
    ]
    return "\n".join(lines) + "\n"


def wrk(url: str, connections: int, duration: int, script: Path, cpus: str | None = None) -> dict[str, float]:
    """One wrk run (2 threads; pinned to `cpus` with taskset when given): req/s, requests, non-2xx."""
    cmd = ["wrk", "-t2", f"-c{connections}", f"-d{duration}s", "--latency", "-s", str(script), url]
    out = subprocess.run(
        ["taskset", "-c", cpus, *cmd] if cpus else cmd,
        capture_output=True, text=True, check=True, env={**os.environ, "WRK_RUN": uuid.uuid4().hex[:12]},
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {"rps": rps, "requests": total, "non2xx": int(non2xx.group(1)) if non2xx else 0, "socket_errors": errors.group(1) if errors else ""}


def paired_wrk(
    servers: list[tuple[str, int, Path]], rounds: int, duration: int, connections: int = 32, cpus: str = "0"
) -> list[list[tuple[float, float]]]:
    """Load two servers at the same time, each with its own wrk pinned to `cpus`: `servers` are
    (url, pid, wrk script), the two processes pinned by the caller to one core of their own, which
    the scheduler shares fairly between two busy processes. Whatever slows the machine down then
    slows both alike, so the ratio of their throughputs is the inverse ratio of what a request
    costs each, without the drift between runs that timing them one after the other suffers from
    on a shared VM. Returns, per round, each server's (req/s, CPU us per request); a first round
    warms both up and is left out; the order the two wrks start in alternates."""
    from concurrent.futures import ThreadPoolExecutor

    from bench._procs import cpu_seconds

    out: list[list[tuple[float, float]]] = []
    with ThreadPoolExecutor(2) as pool:
        for i in range(rounds + 1):
            order = [0, 1] if i % 2 else [1, 0]
            cpu0 = [cpu_seconds(pid) for _, pid, _ in servers]
            runs = dict(zip(order, pool.map(lambda k: wrk(servers[k][0], connections, duration, servers[k][2], cpus), order)))
            if any(r["non2xx"] or r["socket_errors"] for r in runs.values()):
                raise RuntimeError(f"errors under load: {runs}")
            if i:
                out.append([(runs[k]["rps"], (cpu_seconds(servers[k][1]) - cpu0[k]) / runs[k]["requests"] * 1e6) for k in (0, 1)])
    return out


def side_by_side_runs(
    start_a: Callable[[int], subprocess.Popen[bytes]], start_b: Callable[[int], subprocess.Popen[bytes]],
    scripts: tuple[Path, Path], rounds: int, duration: int, path: str = "/v1/chat/completions",
) -> list[list[tuple[float, float]]]:
    """`paired_wrk` over two servers that `start_a` and `start_b` start on a given port (pinned to
    one core), started fresh twice: half the rounds with A started first, half with B (in A/A runs
    the process started second lost up to ~1 %). Per round, [A's, B's] (req/s, CPU us per request)."""
    from bench._procs import free_port, stop, wait_http

    out: list[list[tuple[float, float]]] = []
    first_half = (rounds + 1) // 2
    for order, n in (((0, 1), first_half), ((1, 0), rounds - first_half)):
        if not n:
            continue
        ports = free_port(), free_port()
        procs: dict[int, subprocess.Popen[bytes]] = {}  # 0: A, 1: B
        try:
            for k in order:
                procs[k] = (start_a, start_b)[k](ports[k])
            for k in (0, 1):
                wait_http(f"http://127.0.0.1:{ports[k]}/healthz", proc=procs[k])
            out += paired_wrk([(f"http://127.0.0.1:{ports[k]}{path}", procs[k].pid, scripts[k]) for k in (0, 1)], n, duration)
        finally:
            for p in procs.values():
                stop(p)
    return out


async def fixed_rate(url: str, rate: float, duration: float, body: bytes | str, headers: dict[str, str] | None = None) -> list[float]:
    """Open loop: a request every 1/rate s regardless of answers; returns latencies (s).

    The client is the gateway's own lean HTTP/1.1 pool on uvloop (~50 us of CPU per request),
    so the harness adds as little as it can to what it measures."""
    from gateway.upstream.client import UpstreamPool

    data = body.encode() if isinstance(body, str) else body
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    lat: list[float] = []
    errors = 0
    pool = UpstreamPool()

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        r = await pool.post(url, data, hdrs, connect_timeout_s=5)
        await r.read()
        r.release()
        if r.status != 200:
            errors += 1
        lat.append(time.perf_counter() - t0)

    try:
        await asyncio.gather(*(one() for _ in range(50)))  # warm the pool
        lat.clear()
        tasks = []
        start_t = time.perf_counter()
        n = int(rate * duration)
        for i in range(n):
            delay = start_t + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one()))
        await asyncio.gather(*tasks)
    finally:
        await pool.close()
    if errors:
        raise RuntimeError(f"{errors} errors at fixed rate against {url}")
    return lat


async def ttft(url: str, n: int, body: bytes | str, marker: str = '"content":"w') -> list[float]:
    """Sequential streamed requests; time to the first content chunk (the first line holding
    `marker`: a chat delta's content by default, `"delta":"w` for a Responses stream)."""
    needle = marker.encode()
    out = []
    async with aiohttp.ClientSession() as http:
        for i in range(n + 20):
            t0 = time.perf_counter()
            async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                first = None
                async for line in r.content:
                    if first is None and needle in line:
                        first = time.perf_counter() - t0
                if i >= 20:  # skip warm-up
                    out.append(first)
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_in_subprocess(fn: str, *args: object) -> list[float]:
    """Run a load function of this module in its own process, so the client does not share the
    benchmark's interpreter."""
    code = (
        "import json,sys,uvloop; sys.path.insert(0,'.'); "
        f"from bench._load import {fn}; print(json.dumps(uvloop.run({fn}(*{args!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)
