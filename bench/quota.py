"""Per-tenant quotas: what the quota stage adds to a request, and how exact it is across replicas, in one run.

    python bench/quota.py [--pairs 5000] [--requests 500] [--loop-s 2] [--exact-s 20] [--clients 60]

1. Added latency. In process, against the Redis at 127.0.0.1:6379 (DB 15, a unique key prefix,
   deleted after): p50/p99 of one `quota_take` + `quota_settle` pair for a tenant with rpm, tpm and
   concurrency limits, the same on the in-memory store, and decisions per second on one event loop
   (a tight loop of `quota_take`: one at a time, and 64 in flight). End to end: two gateway
   processes (one worker each, Redis store, cache off) that differ only in the tenant's quota,
   sequential non-stream requests alternating between them; the difference of the p50/p99 is
   what the quota stage adds.
2. Exactness under 3 replicas: our own redis-server on a free port, 3 gateway processes on one
   policy with a tenant `quota: {rpm: 300}`, `--clients` concurrent clients round-robin across
   the 3 ports for `--exact-s` s from an empty Redis. Every request of the run lies in one 60 s
   window, so at most 300 may be admitted. Cross-checked with what reached the upstream.
   LiteLLM's column is modelled from its documented design, not measured: each replica keeps
   in-memory counters and syncs them to Redis every few hundred ms, so N replicas can each admit
   up to the limit before they see each other's counts: up to N x the limit in a burst.

Traffic only to 127.0.0.1; every process is ours and stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import orjson
import redis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import pct  # noqa: E402
from bench._procs import free_port, redis_server, start, stop, wait_http  # noqa: E402
from gateway.tenants.quota_counters import Ask, Scope, Settle  # noqa: E402
from gateway.store.core import MemoryStore, Store  # noqa: E402
from gateway.store.redis_store import RedisStore  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/15"
BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16})
# Limits high enough that nothing in this bench is refused: every decision checks all three.
LIMITS = Scope("", rpm=1_000_000_000, tpm=1_000_000_000_000, concurrency=1_000_000)
LIMITS_YAML = "{rpm: 1000000000, tpm: 1000000000000, concurrency: 1000000}"
RPM = 300
REPLICAS = 3
LITELLM_SYNC = "each replica syncs in-memory counters to Redis every few hundred ms"


# ---------------------------------------------------------------- 1a. in process: the store calls


async def store_latency(store: Store, tenant: str, pairs: int) -> tuple[list[float], list[float]]:
    """Seconds per take + settle pair (a reservation of 1,040 tokens settled at 24 used), and per take."""
    pair: list[float] = []
    take: list[float] = []
    for i in range(pairs + 500):  # the first 500: connections, script load, warm caches
        lease = os.urandom(8).hex()
        t0 = time.perf_counter()
        d = await store.quota_take(tenant, Ask((LIMITS,), 1040, lease, 40_000))
        t1 = time.perf_counter()
        await store.quota_settle(tenant, Settle(("",), d.bucket, d.day, 24 - 1040, 0, lease))
        t2 = time.perf_counter()
        if not d.ok:
            raise RuntimeError(f"quota refused in the bench: {d}")
        if i >= 500:
            pair.append(t2 - t0)
            take.append(t1 - t0)
    return pair, take


async def ping_floor(pairs: int) -> list[float]:
    """Two PINGs through a redis.asyncio client like the store's: the round trips alone, no script."""
    from redis.asyncio import Redis

    r = Redis.from_url(REDIS_URL)
    out: list[float] = []
    try:
        for i in range(pairs + 500):
            t0 = time.perf_counter()
            await r.ping()
            await r.ping()
            if i >= 500:
                out.append(time.perf_counter() - t0)
    finally:
        await r.aclose()
    return out


async def decisions_per_s(store: Store, tenant: str, seconds: float, inflight: int) -> float:
    """quota_take in a tight loop on this event loop (`inflight` loops at once) for `seconds`.
    Nothing is settled, so leases last 20 ms: tens to hundreds stay live, as in a busy worker,
    not every decision of the loop (the memory store scans its live leases on every take)."""
    count = 0
    end = time.perf_counter() + seconds

    async def loop() -> None:
        nonlocal count
        while time.perf_counter() < end:
            d = await store.quota_take(tenant, Ask((LIMITS,), 1040, os.urandom(8).hex(), 20))
            if not d.ok:
                raise RuntimeError(f"quota refused in the bench: {d}")
            count += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(inflight)))
    return count / (time.perf_counter() - t0)


async def in_process(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    prefix = f"bench:quota:{uuid.uuid4().hex}:"
    results: dict[str, dict[str, float]] = {}
    rstore = RedisStore(REDIS_URL, prefix=prefix)
    try:
        for name, store in (("redis", rstore), ("memory", MemoryStore())):
            lat, take = await store_latency(store, "lat", args.pairs)
            results[name] = {
                "pair_p50_ms": pct(lat, 0.5) * 1000,
                "pair_p99_ms": pct(lat, 0.99) * 1000,
                "take_p50_ms": pct(take, 0.5) * 1000,
                "take_p99_ms": pct(take, 0.99) * 1000,
                "decisions_per_s": await decisions_per_s(store, "seq", args.loop_s, 1),
                "decisions_per_s_64": await decisions_per_s(store, "par", args.loop_s, 64),
            }
        floor = await ping_floor(args.pairs)
        results["redis"]["ping2_p50_ms"] = pct(floor, 0.5) * 1000
        results["redis"]["ping2_p99_ms"] = pct(floor, 0.99) * 1000
    finally:
        await rstore.close()
        raw = redis.Redis.from_url(REDIS_URL)
        keys = list(raw.scan_iter(match=prefix + "*", count=1000))
        if keys:
            raw.delete(*keys)
        raw.close()
    return results


# ---------------------------------------------------------------- 1b. end to end: with vs without quota


def _policy(path: Path, up_port: int, store_url: str, tenant: str, digest: str, quota: str | None) -> None:
    quota_line = f"\n    quota: {quota}" if quota else ""
    path.write_text(
        f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [m], max_concurrency: 4096}}\n"
        f"store: {{url: '{store_url}'}}\n"
        "cache: {enabled: false}\n"
        "reload: {watch: false}\n"
        f"tenants:\n  {tenant}:\n    key_sha256: ['{digest}']{quota_line}\n"
    )


async def sequential(urls: dict[str, str], key: str, n: int) -> dict[str, list[float]]:
    """n sequential requests to each URL, alternating between them (drift hits both alike)."""
    from gateway.upstream.client import UpstreamPool

    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    lat: dict[str, list[float]] = {k: [] for k in urls}
    pool = UpstreamPool()
    try:
        for i in range(n + 100):  # the first 100 of each: warm-up
            for name, url in urls.items() if i % 2 else reversed(urls.items()):
                t0 = time.perf_counter()
                r = await pool.post(url, BODY, hdrs, connect_timeout_s=5)
                await r.read()
                r.release()
                dt = time.perf_counter() - t0
                if r.status != 200:
                    raise RuntimeError(f"{name}: HTTP {r.status}")
                if i >= 100:
                    lat[name].append(dt)
    finally:
        await pool.close()
    return lat


def end_to_end(args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    tenant = f"bench{secrets.token_hex(6)}"  # its keys in DB 15 are only this run's: {gwq:<tenant>}
    key = "sk-bench-" + secrets.token_hex(16)
    digest = hashlib.sha256(key.encode()).hexdigest()
    up_port = free_port()
    procs = [start(["-m", "tests.fake_upstream", "--port", str(up_port)])]
    urls = {}
    try:
        for name, quota in (("quota", LIMITS_YAML), ("none", None)):
            port = free_port()
            policy = tmp / f"e2e-{name}.yaml"
            _policy(policy, up_port, REDIS_URL, tenant, digest, quota)
            procs.append(start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)], env={"GATEWAY_LOG_LEVEL": "WARNING"}))
            urls[name] = f"http://127.0.0.1:{port}/v1/chat/completions"
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        for url in urls.values():
            wait_http(url.replace("/v1/chat/completions", "/healthz"))
        lat = uvloop.run(sequential(urls, key, args.requests))
    finally:
        for p in reversed(procs):
            stop(p)
        raw = redis.Redis.from_url(REDIS_URL)
        keys = list(raw.scan_iter(match=f"*{{gwq:{tenant}}}*", count=1000))
        if keys:
            raw.delete(*keys)
        raw.close()
    return {
        "with_p50_ms": pct(lat["quota"], 0.5) * 1000,
        "with_p99_ms": pct(lat["quota"], 0.99) * 1000,
        "without_p50_ms": pct(lat["none"], 0.5) * 1000,
        "without_p99_ms": pct(lat["none"], 0.99) * 1000,
    }


# ---------------------------------------------------------------- 2. exactness under 3 replicas


async def hammer(urls: list[str], key: str, clients: int, seconds: float) -> dict[str, object]:
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    statuses: dict[int, int] = {}
    first_429: list[float] = []
    admitted_at: list[float] = []
    errors = 0
    t_start = time.perf_counter()
    end = t_start + seconds
    turn = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal turn, errors
        while time.perf_counter() < end:
            url = urls[turn % len(urls)]
            turn += 1
            try:
                async with http.post(url, data=BODY, headers=hdrs) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
                    now = time.perf_counter() - t_start
                    if r.status == 200:
                        admitted_at.append(now)
                    elif r.status == 429 and not first_429:
                        first_429.append(now)
            except (aiohttp.ClientError, asyncio.TimeoutError):
                errors += 1

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    elapsed = time.perf_counter() - t_start
    return {
        "statuses": statuses,
        "errors": errors,
        "elapsed_s": elapsed,
        "last_admitted_s": max(admitted_at) if admitted_at else 0.0,
        "first_429_s": first_429[0] if first_429 else None,
    }


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read()


def exactness(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    if not shutil.which("redis-server"):
        sys.exit("redis-server not found: apt-get install redis-server")
    key = "sk-bench-" + secrets.token_hex(16)
    digest = hashlib.sha256(key.encode()).hexdigest()
    redis_port, up_port = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    ports: list[int] = []
    try:
        procs.append(redis_server(redis_port))
        raw = redis.Redis(host="127.0.0.1", port=redis_port)
        for _ in range(100):
            try:
                raw.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        raw.close()
        procs.append(start(["-m", "tests.fake_upstream", "--port", str(up_port)]))
        policy = tmp / "replicas.yaml"
        _policy(policy, up_port, f"redis://127.0.0.1:{redis_port}/0", "acme", digest, f"{{rpm: {RPM}}}")
        for _ in range(REPLICAS):
            ports.append(free_port())
            procs.append(start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(ports[-1])], env={"GATEWAY_LOG_LEVEL": "WARNING"}))
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        for p in ports:
            wait_http(f"http://127.0.0.1:{p}/healthz")
        urls = [f"http://127.0.0.1:{p}/v1/chat/completions" for p in ports]
        res = uvloop.run(hammer(urls, key, args.clients, args.exact_s))
        upstream_seen = orjson.loads(_get(f"http://127.0.0.1:{up_port}/_stats"))
        degraded = 0.0
        for p in ports:
            text = _get(f"http://127.0.0.1:{p}/metrics").decode()
            degraded += sum(float(m) for m in re.findall(r"^gateway_quota_degraded_total(?:\{[^}]*\})? ([\d.e+]+)$", text, re.M))
        res["upstream_requests"] = upstream_seen.get("requests")
        res["quota_degraded"] = degraded
    finally:
        for p in reversed(procs):  # gateways, upstream, then our redis-server: each by its PID
            stop(p)
    return res


# ---------------------------------------------------------------- table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=5000, help="take+settle pairs per store")
    ap.add_argument("--loop-s", type=float, default=2.0, help="seconds of each decisions-per-second loop")
    ap.add_argument("--requests", type=int, default=500, help="sequential requests per gateway, end to end")
    ap.add_argument("--exact-s", type=float, default=20.0, help="seconds of load on the 3 replicas")
    ap.add_argument("--clients", type=int, default=60, help="concurrent clients on the 3 replicas")
    args = ap.parse_args()
    redis.Redis.from_url(REDIS_URL).ping()  # the in-process and end-to-end parts need it
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-quota-"))
    try:
        store = uvloop.run(in_process(args))
        e2e = end_to_end(args, tmp)
        ex = exactness(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - started

    r, m = store["redis"], store["memory"]
    added_p50 = e2e["with_p50_ms"] - e2e["without_p50_ms"]
    added_p99 = e2e["with_p99_ms"] - e2e["without_p99_ms"]
    print("\nQuota stage cost (tenant with rpm + tpm + concurrency limits; one worker)")
    print(f"{'metric':58} {'redis':>10} {'memory':>10} {'target':>8}")
    rows = [
        ("quota_take + quota_settle, p50 ms", "pair_p50_ms", "<= 0.3", 3),
        ("quota_take + quota_settle, p99 ms", "pair_p99_ms", "<= 1", 3),
        ("quota_take alone, p50 ms", "take_p50_ms", "", 3),
        ("quota_take alone, p99 ms", "take_p99_ms", "", 3),
        ("floor: 2 x PING on redis.asyncio, no script, p50 ms", "ping2_p50_ms", "", 3),
        ("floor: 2 x PING on redis.asyncio, no script, p99 ms", "ping2_p99_ms", "", 3),
        ("decisions/s per worker, one at a time", "decisions_per_s", "", 0),
        ("decisions/s per worker, 64 in flight", "decisions_per_s_64", "", 0),
    ]
    for label, k, target, digits in rows:
        mem = f"{m[k]:10.{digits}f}" if k in m else f"{'-':>10}"
        print(f"{label:58} {r[k]:10.{digits}f} {mem} {target:>8}")
    ok50 = "meets" if r["pair_p50_ms"] <= 0.3 else "misses"
    ok99 = "meets" if r["pair_p99_ms"] <= 1.0 else "misses"
    print(f"(redis pair vs target: p50 {r['pair_p50_ms'] / 0.3:.2f}x of 0.3 ms ({ok50}), p99 {r['pair_p99_ms'] / 1.0:.2f}x of 1 ms ({ok99}))")

    print(f"\nEnd to end, {args.requests} sequential non-stream requests each (redis store, cache off)")
    print(f"{'metric':58} {'p50 ms':>10} {'p99 ms':>10}")
    print(f"{'same tenant without quota':58} {e2e['without_p50_ms']:10.3f} {e2e['without_p99_ms']:10.3f}")
    print(f"{'tenant with rpm + tpm + concurrency quota':58} {e2e['with_p50_ms']:10.3f} {e2e['with_p99_ms']:10.3f}")
    print(f"{'added by the quota stage':58} {added_p50:10.3f} {added_p99:10.3f}")
    print(f"(with/without: p50 {e2e['with_p50_ms'] / e2e['without_p50_ms']:.2f}x, p99 {e2e['with_p99_ms'] / e2e['without_p99_ms']:.2f}x)")

    st: dict[int, int] = ex["statuses"]  # type: ignore[assignment]
    admitted = st.get(200, 0)
    refused = st.get(429, 0)
    other = sum(v for k, v in st.items() if k not in (200, 429)) + int(ex["errors"])  # type: ignore[call-overload]
    total = admitted + refused + other
    allowed = RPM  # the whole run lies in one 60 s window, from an empty Redis
    print(f"\nExactness: {REPLICAS} replicas on one Redis, tenant rpm {RPM}, {args.clients} clients round-robin, {ex['elapsed_s']:.0f} s")
    print(f"{'metric':58} {'this gateway':>14} {'LiteLLM (modelled)':>20}")
    print(f"{'allowed in the run (one 60 s window)':58} {allowed:14d} {allowed:20d}")
    print(f"{'admitted (200)':58} {admitted:14d} {'up to ' + str(REPLICAS * RPM):>20}")
    print(f"{'admitted / allowed':58} {admitted / allowed:14.2f} {'up to ' + f'{REPLICAS:.2f}':>20}")
    print(f"{'requests that reached the upstream':58} {ex['upstream_requests']!s:>14} {'':>20}")
    print(f"{'refused (429)':58} {refused:14d} {'':>20}")
    print(f"{'other statuses / client errors':58} {other:14d} {'':>20}")
    print(f"{'quota store degraded (per-replica fallback), count':58} {ex['quota_degraded']:14.0f} {'':>20}")
    print(f"(requests sent: {total}; last admission at {ex['last_admitted_s']:.2f} s, first 429 at {ex['first_429_s'] or float('nan'):.2f} s; "
          f"exact: {'yes' if admitted <= allowed else 'NO'})")
    print(f"(LiteLLM: not measured, by construction from its documented design ({LITELLM_SYNC}): "
          f"up to {REPLICAS}x ({REPLICAS * RPM}) in a burst)")
    print(f"(whole bench {wall:.0f} s)")

    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "quota.json").write_text(json.dumps({
        "in_process": store, "end_to_end": e2e,
        "exactness": {**ex, "statuses": {str(k): v for k, v in st.items()}, "allowed": allowed, "admitted": admitted},
        "args": vars(args), "wall_s": wall,
    }, indent=2))


if __name__ == "__main__":
    main()
