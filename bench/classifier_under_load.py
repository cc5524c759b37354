"""The classifier cascade inside a loaded gateway: which stage decided the requests, and what the
encoder's waits cost, with the event loop busy proxying.

    python bench/classifier_under_load.py [--base REV] [--duration 10] [--connections 16]

One gateway worker on core 1 (its encoder thread shares that core with the event loop, as each
worker of `--workers N` does), the fake upstream and wrk on core 0, wrk posting the labelled dev
+ train prompts in turn with `model: auto` (a classifying route: simple and complex to two
backends on the fake upstream). The gateway's own metrics then say which cascade stage decided
each request (`gateway_classifier_decisions_total`) and how long uncertain requests waited for the
encoder (`gateway_classifier_encoder_seconds`). `--base REV`: the same run first with the gateway at
git revision REV (a temporary worktree), then with this tree's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import ROOT  # noqa: E402
from bench._procs import fake_upstream, free_port, need, start, stop, wait_http, worktree  # noqa: E402
from bench.classifier_cascade import labelled_rows  # noqa: E402

_STAGES = ("rule", "lexical", "encoder", "deadline")


def _policy(up_port: int) -> str:
    url = f"http://127.0.0.1:{up_port}/v1"
    return (f"backends:\n  small: {{url: '{url}', models: [gpt-test], max_concurrency: 1024}}\n"
            f"  big: {{url: '{url}', models: [gpt-test], max_concurrency: 1024}}\n"
            "models:\n  auto: {simple: [small], complex: [big]}\n"
            "reload: {watch: false}\nserver: {drain_delay_ms: 0}\n")


def _script(path: Path) -> None:
    """A wrk script posting the labelled prompts in turn (each wrk thread from its own offset)."""
    bodies = [json.dumps({"model": "auto", "messages": r["messages"], "max_tokens": 16}) for r in labelled_rows()]
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"', "local bodies = {"]
    lines += [f"  [==[{b}]==]," for b in bodies if "]==]" not in b]
    lines += ["}", "local i = 0", "local offset = 0", "local counter = 0",
              "function setup(thread) counter = counter + 1; thread:set('offset', counter * 997) end",
              "request = function()", "  i = i + 1",
              "  return wrk.format(nil, nil, nil, bodies[(i + offset) % #bodies + 1])", "end"]
    path.write_text("\n".join(lines) + "\n")


def _metrics(port: int) -> tuple[dict[str, float], float, float]:
    """Decisions per cascade stage, and the encoder waits' count and sum (s), from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    stages = {s: 0.0 for s in _STAGES}
    waits = {"_count": 0.0, "_sum": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gateway_classifier_decisions_total":
                stages[s.labels["stage"]] = s.value
            elif s.name.removeprefix("gateway_classifier_encoder_seconds") in waits:
                waits[s.name.removeprefix("gateway_classifier_encoder_seconds")] = s.value
    return stages, waits["_count"], waits["_sum"]


def _run(cwd: Path, policy: Path, script: Path, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    gw = start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)],
               env={"GATEWAY_LOG_LEVEL": "WARNING"}, cpus="1", cwd=cwd)
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout_s=120, proc=gw)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        cmd = ["taskset", "-c", "0", "wrk", f"-t{min(2, args.connections)}", f"-c{args.connections}", "--latency", "-s", str(script), url]
        subprocess.run([*cmd[:-3], "-d2s", *cmd[-3:]], capture_output=True, check=True)  # warm-up
        before, n0, s0 = _metrics(port)
        out = subprocess.run([*cmd[:-3], f"-d{args.duration}s", *cmd[-3:]], capture_output=True, text=True, check=True).stdout
        after, n1, s1 = _metrics(port)
    finally:
        stop(gw)
    lat = {p: re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)$", out, re.M) for p in ("50", "99")}
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),  # type: ignore[union-attr]
        "p50": float(lat["50"].group(1)) * scale[lat["50"].group(2)] if lat["50"] else float("nan"),
        "p99": float(lat["99"].group(1)) * scale[lat["99"].group(2)] if lat["99"] else float("nan"),
        "stages": {s: after[s] - before[s] for s in _STAGES},
        "waited": n1 - n0, "wait_ms": (s1 - s0) / max(1.0, n1 - n0) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="a git revision: its gateway first, then this tree's")
    ap.add_argument("--duration", type=int, default=10)
    ap.add_argument("--connections", type=int, default=16)
    args = ap.parse_args()
    need("wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-cul-"))
    upstream, up_port = fake_upstream("--tokens", "16", cpus="0")
    policy, script = tmp / "policy.yaml", tmp / "prompts.lua"
    policy.write_text(_policy(up_port))
    _script(script)
    checkouts = ExitStack()
    trees = [("this tree", ROOT)]
    if args.base:
        trees.insert(0, (f"at {args.base}", checkouts.enter_context(worktree(args.base, tmp / "base"))))
    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        results = [(name, _run(cwd, policy, script, args)) for name, cwd in trees]
    finally:
        stop(upstream)
        checkouts.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"the cascade in one loaded gateway worker (core 1), wrk -c{args.connections} for {args.duration} s, "
          "the dev + train prompts, model auto")
    print(f"{'gateway':<16}{'req/s':>8}{'p50 ms':>8}{'p99 ms':>8}  " + "".join(f"{s:>10}" for s in _STAGES)
          + f"{'encoder waits':>15}{'mean ms':>9}")
    for name, r in results:
        st = r["stages"]
        assert isinstance(st, dict)
        total = sum(st.values()) or 1.0
        print(f"{name:<16}{r['rps']:>8.0f}{r['p50']:>8.2f}{r['p99']:>8.2f}  "
              + "".join(f"{st[s] / total:>10.1%}" for s in _STAGES) + f"{r['waited']:>15.0f}{r['wait_ms']:>9.2f}")


if __name__ == "__main__":
    main()
