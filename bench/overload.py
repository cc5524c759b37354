"""Admission control under overload: the gateway with admission on against admission off, in one run.

    python bench/overload.py [--phase-s 15] [--solo-s 10] [--solo-rate 8] [--seed 1]

A fake upstream (`--ttft-ms 200 --tokens 5`, its own process) behind a backend with
`max_concurrency: 8`: capacity = 8 / 0.2 s = 40 answers/s. Two gateway configurations, each a
fresh gateway process (one worker, cache off) and a fresh upstream, one after the other:

- on:  `admission: {max_inflight: 64, max_queue: 256}` (the rest of the section at its defaults);
- off: `admission: {enabled: false}` (the first come, first served wait on a full backend).

Against each, open-loop Poisson load (arrivals on a seeded clock, never waiting for answers; the
same arrival times for both configurations), every request with `x-request-timeout-ms: 2000`:
1. `solo`: the quiet tenant alone at --solo-rate req/s, for its p95 alone;
2. `1x`: 40 req/s in all for --phase-s s: 5% from a `priority` tenant (its default band), the rest
   from two tenants in `default`, `noisy` at 10x the rate of `quiet`;
3. `2x`: the same mix at 80 req/s.

Per phase and configuration: goodput (200s within the deadline, per second from the phase's
start to its last such answer, and as a share of capacity), the queue wait of `priority` (its
answers' `x-gateway-queue-ms`; absent or 0: none), the quiet tenant's success rate and p95 against
its p95 alone, refusals (429/503) and their p99 time to answer, 504s, every status seen, and the
answers that came after their deadline (> 2.0 s + 50 ms). Then the targets of issue 11 at each
phase (goodput only at 2x). Raw figures go to bench/results/overload.json.

Random keys, their sha256 in the policy; everything on 127.0.0.1; every process ours, stopped by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import hashlib
import json
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import pct  # noqa: E402
from bench._procs import free_port, start, stop, wait_http  # noqa: E402

SLOTS = 8
TTFT_MS = 200
CAPACITY = SLOTS / (TTFT_MS / 1000)  # answers/s
DEADLINE_MS = 2000
LATE_S = DEADLINE_MS / 1000 + 0.05  # an answer slower than this came after its deadline
PRIORITY_SHARE = 0.05  # of the offered load, from the `priority` tenant
NOISY_X = 10  # noisy's rate / quiet's rate
TENANTS = ("noisy", "quiet", "vip")
MODES = {
    "on": "admission: {max_inflight: 64, max_queue: 256}",
    "off": "admission: {enabled: false}",
}

# Targets of issue 11 ("Benchmark")
T_GOODPUT = 0.90  # of capacity, at 2x
T_PRIO_WAIT_MS = 50.0
T_QUIET_OK = 0.95
T_QUIET_P95_X = 1.2
T_REFUSAL_P99_MS = 10.0


@dataclass(slots=True)
class Row:
    tenant: str
    status: int  # -1: a client-side error (connection, client timeout)
    seconds: float
    queue_ms: float | None  # x-gateway-queue-ms, None when absent
    end: float  # perf_counter when the response was read


# ---------------------------------------------------------------- processes


def _drain(proc: subprocess.Popen[bytes], tail: collections.deque[str]) -> None:
    """Read a child's stderr (a full pipe would block it), keeping the last lines for errors."""
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line.decode(errors="replace").rstrip())


def _start(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], collections.deque[str]]:
    proc = start(args, env)
    tail: collections.deque[str] = collections.deque(maxlen=20)
    threading.Thread(target=_drain, args=(proc, tail), daemon=True).start()
    return proc, tail


def _policy(path: Path, up_port: int, mode: str, digests: dict[str, str]) -> None:
    path.write_text(
        "version: 1\n"
        "cache: {enabled: false}\n"
        "reload: {watch: false}\n"
        f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [m], max_concurrency: {SLOTS}}}\n"
        "models:\n  m: {backends: [up]}\n"
        f"{MODES[mode]}\n"
        "tenants:\n"
        f"  noisy: {{key_sha256: ['{digests['noisy']}']}}\n"
        f"  quiet: {{key_sha256: ['{digests['quiet']}']}}\n"
        f"  vip: {{key_sha256: ['{digests['vip']}'], priority: priority}}\n"
    )


# ---------------------------------------------------------------- load


async def open_loop(
    http: aiohttp.ClientSession, url: str, tenant: str, key: str, rate: float, seconds: float, seed: int, rows: list[Row]
) -> None:
    """Poisson arrivals at `rate` for `seconds`, each request on its own task; waits for all answers."""
    rnd = random.Random(seed)
    hdrs = {"Content-Type": "application/json", "Authorization": f"Bearer {key}", "x-request-timeout-ms": str(DEADLINE_MS)}

    async def one(n: int) -> None:
        body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"{tenant} {seed} {n}"}]})
        t0 = time.perf_counter()
        try:
            async with http.post(url, data=body, headers=hdrs) as r:
                await r.read()
                q = r.headers.get("x-gateway-queue-ms")
                end = time.perf_counter()
                rows.append(Row(tenant, r.status, end - t0, float(q) if q else None, end))
        except (aiohttp.ClientError, asyncio.TimeoutError):
            end = time.perf_counter()
            rows.append(Row(tenant, -1, end - t0, None, end))

    tasks = []
    t0 = time.perf_counter()
    t = rnd.expovariate(rate)
    while t < seconds:
        delay = t0 + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(len(tasks))))
        t += rnd.expovariate(rate)
    await asyncio.gather(*tasks)


def rates(factor: float) -> dict[str, float]:
    offered = factor * CAPACITY
    rest = offered * (1 - PRIORITY_SHARE)
    return {"noisy": rest * NOISY_X / (NOISY_X + 1), "quiet": rest / (NOISY_X + 1), "vip": offered * PRIORITY_SHARE}


async def run_mode(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, tuple[float, list[Row]]]:
    """Per phase: when its arrivals started (perf_counter) and its rows."""
    out: dict[str, tuple[float, list[Row]]] = {}
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        warm: list[Row] = []  # connections, the gateway's first requests: not measured
        await open_loop(http, url, "quiet", keys["quiet"], 10, 1.0, args.seed + 99, warm)
        rows: list[Row] = []
        t0 = time.perf_counter()
        await open_loop(http, url, "quiet", keys["quiet"], args.solo_rate, args.solo_s, args.seed, rows)
        out["solo"] = (t0, rows)
        for phase, factor in (("1x", 1.0), ("2x", 2.0)):
            await asyncio.sleep(1.0)  # whatever is left of the previous phase drains
            rows = []
            r = rates(factor)
            t0 = time.perf_counter()
            await asyncio.gather(*(
                open_loop(http, url, t, keys[t], r[t], args.phase_s, args.seed * 1000 + int(factor) * 10 + i, rows)
                for i, t in enumerate(TENANTS)
            ))
            out[phase] = (t0, rows)
    return out


def run(
    mode: str, keys: dict[str, str], digests: dict[str, str], args: argparse.Namespace, tmp: Path
) -> dict[str, tuple[float, list[Row]]]:
    up_port, gw_port = free_port(), free_port()
    policy = tmp / f"policy-{mode}.yaml"
    _policy(policy, up_port, mode, digests)
    procs = []
    try:
        upstream, up_tail = _start(["-m", "tests.fake_upstream", "--port", str(up_port), "--ttft-ms", str(TTFT_MS), "--tokens", "5"])
        procs.append(upstream)
        gateway, gw_tail = _start(
            ["-m", "gateway", "serve", "--policy", str(policy), "--host", "127.0.0.1", "--port", str(gw_port)],
            env={"GATEWAY_LOG_LEVEL": "ERROR"},
        )
        procs.append(gateway)
        wait_http(f"http://127.0.0.1:{up_port}/healthz", 30.0, upstream, lambda: "\n".join(up_tail))
        wait_http(f"http://127.0.0.1:{gw_port}/healthz", 30.0, gateway, lambda: "\n".join(gw_tail))
        return uvloop.run(run_mode(f"http://127.0.0.1:{gw_port}/v1/chat/completions", keys, args))
    finally:
        for p in reversed(procs):
            stop(p)


# ---------------------------------------------------------------- figures


def q(values: list[float], p: float) -> float:
    return pct(values, p) if values else float("nan")


def summarize(t0: float, rows: list[Row], solo_p95: float, seconds: float) -> dict[str, object]:
    """Goodput: answers in time over the span from the phase's start to its last answer (the
    queue left when arrivals stop drains after them), so not above what the upstream can give."""
    good = [r for r in rows if r.status == 200 and r.seconds <= LATE_S]
    span = max([seconds] + [r.end - t0 for r in good])
    prio = [r for r in rows if r.tenant == "vip" and r.status == 200]
    quiet = [r for r in rows if r.tenant == "quiet"]
    quiet_ok = [r.seconds for r in quiet if r.status == 200]
    refused = [r.seconds for r in rows if r.status in (429, 503)]
    expired = [r.seconds for r in rows if r.status == 504]
    statuses = collections.Counter(r.status for r in rows)
    quiet_p95 = q(quiet_ok, 0.95)
    return {
        "sent": len(rows),
        "sent_per_s": len(rows) / seconds,
        "span_s": span,
        "goodput": len(good) / span,
        "goodput_share": len(good) / span / CAPACITY,
        "prio_sent": sum(1 for r in rows if r.tenant == "vip"),
        "prio_ok": len(prio),
        "prio_wait_p50_ms": q([r.queue_ms or 0.0 for r in prio], 0.5),
        "prio_wait_p99_ms": q([r.queue_ms or 0.0 for r in prio], 0.99),
        "prio_p99_s": q([r.seconds for r in prio], 0.99),
        "quiet_sent": len(quiet),
        "quiet_ok_share": len(quiet_ok) / len(quiet) if quiet else float("nan"),
        "quiet_p95_s": quiet_p95,
        "quiet_wait_p95_ms": q([r.queue_ms or 0.0 for r in quiet if r.status == 200], 0.95),
        "quiet_p95_x": quiet_p95 / solo_p95,
        "refused": len(refused),
        "refused_p99_ms": q(refused, 0.99) * 1000,
        "expired": len(expired),
        "expired_p99_s": q(expired, 0.99),
        "late_answers": sum(1 for r in rows if r.status == 200 and r.seconds > LATE_S),
        "late_any": sum(1 for r in rows if r.seconds > LATE_S),
        "slowest_s": max((r.seconds for r in rows), default=float("nan")),
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
    }


def targets(s: dict[str, object], phase: str) -> dict[str, bool | None]:
    refused_p99 = s["refused_p99_ms"]
    return {
        f"goodput >= {T_GOODPUT:.0%} of capacity (2x)": s["goodput_share"] >= T_GOODPUT if phase == "2x" else None,  # type: ignore[operator]
        f"priority p99 queue wait <= {T_PRIO_WAIT_MS:g} ms": s["prio_wait_p99_ms"] <= T_PRIO_WAIT_MS,  # type: ignore[operator]
        f"quiet success >= {T_QUIET_OK:.0%}": s["quiet_ok_share"] >= T_QUIET_OK,  # type: ignore[operator]
        f"quiet p95 <= {T_QUIET_P95_X}x its p95 alone": s["quiet_p95_x"] <= T_QUIET_P95_X,  # type: ignore[operator]
        # None with no 429/503 at all (a 504 after the deadline is counted on its own row)
        f"refusals p99 <= {T_REFUSAL_P99_MS:g} ms": refused_p99 <= T_REFUSAL_P99_MS if s["refused"] else None,  # type: ignore[operator]
        "no answer after its deadline": s["late_answers"] == 0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds of arrivals at 1x and at 2x")
    ap.add_argument("--solo-s", type=float, default=10.0, help="seconds of the quiet tenant alone")
    ap.add_argument("--solo-rate", type=float, default=8.0, help="req/s of the quiet tenant alone")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    keys = {t: f"sk-bench-{t}-" + secrets.token_hex(16) for t in TENANTS}
    digests = {t: hashlib.sha256(k.encode()).hexdigest() for t, k in keys.items()}
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    try:
        raw = {mode: run(mode, keys, digests, args, tmp) for mode in MODES}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - started

    solo = {m: q([r.seconds for r in raw[m]["solo"][1] if r.status == 200], 0.95) for m in MODES}
    solo_ok = {m: sum(r.status == 200 for r in raw[m]["solo"][1]) / max(1, len(raw[m]["solo"][1])) for m in MODES}
    cols = [(phase, mode) for phase in ("1x", "2x") for mode in MODES]
    res = {f"{p} {m}": summarize(*raw[m][p], solo[m], args.phase_s) for p, m in cols}

    r1, r2 = rates(1.0), rates(2.0)
    print(f"\nAdmission under overload: fake upstream TTFT {TTFT_MS} ms, max_concurrency {SLOTS} "
          f"(capacity {CAPACITY:g} answers/s), deadline {DEADLINE_MS} ms, {args.phase_s:g} s per phase")
    print(f"load (req/s, Poisson): 1x noisy {r1['noisy']:.1f} + quiet {r1['quiet']:.2f} + priority {r1['vip']:.1f}; "
          f"2x noisy {r2['noisy']:.1f} + quiet {r2['quiet']:.2f} + priority {r2['vip']:.1f}")
    print(f"on  = {MODES['on']}\noff = {MODES['off']}")
    print(f"quiet alone ({args.solo_rate:g} req/s, {args.solo_s:g} s): p95 {solo['on'] * 1000:.1f} ms (on), "
          f"{solo['off'] * 1000:.1f} ms (off); success {solo_ok['on']:.0%} (on), {solo_ok['off']:.0%} (off)\n")

    head = "".join(f"{c:>11}" for c in res)
    print(f"{'metric':46}{head}")

    def line(label: str, fmt: str, key: str) -> None:
        print(f"{label:46}" + "".join(f"{format(s[key], fmt):>11}" for s in res.values()))

    line("requests sent, per s", ".1f", "sent_per_s")
    line("span: phase start to last answer in time, s", ".1f", "span_s")
    line("goodput: answers in time, per s", ".1f", "goodput")
    print(f"{'goodput, % of capacity':46}" + "".join(f"{s['goodput_share']:>11.0%}" for s in res.values()))
    print(f"{'priority answered / sent':46}" + "".join(f"{str(s['prio_ok']) + '/' + str(s['prio_sent']):>11}" for s in res.values()))
    line("priority p50 queue wait (x-gateway-queue-ms)", ".1f", "prio_wait_p50_ms")
    line("priority p99 queue wait (x-gateway-queue-ms)", ".1f", "prio_wait_p99_ms")
    print(f"{'quiet success rate':46}" + "".join(f"{s['quiet_ok_share']:>11.1%}" for s in res.values()))
    print(f"{'quiet p95, ms':46}" + "".join(f"{s['quiet_p95_s'] * 1000:>11.1f}" for s in res.values()))
    line("quiet p95 / its p95 alone", ".2f", "quiet_p95_x")
    line("quiet p95 queue wait (x-gateway-queue-ms)", ".1f", "quiet_wait_p95_ms")
    line("refusals (429/503)", "d", "refused")
    line("refusals p99 time to answer, ms", ".1f", "refused_p99_ms")
    line("timed out (504)", "d", "expired")
    line("timed out (504) p99 time to answer, s", ".3f", "expired_p99_s")
    line("answers (200) after the deadline + 50 ms", "d", "late_answers")
    line("any response after the deadline + 50 ms", "d", "late_any")
    line("slowest response, s", ".3f", "slowest_s")
    print("statuses seen:")
    for name, s in res.items():
        print(f"  {name:7} " + ", ".join(f"{k}: {v}" for k, v in s["statuses"].items()))  # type: ignore[attr-defined]

    print(f"\n{'target (issue 11)':46}{head}")
    checks = {name: targets(s, name.split()[0]) for name, s in res.items()}
    for label in next(iter(checks.values())):
        cells = ["n/a" if c[label] is None else ("met" if c[label] else "MISSED") for c in checks.values()]
        print(f"{label:46}" + "".join(f"{c:>11}" for c in cells))
    for name, c in checks.items():
        vals = [v for v in c.values() if v is not None]
        print(f"  {name:7} {sum(vals)}/{len(vals)} targets met")
    print("(n/a: goodput is a target at 2x only; refusals p99 needs at least one 429/503)")
    print(f"(whole bench {wall:.0f} s)")

    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "overload.json").write_text(json.dumps({
        "results": res, "solo_p95_s": solo, "solo_ok": solo_ok,
        "targets": {k: {t: v for t, v in c.items()} for k, c in checks.items()},
        "rates": {"1x": r1, "2x": r2}, "args": vars(args), "wall_s": wall,
    }, indent=2))


if __name__ == "__main__":
    main()
