"""The store past one Redis, measured: a master killed under load on a Cluster and behind
Sentinels, the connection bound under a 10x burst, and a cache hit's latency on a Cluster
against one Redis.

    python bench/store_failover.py [--rate 200] [--after-s 15] [--hits 400]

1. Failover, for each of a 3-master Cluster (one replica each) and a master + replica + 3
   Sentinels: 3 gateway replicas x 2 workers (`gateway serve --workers 2`) on that store, a steady
   `--rate` req/s open-loop mix (45 % repeated prompts, 45 % new ones, 10 % from a tenant capped at
   120 requests a minute, saturated before the kill), 30 stateful Responses answers recorded
   (`responses.record_replicas: 1`) before the master holding the tenants' quota counters is
   SIGKILLed; the load goes on `--after-s` seconds. Reported: answers by status (target: no 5xx),
   the promotion's time, how long the replicas fell back to their own quota counters and how long
   repeated prompts missed (target: back within 10 s), the capped tenant's answers admitted past
   its limit meanwhile (bound: 6 processes x 120), and the recorded ids found afterwards.
2. Connections: on the Cluster, once recovered, a 10x burst (`--rate` x 10 for one second) while
   CLIENT LIST is read on every master every 100 ms: the most connections of one pool of one
   process on one node, against `store.max_connections` (+1 on a Cluster: its topology reads).
3. Cache hit latency: one gateway (one worker) on one Redis and on the Cluster, `--hits`
   sequential requests of a cached prompt each; client-side p50/p99. Target: the Cluster's p50
   within 0.3 ms of one Redis's.

Every process is the benchmark's own, on loopback ports, stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import re
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._procs import free_port, start, stop, wait_http  # noqa: E402
from tests.procs import redis_server, serve  # noqa: E402
from tests.redis_topology import redis_cluster, redis_sentinel  # noqa: E402

MAIN, CAPPED = "sk-bench-main", "sk-bench-capped"
CAP_RPM = 120
POOL = 8  # store.max_connections
REPEATED = [f"a question asked again and again, number {i}" for i in range(20)]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _policy(up: int, url: str, replicas: int) -> str:
    return (
        f"backends:\n  up: {{url: 'http://127.0.0.1:{up}/v1', models: [gpt-test], max_concurrency: 512}}\n"
        "tenants:\n"
        f"  main: {{key_sha256: ['{_sha(MAIN)}'], quota: {{rpm: 10000000}}}}\n"
        f"  capped: {{key_sha256: ['{_sha(CAPPED)}'], quota: {{rpm: {CAP_RPM}}}}}\n"
        f"store: {{url: '{url}', timeout_ms: 50, quota_timeout_ms: 250, max_connections: {POOL}, replicas: {replicas}}}\n"
        "cache: {ttl_s: 600}\n"
        "responses: {record_replicas: 1, record_timeout_ms: 1000, record_attempts: 4}\n"
        f"reload: {{watch: false, channel: bench-store-{secrets.token_hex(3)}}}\nserver: {{drain_delay_ms: 0}}\n"
    )


@asynccontextmanager
async def _gateways(tmp: Path, up: int, url: str, replicas: int, workers: int) -> AsyncIterator[list[str]]:
    """`replicas` x `gateway serve --workers N` on the store at `url`; their base URLs."""
    pol = tmp / f"policy-{secrets.token_hex(3)}.yaml"
    pol.write_text(_policy(up, url, replicas))
    async with AsyncExitStack() as stack:
        gws = [await stack.enter_async_context(serve(pol, tmp, "--workers", str(workers), ready="/readyz", wait_s=90))
               for _ in range(replicas)]
        try:
            yield [g.url for g in gws]
        finally:
            for g in gws:
                await g.stop()
                text = g.log.read_text(errors="replace")
                if "Traceback" in text:  # an internal error's cause, before the logs go
                    print(f"{g.log.name}: " + text[text.index("Traceback"):][:2500], file=sys.stderr)


@dataclass
class _Seen:
    t: float
    kind: str  # repeated, new, capped
    status: int
    cache: str
    detail: str = ""  # a 5xx's body (what failed)


@dataclass
class _Load:
    urls: list[str]
    rate: float
    seen: list[_Seen] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, http: aiohttp.ClientSession, seconds: float | None = None) -> None:
        tasks: set[asyncio.Task[None]] = set()
        i, t0 = 0, time.monotonic()
        while not self.stop.is_set() and (seconds is None or time.monotonic() - t0 < seconds):
            kind = "capped" if i % 10 == 0 else ("repeated" if i % 2 else "new")
            task = asyncio.create_task(self._one(http, self.urls[i % len(self.urls)], kind))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / self.rate - time.monotonic()))
        await asyncio.gather(*tasks)

    async def _one(self, http: aiohttp.ClientSession, url: str, kind: str) -> None:
        prompt = REPEATED[secrets.randbelow(len(REPEATED))] if kind == "repeated" else f"new {secrets.token_hex(8)}"
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 8}
        key = CAPPED if kind == "capped" else MAIN
        t = time.monotonic()
        try:
            async with http.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                text = await r.read()
                detail = text[:300].decode("utf-8", "replace") if r.status >= 500 else ""
                self.seen.append(_Seen(t, kind, r.status, r.headers.get("x-gateway-cache", ""), detail))
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.seen.append(_Seen(t, kind, 0, "", repr(exc)))


async def _metric(http: aiohttp.ClientSession, url: str, name: str) -> float:
    try:
        async with http.get(url + "/metrics") as r:
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return float("nan")
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def _responses(http: aiohttp.ClientSession, url: str, n: int) -> list[str]:
    ids = []
    for i in range(n):
        async with http.post(url + "/v1/responses", json={"model": "gpt-test", "input": f"keep {i}", "store": True},
                             headers={"Authorization": f"Bearer {MAIN}"}) as r:
            assert r.status == 200, (r.status, await r.text())
            ids.append((await r.json())["id"])
    return ids


async def _found(http: aiohttp.ClientSession, urls: list[str], ids: list[str]) -> int:
    n = 0
    for i, rid in enumerate(ids):
        async with http.get(urls[i % len(urls)] + f"/v1/responses/{rid}", headers={"Authorization": f"Bearer {MAIN}"}) as r:
            n += r.status == 200
    return n


@dataclass
class _Failover:
    name: str
    seen: list[_Seen]
    killed_at: float
    promoted_s: float
    degraded_s: float
    misses_s: float
    ids: int
    found: int
    connections: dict[str, int] = field(default_factory=dict)


async def _failover(
    name: str, topology: Callable[[], AbstractAsyncContextManager[Any]], kill: Callable[[Any], int],
    promoted: Callable[[Any, int], Any], masters: Callable[[Any], list[int]], args: argparse.Namespace, tmp: Path, up: int,
) -> _Failover:  # fmt: skip
    async with topology() as rs, _gateways(tmp, up, rs.url, 3, 2) as urls:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
            ids = await _responses(http, urls[0], 30)
            load = _Load(urls, args.rate)
            running = asyncio.create_task(load.run(http))
            degraded: list[tuple[float, float]] = []

            async def watch() -> None:
                while not load.stop.is_set():
                    values = await asyncio.gather(*(_metric(http, u, "gateway_quota_degraded_total") for u in urls))
                    degraded.append((time.monotonic(), sum(v for v in values if v == v)))
                    await asyncio.sleep(0.25)

            watching = asyncio.create_task(watch())
            await asyncio.sleep(8.0)  # the capped tenant's minute is used up by now (20 req/s x 6 s)
            killed_at = time.monotonic()
            old = kill(rs)
            promoted_s = await promoted(rs, old)
            await asyncio.sleep(max(0.0, killed_at + args.after_s - time.monotonic()))
            load.stop.set()
            await running
            await watching
            found = await _found(http, urls, ids)
            result = _Failover(name, load.seen, killed_at, promoted_s, 0.0, 0.0, len(ids), found)
            # Fallen back from the kill until the counter last moved; repeated prompts missing from
            # the kill until the last such miss.
            moved = [t for (t, v), (_, prev) in zip(degraded[1:], degraded, strict=False) if v > prev]
            result.degraded_s = (max(moved) - killed_at) if moved else 0.0
            misses = [s.t for s in load.seen if s.kind == "repeated" and s.t > killed_at and s.cache != "hit"]
            result.misses_s = (max(misses) - killed_at) if misses else 0.0
            if name == "cluster":
                result.connections = await _burst(http, urls, args.rate * 10, lambda: masters(rs))
    return result


async def _burst(http: aiohttp.ClientSession, urls: list[str], rate: float, masters: Callable[[], list[int]]) -> dict[str, int]:
    """A second at `rate` while every master's CLIENT LIST is read: the most connections of each
    kind of pool (by its name, less the pid) of one process on one node."""
    most: Counter[str] = Counter()
    load = _Load(urls, rate)

    def sample() -> None:
        for port in masters():
            try:
                with redis.Redis(port=port, socket_timeout=1) as r:
                    names = Counter(c.get("name", "") for c in r.client_list())
            except redis.RedisError:
                continue
            for n, count in names.items():
                if n.startswith("gw-"):
                    kind = n.rsplit("-", 1)[0]
                    most[kind] = max(most[kind], count)

    async def watch() -> None:
        while not load.stop.is_set():
            await asyncio.to_thread(sample)
            await asyncio.sleep(0.1)

    watching = asyncio.create_task(watch())
    await load.run(http, seconds=1.0)
    load.stop.set()
    await watching
    return dict(most)


async def _hits(tmp: Path, up: int, url: str, n: int) -> tuple[float, float]:
    async with _gateways(tmp, up, url, 1, 1) as (gw,), aiohttp.ClientSession() as http:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "cached"}], "temperature": 0, "max_tokens": 8}
        h = {"Authorization": f"Bearer {MAIN}"}
        took = []
        for i in range(n + 50):
            t = time.perf_counter()
            async with http.post(gw + "/v1/chat/completions", json=body, headers=h) as r:
                await r.read()
                hit = r.headers.get("x-gateway-cache") == "hit"
            if i >= 50 and hit:  # the first ones warm the connections (and store the entry)
                took.append((time.perf_counter() - t) * 1000)
        took.sort()
        return statistics.median(took), took[int(len(took) * 0.99) - 1]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--after-s", type=float, default=15.0)
    ap.add_argument("--hits", type=int, default=400)
    ap.add_argument("--only", choices=["cluster", "sentinel"], help="one failover run, nothing else")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        up_port = free_port()
        up = start(["-m", "tests.fake_upstream", "--port", str(up_port), "--tokens", "4"])
        try:
            await asyncio.to_thread(wait_http, f"http://127.0.0.1:{up_port}/v1/models", 30, up)

            def kill_cluster(c: Any) -> int:
                port: int = c.master_of("{gwq:capped}")
                c.kill(port)
                return port

            runs = []
            if args.only in (None, "cluster"):
                runs.append(await _failover("cluster", redis_cluster, kill_cluster, lambda c, _old: c.wait_ok(30.0),
                                            lambda c: [n.port for n in c.nodes() if n.role == "master"], args, tmp, up_port))
            if args.only in (None, "sentinel"):
                runs.append(await _failover("sentinel", redis_sentinel, lambda s: s.kill_master(),
                                            lambda s, old: s.wait_promoted(old, 30.0), lambda s: [s.master_port()], args, tmp, up_port))
            if args.only:
                _report_failover(runs, args)
                return
            async with redis_server() as single:
                one = await _hits(tmp, up_port, single, args.hits)
            async with redis_cluster() as cluster:
                many = await _hits(tmp, up_port, cluster.url, args.hits)
        finally:
            stop(up)
    _report(runs, one, many, args)


def _report(runs: list[_Failover], one: tuple[float, float], many: tuple[float, float], args: argparse.Namespace) -> None:
    _report_failover(runs, args)
    conns = next(r.connections for r in runs if r.name == "cluster")
    print(f"\nConnections under a 10x burst ({args.rate * 10:g} req/s for 1 s), Cluster, store.max_connections {POOL}: "
          "the most of one pool of one process on one node (bound: the pool + 1 for the Cluster client's topology reads)")
    print("| pool | most | bound |\n|---|---:|---:|")
    for kind in sorted(conns):
        bound = POOL + 1 if kind in ("gw-store", "gw-quota", "gw-records") else 3
        print(f"| {kind} | {conns[kind]} | {bound} |")
    print(f"\nCache hit latency, one gateway worker, {args.hits} sequential hits (client side)")
    print("| store | p50 | p99 |\n|---|---:|---:|")
    print(f"| one Redis | {one[0]:.2f} ms | {one[1]:.2f} ms |")
    print(f"| Cluster (3 masters) | {many[0]:.2f} ms | {many[1]:.2f} ms |")
    print(f"| difference | {many[0] - one[0]:+.2f} ms (target: within 0.3 ms) | {many[1] - one[1]:+.2f} ms |")


def _report_failover(runs: list[_Failover], args: argparse.Namespace) -> None:
    print(f"\nFailover: 3 replicas x 2 workers, {args.rate:g} req/s, the quota counters' master SIGKILLed, {args.after_s:g} s after")
    print("| store | answers | 200 | 429 (capped tenant) | 5xx | other | promoted in | quotas fell back for | repeated prompts missed for | capped admitted past its limit (bound 720) | ids found |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
        status = Counter(s.status for s in r.seen)
        other = sum(n for st, n in status.items() if st not in (200, 429) and st < 500)
        over = sum(1 for s in r.seen if s.kind == "capped" and s.status == 200 and s.t >= r.killed_at)
        print(f"| {r.name} | {len(r.seen)} | {status[200]} | {status[429]} | {sum(n for st, n in status.items() if st >= 500)} "
              f"| {other} | {r.promoted_s:.1f} s | {r.degraded_s:.1f} s | {r.misses_s:.1f} s | {over} | {r.found}/{r.ids} |")
    for r in runs:
        for s in r.seen:
            if s.status >= 500 or s.status == 0:
                print(f"  {r.name}: {s.status} at {s.t - r.killed_at:+.2f} s from the kill ({s.kind}): {s.detail}")


if __name__ == "__main__":
    asyncio.run(main())
