"""Instructions per request: the gateway's own work counted, not timed, beside the bare hop's.

    python bench/instructions.py [--requests 800] [--only bare,default,...]

Each server runs under valgrind's callgrind with counting off; after it is up and has answered
200 warm-up requests, counting is switched on (callgrind_control) for `--requests` requests and
off again. What is counted is the user-space instructions the server executed for them: the
same count run after run, whatever else the machine does, where the CPU time of
bench/gateway_overhead.py and bench/admin_plane.py moves by 5 to 15 % between runs on these
shared 2-core VMs. It does not see the kernel's share (system calls, the loopback) nor cache
misses: a change's effect on speed is confirmed there; its effect on work is measured here.
Work driven by wall-clock timers is over-counted: ~50x slower, a server answers ~60 requests a
second, so the request log's writer (every `flush_ms`) and the access log's (every 50 ms) spread
their per-batch work over a few requests instead of hundreds; run alone, two at a time, counts
repeat within ~1 %, and a busier machine moves the log's share (+18k to +34k seen).

The requests are the `every stage` ones of gateway_overhead.py (c=4, a prompt of their own each,
temperature 0), to the fake upstream at zero delay. Variants, in one run:
  bare       bench/_minproxy.py (an aiohttp server and ClientSession), the floor
  default    `gateway serve` on its defaults (open mode: the cache looks up and stores each)
  log off    a tenant's key, cache off, `request_log.enabled: false`
  log on     the same with the request log on (its cost: the ratio of the two)
  log on big batches   the same, its writer every 10 s (200 ms x callgrind's ~50x): the
             batches as large as at speed, so their per-batch work is shared as it is there;
             counting starts after a flush and stops after the next one, so its window also
             holds ~22 s of idle timers the others lack (an upper bound of the log's cost)
  every      a tenant with a quota, the cache, admission, Server-Timing and the access log
  redis log off / on / on big batches   (--redis) the same with `store.url` a
             redis-server of its own
Two servers are counted at a time (one per core); callgrind runs them ~50x slower.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._procs import ROOT, free_port, redis_server, start, stop, wait_http  # noqa: E402

KEY = "sk-bench"
BODY = '{"model":"gpt-test","messages":[{"role":"user","content":"Say hello in one word %s."}],"max_tokens":16,"temperature":0}'
WARM_UP = 200
BIG_FLUSH_S = 10  # the "big batches" variants' request_log.flush_ms, in seconds
_BIG = f"request_log: {{flush_ms: {BIG_FLUSH_S * 1000}}}\n"


def _policies(up_port: int, redis_url: str | None) -> dict[str, str | None]:
    base = (f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [gpt-test], max_concurrency: 1024}}\n"
            "reload: {watch: false}\nserver: {drain_delay_ms: 0}\n")
    tenant = f"tenants:\n  bench:\n    key_sha256: ['{hashlib.sha256(KEY.encode()).hexdigest()}']\n"
    quota = "    quota: {rpm: 100000000, tpm: 1000000000}\n"
    variants: dict[str, str | None] = {
        "bare": None,
        "default": base,
        "log off": base + tenant + "cache: {enabled: false}\nrequest_log: {enabled: false}\n",
        "log on": base + tenant + "cache: {enabled: false}\n",
        # The writer's period scaled by callgrind's slowdown (200 ms x 50): batches of the size
        # they have at speed (~400 entries at 2,000 req/s), not of ~12.
        "log on big batches": base + tenant + "cache: {enabled: false}\n" + _BIG,
        "every": base + tenant + quota + "cache: {enabled: true}\nlog: {access: true}\n",
    }
    if redis_url is not None:  # the request log (and the rest of the store's state) in Redis
        store = f"store: {{url: '{redis_url}'}}\n"
        variants["redis log off"] = base + tenant + store + "cache: {enabled: false}\nrequest_log: {enabled: false}\n"
        variants["redis log on"] = base + tenant + store + "cache: {enabled: false}\n"
        variants["redis log on big batches"] = base + tenant + store + "cache: {enabled: false}\n" + _BIG
    return variants


async def _send(url: str, n: int, tag: str, connections: int = 4) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    todo = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as http:

        async def one_connection() -> None:
            for i in todo:
                async with http.post(url, data=BODY % f"{tag}-{i}", headers=headers) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"{url} answered {r.status}")

        await asyncio.gather(*(one_connection() for _ in range(connections)))


def _count(name: str, policy: str | None, up_port: int, requests: int, tmp: Path) -> float:
    """Instructions per request of one server (see the module docstring)."""
    port, out = free_port(), tmp / f"{name.replace(' ', '_')}.callgrind"
    if policy is None:
        args = ["bench/_minproxy.py", f"http://127.0.0.1:{up_port}/v1/chat/completions", str(port)]
    else:
        (tmp / f"{name}.yaml").write_text(policy)
        args = ["-m", "gateway", "serve", "--policy", str(tmp / f"{name}.yaml"), "--port", str(port)]
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", sys.executable, *args],
        cwd=ROOT, env={**os.environ, "GATEWAY_LOG_LEVEL": "WARNING"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=600, proc=proc)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        asyncio.run(_send(url, WARM_UP, f"{name}-warm"))
        # A 10 s writer: the warm-up's entries written before counting starts, and the counted
        # requests' entries written before it stops (each flush writes what is queued then).
        settle_s = BIG_FLUSH_S + 1 if name.endswith("big batches") else 0
        time.sleep(settle_s)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        asyncio.run(_send(url, requests, name))
        time.sleep(settle_s)
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    totals = [int(line.split()[1]) for f in tmp.glob(f"{out.name}*") for line in f.read_text().splitlines()
              if line.startswith(("totals:", "summary:"))]
    if not totals:
        raise RuntimeError(f"callgrind wrote no totals for {name}")
    return max(totals) / requests


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--only", default="", help="comma-separated variants (default: all)")
    ap.add_argument("--redis", action="store_true", help="also the request log on a redis-server of the benchmark's own")
    args = ap.parse_args()
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        sys.exit("needs valgrind: apt-get install valgrind")
    tmp = Path(tempfile.mkdtemp(prefix="bench-instructions-"))
    up_port = free_port()
    upstream = start(["-m", "tests.fake_upstream", "--port", str(up_port), "--tokens", "16"])
    redis, redis_url = None, None
    if args.redis:
        redis_port = free_port()
        redis = redis_server(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    policies = _policies(up_port, redis_url)
    names = [n for n in policies if not args.only or n in args.only.split(",")]
    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        with ThreadPoolExecutor(2) as pool:  # two servers at a time: one per core
            counts = dict(zip(names, pool.map(lambda n: _count(n, policies[n], up_port, args.requests, tmp), names)))
    finally:
        stop(upstream)
        if redis is not None:
            redis.terminate()
            redis.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    bare = counts.get("bare")
    print(f"\n{'instructions per request (user space)':40} {'count':>10} {'vs bare':>8}")
    for name, n in counts.items():
        print(f"{name:40} {n:10.0f} {n / bare if bare else float('nan'):8.2f}")
    for where in ("", "redis "):
        off = counts.get(f"{where}log off")
        for on_name in (f"{where}log on", f"{where}log on big batches"):
            on = counts.get(on_name)
            if on and off:
                print(f"{(where or 'memory ') + 'request ' + on_name.removeprefix(where)} / off: {on / off:.3f} "
                      f"(+{on - off:.0f} instructions a request)")


if __name__ == "__main__":
    main()
