"""Routing under load (issue 3): the same Poisson stream through each strategy while one backend
degrades and heals and another fails a share of requests and then dies.

    flock /tmp/bench.lock .venv/bin/python bench/routing.py [--rate 40] [--seed 7] [--only latency]

Four fake upstreams, each its own process with a limited capacity (requests beyond it queue inside
the upstream, so load shows up as TTFT):

    a  ~80 ms TTFT                 b  ~200 ms TTFT
    c  ~120 ms, 1,500 ms from T1 to T2 (via its /_control), then 120 ms again
    d  ~100 ms, fails 20% of requests (500 before the first byte) from the start, killed at T3

plus 10 ms TTFT per 1,000 prompt characters everywhere (a long prompt costs ~80 ms more). One
gateway process per run (strategy `round_robin`, `least_inflight`, `latency`, and a reference
`drained` run: `latency` over a, b, d only, as if an operator had drained c by hand). An open-loop
client in its own process sends the same seeded schedule in every run: Poisson arrivals, 20% long
prompts (~2,000 tokens), streaming, max_tokens 8. Per request it records the send time, the TTFT
(first content chunk), the answering backend (`x-gateway-backend`) and any client-visible error
(non-200, an error event, a stream cut without [DONE]). Meanwhile this process drives the timeline
and samples `GET /admin/backends` and c's `/_stats` every 0.5 s (kept in the JSON as evidence).

Reported per strategy: TTFT p50/p95/p99 over the measured part (after the warm-up) and during the
degradation [T1, T2); client-visible errors (all, and those whose backend was d); c's share of
answered requests from T1+10 s to T2; seconds from T1 until c's share over every later 2 s window
(up to T2) stays under 5%; seconds from T2 until a 5 s window ends with c at >= 15%; and the
decision cost (Selector.rank over 4 candidates, in process, as bench/selection.py times it).
Results also go to bench/results/routing.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._procs import free_port, stop, wait_http  # noqa: E402

# -- the scenario -------------------------------------------------------------------------------

WARMUP_S = 10.0  # not measured: trackers learn, connections open
T1 = 15.0  # c degrades
T3 = 30.0  # d is killed (SIGKILL, by PID)
T2 = 40.0  # c heals
END_S = 65.0  # last send; T2 + 25 s, so "back within 25 s" can be judged
DRAIN_S = 20.0  # after END_S, how long the client waits for answers still streaming

COMMON = {"itl_ms": 20, "tokens": 8, "capacity": 8, "prompt_ms_per_kchar": 10}
UPSTREAMS = {
    "a": {"ttft_ms": 80},
    "b": {"ttft_ms": 200},
    "c": {"ttft_ms": 120},
    "d": {"ttft_ms": 100, "fail_pct": 0.2},
}
C_DEGRADED_MS = 1500
MAX_TOKENS = 8
LONG_SHARE = 0.2
STRATEGIES = ("drained", "round_robin", "least_inflight", "latency")

# targets of the issue
T_P95_VS_DRAINED = 1.15
T_P95_BELOW_RR = 0.40
T_C_SHARE = 0.05
T_RETURN_SHARE = 0.15
T_RETURN_S = 25.0
T_SELECT_P99_US = 50.0


def schedule(seed: int, rate: float, duration: float) -> list[tuple[float, int]]:
    """(send time in s from t0, prompt characters) for a Poisson stream; the same for a seed."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        if rng.random() < LONG_SHARE:
            chars = int(rng.uniform(7000, 9000))  # ~2,000 tokens
        else:
            chars = int(rng.uniform(80, 1200))  # 20-300 tokens
        out.append((t, chars))


_TEXT = ("the quick brown fox jumps over the lazy dog while routing packets " * 200)[:10_000]


def body(i: int, chars: int) -> bytes:
    text = f"request {i}: " + _TEXT[:chars]
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": text}], "stream": True, "max_tokens": MAX_TOKENS}
    ).encode()


# -- the client (its own process) ---------------------------------------------------------------


async def client(url: str, t0: float, seed: int, rate: float, out: str) -> None:
    """Open loop: each request goes at its scheduled time whatever the answers; t0 is on the
    system-wide monotonic clock (CLOCK_MONOTONIC), shared with the orchestrating process."""
    plan = schedule(seed, rate, END_S)
    bodies = [body(i, c) for i, (_, c) in enumerate(plan)]
    records: list[dict] = []
    headers = {"Content-Type": "application/json", "Cache-Control": "no-cache"}
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=END_S + DRAIN_S)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def one(i: int) -> None:
            sched, chars = plan[i]
            rec: dict = {"i": i, "sched": round(sched, 4), "long": chars > 5000, "ttft": None, "backend": None, "error": None}
            records.append(rec)
            sent = time.monotonic()
            rec["sent"] = round(sent - t0, 4)
            try:
                async with http.post(url, data=bodies[i], headers=headers) as r:
                    rec["backend"] = r.headers.get("x-gateway-backend")
                    rec["status"] = r.status
                    if r.status != 200:
                        rec["error"] = f"http_{r.status}"
                        rec["detail"] = (await r.text())[:300]
                        return
                    done = False
                    async for line in r.content:
                        if line.startswith(b"data: {\"error\""):
                            rec["error"] = "error_event"
                            rec["detail"] = line[:300].decode(errors="replace")
                            break
                        if line.startswith(b"data: [DONE]"):
                            done = True
                        elif rec["ttft"] is None and b'"content":"' in line and b'"content":""' not in line:
                            rec["ttft"] = round(time.monotonic() - sent, 5)
                    if not done and rec["error"] is None:
                        rec["error"] = "cut" if rec["ttft"] is not None else "cut_before_first_token"
            except asyncio.TimeoutError:
                rec["error"] = "client_timeout"
            except aiohttp.ClientError as e:
                rec["error"] = "client_" + type(e).__name__
            finally:
                rec["end"] = round(time.monotonic() - t0, 4)

        tasks = []
        for i, (at, _) in enumerate(plan):
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    records.sort(key=lambda r: r["i"])
    Path(out).write_text(json.dumps(records))


# -- processes ----------------------------------------------------------------------------------


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    f = log.open("wb")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)


def _policy(ports: dict[str, int], strategy: str) -> str:
    names = ["a", "b", "d"] if strategy == "drained" else ["a", "b", "c", "d"]
    strat = "latency" if strategy == "drained" else strategy
    lines = ["version: 1", "reload: {watch: false}", "health: {probe_interval_ms: 1000}", "backends:"]
    for n, p in ports.items():
        lines.append(f"  {n}: {{url: 'http://127.0.0.1:{p}/v1', models: [m]}}")
    lines.append(f"models:\n  m: {{backends: [{', '.join(names)}], strategy: {strat}}}")
    return "\n".join(lines) + "\n"


async def _post(http: aiohttp.ClientSession, url: str, payload: dict) -> None:
    async with http.post(url, json=payload) as r:
        r.raise_for_status()


async def _orchestrate(
    ups: dict[str, subprocess.Popen[bytes]], ports: dict[str, int], gw_port: int, t0: float, client_proc: subprocess.Popen[bytes], explain: bool
) -> tuple[list, list]:
    """Drive c and d on the timeline; sample the gateway's and c's view every 0.5 s (and, with
    `explain`, the selector's ranking of a short prompt: a diagnostic that perturbs the run, since
    each explain is a pick for the selector's exploration budget)."""
    explain_body = json.loads(body(0, 800))
    explain_body.pop("stream")
    events: list[tuple[float, str]] = []
    samples: list[dict] = []
    c_ctl = f"http://127.0.0.1:{ports['c']}/_control"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

        async def at(t: float, what: str, fn) -> None:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            await fn()
            events.append((round(time.monotonic() - t0, 3), what))

        async def kill_d() -> None:
            ups["d"].kill()  # SIGKILL, by PID: connections drop, the port refuses
            ups["d"].wait()

        async def sample() -> None:
            k = 0
            while client_proc.poll() is None:
                k += 1
                await asyncio.sleep(max(0.0, t0 + 0.5 * k - time.monotonic()))
                s: dict = {"t": round(time.monotonic() - t0, 2)}
                try:
                    async with http.get(f"http://127.0.0.1:{gw_port}/admin/backends") as r:
                        snap = (await r.json())["backends"]
                    s["gw"] = {
                        n: {key: b.get(key) for key in ("health", "inflight", "predicted_ttft_ms", "ttft_p95_ms", "error_ewma", "idle_s", "consecutive_failures")}
                        for n, b in snap.items()
                    }
                    async with http.get(f"http://127.0.0.1:{ports['c']}/_stats") as r:
                        st = await r.json()
                    s["c_up"] = {key: st[key] for key in ("requests", "generating", "queued", "cancelled")}
                    if explain:
                        async with http.post(f"http://127.0.0.1:{gw_port}/v1/route/explain", json=explain_body) as r:
                            ex = await r.json()
                        s["explain"] = {"chosen": ex["chosen"], "prompt_tokens": ex["prompt_tokens"], "candidates": [
                            {k: c[k] for k in ("backend", "health", "inflight", "predicted_ttft_ms", "score", "skipped", "note")} for c in ex["candidates"]]}
                except (aiohttp.ClientError, asyncio.TimeoutError, KeyError) as e:
                    s["err"] = repr(e)
                samples.append(s)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(
            at(T1, f"c ttft_ms -> {C_DEGRADED_MS}", lambda: _post(http, c_ctl, {"ttft_ms": C_DEGRADED_MS})),
            at(T3, "d killed", kill_d),
            at(T2, f"c ttft_ms -> {UPSTREAMS['c']['ttft_ms']}", lambda: _post(http, c_ctl, {"ttft_ms": UPSTREAMS["c"]["ttft_ms"]})),
        )
        while client_proc.poll() is None:
            await asyncio.sleep(0.2)
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    return events, samples


def run_one(strategy: str, args: argparse.Namespace, tmp: Path) -> dict:
    ports = {n: free_port() for n in UPSTREAMS}
    gw_port = free_port()
    ups: dict[str, subprocess.Popen[bytes]] = {}
    gateway = client_proc = None
    try:
        for n, knobs in UPSTREAMS.items():
            flags = ["-m", "tests.fake_upstream", "--port", str(ports[n]), "--name", n]
            for k, v in {**COMMON, **knobs}.items():
                flags += ["--" + k.replace("_", "-"), str(v)]
            ups[n] = _spawn(flags, tmp / f"{strategy}-{n}.log")
        policy = tmp / f"{strategy}.yaml"
        policy.write_text(_policy(ports, strategy))
        gateway = _spawn(
            ["-m", "gateway", "serve", "--policy", str(policy), "--port", str(gw_port)], tmp / f"{strategy}-gateway.log"
        )
        for n in UPSTREAMS:
            wait_http(f"http://127.0.0.1:{ports[n]}/healthz")
        wait_http(f"http://127.0.0.1:{gw_port}/readyz")
        t0 = time.monotonic() + 1.5  # the client's imports take ~0.5 s
        out = tmp / f"{strategy}-records.json"
        code = (
            "import asyncio, sys; sys.path.insert(0, '.'); from bench.routing import client; "
            f"asyncio.run(client({f'http://127.0.0.1:{gw_port}/v1/chat/completions'!r}, {t0!r}, {args.seed}, {args.rate}, {str(out)!r}))"
        )
        client_proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
        events, samples = asyncio.run(_orchestrate(ups, ports, gw_port, t0, client_proc, args.explain))
        if client_proc.wait() != 0:
            raise RuntimeError(f"client failed in the {strategy} run")
        records = json.loads(out.read_text())
    finally:
        if client_proc is not None and client_proc.poll() is None:
            stop(client_proc)  # type: ignore[arg-type]
        if gateway is not None:
            stop(gateway)
        for p in ups.values():
            stop(p)
    return {"strategy": strategy, "records": records, "events": events, "samples": samples}


# -- analysis -----------------------------------------------------------------------------------


def _q(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (the gateway's own definition)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


def _share(records: list[dict], lo: float, hi: float, name: str) -> tuple[float | None, int]:
    """Share of answered requests sent in [lo, hi) that `name` answered."""
    got = [r for r in records if lo <= r["sent"] < hi and r["backend"] and r["error"] is None]
    if not got:
        return None, 0
    return sum(1 for r in got if r["backend"] == name) / len(got), len(got)


def analyze(run: dict) -> dict:
    recs = run["records"]
    measured = [r for r in recs if WARMUP_S <= r["sent"] < END_S]
    degraded = [r for r in measured if T1 <= r["sent"] < T2]

    def ttft(rs: list[dict]) -> dict:
        v = [r["ttft"] * 1000 for r in rs if r["ttft"] is not None and r["error"] is None]
        return {"p50": _q(v, 0.5), "p95": _q(v, 0.95), "p99": _q(v, 0.99), "n": len(v)}

    errors = [r for r in measured if r["error"] is not None]
    kinds: dict[str, int] = {}
    for r in errors:
        key = f"{r['error']}@{r['backend']}"
        kinds[key] = kinds.get(key, 0) + 1
    c_late, n_late = _share(recs, T1 + 10, T2, "c")
    # Seconds until c's share over every later 2 s window [s, s + 2) within [T1, T2) stays < 5%.
    step, starts = 0.1, []
    s = T1
    while s + 2.0 <= T2 + 1e-9:
        starts.append(s)
        s += step
    last_bad = None
    for s in starts:
        sh, n = _share(recs, s, s + 2.0, "c")
        if sh is not None and sh >= T_C_SHARE:
            last_bad = s
    move_off = 0.0 if last_bad is None else (last_bad + step - T1)
    if last_bad is not None and last_bad >= starts[-1] - 1e-9:
        move_off = math.inf  # never settled below 5% before T2
    # Seconds from T2 until a 5 s window [s, s + 5) ends with c at >= 15%.
    back = math.inf
    s = T2
    while s + 5.0 <= END_S + 1e-9:
        sh, _ = _share(recs, s, s + 5.0, "c")
        if sh is not None and sh >= T_RETURN_SHARE:
            back = s + 5.0 - T2
            break
        s += step
    per_backend: dict[str, int] = {}
    for r in measured:
        if r["error"] is None and r["backend"]:
            per_backend[r["backend"]] = per_backend.get(r["backend"], 0) + 1
    # c's share per 1 s of send time, for the timeline.
    timeline = []
    for sec in range(int(WARMUP_S), int(END_S)):
        sh, n = _share(recs, sec, sec + 1, "c")
        timeline.append(None if sh is None else round(sh, 3))
    return {
        "requests": len(measured),
        "ttft_ms": ttft(measured),
        "ttft_ms_degraded": ttft(degraded),
        "ttft_ms_degraded_long": ttft([r for r in degraded if r["long"]]),
        "errors": len(errors),
        "errors_from_d": sum(1 for r in errors if r["backend"] == "d"),
        # Streams d had already started when it was killed: nothing can be retried after a content
        # byte reached the client, so these are the floor any strategy pays for d's traffic share.
        "errors_from_d_mid_stream": sum(1 for r in errors if r["backend"] == "d" and r["ttft"] is not None),
        "error_kinds": kinds,
        "c_share_t1p10_to_t2": c_late,
        "c_share_t1p10_to_t2_n": n_late,
        "move_off_s": move_off,
        "return_s": back,
        "answered_by": per_backend,
        "c_share_per_s": timeline,
    }


def decision_cost(calls: int) -> dict[str, dict[str, float]]:
    """Selector.rank() over 4 candidates with realistic tracker state (bench/selection.py's setup)."""
    from bench.selection import _candidates, _time
    from gateway.routing.selector import Selector

    rng = random.Random(1)
    out = {}
    for strategy in ("latency", "round_robin", "least_inflight"):
        cands = _candidates(4, rng)
        sel = Selector(strategy, rng=random.Random(2))
        p50, p99 = _time(lambda: sel.rank(cands, 700), calls)
        out[strategy] = {"p50_us": p50, "p99_us": p99}
    return out


def _fmt(v: float | None, nd: int = 0) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "never"
    return f"{v:.{nd}f}"


def report(results: dict[str, dict], cost: dict, args: argparse.Namespace) -> dict:
    cols = [s for s in STRATEGIES if s in results]
    rows = [
        ("TTFT p50, measured (ms)", lambda a: _fmt(a["ttft_ms"]["p50"])),
        ("TTFT p95, measured (ms)", lambda a: _fmt(a["ttft_ms"]["p95"])),
        ("TTFT p99, measured (ms)", lambda a: _fmt(a["ttft_ms"]["p99"])),
        ("TTFT p50, degradation (ms)", lambda a: _fmt(a["ttft_ms_degraded"]["p50"])),
        ("TTFT p95, degradation (ms)", lambda a: _fmt(a["ttft_ms_degraded"]["p95"])),
        ("TTFT p99, degradation (ms)", lambda a: _fmt(a["ttft_ms_degraded"]["p99"])),
        ("client-visible errors", lambda a: str(a["errors"])),
        ("  of them answered by d", lambda a: str(a["errors_from_d"])),
        ("    d: cut mid-stream by kill", lambda a: str(a["errors_from_d_mid_stream"])),
        ("share to c, T1+10 s..T2", lambda a: _fmt(None if a["c_share_t1p10_to_t2"] is None else 100 * a["c_share_t1p10_to_t2"], 1) + "%"),
        ("s until c < 5% (2 s windows)", lambda a: _fmt(a["move_off_s"], 1)),
        ("s until c >= 15% (5 s window)", lambda a: _fmt(a["return_s"], 1)),
        ("requests measured", lambda a: str(a["requests"])),
    ]
    print(
        f"\nrate {args.rate}/s, seed {args.seed}; measured {WARMUP_S:.0f}-{END_S:.0f} s; c degrades {T1:.0f}-{T2:.0f} s "
        f"({UPSTREAMS['c']['ttft_ms']} -> {C_DEGRADED_MS} ms); d fails {UPSTREAMS['d']['fail_pct']:.0%} and is killed at {T3:.0f} s"
    )
    print(f"{'':32}" + "".join(f"{c:>16}" for c in cols))
    for name, fn in rows:
        print(f"{name:32}" + "".join(f"{fn(results[c]):>16}" for c in cols))
    for c in cols:
        a = results[c]
        print(f"  {c:15} answered by {a['answered_by']}; errors {a['error_kinds'] or 'none'}")
    print("  c's share per 1 s of send time (10..64 s):")
    for c in cols:
        print(f"  {c:15} " + " ".join("--" if v is None else f"{round(100 * v):2d}" for v in results[c]["c_share_per_s"]))
    print(f"\n{'decision cost, rank() of 4':32}{'p50 us':>10}{'p99 us':>10}")
    for s, v in cost.items():
        print(f"{'  ' + s:32}{v['p50_us']:>10.2f}{v['p99_us']:>10.2f}")

    checks: dict[str, dict] = {}
    lat, ref, rr = results.get("latency"), results.get("drained"), results.get("round_robin")
    if lat and ref:
        r = lat["ttft_ms_degraded"]["p95"] / ref["ttft_ms_degraded"]["p95"]
        checks["p95_degraded_vs_drained"] = {"value": round(r, 3), "target": f"<= {T_P95_VS_DRAINED}", "ok": r <= T_P95_VS_DRAINED}
    if lat and rr:
        below = 1 - lat["ttft_ms_degraded"]["p95"] / rr["ttft_ms_degraded"]["p95"]
        checks["p95_degraded_below_round_robin"] = {"value": round(below, 3), "target": f">= {T_P95_BELOW_RR}", "ok": below >= T_P95_BELOW_RR}
    if lat:
        sh = lat["c_share_t1p10_to_t2"]
        checks["c_share_from_t1_plus_10s"] = {"value": sh, "target": f"< {T_C_SHARE}", "ok": sh is not None and sh < T_C_SHARE}
        checks["c_back_after_heal_s"] = {"value": lat["return_s"], "target": f"<= {T_RETURN_S}", "ok": lat["return_s"] <= T_RETURN_S}
        checks["errors_from_d"] = {"value": lat["errors_from_d"], "target": "0", "ok": lat["errors_from_d"] == 0}
        before = lat["errors_from_d"] - lat["errors_from_d_mid_stream"]
        checks["errors_from_d_before_first_token"] = {"value": before, "target": "0", "ok": before == 0}
    p99 = cost["latency"]["p99_us"]
    checks["selection_p99_us"] = {"value": round(p99, 2), "target": f"<= {T_SELECT_P99_US}", "ok": p99 <= T_SELECT_P99_US}
    print("\ntargets (latency strategy):")
    for k, v in checks.items():
        print(f"  {'PASS' if v['ok'] else 'MISS'}  {k:34} {_fmt(v['value'], 3) if isinstance(v['value'], float) else v['value']!s:>8}  (target {v['target']})")
    return checks


def _finite(o):
    """Strict JSON: inf (never happened) becomes null."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=40.0, help="requests per second (Poisson)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--only", action="append", choices=STRATEGIES, help="run only these strategies (repeatable)")
    ap.add_argument("--calls", type=int, default=20000, help="rank() calls timed per strategy")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, records)")
    ap.add_argument("--explain", action="store_true", help="diagnostic: also sample /v1/route/explain every 0.5 s (perturbs the selector)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    results, runs = {}, {}
    try:
        for strategy in args.only or STRATEGIES:
            started = time.monotonic()
            run = run_one(strategy, args, tmp)
            runs[strategy] = run
            results[strategy] = analyze(run)
            print(f"[{strategy}: {time.monotonic() - started:.0f} s, {len(run['records'])} requests, events {run['events']}]", flush=True)
    finally:
        if args.keep:
            print(f"(logs and records in {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    cost = decision_cost(args.calls)
    checks = report(results, cost, args)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "routing.json").write_text(
        json.dumps(
            _finite({
                "args": vars(args),
                "scenario": {"upstreams": UPSTREAMS, "common": COMMON, "c_degraded_ms": C_DEGRADED_MS, "warmup_s": WARMUP_S, "t1": T1, "t2": T2, "t3": T3, "end_s": END_S},
                "results": results,
                "decision_cost": cost,
                "targets": checks,
                "runs": {s: {"events": r["events"], "samples": r["samples"], "records": r["records"]} for s, r in runs.items()},
            })
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
