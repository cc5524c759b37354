"""The admin plane's costs, in one run: the request log on the request path, and the requests view
on a large log.

    python bench/admin_plane.py [--duration 5] [--rounds 8] [--side-rounds 8] [--entries 100000]

1. Throughput and CPU per request of one gateway worker with the request log on against the same
   policy with it off (`request_log.enabled: false`), on the in-memory store and on Redis (a
   redis-server of the benchmark's own), alternating on/off `--rounds` times (wrk, c=32, a
   tenant's key, the fake upstream at zero delay; the gateway pinned to one core, the upstream and
   Redis and wrk to the other); medians, and the median of each round's on/off ratio (the two ran
   back to back). Target: throughput within 5 %.
   Then the same two gateways side by side (`--side-rounds`): both at once on the one core, each
   under its own wrk, so that whatever slows the VM slows both alike; their throughput ratio is
   the inverse ratio of what a request costs each (`bench/_load.side_by_side_runs`). `--control` adds
   an A/A run, the log off in both.
2. `GET /admin/requests` on a Redis log of `--entries` entries (written straight to the store, as
   the writers would): the first page, a page deep in the log (its cursor), a page filtered by
   tenant (its index) and one filtered by model and status (scanned). Target: first page < 200 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import lua_post, side_by_side_runs, wrk  # noqa: E402
from bench._procs import cpu_seconds, free_port, need, redis_server, start, stop, wait_http  # noqa: E402
from gateway.admin.log_store import RedisLogStore  # noqa: E402

KEY, ADMIN = "sk-bench-tenant", "sk-bench-admin"
BODY = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 16})
TENANTS = [f"team-{i}" for i in range(20)]


def _policy(up_port: int, log_on: bool, redis_url: str | None) -> str:
    sha = lambda k: hashlib.sha256(k.encode()).hexdigest()  # noqa: E731
    store = f"store: {{url: '{redis_url}', timeout_ms: 200}}\n" if redis_url else ""
    tenants = "".join(f"  {t}: {{key_sha256: ['{sha(t)}']}}\n" for t in TENANTS[1:])
    return (f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [gpt-test], max_concurrency: 1024}}\n"
            f"tenants:\n  {TENANTS[0]}: {{key_sha256: ['{sha(KEY)}']}}\n{tenants}"
            f"admin: {{key_sha256: ['{sha(ADMIN)}']}}\nrequest_log: {{enabled: {str(log_on).lower()}}}\n{store}"
            "cache: {enabled: false}\nreload: {watch: false, channel: bench-admin-plane}\nserver: {drain_delay_ms: 0}\n")


# A run's figures: requests/s, the gateway's CPU per request (us), and the other core's: the
# upstream's and redis-server's CPU per request (us) and that core's busy share (0-1).
Run = tuple[float, float, float, float]


def _throughput(args: argparse.Namespace, tmp: Path, up_port: int, redis_url: str | None, side: list[int]) -> dict[str, list[Run]]:
    """Alternating on/off runs; `side`: the pids on the other core (the upstream, redis-server)."""
    script = tmp / "post.lua"
    script.write_text(lua_post(BODY, {"Authorization": f"Bearer {KEY}"}))
    out: dict[str, list[Run]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for mode in (("on", "off") if i % 2 else ("off", "on")):  # the order alternates: no side always goes first
            port = free_port()
            # The gateway on a core of its own, the upstream on the other: a 5 % difference is not
            # lost in the noise of the three sharing two cores.
            gw = _serve(tmp, up_port, mode == "on", redis_url, port)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                wait_http(f"http://127.0.0.1:{port}/healthz")
                wrk(url, 32, 2, script, cpus="0")
                c0, s0, t0 = cpu_seconds(gw.pid), sum(map(cpu_seconds, side)), time.monotonic()
                r = wrk(url, 32, args.duration, script, cpus="0")
                spent, elapsed = sum(map(cpu_seconds, side)) - s0, time.monotonic() - t0
                out[mode].append((r["rps"], (cpu_seconds(gw.pid) - c0) / r["requests"] * 1e6,
                                  spent / r["requests"] * 1e6, spent / elapsed))
            finally:
                stop(gw)
    return out


def _serve(tmp: Path, up_port: int, log_on: bool, redis_url: str | None, port: int) -> subprocess.Popen[bytes]:
    """A gateway on core 1 (the upstream, Redis and wrk on core 0) with the request log on or off."""
    pol = tmp / f"log-{'on' if log_on else 'off'}.yaml"
    pol.write_text(_policy(up_port, log_on, redis_url))
    return start(["-m", "gateway", "serve", "--policy", str(pol), "--port", str(port)], env={"GATEWAY_LOG_LEVEL": "WARNING"},
                 cpus="1")


# A round of the side-by-side runs: (off, on) throughput and (off, on) CPU per request (us).
Pair = tuple[float, float, float, float]


def _side_by_side(args: argparse.Namespace, tmp: Path, up_port: int, redis_url: str | None, control: bool = False) -> list[Pair]:
    """The log off and on at the same time, both gateways on core 1 (`side_by_side_runs`).
    `control`: the log off in both (an A/A run: how far from 1.000 the method itself lands)."""
    script = tmp / "post.lua"
    script.write_text(lua_post(BODY, {"Authorization": f"Bearer {KEY}"}))
    runs = side_by_side_runs(lambda port: _serve(tmp, up_port, False, redis_url, port),
                             lambda port: _serve(tmp, up_port, not control, redis_url, port),
                             (script, script), args.side_rounds, args.duration)
    return [(off[0], on[0], off[1], on[1]) for off, on in runs]


async def _fill(redis_url: str, n: int) -> None:
    store = RedisLogStore(redis_url, n, prefix="gateway:admin:", timeout_s=30)
    now = time.time() - n / 1000
    batch = []
    for i in range(n):
        t = now + i / 1000
        tenant = TENANTS[i % len(TENANTS)]
        e = {"id": f"bench-{i:08d}", "time": round(t, 6), "tenant": tenant, "key_id": None, "endpoint": "chat",
             "model": "gpt-test" if i % 7 else "other", "backend": "up", "class": "simple", "cache": "bypass",
             "status": 200 if i % 50 else 503, "stream": False, "ttft_ms": 12.5, "duration_ms": 20.1, "prompt_tokens": 12,
             "completion_tokens": 16, "cost_usd": 0.0, "attempts": ["up"], "finish": "ok", "rule": None,
             "reasons": ["short prompt"], "error": None}  # fmt: skip
        batch.append((int(t * 1e6), tenant, orjson.dumps(e)))
        if len(batch) == 5000:
            await store.append(batch)
            batch = []
    if batch:
        await store.append(batch)
    await store.close()


async def _views(args: argparse.Namespace, tmp: Path, up_port: int, redis_url: str) -> dict[str, list[float]]:
    await _fill(redis_url, args.entries)
    pol = tmp / "views.yaml"
    pol.write_text(_policy(up_port, True, redis_url).replace("request_log: {enabled: true}", f"request_log: {{size: {args.entries}}}"))
    port = free_port()
    gw = start(["-m", "gateway", "serve", "--policy", str(pol), "--port", str(port)], env={"GATEWAY_LOG_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}/admin/requests"
    h = {"Authorization": f"Bearer {ADMIN}"}
    times: dict[str, list[float]] = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        async with aiohttp.ClientSession() as http:
            async with http.get(base + f"?limit=50&before={int((time.time() - args.entries / 2000) * 1e6)}", headers=h) as r:
                deep = (await r.json())["next"]
            queries = {
                "first page (50)": "?limit=50",
                "a page deep in the log (cursor)": f"?limit=50&before={deep}",
                "filtered by tenant (50)": f"?limit=50&tenant={TENANTS[3]}",
                "filtered by model and status (50)": "?limit=50&model=other&status=503",
            }
            for name, q in queries.items():
                ts = []
                for _ in range(30):
                    t0 = time.perf_counter()
                    async with http.get(base + q, headers=h) as r:
                        body = await r.read()
                        assert r.status == 200 and len(orjson.loads(body)["data"]) == 50, body[:200]
                    ts.append((time.perf_counter() - t0) * 1000)
                times[name] = ts
    finally:
        stop(gw)
    return times


def _print_throughput(mem: dict[str, list[Run]], red: dict[str, list[Run]]) -> None:
    """The first table, printed as soon as it is measured (before the requests view's run). The
    other core's lines say whether the gateway's core set the pace: where the upstream's and
    redis-server's core (wrk runs on both) is near full, the throughput measures that core too."""
    print(f"\n{'request log on the request path (1 worker, c=32)':52} {'off':>10} {'on':>10} {'ratio':>7}")
    for label, res in (("memory store", mem), ("redis store", red)):
        for name, i, fmt in (("throughput (req/s)", 0, "10.0f"), ("CPU per request (us)", 1, "10.0f"),
                             ("other core: upstream+redis CPU per request (us)", 2, "10.0f"), ("other core: busy", 3, "10.2f")):
            off, on = (statistics.median(run[i] for run in res[m]) for m in ("off", "on"))
            print(f"{label + ': ' + name:52} {off:{fmt}} {on:{fmt}} {on / off:7.3f}", flush=True)
        # Each round's on and off ran back to back: their ratio leaves out what drifts between
        # rounds (this VM's speed moves 5-15 % within minutes), which the medians above do not.
        paired = sorted(on[0] / off[0] for on, off in zip(res["on"], res["off"]))
        print(f"{label + ': throughput on/off, paired by round':52} {'median':>10} {statistics.median(paired):10.3f} "
              f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, {len(paired)} rounds)", flush=True)


def _print_side_by_side(runs: dict[str, list[Pair]]) -> None:
    print(f"\n{'both at once, one core shared (1 worker each, c=32)':52} {'off':>10} {'on':>10} {'ratio':>7}")
    for label, res in runs.items():
        for name, i in (("throughput (req/s)", 0), ("CPU per request (us)", 2)):
            off, on = statistics.median(r[i] for r in res), statistics.median(r[i + 1] for r in res)
            print(f"{label + ': ' + name:52} {off:10.0f} {on:10.0f} {on / off:7.3f}", flush=True)
        paired = sorted(r[1] / r[0] for r in res)
        print(f"{label + ': throughput on/off, each round':52} {'median':>10} {statistics.median(paired):10.3f} "
              f"(min {paired[0]:.3f}, max {paired[-1]:.3f}, {len(paired)} rounds)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=8, help="alternating on/off rounds (0: skip them)")
    ap.add_argument("--side-rounds", type=int, default=8, help="rounds of the side-by-side runs (0: skip them)")
    ap.add_argument("--control", action="store_true", help="also an A/A side-by-side run (the log off in both)")
    ap.add_argument("--stores", default="memory,redis", help="the side-by-side runs' log stores")
    ap.add_argument("--entries", type=int, default=100_000, help="the requests view's log (0: skip that part)")
    args = ap.parse_args()
    need("wrk", "redis-server")
    tmp = Path(tempfile.mkdtemp(prefix="bench-admin-"))
    up_port, redis_port = free_port(), free_port()
    upstream = start(["-m", "tests.fake_upstream", "--port", str(up_port), "--tokens", "16"], cpus="0")
    # Redis beside the upstream, off the gateway's core: what is measured is the gateway's cost of
    # writing the log, not Redis's work on its batches competing with the gateway for its core.
    redis = redis_server(redis_port, cpus="0")
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        if args.rounds:
            mem = _throughput(args, tmp, up_port, None, [upstream.pid, redis.pid])
            red = _throughput(args, tmp, up_port, redis_url, [upstream.pid, redis.pid])
            _print_throughput(mem, red)
        if args.side_rounds:
            runs = {label: _side_by_side(args, tmp, up_port, url) for label, url in
                    (("memory store", None), ("redis store", redis_url)) if label.split()[0] in args.stores}
            if args.control:
                runs["control, the log off in both"] = _side_by_side(args, tmp, up_port, None, control=True)
            _print_side_by_side(runs)
        if not args.entries:
            return
        subprocess.run(["redis-cli", "-p", str(redis_port), "FLUSHALL"], check=True, capture_output=True)
        views = asyncio.run(_views(args, tmp, up_port, redis_url))
    finally:
        stop(upstream)
        redis.terminate()
        redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{f'GET /admin/requests on {args.entries:,} entries (Redis)':52} {'p50 ms':>10} {'p95 ms':>10}")
    for name, ts in views.items():
        ts.sort()
        print(f"{name:52} {statistics.median(ts):10.2f} {ts[int(0.95 * len(ts)) - 1]:10.2f}")


if __name__ == "__main__":
    main()
