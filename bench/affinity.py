"""Prefix-cache affinity: the same multi-turn chat workload through the gateway with
`routing.prefix_affinity` on and off, against three fake vLLM replicas that keep a prefix cache.

    flock /tmp/bench.lock .venv/bin/python bench/affinity.py [--quick] [--json OUT] [--keep]

Three replicas (tests/fake_replica.py, each its own process): capacity 4 (others queue FIFO),
TTFT = queue wait + 20 ms + 40 ms per 1,000 uncached prompt characters, 1,024-character KV blocks,
an LRU of 30 blocks, 8 tokens 5 ms apart. Each replica's /metrics reports vLLM's gauges, which the
gateway scrapes through each backend's `metrics_url`.

Workload: 9 system prompts of ~6,000 characters (deterministic random words, each different from
its first character), 36 streamed 4-turn conversations (18 with --quick) started evenly over 3 s;
each turn appends a user message ("Conversation c, question t: what comes next, and why?"), sends
the whole conversation (max_tokens 8, x-request-timeout-ms 20000), and appends the answer; 0.25 s
of think time between turns. TTFT is measured by this client: request sent to the first non-empty
content delta. Mixes: `normal` (conversation i on prompt i % 9) and `hot` (60% on prompt 0, the
rest spread over the other 8, shuffled with a fixed seed). A replica's cache holds 30 blocks, a
system prompt is 5 of them: all nine prompts on one replica do not fit, three do.

Runs, one gateway process each (replicas reset via POST /reset before each): normal off/on, hot
off/on, and normal with affinity on while r3 (restarted with --report-waiting 40) claims 40 queued
requests in its /metrics. Per run: TTFT p50/p95, prefix-cache hit ratio (sum cached_chars / sum
prompt_chars over the replicas' /stats), each replica's share of requests, failures (non-200, an
error event, a stream without [DONE], a timeout), and the gateway's `x-gateway-affinity` header
values (hit/miss/spill; "-" when absent, e.g. while the feature is off or not built).

Everything listens on 127.0.0.1; each run has a wall-clock cap; every process started here is
stopped by its PID at the end, also on an error or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench._procs import free_port, stop, wait_http  # noqa: E402

# -- the scenario -------------------------------------------------------------------------------

REPLICAS = ("r1", "r2", "r3")
REPLICA_FLAGS = {
    "capacity": 4,
    "base-ms": 20,
    "prefill-ms-per-kchar": 40,
    "block-chars": 1024,
    "cache-blocks": 30,
    "tokens": 8,
    "itl-ms": 5,
}
N_PROMPTS = 9
PROMPT_CHARS = 6000
CONVERSATIONS = 36
QUICK_CONVERSATIONS = 18
TURNS = 4
START_WINDOW_S = 3.0
THINK_S = 0.25
MAX_TOKENS = 8
REQUEST_TIMEOUT_MS = 20_000
HOT_SHARE = 0.6
SEED = 20240
RUN_CAP_S = 90.0  # wall clock per run's workload; what has not finished by then counts as failed
BUSY_WAITING = 40  # what r3 claims in the last run

# (label, affinity on, mix, r3 busy)
RUNS = [
    ("normal/off", False, "normal", False),
    ("normal/on", True, "normal", False),
    ("hot/off", False, "hot", False),
    ("hot/on", True, "hot", False),
    ("normal/on, r3 claims 40 waiting", True, "normal", True),
]


def system_prompts(n: int = N_PROMPTS, chars: int = PROMPT_CHARS) -> list[str]:
    """n deterministic prompts of `chars` random words; prompt k starts with its own letter, so no
    two share even their first character (nor any KV block)."""
    out = []
    for k in range(n):
        rng = random.Random(SEED + k)
        words = [chr(ord("A") + k) + "."]
        size = 2
        while size < chars:
            w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
            words.append(w)
            size += len(w) + 1
        out.append(" ".join(words)[:chars])
    return out


def assignment(mix: str, n: int) -> list[int]:
    """The system prompt of each conversation."""
    if mix == "normal":
        return [i % N_PROMPTS for i in range(n)]
    hot = round(HOT_SHARE * n)
    rest = [1 + i % (N_PROMPTS - 1) for i in range(n - hot)]
    out = [0] * hot + rest
    random.Random(SEED).shuffle(out)
    return out


# -- processes ----------------------------------------------------------------------------------


class Procs:
    """Every process this benchmark starts, stopped by PID (most recent first) in stop_all()."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.live: list[subprocess.Popen[bytes]] = []
        self.logs: dict[int, Path] = {}

    def spawn(self, args: list[str], log_name: str) -> subprocess.Popen[bytes]:
        log = self.tmp / log_name
        with log.open("wb") as f:
            p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
        self.live.append(p)
        self.logs[p.pid] = log
        return p

    def tail(self, p: subprocess.Popen[bytes], n: int = 4000) -> str:
        try:
            return self.logs[p.pid].read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        stop(p)
        if p in self.live:
            self.live.remove(p)

    def stop_all(self) -> None:
        for p in reversed(list(self.live)):
            try:
                stop(p)
            except Exception as e:  # keep stopping the others
                print(f"could not stop pid {p.pid}: {e!r}", file=sys.stderr)
        self.live.clear()


def start_replica(procs: Procs, name: str, port: int, max_s: float, extra: dict[str, Any] | None = None) -> subprocess.Popen[bytes]:
    flags = ["-m", "tests.fake_replica", "--port", str(port), "--name", name, "--max-seconds", str(int(max_s))]
    for k, v in {**REPLICA_FLAGS, **(extra or {})}.items():
        flags += [f"--{k}", str(v)]
    p = procs.spawn(flags, f"{name}-{port}-{len(procs.logs)}.log")
    wait_http(f"http://127.0.0.1:{port}/health", 20, proc=p, on_exit=lambda: procs.tail(p))
    return p


def policy_text(ports: dict[str, int], affinity: bool) -> str:
    lines = [
        "version: 1",
        "reload: {watch: false}",
        "cache: {enabled: false}",
        f"routing: {{prefix_affinity: {{enabled: {'true' if affinity else 'false'}}}}}",
        "backends:",
    ]
    for n, p in ports.items():
        lines.append(f'  {n}: {{url: "http://127.0.0.1:{p}/v1", models: [m], metrics_url: "http://127.0.0.1:{p}/metrics"}}')
    lines += ["models:", f"  m: {{backends: [{', '.join(ports)}]}}"]
    return "\n".join(lines) + "\n"


# -- the client ---------------------------------------------------------------------------------


async def one_request(http: aiohttp.ClientSession, url: str, messages: list[dict], rec: dict) -> str:
    """Send one streamed turn; fill `rec`; return the answer's text."""
    body = {"model": "m", "messages": messages, "stream": True, "max_tokens": MAX_TOKENS}
    headers = {"Content-Type": "application/json", "x-request-timeout-ms": str(REQUEST_TIMEOUT_MS)}
    text: list[str] = []
    sent = time.monotonic()
    rec["sent"] = sent
    try:
        async with http.post(url, data=json.dumps(body), headers=headers) as r:
            rec["status"] = r.status
            rec["backend"] = r.headers.get("x-gateway-backend")
            rec["affinity"] = r.headers.get("x-gateway-affinity") or "-"
            if r.status != 200:
                rec["error"] = f"http_{r.status}"
                rec["detail"] = (await r.text())[:300]
                return ""
            done = False
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    continue
                try:
                    obj = json.loads(data)
                except ValueError:
                    rec["error"] = "bad_chunk"
                    continue
                if "error" in obj:
                    rec["error"] = "error_event"
                    rec["detail"] = str(obj["error"])[:300]
                    break
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if rec["ttft"] is None:
                            rec["ttft"] = time.monotonic() - sent
                        text.append(piece)
            if not done and rec["error"] is None:
                rec["error"] = "no_done"
    except asyncio.TimeoutError:
        rec["error"] = "timeout"
    except aiohttp.ClientError as e:
        rec["error"] = "client_" + type(e).__name__
    finally:
        rec["end"] = time.monotonic()
    return "".join(text)


async def workload(url: str, prompts: list[str], plan: list[int], records: list[dict]) -> None:
    n = len(plan)
    t0 = time.monotonic() + 0.2
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_MS / 1000 + 5)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:

        async def conversation(c: int) -> None:
            await asyncio.sleep(max(0.0, t0 + c * START_WINDOW_S / n - time.monotonic()))
            messages: list[dict] = [{"role": "system", "content": prompts[plan[c]]}]
            for t in range(1, TURNS + 1):
                messages.append({"role": "user", "content": f"Conversation {c}, question {t}: what comes next, and why?"})
                rec: dict[str, Any] = {"conv": c, "turn": t, "prompt": plan[c], "ttft": None, "error": None,
                                       "status": None, "backend": None, "affinity": None}
                records.append(rec)
                answer = await one_request(http, url, list(messages), rec)
                messages.append({"role": "assistant", "content": answer or "(no answer)"})
                if t < TURNS:
                    await asyncio.sleep(THINK_S)

        await asyncio.gather(*(conversation(c) for c in range(n)))


# -- one run ------------------------------------------------------------------------------------


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as r:
        r.raise_for_status()
        return await r.json()


async def _reset_all(ports: dict[str, int]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        for p in ports.values():
            async with http.post(f"http://127.0.0.1:{p}/reset") as r:
                r.raise_for_status()


async def _stats_all(ports: dict[str, int]) -> dict[str, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        return {n: await _get_json(http, f"http://127.0.0.1:{p}/stats") for n, p in ports.items()}


def run_one(label: str, affinity: bool, mix: str, procs: Procs, ports: dict[str, int], n_conv: int, prompts: list[str]) -> dict:
    asyncio.run(_reset_all(ports))
    gw_port = free_port()
    slug = label.split(",")[0].replace("/", "-") + ("-busy" if "," in label else "")
    policy = procs.tmp / f"{slug}.yaml"
    policy.write_text(policy_text(ports, affinity))
    gw = procs.spawn(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(gw_port)], f"{slug}-gateway.log")
    try:
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", 60, proc=gw, on_exit=lambda: procs.tail(gw))
        time.sleep(1.5)  # a scrape or so of every metrics_url (load_signals.interval_ms: 1 s)
        plan = assignment(mix, n_conv)
        records: list[dict] = []
        started = time.monotonic()
        timed_out = False

        async def bounded() -> None:
            nonlocal timed_out
            try:
                await asyncio.wait_for(workload(f"http://127.0.0.1:{gw_port}/v1/chat/completions", prompts, plan, records), RUN_CAP_S)
            except asyncio.TimeoutError:
                timed_out = True

        asyncio.run(bounded())
        wall = time.monotonic() - started
        stats = asyncio.run(_stats_all(ports))
    finally:
        procs.stop(gw)
    return {"label": label, "affinity": affinity, "mix": mix, "conversations": n_conv, "plan": plan, "wall_s": round(wall, 2),
            "timed_out": timed_out, "stats": stats, "records": records, "gateway_log_tail": procs.tail(gw, 1500)}


# -- analysis -----------------------------------------------------------------------------------


def _q(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))]


def analyze(run: dict) -> dict:
    recs = run["records"]
    expected = run["conversations"] * TURNS
    ok = [r for r in recs if r["error"] is None and r["ttft"] is not None and r.get("end") is not None]
    ok_ids = {id(r) for r in ok}
    ttfts = [r["ttft"] * 1000 for r in ok]
    stats = run["stats"]
    prompt_chars = sum(s["prompt_chars"] for s in stats.values())
    cached = sum(s["cached_chars"] for s in stats.values())
    served = sum(s["requests"] for s in stats.values())
    errors = collections.Counter(r["error"] or "unfinished" for r in recs if id(r) not in ok_ids)
    missing = expected - len(recs)
    if missing > 0:
        errors["never_sent"] += missing
    aff = collections.Counter(r["affinity"] or "-" for r in recs if r.get("status") is not None)
    by_header = collections.Counter(r["backend"] or "-" for r in recs if r.get("status") is not None)
    return {
        "requests": expected,
        "answered": len(ok),
        "ttft_p50_ms": _q(ttfts, 0.5),
        "ttft_p95_ms": _q(ttfts, 0.95),
        "ttft_max_ms": max(ttfts) if ttfts else None,
        "hit_ratio": cached / prompt_chars if prompt_chars else None,
        "shares": {n: (stats[n]["requests"] / served if served else None) for n in REPLICAS},
        "replica_requests": {n: stats[n]["requests"] for n in REPLICAS},
        "peak_waiting": {n: stats[n]["peak_waiting"] for n in REPLICAS},
        "metrics_scrapes": {n: stats[n].get("metrics_scrapes") for n in REPLICAS},  # the gateway's reads of metrics_url
        "failures": expected - len(ok),
        "failure_kinds": dict(errors),
        "affinity_headers": dict(aff),
        "backend_headers": dict(by_header),
    }


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def report(results: dict[str, dict], quick: bool) -> list[str]:
    lines = [
        f"{'quick: ' if quick else ''}{next(iter(results.values()))['requests'] // TURNS if results else 0} conversations x {TURNS} turns per run; "
        f"3 replicas, capacity {REPLICA_FLAGS['capacity']}, cache {REPLICA_FLAGS['cache-blocks']} x {REPLICA_FLAGS['block-chars']} chars; "
        f"{N_PROMPTS} system prompts of {PROMPT_CHARS} chars",
        "",
        "| run | TTFT p50 (ms) | TTFT p95 (ms) | hit ratio | share r1 | share r2 | share r3 | failures | x-gateway-affinity |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for label, a in results.items():
        sh = a["shares"]
        aff = " ".join(f"{k}:{v}" for k, v in sorted(a["affinity_headers"].items())) or "-"
        fails = str(a["failures"]) + (f" ({', '.join(f'{k}:{v}' for k, v in a['failure_kinds'].items())})" if a["failures"] else "")
        lines.append(
            f"| {label} | {_f(a['ttft_p50_ms'], '.0f')} | {_f(a['ttft_p95_ms'], '.0f')} | {_f(a['hit_ratio'], '.3f')} | "
            + " | ".join(_f(sh[n], ".2f") for n in REPLICAS)
            + f" | {fails} | {aff} |"
        )
    lines.append("")
    on, off = results.get("normal/on"), results.get("normal/off")
    if on and off:
        lines.append(
            f"normal: hit ratio on/off {_ratio(on['hit_ratio'], off['hit_ratio'])} "
            f"({_f(on['hit_ratio'], '.3f')} / {_f(off['hit_ratio'], '.3f')}); "
            f"TTFT p50 on/off {_ratio(on['ttft_p50_ms'], off['ttft_p50_ms'])}; p95 on/off {_ratio(on['ttft_p95_ms'], off['ttft_p95_ms'])}"
        )
    hon, hoff = results.get("hot/on"), results.get("hot/off")
    if hon and hoff:
        def busiest(a: dict) -> str:
            n = max(REPLICAS, key=lambda k: a["shares"][k] or 0)
            return f"{n} {_f(a['shares'][n], '.2f')}"

        lines.append(
            f"hot: busiest replica share on {busiest(hon)}, off {busiest(hoff)}; "
            f"TTFT p95 on/off {_ratio(hon['ttft_p95_ms'], hoff['ttft_p95_ms'])} "
            f"({_f(hon['ttft_p95_ms'], '.0f')} / {_f(hoff['ttft_p95_ms'], '.0f')} ms); "
            f"hit ratio on/off {_ratio(hon['hit_ratio'], hoff['hit_ratio'])}"
        )
    busy = next((a for k, a in results.items() if "," in k), None)
    if busy and on:
        lines.append(
            f"r3 claims {BUSY_WAITING} waiting: r3 share {_f(busy['shares']['r3'], '.2f')} (normal/on: {_f(on['shares']['r3'], '.2f')}); "
            f"TTFT p95 {_f(busy['ttft_p95_ms'], '.0f')} ms vs {_f(on['ttft_p95_ms'], '.0f')} ms"
        )
    return lines


# -- main ---------------------------------------------------------------------------------------


def decision_cost(prompts: list[str], n: int = 20_000) -> list[str]:
    """The request path's cost of the decision, in process (best of 5 rounds of n): the keys of a
    4th turn on a 6,000-character system prompt, and the whole plan (ranking, affinity) for a pool
    of three against the same plan with affinity off, on a learned map of 36 conversations."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from gateway.classify.classifier import Verdict
    from gateway.config.policy import Policy
    from gateway.config.runtime import build_runtime
    from gateway.pipeline.call import Call
    from gateway.relay.plan import plan
    from gateway.routing.prefix import prefix_keys
    from gateway.wire.endpoints import ENDPOINTS

    def runtime(on: bool) -> Any:
        rt = build_runtime(Policy.model_validate({
            "backends": {b: {"url": f"http://127.0.0.1:{9 + i}/v1", "models": ["m"]} for i, b in enumerate(REPLICAS)},
            "routing": {"prefix_affinity": {"enabled": on}},
        }), {}, 1)
        rt.activate({}, {})
        for b in rt.backends.values():
            b.tracker.observe_ttft(0.05, 1500)
        return rt

    convs = []
    for c in range(CONVERSATIONS):
        msgs = [{"role": "system", "content": prompts[c % N_PROMPTS]}]
        for t in range(TURNS):
            msgs += [{"role": "user", "content": f"Conversation {c}, question {t + 1}: what comes next, and why?"},
                     {"role": "assistant", "content": "the cache keeps what the prompt shared"}]
        convs.append({"model": "m", "messages": msgs[:-1]})
    rows = []
    best: dict[str, float] = {}
    for label, on in (("plan, affinity off", False), ("plan, affinity on", True)):
        rt = runtime(on)
        route = rt.route("m")
        calls = []
        for body in convs:
            call = Call("bench", ENDPOINTS["chat"], b"", None, time.monotonic() + 3600)
            call.body, call.model, call.verdict = body, "m", Verdict("complex", 0.9, 0.5, None, {})
            call.prefix = prefix_keys(body, 1024) if route.prefixes is not None else None
            if route.prefixes is not None:
                route.prefixes.learn(call.prefix or (), REPLICAS[len(calls) % 3], "none")
            calls.append(call)
        pool = route.pool("none")
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(n):
                plan(calls[i % len(calls)], route, pool)
            rounds.append((time.perf_counter() - t0) / n * 1e6)
        best[label] = min(rounds)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(n // 4):
            prefix_keys(convs[i % len(convs)], 1024)
        rounds.append((time.perf_counter() - t0) / (n // 4) * 1e6)
    best["block keys (6,000-char system prompt, 4th turn)"] = min(rounds)
    rows.append("| step (in process, one core) | us per request |")
    rows.append("|---|---:|")
    rows += [f"| {k} | {v:.1f} |" for k, v in best.items()]
    extra = best["plan, affinity on"] - best["plan, affinity off"] + best["block keys (6,000-char system prompt, 4th turn)"]
    rows.append(f"\ndecision cost (keys + affinity's part of the plan): {extra:.1f} us per request (target <= 20 us)")
    return rows


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally that stops every process


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_CONVERSATIONS} conversations per run instead of {CONVERSATIONS}")
    ap.add_argument("--json", metavar="OUT", help="write the summaries and every request's record here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (policies, logs)")
    ap.add_argument("--decision-only", action="store_true", help="only the in-process decision cost (no processes)")
    args = ap.parse_args()
    if args.decision_only:
        print("\n".join(decision_cost(system_prompts())))
        return 0
    signal.signal(signal.SIGTERM, _sigterm)
    n_conv = QUICK_CONVERSATIONS if args.quick else CONVERSATIONS
    prompts = system_prompts()
    tmp = Path(tempfile.mkdtemp(prefix="bench-affinity-"))
    procs = Procs(tmp)
    ports = {n: free_port() for n in REPLICAS}
    life_s = len(RUNS) * (RUN_CAP_S + 90) + 60  # replicas exit by themselves after this, whatever happens here
    results: dict[str, dict] = {}
    runs: dict[str, dict] = {}
    replicas: dict[str, subprocess.Popen[bytes]] = {}
    started = time.monotonic()
    try:
        for n, p in ports.items():
            replicas[n] = start_replica(procs, n, p, life_s)
        for label, affinity, mix, r3_busy in RUNS:
            if r3_busy:
                procs.stop(replicas["r3"])
                replicas["r3"] = start_replica(procs, "r3", ports["r3"], life_s, {"report-waiting": BUSY_WAITING})
            t = time.monotonic()
            run = run_one(label, affinity, mix, procs, ports, n_conv, prompts)
            runs[label] = run
            results[label] = analyze(run)
            a = results[label]
            print(
                f"[{label}: {time.monotonic() - t:.1f} s; {a['answered']}/{a['requests']} answered; "
                f"p50 {_f(a['ttft_p50_ms'], '.0f')} ms, p95 {_f(a['ttft_p95_ms'], '.0f')} ms; hit {_f(a['hit_ratio'], '.3f')}; "
                f"/metrics scrapes {a['metrics_scrapes']}"
                f"{'; RUN CAP HIT' if run['timed_out'] else ''}]",
                flush=True,
            )
    finally:
        procs.stop_all()
        if args.keep:
            print(f"(policies and logs in {tmp})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    lines = report(results, args.quick) + [""] + decision_cost(prompts)
    print("\n" + "\n".join(lines))
    print(f"\n(total {time.monotonic() - started:.0f} s)")
    if args.json:
        out = {
            "args": vars(args),
            "scenario": {"replica_flags": REPLICA_FLAGS, "prompts": N_PROMPTS, "prompt_chars": PROMPT_CHARS, "conversations": n_conv,
                         "turns": TURNS, "start_window_s": START_WINDOW_S, "think_s": THINK_S, "max_tokens": MAX_TOKENS,
                         "hot_share": HOT_SHARE, "seed": SEED, "busy_waiting": BUSY_WAITING},
            "results": results,
            "table": lines,
            "runs": {k: {kk: vv for kk, vv in r.items()} for k, r in runs.items()},
        }
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
