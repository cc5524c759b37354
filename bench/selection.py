"""Micro-benchmark of backend selection: the cost of one Selector.rank() call, and of the tracker
updates and deadline the relay makes around each request.

    flock /tmp/bench.lock python bench/selection.py [--calls 20000]

Candidates carry realistic state: a few hundred TTFT samples with varied prompt sizes, some load in
flight, one candidate cooling. Each row times one call at a time with perf_counter_ns (so the
figures include the timer's own ~0.1 us), after a warm-up; p50 and p99 in microseconds.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.routing.health import Health  # noqa: E402
from gateway.routing.latency import Tracker  # noqa: E402
from gateway.routing.selector import Candidate, Selector  # noqa: E402


def _candidates(n: int, rng: random.Random) -> list[Candidate]:
    out = []
    for i in range(n):
        tr = Tracker()
        base = 0.05 * (1 + i % 5)
        for _ in range(300):
            tokens = rng.randrange(20, 3000)
            tr.observe_ttft(base + 0.0002 * tokens * rng.uniform(0.9, 1.1), prompt_tokens=tokens)
            tr.observe_itl(0.01)
            tr.observe_done(0.5, ok=rng.random() > 0.02)
        tr.inflight = rng.randrange(0, 8)
        h = Health()
        if n > 2 and i == n - 1:
            h.cool_down(3600)
        out.append(Candidate(f"b{i}", tr, h))
    return out


def _time(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    for _ in range(min(2000, calls)):
        fn()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t = clock()
        fn()
        samples.append(clock() - t)
    samples.sort()
    return samples[calls // 2] / 1000, samples[int(calls * 0.99)] / 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    rng = random.Random(1)
    print(f"python {platform.python_version()} on {platform.machine()}; {args.calls} calls per row")
    print(f"{'operation':<44} {'p50 us':>8} {'p99 us':>8}")
    for strategy in ("latency", "round_robin", "least_inflight", "weighted"):
        for n in (2, 4, 16):
            cands = _candidates(n, rng)
            sel = Selector(strategy, rng=random.Random(2))
            p50, p99 = _time(lambda: sel.rank(cands, 700), args.calls)
            print(f"{f'rank() {strategy}, {n} candidates':<44} {p50:>8.2f} {p99:>8.2f}")
    tr = _candidates(1, rng)[0].tracker
    tokens = iter(rng.randrange(20, 3000) for _ in range(10 * args.calls + 4000))
    for name, fn in (
        ("tracker.observe_ttft(s, prompt_tokens=n)", lambda: tr.observe_ttft(0.1, prompt_tokens=next(tokens))),
        ("tracker.observe_itl(s)", lambda: tr.observe_itl(0.01)),
        ("tracker.observe_done(s, ok=True)", lambda: tr.observe_done(0.5, ok=True)),
        ("tracker.first_token_deadline_s(30.0)", lambda: tr.first_token_deadline_s(30.0, prompt_tokens=700)),
        ("tracker.snapshot() (admin, 512 samples)", tr.snapshot),
    ):
        p50, p99 = _time(fn, args.calls)
        print(f"{name:<44} {p50:>8.2f} {p99:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
