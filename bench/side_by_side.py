"""Two servers side by side on one core, under the same load at the same time: how to compare what
a request costs each on a shared VM, where timing one after the other drifts by 5-15 % within
minutes (bench/_load.paired_wrk says why the ratio holds).

    python bench/side_by_side.py --base REV [--policy plain|every] [--rounds 8] [--duration 5]
    python bench/side_by_side.py --vs-bare [--policy plain|every] [--rounds 8] [--duration 5]

`--base REV`: the gateway at git revision REV (checked out in a temporary worktree, run with this
tree's virtual environment) against this tree's, under the same policy: what a change did to a
request's cost. `--base HEAD` with no change in the tree is an A/A run: how far from 1.000 the
method lands by itself (0.99-1.01 seen).
`--vs-bare`: the bare aiohttp pass-through (bench/_minproxy.py) against this tree's gateway: the
gateway's CPU per request as a multiple of the bare hop's, and its throughput as a fraction.

Policies: `plain` is open mode with one backend (bench/gateway_overhead.py's first rows), one
body repeated; `every` has every stage doing work (a tenant's quota, a cache lookup, flight and
store per request with a prompt of its own, admission, Server-Timing, the access log).
Both servers on core 1, the fake upstream and the two wrks on core 0; half the rounds with A
started first, half with B.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import ROOT, lua_post, lua_post_unique, side_by_side_runs  # noqa: E402
from bench._procs import fake_upstream, need, start, stop, wait_http, worktree  # noqa: E402
from bench.gateway_overhead import BODY, UNIQUE_BODY, every_stage_policy, plain_policy  # noqa: E402

_PATH = "/v1/chat/completions"


def _gateway(cwd: Path, policy: Path, port: int) -> subprocess.Popen[bytes]:
    """`gateway serve` on core 1, the `gateway` package of the checkout in `cwd`."""
    return start(["-m", "gateway", "serve", "--policy", str(policy), "--port", str(port)], env={"GATEWAY_LOG_LEVEL": "WARNING"},
                 cpus="1", cwd=cwd)


def main() -> None:
    ap = argparse.ArgumentParser()
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--base", help="a git revision: its gateway against this tree's")
    which.add_argument("--vs-bare", action="store_true", help="the bare aiohttp pass-through against this tree's gateway")
    ap.add_argument("--policy", choices=("plain", "every"), default="plain")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--duration", type=int, default=5)
    args = ap.parse_args()
    need("wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-sbs-"))
    trees = ExitStack()
    base_tree = trees.enter_context(worktree(args.base, tmp / "base")) if args.base else tmp
    upstream, up_port = fake_upstream("--tokens", "16", cpus="0")
    policy = tmp / "policy.yaml"
    policy.write_text((every_stage_policy if args.policy == "every" else plain_policy)(up_port))
    gw_script, bare_script = tmp / "gw.lua", tmp / "bare.lua"
    headers = {"Authorization": "Bearer sk-bench"}
    gw_script.write_text(lua_post_unique(UNIQUE_BODY, headers) if args.policy == "every" else lua_post(BODY, headers))
    bare_script.write_text(lua_post(BODY))
    if args.base:
        names, a_script = (f"gateway at {args.base}", "this tree's gateway"), gw_script
    else:
        names, a_script = ("bare aiohttp hop", "the gateway"), bare_script

    def start_a(port: int) -> subprocess.Popen[bytes]:
        if args.base:
            return _gateway(base_tree, policy, port)
        return start(["bench/_minproxy.py", f"http://127.0.0.1:{up_port}{_PATH}", str(port)], cpus="1")

    try:
        wait_http(f"http://127.0.0.1:{up_port}/healthz")
        runs = side_by_side_runs(start_a, lambda port: _gateway(ROOT, policy, port), (a_script, gw_script), args.rounds,
                                 args.duration, _PATH)
    finally:
        stop(upstream)
        trees.close()
        shutil.rmtree(tmp, ignore_errors=True)

    a, b = names
    print(f"side by side on one core, policy {args.policy!r}, {args.rounds} rounds of {args.duration} s (wrk -c32 each)")
    print(f"{'':34} {a:>22} {b:>22} {'ratio':>7}")
    for label, i in (("throughput (req/s)", 0), ("CPU per request (us)", 1)):
        x, y = statistics.median(r[0][i] for r in runs), statistics.median(r[1][i] for r in runs)
        print(f"{label:34} {x:22.0f} {y:22.0f} {y / x:7.3f}")
    ratios = sorted(r[1][0] / r[0][0] for r in runs)
    print(f"{'throughput ratio, each round':34} median {statistics.median(ratios):.3f} (min {ratios[0]:.3f}, max {ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
