"""Upstream client cost: aiohttp's ClientSession against gateway.upstream.client.UpstreamPool.

The same POST load (sequential, and `--concurrency` workers) from this one process against the fake
upstream in its own process, for non-stream and stream answers, through both clients in alternating
order. Reports requests/s and this process's CPU microseconds per request (time.process_time),
median over rounds. Run it under the shared bench lock:

    flock /tmp/bench.lock .venv/bin/python -m bench.upstream_client [--requests 4000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
import uvloop

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script too
from bench._procs import cpu_seconds, free_port, start, stop, wait_http  # noqa: E402
from gateway.upstream.client import UpstreamPool  # noqa: E402

Send = Callable[[bytes], Awaitable[int]]

HEADERS = {
    "Content-Type": "application/json",
    "Accept-Encoding": "identity",
    "Authorization": "Bearer sk-bench",
    "X-Request-Id": "req-0123456789abcdef",
}


def _body(stream: bool) -> bytes:
    msgs = [{"role": "user", "content": "Summarise the plot of Hamlet in two sentences, please."}]
    return orjson.dumps({"model": "fake", "messages": msgs, "stream": stream, "max_tokens": 16})


def aiohttp_sender(session: aiohttp.ClientSession, url: str, stream: bool) -> Send:
    timeout = aiohttp.ClientTimeout(total=None, connect=5)  # as the gateway builds it, once per backend

    async def send(body: bytes) -> int:
        resp = await session.post(url, data=body, headers=HEADERS, timeout=timeout)
        n = 0
        if stream:
            while chunk := await resp.content.readany():
                n += len(chunk)
        else:
            n = len(await resp.read())
        resp.release()
        return n

    return send


def pool_sender(pool: UpstreamPool, url: str, stream: bool) -> Send:
    async def send(body: bytes) -> int:
        resp = await pool.post(url, body, HEADERS, connect_timeout_s=5)
        n = 0
        if stream:
            while chunk := await resp.readany():
                n += len(chunk)
        else:
            n = len(await resp.read())
        resp.release()
        return n

    return send


async def load(send: Send, body: bytes, requests: int, concurrency: int) -> tuple[float, float]:
    """Run `requests` calls over `concurrency` workers; (requests/s, client CPU us per request)."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await send(body) <= 0:
                raise RuntimeError("empty answer")

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    return requests / wall, cpu / requests * 1e6


async def run(args: argparse.Namespace, base: str, upstream_pid: int) -> dict[str, dict[str, float]]:
    url = base + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, keepalive_timeout=60)
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    pool = UpstreamPool()
    cells: dict[str, dict[str, list[float]]] = {}
    try:
        for rnd in range(args.rounds):
            order = ("aiohttp", "pool") if rnd % 2 == 0 else ("pool", "aiohttp")
            for stream in (False, True):
                body = _body(stream)
                for conc in (1, args.concurrency):
                    for client in order:
                        send = aiohttp_sender(session, url, stream) if client == "aiohttp" else pool_sender(pool, url, stream)
                        await load(send, body, max(200, args.requests // 10), conc)  # warm: connections, caches
                        up0 = cpu_seconds(upstream_pid)
                        rps, us = await load(send, body, args.requests, conc)
                        up_us = (cpu_seconds(upstream_pid) - up0) / args.requests * 1e6
                        key = f"{'stream' if stream else 'non-stream'} c={conc} {client}"
                        cell = cells.setdefault(key, {"rps": [], "cpu_us": [], "upstream_cpu_us": []})
                        cell["rps"].append(rps)
                        cell["cpu_us"].append(us)
                        cell["upstream_cpu_us"].append(up_us)
    finally:
        await session.close()
        await pool.close()
    return {k: {m: statistics.median(v) for m, v in cell.items()} for k, cell in cells.items()}


def report(res: dict[str, dict[str, float]], concurrency: int) -> str:
    lines = [
        "parser: httptools (llhttp) for UpstreamPool; aiohttp's own C parser (llhttp) for ClientSession",
        f"{'load':<18} {'client':<8} {'req/s':>8} {'client CPU us/req':>18} {'upstream CPU us/req':>20}",
    ]
    for stream in ("non-stream", "stream"):
        for conc in (1, concurrency):
            a, p = res[f"{stream} c={conc} aiohttp"], res[f"{stream} c={conc} pool"]
            for name, r in (("aiohttp", a), ("pool", p)):
                lines.append(
                    f"{stream + f' c={conc}':<18} {name:<8} {r['rps']:>8.0f} {r['cpu_us']:>18.1f} {r['upstream_cpu_us']:>20.1f}"
                )
            lines.append(
                f"{'':<18} {'ratio':<8} {p['rps'] / a['rps']:>7.2f}x {p['cpu_us'] / a['cpu_us']:>17.2f}x"
                f"   (pool saves {a['cpu_us'] - p['cpu_us']:.0f} us/req)"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4000, help="measured requests per cell")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are reported")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pin", action="store_true", help="upstream on CPU 1, this client on CPU 0")
    ap.add_argument("--json", help="also write the medians to this file")
    args = ap.parse_args()
    port = free_port()
    proc = start(["-m", "tests.fake_upstream", "--port", str(port), "--tokens", str(args.tokens)], cpus="1" if args.pin else None)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/healthz")
        if args.pin:
            os.sched_setaffinity(0, {0})
        res = uvloop.run(run(args, base, proc.pid))
    finally:
        stop(proc)
    print(report(res, args.concurrency))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
