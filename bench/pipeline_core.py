"""The request core's CPU per request, stage by stage, in process: no sockets, no load generator.

    python bench/pipeline_core.py [--requests 20000] [--rounds 3]

The real pipeline (a Runtime built from a policy, the stages, the relay, the observer with the
request log) over a scripted upstream that answers at once (tests/scripted.py) and a recording
sink: what `bench/gateway_overhead.py` measures minus HTTP, with a noise of about 2 us instead of
10. Each policy variant adds one stage to the one before; every request has a prompt of its own
(temperature 0: a cache lookup, a single flight and a store each, when the cache is on); the loop
runs its timers every 256 requests, so the request log's writer encodes and stores its batches. CPU from
`time.process_time()` (the access log's writer thread included); the GC set up as a serving
worker does (`settle_heap`). Rounds alternate the variants; medians.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway.admin.log_store import MemoryLogStore  # noqa: E402
from gateway.admin.request_log import RequestLog  # noqa: E402
from gateway.admission.gate import Admission  # noqa: E402
from gateway.config.policy import parse_policy  # noqa: E402
from gateway.config.runtime import build_runtime  # noqa: E402
from gateway.observe.metrics import Metrics  # noqa: E402
from gateway.observe.observer import Observer  # noqa: E402
from gateway.pipeline.call import Call  # noqa: E402
from gateway.pipeline.core import Pipeline  # noqa: E402
from gateway.process.serve import settle_heap  # noqa: E402
from gateway.relay.context import RelayContext  # noqa: E402
from gateway.wire.endpoints import ENDPOINTS  # noqa: E402
from tests.scripted import Answer, RecordingSink, ScriptedResponse, chat_answer  # noqa: E402

KEY = "sk-bench"
_BASE = "backends:\n  up: {url: 'http://up.invalid/v1', models: [gpt-test], max_concurrency: 1024}\n"
_TENANT = f"tenants:\n  bench:\n    key_sha256: ['{hashlib.sha256(KEY.encode()).hexdigest()}']\n"
_QUOTA = "    quota: {rpm: 100000000, tpm: 1000000000}\n"
_NO_CACHE, _NO_LOG = "cache: {enabled: false}\n", "request_log: {enabled: false}\n"
VARIANTS = {
    "open mode, cache off, request log off": _BASE + _NO_CACHE + _NO_LOG,
    "+ request log": _BASE + _NO_CACHE,
    "+ a tenant's key": _BASE + _TENANT + _NO_CACHE,
    "+ cache (lookup, flight, store)": _BASE + _TENANT,
    "+ quota": _BASE + _TENANT + _QUOTA,
    "+ access log (every stage on)": _BASE + _TENANT + _QUOTA + "log: {access: true}\n",
}


class _Pool:
    """The upstream pool's one method the relay calls, answering at once."""

    def __init__(self) -> None:
        self.answer = Answer(200, [chat_answer("Hello there, how are you?")], {"Content-Type": "application/json"})

    async def post(self, url: Any, body: bytes, headers: Mapping[str, str], *, connect_timeout_s: float,
                   method: str = "POST") -> ScriptedResponse:
        return ScriptedResponse(self.answer)

    async def close(self) -> None:
        return None


async def _measure(policy_yaml: str, n: int) -> float:
    """CPU microseconds per request through one freshly built pipeline."""
    policy = parse_policy(policy_yaml)
    states: dict[str, Any] = {}
    stores: dict[Any, Any] = {}
    rt = build_runtime(policy, states, 1, stores)
    rt.activate(states, stores)
    ap = policy.admission
    admission = Admission(ap.max_inflight, ap.max_queue)
    admission.configure(ap.max_inflight, ap.max_queue, ap.starvation_share, ap.enabled, ap.priority_reserve_pct, ap.standing())
    metrics = Metrics()
    observer = Observer(metrics)
    rp = policy.request_log
    request_log = RequestLog(MemoryLogStore(rp.size, rp.memory_max_bytes), rp, on_drop=lambda _r, _n: None)
    observer.request_log = request_log
    request_log.start()
    observer.start(policy)
    pipeline = Pipeline(RelayContext(_Pool(), metrics, admission=admission), observer)  # type: ignore[arg-type]
    key = KEY if "tenants:" in policy_yaml else None
    ids = itertools.count()

    async def one() -> None:
        i = next(ids)
        raw = orjson.dumps({"model": "gpt-test", "messages": [{"role": "user", "content": f"Say hello in one word {i}."}],
                            "max_tokens": 16, "temperature": 0})
        call, sink = Call(f"req-{i}", ENDPOINTS["chat"], raw, key, time.monotonic() + 30), RecordingSink()
        await pipeline.run(call, rt, sink)
        observer.done(call, rt)
        if sink.status not in (200, None):
            raise RuntimeError(f"request {i} answered {sink.status}: {sink.body!r}")

    async def many(count: int) -> None:
        for i in range(count):
            await one()
            if i % 256 == 255:
                await asyncio.sleep(0)  # the scripted upstream never suspends: let the loop run its timers (the log's writer)

    try:
        await many(min(2000, n))  # warm-up: the interpreter's specializations, the first allocations
        t0 = time.process_time()
        await many(n)
        return (time.process_time() - t0) / n * 1e6
    finally:
        await request_log.close()
        observer.close()
        if rt.quota is not None:
            await rt.quota.drain()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    settle_heap()
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    table, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115 (the access log writes to stdout)
    try:
        for _ in range(args.rounds):
            for name, policy_yaml in VARIANTS.items():
                runs[name].append(asyncio.run(_measure(policy_yaml, args.requests)))
    finally:
        sys.stdout.close()
        sys.stdout = table
    print(f"{'pipeline in process (no sockets)':42} {'us/request':>10} {'added':>8} {'vs first':>9}")
    first = prev = statistics.median(runs[next(iter(VARIANTS))])
    for name, xs in runs.items():
        us = statistics.median(xs)
        print(f"{name:42} {us:10.1f} {us - prev:8.1f} {us / first:9.2f}")
        prev = us


if __name__ == "__main__":
    main()
