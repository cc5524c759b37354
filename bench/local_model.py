"""Benchmark the local model engine on this machine (not a test).

For each quantization: greedy answers on a fixed question set (how many are right, how many
equal fp32's word for word), TTFT and decode tokens/s at concurrency 1 for a ~50-token prompt,
and aggregate tokens/s at concurrency 1, 4, 8, 16 with continuous batching and one at a time
(the same engine with max_batch=1). Optionally, the latency of a separate aiohttp process (a
stand-in for the gateway) while the model is busy.

    flock /tmp/bench.lock .venv/bin/python bench/local_model.py [--quantize none int8 int4] [--threads N]

Prints a markdown table; writes JSON to bench/results/local_model.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_backend.boot import EngineSettings, build_engine  # noqa: E402
from local_backend.engine import Engine  # noqa: E402
from local_backend.protocol import GenerationRequest  # noqa: E402

# Easy questions and a word any right answer contains.
QUESTIONS = [
    ("What is the capital of France?", ("paris",)),
    ("What is 2 + 2?", ("is 4", "= 4", "four")),
    ("What is the largest planet in our solar system?", ("jupiter",)),
    ("Who wrote Romeo and Juliet?", ("shakespeare",)),
    ("How many legs does a spider have?", ("8 legs", "eight legs")),
    ("What color is the sky on a clear day?", ("blue",)),
    ("At what temperature in Celsius does water freeze?", (" 0°", " 0 degrees", "zero")),
    ("How many days are in a week?", ("7 day", "seven day")),
    ("What is the capital of Japan?", ("tokyo",)),
    ("What is the opposite of hot?", ("cold",)),
    ("Who was the first president of the United States?", ("washington",)),
    ("What is the chemical symbol for water?", ("h2o", "h₂o")),
]
PADDING = " Please answer in one short sentence, and do not add any extra explanation or commentary."
DECODE_TOKENS = 64
CONCURRENCY = (1, 4, 8, 16)


def _ids(engine: Engine, question: str) -> list[int]:
    tok = engine.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False).input_ids)


async def _one(engine: Engine, request: GenerationRequest) -> tuple[str, float, float, int]:
    """Text, TTFT (s), time from first to last token (s), tokens."""
    started = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    n = 0
    async for delta in engine.submit(request).deltas():
        now = time.perf_counter()
        if not first:
            first = now
        last, n = now, delta.completion_tokens
        parts.append(delta.text)
    return "".join(parts), first - started, last - first, n


async def quality(engine: Engine) -> list[str]:
    return [(await _one(engine, GenerationRequest(_ids(engine, q), max_tokens=48)))[0] for q, _ in QUESTIONS]


async def single_stream(engine: Engine) -> dict[str, float]:
    """TTFT p50 and decode tokens/s at concurrency 1, ~50-token prompts, 64 tokens each."""
    ttfts, rates, lengths = [], [], []
    for q, _ in QUESTIONS[:6]:
        ids = _ids(engine, q + PADDING)
        _, ttft, span, n = await _one(engine, GenerationRequest(ids, max_tokens=DECODE_TOKENS, ignore_eos=True))
        ttfts.append(ttft)
        rates.append((n - 1) / span)
        lengths.append(len(ids))
    return {
        "prompt_tokens": statistics.median(lengths),
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "decode_tok_s": statistics.median(rates),
    }


async def aggregate(engine: Engine, concurrency: int) -> float:
    """Generated tokens per second with `concurrency` requests in flight (each 64 tokens)."""
    rounds = 2 if concurrency == 1 else 1
    prompts = [_ids(engine, QUESTIONS[i % len(QUESTIONS)][0] + PADDING) for i in range(concurrency)]
    started = time.perf_counter()
    total = 0
    for _ in range(rounds):
        results = await asyncio.gather(
            *(_one(engine, GenerationRequest(p, max_tokens=DECODE_TOKENS, ignore_eos=True)) for p in prompts)
        )
        total += sum(r[3] for r in results)
    return total / (time.perf_counter() - started)


_PROBE_SERVER = """
import sys
from aiohttp import web
async def ok(request): return web.Response(text="ok")
app = web.Application(); app.router.add_get("/", ok)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


async def _probe_latency(port: int, n: int = 200) -> dict[str, float]:
    import aiohttp

    samples = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            t = time.perf_counter()
            async with session.get(f"http://127.0.0.1:{port}/") as resp:
                await resp.read()
            samples.append((time.perf_counter() - t) * 1000)
            await asyncio.sleep(0.005)
    samples.sort()
    return {"p50_ms": samples[len(samples) // 2], "p99_ms": samples[int(len(samples) * 0.99)]}


async def gateway_probe(engine: Engine) -> dict[str, Any]:
    """Latency of another aiohttp process, idle vs while the engine decodes 16 sequences."""
    port = 18999
    proc = subprocess.Popen([sys.executable, "-c", _PROBE_SERVER, str(port)])
    try:
        await asyncio.sleep(1.5)
        idle = await _probe_latency(port)
        prompts = [_ids(engine, q + PADDING) for q, _ in QUESTIONS[:16]]
        load = asyncio.gather(*(_one(engine, GenerationRequest(p, max_tokens=256, ignore_eos=True)) for p in prompts * 2))
        await asyncio.sleep(1.0)
        busy = await _probe_latency(port)
        await load
    finally:
        proc.terminate()
        proc.wait()
    return {"idle": idle, "busy": busy}


def _build(quantize: str, threads: int | None, max_batch: int) -> Engine:
    return build_engine(EngineSettings("smollm2-135m-instruct", quantize, "cpu", threads, max_batch, 256), lambda _: None)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"threads": args.threads, "results": {}}
    reference: list[str] | None = None
    for quantize in args.quantize:
        engine = _build(quantize, args.threads, 16)
        row: dict[str, Any] = {}
        answers = await quality(engine)
        reference = reference if reference is not None else answers if quantize == "none" else None
        row["correct"] = sum(any(k in a.lower() for k in keys) for a, (_, keys) in zip(answers, QUESTIONS, strict=True))
        row["same_as_fp32"] = None if reference is None else sum(a == b for a, b in zip(answers, reference, strict=True))
        row["answers"] = answers
        row.update(await single_stream(engine))
        row["batched_tok_s"] = {c: await aggregate(engine, c) for c in CONCURRENCY}
        if args.gateway_probe and quantize == args.quantize[0]:
            row["gateway_probe"] = await gateway_probe(engine)
        engine.close()
        one = _build(quantize, args.threads, 1)
        row["one_at_a_time_tok_s"] = {c: await aggregate(one, c) for c in CONCURRENCY if c in (1, 8)}
        one.close()
        out["results"][quantize] = row
        print(f"# {quantize}: done", file=sys.stderr, flush=True)
    return out


def table(data: dict[str, Any]) -> str:
    res = data["results"]
    base = res.get("none")
    lines = [
        "| quantize | right /12 | same as fp32 | prompt tok | TTFT p50 | decode tok/s (c=1) | vs fp32 | agg c=1 | c=4 | c=8 | c=16 | c=8/c=1 | c=16/c=1 | one-at-a-time c=8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q, r in res.items():
        b = r["batched_tok_s"]
        speed = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        lines.append(
            f"| {q} | {r['correct']} | {r['same_as_fp32'] if r['same_as_fp32'] is not None else '-'} | {r['prompt_tokens']:.0f} "
            f"| {r['ttft_p50_ms']:.0f} ms | {r['decode_tok_s']:.1f} | {speed} "
            f"| {b[1]:.1f} | {b[4]:.1f} | {b[8]:.1f} | {b[16]:.1f} | {b[8] / b[1]:.1f}x | {b[16] / b[1]:.1f}x "
            f"| {r['one_at_a_time_tok_s'][8]:.1f} |"
        )
    for q, r in res.items():
        if "gateway_probe" in r:
            p = r["gateway_probe"]
            lines.append(
                f"\nAnother aiohttp process (gateway stand-in), {q}: idle p50 {p['idle']['p50_ms']:.2f} ms / p99 {p['idle']['p99_ms']:.2f} ms; "
                f"model decoding 16 sequences: p50 {p['busy']['p50_ms']:.2f} ms / p99 {p['busy']['p99_ms']:.2f} ms"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", nargs="+", default=["none", "int8", "int4"], choices=["none", "int8", "int4"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores - 1)")
    parser.add_argument("--gateway-probe", action="store_true", help="also measure a separate aiohttp process under model load")
    args = parser.parse_args()
    data = asyncio.run(run(args))
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/local_model.json").write_text(json.dumps(data, indent=2))
    print(table(data))


if __name__ == "__main__":
    main()
