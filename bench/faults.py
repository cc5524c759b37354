"""Every fault row of the rescue suite, timed: the gateway as configured by default (continuation,
cold and stall deadlines, a route `retry`, `context_fallbacks`) against the old behaviour (all of
that off), side by side.

    python bench/faults.py [--only SUBSTRING]

Primary `p` and fallback `s` are fake upstreams in this process (deterministic 24-word answers,
5 ms between tokens); the gateway runs in this process too, on loopback. For each row: whether
the client got the complete answer (byte-identical to an unfaulted one), the time to it (or to
the error), who answered, and the attempts each backend saw. The slow rows wait for the old
deadlines (first_token_ms 30 s, idle_ms 60 s) and the outage row lasts two minutes or more: a full
run takes about six minutes.

The row "down 60 s, then healthy" is the fault suite's flapping primary: `p` answers 500 for
60 s, a request every 250 ms, then `p` is healthy again; "s" is the time from its recovery to
the first answer from `p` again (inf: not within 60 s), "p/s" the requests each backend saw
(request probes included; a line after the table splits them). Its old column also has no
request probes (model-list probes only, as before them).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gateway.web.app import create_app  # noqa: E402
from tests.fake_upstream import Behaviour, FakeUpstream  # noqa: E402

N = 24
ANSWER = "".join(f"w{i} " for i in range(N))
MSG = [{"role": "user", "content": "count"}]
CONTEXT_LENGTH = orjson.dumps({"error": {"message": "This model's maximum context length is 8192 tokens.",
                                         "type": "invalid_request_error", "code": "context_length_exceeded"}}).decode()
CONTENT_FILTER = orjson.dumps({"error": {"message": "filtered by the content policy", "type": "invalid_request_error",
                                         "code": "content_filter"}}).decode()
RETRY = {"attempts": 2, "on": [429, 500, 502, 503, "reset"], "max_wait_ms": 3000}


@dataclass(frozen=True)
class Row:
    name: str
    p: dict[str, Any]
    stream: bool = True
    s: dict[str, Any] = field(default_factory=dict)
    s_prefill: bool = True
    context: bool = False  # p says context length: s is the larger-context fallback
    warm_s: bool = False  # s has latency history (20 answers) before the faulty request
    requests: int = 1
    down_s: float = 0.0  # > 0: p has the fault this long (a request every 250 ms), then is healthy
    health: dict[str, Any] = field(default_factory=lambda: {"probe_interval_ms": 600_000})


ROWS = [
    Row("429 Retry-After: 2 (once)", {"mode": "error_429", "retry_after_s": 2, "fault_count": 1}, stream=False),
    Row("429 without Retry-After (once)", {"mode": "error_429", "fault_count": 1}, stream=False),
    Row("500 once", {"mode": "error_500", "fault_count": 1}, stream=False),
    Row("500 persistent", {"mode": "error_500"}, stream=False),
    Row("connection reset before headers", {"mode": "reset"}, stream=False),
    # Not streamed: a stream's headers (x-gateway-backend) go out with its first heartbeat, at 5 s.
    Row("silent upstream (no latency history)", {"mode": "hang"}, stream=False),
    Row("slow first token 20 s (fallback warm)", {"ttft_ms": 20_000}, stream=False, warm_s=True),
    Row("stream cut mid-answer", {"mode": "cut", "fail_after": 8, "fault_count": 1}),
    Row("stream stalls mid-answer", {"mode": "stall_mid", "fail_after": 8, "fault_count": 1}),
    Row("error event mid-answer", {"mode": "error_event", "fail_after": 8, "fault_count": 1}),
    Row("malformed chunk", {"mode": "malformed", "fail_after": 4}),
    Row("missing [DONE]", {"mode": "no_done"}),
    Row("context length exceeded", {"mode": "error_400", "error_body": CONTEXT_LENGTH}, stream=False, context=True),
    Row("content filter", {"mode": "error_400", "error_body": CONTENT_FILTER}, stream=False),
    Row("cut, fallback rejects prefill", {"mode": "cut", "fail_after": 8, "fault_count": 1}, s={"prefill": False}, s_prefill=False),
    Row("flapping primary (20 requests)", {"mode": "disconnect", "fail_after": 6, "flap_ms": 150, "itl_ms": 2}, requests=20),
    # Default health (model-list probes every 5 s), as the fault suite runs it.
    Row("flapping primary: down 60 s, then healthy", {"mode": "error_500"}, stream=False, down_s=60.0, health={}),
]
OUTAGE_GAP_S = 0.25  # between two requests of a down_s row
OUTAGE_AFTER_S = 60.0  # how long a down_s row waits for p to answer again after its recovery


def _policy(p: FakeUpstream, s: FakeUpstream, row: Row, rescue: bool) -> dict[str, Any]:
    route: dict[str, Any] = {"backends": ["p"] if row.context else ["p", "s"], "strategy": "ordered"}
    if rescue:
        route["retry"] = RETRY
        if row.context:
            route["context_fallbacks"] = ["s"]
    policy: dict[str, Any] = {
        "version": 1,
        "cache": {"enabled": False},
        "health": dict(row.health),
        "backends": {"p": {"url": p.url, "models": ["m"]}, "s": {"url": s.url, "models": ["m", "warm"], "prefill": row.s_prefill}},
        "models": {"m": route, "warm": {"backends": ["s"]}},
    }
    if not rescue:  # the old behaviour: no continuation, fixed first-token and stall deadlines, no request probes
        policy["routing"] = {"continuation": False, "cold_first_token_ms": 30_000, "cold_idle_ms": 60_000, "deadline_floor_ms": 30_000}
        policy["health"]["recovery_probe_interval_ms"] = 0
    return policy


async def _ask(client: openai.AsyncOpenAI, model: str, stream: bool) -> tuple[str, str | None, str | None]:
    """(text, backend, error)"""
    try:
        if not stream:
            raw = await client.chat.completions.with_raw_response.create(model=model, messages=MSG)
            return raw.parse().choices[0].message.content or "", raw.headers.get("x-gateway-backend"), None
        raw = await client.chat.completions.with_raw_response.create(model=model, messages=MSG, stream=True)
        text = ""
        try:
            async for chunk in raw.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
        except openai.APIError as exc:
            return text, raw.headers.get("x-gateway-backend"), f"error event: {exc.message[:40]}"
        return text, raw.headers.get("x-gateway-backend"), None
    except openai.APIStatusError as exc:
        return "", None, f"HTTP {exc.status_code}"


async def _run(row: Row, rescue: bool, tmp: Path) -> dict[str, Any]:
    p = await FakeUpstream(Behaviour(tokens=N, itl_ms=5), name="p").start()
    s = await FakeUpstream(Behaviour(tokens=N, itl_ms=5, **row.s), name="s").start()
    path = tmp / f"policy-{rescue}.yaml"
    path.write_text(yaml.safe_dump(_policy(p, s, row, rescue)))
    runner = web.AppRunner(create_app(path), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120)
    try:
        if row.warm_s:
            for _ in range(20):
                await _ask(client, "warm", True)
        if row.down_s:
            return await _outage(row, client, p, s, port)
        p.set(**row.p)
        calls = (len(p.stats.calls), len(s.stats.calls))
        t0 = time.perf_counter()
        complete, answered, errors = 0, [], []
        for _ in range(row.requests):
            text, backend, err = await _ask(client, "m", row.stream)
            complete += text == ANSWER and err is None
            answered.append(backend or "-")
            if err:
                errors.append(err)
        elapsed = time.perf_counter() - t0
        return {
            "complete": f"{complete}/{row.requests}",
            "seconds": elapsed,
            "by": ",".join(sorted(set(answered))),
            "p": len(p.stats.calls) - calls[0],
            "s": len(s.stats.calls) - calls[1],
            "error": errors[0] if errors else "",
        }
    finally:
        await client.close()
        await runner.cleanup()
        await p.stop()
        await s.stop()


async def _outage(row: Row, client: openai.AsyncOpenAI, p: FakeUpstream, s: FakeUpstream, port: int) -> dict[str, Any]:
    """A down_s row: p faulty for row.down_s, then healthy; "seconds" is from its recovery to the
    first answer from p (inf when none came within OUTAGE_AFTER_S)."""
    p.set(**row.p)
    calls = (len(p.stats.calls), len(s.stats.calls))
    lists = p.stats.by_path.get("/v1/models", 0)
    t0 = time.perf_counter()
    recovered: float | None = None
    back_s = math.inf
    complete = sent = 0
    answered: set[str] = set()
    errors: list[str] = []
    while recovered is None or time.perf_counter() - recovered < OUTAGE_AFTER_S:
        if recovered is None and time.perf_counter() - t0 >= row.down_s:
            p.set(mode="ok")
            recovered = time.perf_counter()
        text, backend, err = await _ask(client, "m", row.stream)
        sent += 1
        complete += text == ANSWER and err is None
        answered.add(backend or "-")
        if err:
            errors.append(err)
        if recovered is not None and backend == "p":
            back_s = time.perf_counter() - recovered
            break
        await asyncio.sleep(OUTAGE_GAP_S)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
            metrics = await r.text()

    def total(prefix: str) -> int:
        return int(sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)))

    seen = len(p.stats.calls) - calls[0]
    list_probes = p.stats.by_path.get("/v1/models", 0) - lists  # GET /models: not in p.stats.calls
    request_probes = total('gateway_probes_total{backend="p",') - list_probes
    return {
        "complete": f"{complete}/{sent}",
        "seconds": back_s,
        "by": ",".join(sorted(answered)),
        "p": seen,
        "s": len(s.stats.calls) - calls[1],
        "error": errors[0] if errors else "",
        "split": {
            "user attempts": seen - request_probes,
            "request probes": request_probes,
            "model-list probes": list_probes,
            "ejections": total('gateway_backend_ejections_total{backend="p"}'),
            "retries": total('gateway_relay_events_total{event="retry",'),
        },
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="run the rows whose name contains this")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the relay's INFO/WARNING lines would bury the table
    rows = [r for r in ROWS if args.only.lower() in r.name.lower()]
    head = f"{'fault':44} | {'rescue: answer':>14} {'s':>6} {'by':>5} {'p/s':>5} | {'old: answer':>11} {'s':>6} {'by':>5} {'p/s':>5}  old error"
    print(head)
    print("-" * len(head))
    totals = {True: 0, False: 0}
    splits: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        for row in rows:
            new = await _run(row, True, Path(d))
            old = await _run(row, False, Path(d))
            for key, r in ((True, new), (False, old)):
                n = r["complete"].split("/")[1]
                totals[key] += r["complete"] == f"{n}/{n}"
                if "split" in r:
                    figures = ", ".join(f"{v} {k}" for k, v in r["split"].items())
                    splits.append(f"{row.name} ({'rescue' if key else 'old'}): p saw {figures}")
            print(f"{row.name:44} | {new['complete']:>14} {new['seconds']:6.2f} {new['by']:>5} {new['p']:>2}/{new['s']:<2} | "
                  f"{old['complete']:>11} {old['seconds']:6.2f} {old['by']:>5} {old['p']:>2}/{old['s']:<2}  {old['error']}", flush=True)
    print(f"\nrows with every answer complete: rescue {totals[True]}/{len(rows)}, old behaviour {totals[False]}/{len(rows)}"
          " (content filter: the backend's 400 is the right answer in both)")
    for line in splits:
        print(line)


if __name__ == "__main__":
    asyncio.run(main())
