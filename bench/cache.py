"""Cache hits through the gateway with Redis, against misses to a slow upstream, in one run.

    python bench/cache.py [--duration 10] [--rate 500]

A fake upstream with 300 ms TTFT; the gateway (one worker) with the Redis at 127.0.0.1:6379
(DB 15, flushed before and after). Reports hit latency p50/p99 at a fixed rate (open loop, its own
process), miss latency, hit throughput (wrk, c=32), streamed hits, and the same through the
in-memory store.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import orjson
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import lua_post, pct, run_in_subprocess, wrk  # noqa: E402
from bench._procs import free_port, need, start, stop, wait_http  # noqa: E402

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "What is an FAQ?"}], "temperature": 0})
STREAM = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "What is an FAQ?"}], "temperature": 0, "stream": True})
REDIS_DB = 15


def run(store: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    up_port, gw_port = free_port(), free_port()
    policy = tmp / f"policy-{store}.yaml"
    store_line = f"store: {{url: 'redis://127.0.0.1:6379/{REDIS_DB}', timeout_ms: 20}}\n" if store == "redis" else ""
    policy.write_text(
        f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [m], max_concurrency: 4096}}\n"
        f"{store_line}reload: {{watch: false}}\n"
    )
    upstream = start(["-m", "tests.fake_upstream", "--port", str(up_port), "--tokens", "64", "--ttft-ms", "300"])
    gateway = start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(gw_port)], env={"GATEWAY_LOG_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        wait_http(f"http://127.0.0.1:{gw_port}/healthz")
        # temperature > 0 and no seed: not cacheable, so every one of these goes to the upstream
        misses = run_in_subprocess("fixed_rate", url, 20.0, 2.0, orjson.dumps({**orjson.loads(BODY), "temperature": 0.7}).decode())
        run_in_subprocess("fixed_rate", url, 10.0, 0.5, BODY.decode())  # the first one stores the answer
        hits = run_in_subprocess("fixed_rate", url, args.rate, args.duration, BODY.decode())
        stream_hits = run_in_subprocess("fixed_rate", url, args.rate / 5, args.duration / 2, STREAM.decode())
        script = tmp / "hit.lua"
        script.write_text(lua_post(BODY))
        thr = wrk(url, 32, args.duration, script)
    finally:
        stop(gateway)
        stop(upstream)
    return {
        "miss_p50_ms": pct(misses, 0.5) * 1000,
        "hit_p50_ms": pct(hits, 0.5) * 1000,
        "hit_p99_ms": pct(hits, 0.99) * 1000,
        "stream_hit_p50_ms": pct(stream_hits, 0.5) * 1000,
        "stream_hit_p99_ms": pct(stream_hits, 0.99) * 1000,
        "hit_rps": thr["rps"],
        "non2xx": thr["non2xx"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rate", type=float, default=500)
    args = ap.parse_args()
    need("wrk")
    r = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
    r.flushdb()
    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    try:
        results = {store: run(store, args, tmp) for store in ("redis", "memory")}
    finally:
        r.flushdb()
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [
        ("uncached (upstream TTFT 300 ms), p50 ms", "miss_p50_ms"),
        (f"hit p50 at {args.rate:g} req/s, ms", "hit_p50_ms"),
        (f"hit p99 at {args.rate:g} req/s, ms", "hit_p99_ms"),
        (f"streamed hit p50 at {args.rate / 5:g} req/s, ms", "stream_hit_p50_ms"),
        (f"streamed hit p99 at {args.rate / 5:g} req/s, ms", "stream_hit_p99_ms"),
        ("hit throughput, c=32, req/s", "hit_rps"),
    ]
    print(f"\n{'metric':44} {'redis':>10} {'memory':>10}")
    for name, key in rows:
        print(f"{name:44} {results['redis'][key]:10.2f} {results['memory'][key]:10.2f}")
    ratio = results["redis"]["miss_p50_ms"] / results["redis"]["hit_p50_ms"]
    print(f"(hit vs miss p50 with redis: {ratio:.0f}x faster; non-2xx under wrk: {results['redis']['non2xx']}, {results['memory']['non2xx']})")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "cache.json").write_text(json.dumps({"results": results, "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
