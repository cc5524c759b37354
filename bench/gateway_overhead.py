"""What the gateway adds: gateway vs direct to the same fake upstream (zero delay), in one run.

    python bench/gateway_overhead.py [--duration 10] [--rate 500] [--connections 32]

Also runs a bare aiohttp passthrough (bench/_minproxy.py) in the same run as the floor to compare
with: the machine's speed moves between runs, the ratios do not. Measures non-streaming throughput at concurrency 32 (wrk, a C load generator), latency p50/p99 at
a fixed request rate (an open-loop generator in its own process), TTFT added on streams, the
gateway's CPU time per request and its peak RSS; the same again for the Responses API (rows
"responses:", the TTFT being the first `response.output_text.delta`). One gateway worker, uvloop. Each figure is
reported beside the direct one and as a ratio.

Then one worker with every stage doing work (a tenant's quota, a distinct deterministic prompt per
request so the cache looks up, leads a flight and stores each time, admission, Server-Timing, the
access log), beside the bare passthrough. Then the same throughput through `gateway serve --workers 2` (`--workers 0` skips it): req/s and
CPU per request (supervisor and workers together) beside one worker's, in the same run. On a
2-core machine wrk and the fake upstream share the cores with the workers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import lua_post, lua_post_unique, pct, run_in_subprocess, wrk  # noqa: E402
from bench._procs import cpu_seconds, free_port, need, peak_rss_mb, start, stop, tree_cpu_seconds, wait_http  # noqa: E402

BODY = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 16})
STREAM_BODY = orjson.dumps(
    {"model": "gpt-test", "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 16, "stream": True}
)
# The Responses API (/v1/responses), the same request in its shape.
RESP_BODY = orjson.dumps({"model": "gpt-test", "input": "Say hello in one word.", "max_output_tokens": 16})
RESP_STREAM_BODY = orjson.dumps({"model": "gpt-test", "input": "Say hello in one word.", "max_output_tokens": 16, "stream": True})
# Anthropic's Messages API, answered by the same chat upstream through translation.
MSG_STREAM_BODY = orjson.dumps(
    {"model": "gpt-test", "messages": [{"role": "user", "content": "Say hello in one word."}], "max_tokens": 16, "stream": True}
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--stream-n", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2, help="also measure `serve --workers N` (0: skip)")
    args = ap.parse_args()
    need("wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    script = tmp / "post.lua"
    script.write_text(lua_post(BODY, {"Authorization": "Bearer sk-bench"}))
    resp_script = tmp / "responses.lua"
    resp_script.write_text(lua_post(RESP_BODY, {"Authorization": "Bearer sk-bench"}))
    up_port, gw_port, mp_port = free_port(), free_port(), free_port()
    policy = tmp / "policy.yaml"
    policy.write_text(plain_policy(up_port))
    upstream = start(["-m", "tests.fake_upstream", "--port", str(up_port), "--tokens", "16"])
    gateway = start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(gw_port)], env={"GATEWAY_LOG_LEVEL": "WARNING"})
    direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    bare = start(["bench/_minproxy.py", direct, str(mp_port)])
    via_bare = f"http://127.0.0.1:{mp_port}/v1/chat/completions"
    via = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
    results: dict[str, dict[str, float]] = {}
    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        wait_http(f"http://127.0.0.1:{gw_port}/healthz")
        wait_http(f"http://127.0.0.1:{mp_port}/healthz")
        wrk(via, args.connections, 2, script)  # warm-up
        wrk(direct, args.connections, 2, script)
        d = wrk(direct, args.connections, args.duration, script)
        cpu0 = cpu_seconds(gateway.pid)
        g = wrk(via, args.connections, args.duration, script)
        cpu_per_req_us = (cpu_seconds(gateway.pid) - cpu0) / g["requests"] * 1e6
        cpu0 = cpu_seconds(bare.pid)
        b = wrk(via_bare, args.connections, args.duration, script)
        bare_cpu_us = (cpu_seconds(bare.pid) - cpu0) / b["requests"] * 1e6
        results["throughput"] = {"direct_rps": d["rps"], "gateway_rps": g["rps"], "gateway_non2xx": g["non2xx"]}
        lat_d = run_in_subprocess("fixed_rate", direct, args.rate, args.duration, BODY.decode())
        lat_g = run_in_subprocess("fixed_rate", via, args.rate, args.duration, BODY.decode())
        ttft_d = run_in_subprocess("ttft", direct, args.stream_n, STREAM_BODY.decode())
        ttft_g = run_in_subprocess("ttft", via, args.stream_n, STREAM_BODY.decode())
        # The Responses API, against the same upstream and gateway.
        r_direct = direct.replace("/chat/completions", "/responses")
        r_via = via.replace("/chat/completions", "/responses")
        wrk(r_via, args.connections, 2, resp_script)  # warm-up
        rd = wrk(r_direct, args.connections, args.duration, resp_script)
        rg = wrk(r_via, args.connections, args.duration, resp_script)
        results["responses_throughput"] = {"direct_rps": rd["rps"], "gateway_rps": rg["rps"], "gateway_non2xx": rg["non2xx"]}
        rlat_d = run_in_subprocess("fixed_rate", r_direct, args.rate, args.duration, RESP_BODY.decode())
        rlat_g = run_in_subprocess("fixed_rate", r_via, args.rate, args.duration, RESP_BODY.decode())
        rttft_d = run_in_subprocess("ttft", r_direct, args.stream_n, RESP_STREAM_BODY.decode(), '"delta":"w')
        rttft_g = run_in_subprocess("ttft", r_via, args.stream_n, RESP_STREAM_BODY.decode(), '"delta":"w')
        # The translation's own cost: Messages in, chat upstream, Anthropic events out, beside chat through the gateway.
        m_via = via.replace("/chat/completions", "/messages")
        mttft_chat = run_in_subprocess("ttft", via, args.stream_n, STREAM_BODY.decode())
        mttft_g = run_in_subprocess("ttft", m_via, args.stream_n, MSG_STREAM_BODY.decode(), '"text":"w')
        rss = peak_rss_mb(gateway.pid)
        multi = _workers(args, policy, script, g["rps"], cpu_per_req_us) if args.workers > 1 else None
        every = _every_stage(args, tmp, up_port)
    finally:
        stop(gateway)
        stop(bare)
        stop(upstream)
        shutil.rmtree(tmp, ignore_errors=True)

    ms = 1000
    rows = [
        ("throughput, non-stream, c=%d (req/s)" % args.connections, d["rps"], g["rps"], g["rps"] / d["rps"]),
        ("latency p50 at %d req/s (ms)" % args.rate, pct(lat_d, 0.5) * ms, pct(lat_g, 0.5) * ms, pct(lat_g, 0.5) / pct(lat_d, 0.5)),
        ("latency p99 at %d req/s (ms)" % args.rate, pct(lat_d, 0.99) * ms, pct(lat_g, 0.99) * ms, pct(lat_g, 0.99) / pct(lat_d, 0.99)),
        ("stream TTFT p50 (ms)", pct(ttft_d, 0.5) * ms, pct(ttft_g, 0.5) * ms, pct(ttft_g, 0.5) / pct(ttft_d, 0.5)),
        ("stream TTFT p99 (ms)", pct(ttft_d, 0.99) * ms, pct(ttft_g, 0.99) * ms, pct(ttft_g, 0.99) / pct(ttft_d, 0.99)),
        ("responses: throughput, non-stream (req/s)", rd["rps"], rg["rps"], rg["rps"] / rd["rps"]),
        ("responses: latency p50 at %d req/s (ms)" % args.rate, pct(rlat_d, 0.5) * ms, pct(rlat_g, 0.5) * ms,
         pct(rlat_g, 0.5) / pct(rlat_d, 0.5)),
        ("responses: latency p99 at %d req/s (ms)" % args.rate, pct(rlat_d, 0.99) * ms, pct(rlat_g, 0.99) * ms,
         pct(rlat_g, 0.99) / pct(rlat_d, 0.99)),
        ("responses: stream TTFT p50 (ms)", pct(rttft_d, 0.5) * ms, pct(rttft_g, 0.5) * ms, pct(rttft_g, 0.5) / pct(rttft_d, 0.5)),
        ("responses: stream TTFT p99 (ms)", pct(rttft_d, 0.99) * ms, pct(rttft_g, 0.99) * ms, pct(rttft_g, 0.99) / pct(rttft_d, 0.99)),
        # "direct" here is chat through the gateway (the untranslated path), "gateway" Messages through it.
        ("messages (translated) vs chat: TTFT p50 (ms)", pct(mttft_chat, 0.5) * ms, pct(mttft_g, 0.5) * ms,
         pct(mttft_g, 0.5) / pct(mttft_chat, 0.5)),
        ("messages (translated) vs chat: TTFT p99 (ms)", pct(mttft_chat, 0.99) * ms, pct(mttft_g, 0.99) * ms,
         pct(mttft_g, 0.99) / pct(mttft_chat, 0.99)),
    ]
    print(f"\n{'metric':42} {'direct':>10} {'gateway':>10} {'ratio':>7} {'added':>9}")
    for name, dv, gv, ratio in rows:
        print(f"{name:42} {dv:10.2f} {gv:10.2f} {ratio:7.2f} {gv - dv:9.2f}")
    print(f"{'gateway CPU per request (us)':42} {'':10} {cpu_per_req_us:10.0f}")
    print(
        f"bare aiohttp passthrough, same run: {b['rps']:.0f} req/s, {bare_cpu_us:.0f} us CPU per request "
        f"(gateway/bare: {g['rps'] / b['rps']:.2f}x req/s, {cpu_per_req_us / bare_cpu_us:.2f}x CPU)"
    )
    print(f"{'gateway peak RSS (MB)':42} {'':10} {rss:10.1f}")
    print(f"(non-2xx through the gateway: {g['non2xx']} chat, {rg['non2xx']} responses; "
          f"wrk socket errors: {g['socket_errors'] or 'none'})")
    print(
        f"every stage on (a tenant's quota, a cache lookup and store per request, admission, Server-Timing, access log): "
        f"{every['rps']:.0f} req/s, {every['cpu_us']:.0f} us CPU per request "
        f"(gateway/bare: {every['rps'] / b['rps']:.2f}x req/s, {every['cpu_us'] / bare_cpu_us:.2f}x CPU; non-2xx {every['non2xx']})"
    )
    if multi is not None:
        n = args.workers
        print(f"\n{'--workers, same run':42} {'1 worker':>10} {f'{n} workers':>10} {'ratio':>7}")
        print(f"{'throughput, non-stream (req/s)':42} {g['rps']:10.0f} {multi['rps']:10.0f} {multi['rps'] / g['rps']:7.2f}")
        print(f"{'CPU per request (us, all processes)':42} {cpu_per_req_us:10.0f} {multi['cpu_us']:10.0f} {multi['cpu_us'] / cpu_per_req_us:7.2f}")
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "gateway_overhead.json").write_text(
        json.dumps(
            {"rows": rows, "cpu_per_request_us": cpu_per_req_us, "bare_proxy": {"rps": b["rps"], "cpu_per_request_us": bare_cpu_us},
             "peak_rss_mb": rss, "workers": multi, "every_stage": every, "args": vars(args)},
            indent=2,
        )
    )


# A body with a prompt of its own per request (`{n}`: lua_post_unique), cacheable (temperature 0).
UNIQUE_BODY = '{"model":"gpt-test","messages":[{"role":"user","content":"Say hello in one word {n}."}],"max_tokens":16,"temperature":0}'


def plain_policy(up_port: int) -> str:
    """The default policy's stages: open mode (no tenants), the fake upstream as the one backend."""
    return (f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [gpt-test], max_concurrency: 1024}}\n"
            "reload: {watch: false}\nserver: {drain_delay_ms: 0}\n")


def every_stage_policy(up_port: int) -> str:
    """Every stage doing work: a tenant (key `sk-bench`) with a quota, the cache, the access log."""
    digest = hashlib.sha256(b"sk-bench").hexdigest()
    return (f"backends:\n  up: {{url: 'http://127.0.0.1:{up_port}/v1', models: [gpt-test], max_concurrency: 1024}}\n"
            f"tenants:\n  bench:\n    key_sha256: ['{digest}']\n    quota: {{rpm: 100000000, tpm: 1000000000}}\n"
            "cache: {enabled: true}\nlog: {access: true}\nreload: {watch: false}\nserver: {drain_delay_ms: 0}\n")


def _every_stage(args: argparse.Namespace, tmp: Path, up_port: int) -> dict[str, float]:
    """One worker with every stage of the pipeline doing work: a tenant with a quota (reserved and
    settled per request), the cache on with a distinct deterministic prompt per request (a lookup,
    a single flight and a store each), admission, Server-Timing and the access log (to /dev/null)."""
    policy = tmp / "every.yaml"
    policy.write_text(every_stage_policy(up_port))
    script = tmp / "unique.lua"
    script.write_text(lua_post_unique(UNIQUE_BODY, {"Authorization": "Bearer sk-bench"}))
    port = free_port()
    gw = start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)], env={"GATEWAY_LOG_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        wrk(url, args.connections, 2, script)  # warm-up
        cpu0 = cpu_seconds(gw.pid)
        r = wrk(url, args.connections, args.duration, script)
        cpu_us = (cpu_seconds(gw.pid) - cpu0) / r["requests"] * 1e6
    finally:
        stop(gw)
    return {"rps": r["rps"], "cpu_us": cpu_us, "non2xx": r["non2xx"]}


def _workers(args: argparse.Namespace, policy: Path, script: Path, one_rps: float, one_cpu_us: float) -> dict[str, float]:
    """Throughput and CPU per request through `gateway serve --workers N` (the single gateway
    stays up, idle: one gateway takes load at a time)."""
    port = free_port()
    gw = start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(port), "--workers", str(args.workers)],
               env={"GATEWAY_LOG_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        wrk(url, args.connections, 3, script)  # warm-up: every worker up and its pool open
        cpu0 = tree_cpu_seconds(gw.pid)
        r = wrk(url, args.connections, args.duration, script)
        cpu_us = (tree_cpu_seconds(gw.pid) - cpu0) / r["requests"] * 1e6
    finally:
        stop(gw)
    return {"rps": r["rps"], "cpu_us": cpu_us, "non2xx": r["non2xx"], "one_worker_rps": one_rps, "one_worker_cpu_us": one_cpu_us}


if __name__ == "__main__":
    main()
