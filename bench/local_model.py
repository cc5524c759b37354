"""Benchmark the local model's engine per quantization mode on this machine (not a test).

Each mode runs in its own subprocess (so its RSS is its own) with a fixed torch thread count:
the check set's greedy answers (right, identical to fp32's, share of fp32's tokens reproduced
before the first difference), TTFT p50 for a 50-token prompt (a new question each time: cold but
for the chat template's pinned opening), decode tokens/s for one stream,
aggregate tokens/s for 1 and 8 concurrent streams of 64 tokens (TTFT included, as a client sees
it) and their ratio, the prefix cache (TTFT of a prompt with a ~1,000-token system prompt never
seen, then seen: the same prompt again), and the process's RSS. Speed figures are medians over
``--repeat`` rounds. A mode may name the kernel build: ``w8a16@avx2`` runs the AVX2 build (on an
AVX-512 machine too). When ``llama-cpp-python`` is installed, llama.cpp on the same GGUF gets a
row (optional: never a dependency; it serves one sequence at a time, so no 8-stream figure).

    flock /tmp/bench.lock .venv/bin/python bench/local_model.py [--quantize none w8a16 w8a16@avx2 w8a8 int8 int4] [--threads 1] [--repeat 3]

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

TTFT_PROMPT_TOKENS = 50
DECODE_TOKENS = 64
CONCURRENT = 8
# the acceptance check's system prompt: ~1,000 tokens of rules
SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and truthfully, and never reveal rule {i}." for i in range(60))
MODES = ("auto", "none", "int8", "w8a16", "w8a8", "int4")


def _rss_mb() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            fields[line.split(":")[0]] = int(line.split()[1]) / 1024
    return {"rss_mb": fields.get("VmRSS", 0.0), "peak_rss_mb": fields.get("VmHWM", 0.0)}


def _prompt_of(engine: Any, tokens: int, variant: int = 0) -> list[int]:
    """A chat prompt of exactly ``tokens`` tokens (a question padded with filler words); each ``variant``
    differs from its first word on, so it shares only the chat template's opening with the others
    (what a new question shares with earlier ones: its TTFT is a cold one, not the prefix cache's)."""
    from local_backend.checkset import chat_prompt_ids

    words = [f"Round {variant}: summarize", "in", "one", "sentence:", "the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog"]
    n = len(words)
    while len(chat_prompt_ids(engine.tokenizer, " ".join(words[: n + 1]))) <= tokens and n < 200:
        words.append(words[4 + n % 9])
        n += 1
    ids = chat_prompt_ids(engine.tokenizer, " ".join(words[:n]))
    return ids[:tokens] if len(ids) >= tokens else ids


async def _stream(engine: Any, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    """TTFT (s), seconds from first to last token, tokens."""
    from local_backend.protocol import GenerationRequest

    started = time.perf_counter()
    first = last = 0.0
    n = 0
    async for delta in engine.submit(GenerationRequest(ids, max_tokens=max_tokens, ignore_eos=True)).deltas():
        last = time.perf_counter()
        first = first or last
        n = delta.completion_tokens
    return first - started, last - first, n


async def _aggregate(engine: Any, prompts: list[list[int]]) -> float:
    started = time.perf_counter()
    results = await asyncio.gather(*(_stream(engine, p, DECODE_TOKENS) for p in prompts))
    return sum(r[2] for r in results) / (time.perf_counter() - started)


async def _measure(engine: Any, repeat: int) -> dict[str, Any]:
    from local_backend.checkset import chat_prompt_ids, run_checks

    checks = await run_checks(engine)
    ttft_ids = _prompt_of(engine, TTFT_PROMPT_TOKENS)
    variant = 0
    stories = [chat_prompt_ids(engine.tokenizer, f"Write a short story about a robot number {i}.") for i in range(CONCURRENT)]
    ttfts, decode, agg1, agg8, cold, warm = [], [], [], [], [], []
    same = True
    for r in range(repeat):
        ids = _system_prompt_ids(engine, f"Session {r} {time.time_ns()}. ")  # a prefix this engine never saw
        t_cold, _, _ = await _stream(engine, ids, 1)
        t_warm, _, _ = await _stream(engine, ids, 1)
        cold.append(t_cold)
        warm.append(t_warm)
        same = same and await _greedy(engine, ids) == await _greedy(engine, ids)
        for _ in range(3):
            variant += 1
            ttfts.append((await _stream(engine, _prompt_of(engine, TTFT_PROMPT_TOKENS, variant), 1))[0])
        _, span, n = await _stream(engine, stories[0], DECODE_TOKENS)
        decode.append((n - 1) / span)
        agg1.append(await _aggregate(engine, stories[:1]))
        agg8.append(await _aggregate(engine, stories))
    return {
        "right": checks.right,
        "answers": checks.answers,
        "tokens": [list(t) for t in checks.tokens],
        "wrong": checks.wrong(),
        "ttft_prompt_tokens": len(ttft_ids),
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "decode_tok_s": statistics.median(decode),
        "agg1_tok_s": statistics.median(agg1),
        "agg8_tok_s": statistics.median(agg8),
        "ratio8": statistics.median(a8 / a1 for a1, a8 in zip(agg1, agg8, strict=True)),
        "prefix_tokens": len(_system_prompt_ids(engine, "")),
        "prefix_cold_ms": statistics.median(cold) * 1000,
        "prefix_warm_ms": statistics.median(warm) * 1000,
        "prefix_same": same,
        "runs": {"ttft_ms": [t * 1000 for t in ttfts], "decode_tok_s": decode, "agg1_tok_s": agg1, "agg8_tok_s": agg8,
                 "prefix_cold_ms": [t * 1000 for t in cold], "prefix_warm_ms": [t * 1000 for t in warm]},
    }


def _system_prompt_ids(engine: Any, session: str) -> list[int]:
    messages = [{"role": "system", "content": session + SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(engine.tokenizer(text, add_special_tokens=False).input_ids)


async def _greedy(engine: Any, ids: list[int]) -> tuple[int, ...]:
    from local_backend.protocol import GenerationRequest

    return [d async for d in engine.submit(GenerationRequest(ids, max_tokens=12)).deltas()][-1].token_ids


def _one_mode(spec: str, threads: int, repeat: int) -> dict[str, Any]:
    from local_backend.boot import EngineSettings, build_engine

    quantize, _, isa = spec.partition("@")
    started = time.perf_counter()
    engine = build_engine(EngineSettings("smollm2-135m-instruct", quantize, "cpu", threads, 16, 256, kernel=isa or None), lambda _: None)
    out: dict[str, Any] = {"start_s": time.perf_counter() - started, "weights_mb": engine.model.nbytes() / 1e6,
                           "path": engine.plan.path if engine.plan else "-"}
    out.update(_rss_mb())
    try:
        out.update(asyncio.run(_measure(engine, repeat)))
    finally:
        engine.close()
    out["after"] = _rss_mb()
    return out


def _llama_cpp(threads: int, repeat: int) -> dict[str, Any] | None:
    """llama.cpp on the same GGUF (Q4_1), when llama-cpp-python is installed: the check set's greedy
    answers, TTFT for the 50-token prompt and one-stream decode, measured like the engine's rows."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from local_backend.checkset import CHECKS, chat_prompt_ids
    from local_backend.models import _smollm2_gguf

    gguf = _smollm2_gguf()
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)

    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from local_backend.models import _gguf_tokenizer_dir

    # the engine's tokenizer (the same vocabulary) for the chat template and the prompts' ids
    tok = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(_gguf_tokenizer_dir(gguf, lambda _: None))))

    def generate(ids: list[int], n: int) -> tuple[float, float, list[int]]:
        llm.reset()
        started = time.perf_counter()
        first = last = 0.0
        out: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            last = time.perf_counter()
            first = first or last
            if token == llm.token_eos() or len(out) >= n:
                break
            out.append(token)
        return first - started, last - first, out

    right, answers, tokens = 0, [], []
    for check in CHECKS:
        ids = chat_prompt_ids(tok.tokenizer, check.prompt)
        _, _, out = generate(ids, 40)
        text = llm.detokenize(out).decode(errors="replace")
        answers.append(text)
        tokens.append(out)
        right += check.passes(text)
    ttft_ids = _prompt_of(tok, TTFT_PROMPT_TOKENS)
    story = chat_prompt_ids(tok.tokenizer, "Write a short story about a robot number 0.")
    ttfts, decode, agg1 = [], [], []
    for _ in range(repeat):
        for i in range(3):
            ttfts.append(generate(_prompt_of(tok, TTFT_PROMPT_TOKENS, len(ttfts) + i + 1), 1)[0])
        t0 = time.perf_counter()
        first, span, out = generate(story, DECODE_TOKENS)
        decode.append((len(out) - 1) / span)
        agg1.append(len(out) / (time.perf_counter() - t0))
    return {
        "right": right, "answers": answers, "tokens": tokens, "ttft_prompt_tokens": len(ttft_ids),
        "ttft_p50_ms": statistics.median(ttfts) * 1000, "decode_tok_s": statistics.median(decode),
        "agg1_tok_s": statistics.median(agg1), "weights_mb": gguf.stat().st_size / 1e6, "path": "llama.cpp",
    }


def _kernel_scaling(threads: int) -> dict[str, dict[int, float]]:
    """Milliseconds of matmul per decode step (SmolLM2's 30 layers and LM head) at 1 and 8 rows, per weight format.

    Shows where the 8-stream ratio comes from: torch's weight-only kernels cost ~M times their
    one-row time (compute, not memory, bounds them on one core); our kernel's 8 rows cost less
    than 8 memory passes, more so at 8-bit activations.
    """
    import torch

    from local_backend.llama.native import ISAS, kernel
    from local_backend.llama.weights import DenseLinear, Int4Linear, Int8Linear, Q8Linear

    torch.set_num_threads(threads)
    shapes = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]  # (out, in, count)
    formats = {
        "fp32 dense": lambda w: DenseLinear(w),
        "bf16 dense": lambda w: DenseLinear(w.bfloat16()),
        "int8": lambda w: Int8Linear(w, torch.bfloat16),
        "int4": lambda w: Int4Linear(w, torch.bfloat16, 32),
    }
    for isa in ISAS:
        if kernel(isa) is not None:
            formats[f"int8 {isa} kernel, 16-bit activations (w8a16)"] = lambda w, isa=isa: Q8Linear(w, digits=2, isa=isa)
            formats[f"int8 {isa} kernel, 8-bit activations"] = lambda w, isa=isa: Q8Linear(w, digits=1, isa=isa)
    out: dict[str, dict[int, float]] = {}
    for name, make in formats.items():
        layers = [(make(torch.randn(n, k) * 0.02), k, count) for n, k, count in shapes]
        dtype = torch.float32 if name.startswith("fp32") or "kernel" in name else torch.bfloat16
        out[name] = {}
        for rows in (1, CONCURRENT):
            total = 0.0
            for linear, k, count in layers:
                x = torch.randn(rows, k).to(dtype)
                linear(x)
                samples = []
                for _ in range(5):
                    started = time.perf_counter()
                    for _ in range(10):
                        linear(x)
                    samples.append((time.perf_counter() - started) / 10)
                total += statistics.median(samples) * count
            out[name][rows] = total * 1000
    return out


def _agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    from local_backend.checkset import prefix_agreement

    same = sum(a == b for a, b in zip(ref, other, strict=True))
    return same, prefix_agreement([tuple(t) for t in ref], [tuple(t) for t in other])


def table(data: dict[str, Any]) -> str:
    from local_backend.checkset import CHECKS

    res, base = dict(data["results"]), data["results"].get("none")
    if data.get("llama_cpp"):
        res["llama.cpp (Q4_1 GGUF)"] = data["llama_cpp"]
    lines = [
        (
            f"| quantize | path | right /{len(CHECKS)} | same as fp32 | fp32 tokens kept | TTFT p50 ({TTFT_PROMPT_TOKENS} tok) "
            f"| decode tok/s (1 stream) | vs fp32 | agg 1 stream | agg {CONCURRENT} streams | {CONCURRENT}/1 "
            f"| prefix cold -> warm TTFT | weights MB | RSS MB (peak) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q, r in res.items():
        same, kept = _agreement(base["tokens"], r["tokens"]) if base else ("-", None)
        kept_s = f"{kept:.0%}" if kept is not None else "-"
        speedup = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        agg8 = f"{r['agg8_tok_s']:.1f} | {r['ratio8']:.1f}x" if "agg8_tok_s" in r else "- | -"
        prefix = (f"{r['prefix_cold_ms']:.0f} -> {r['prefix_warm_ms']:.0f} ms ({r['prefix_warm_ms'] / r['prefix_cold_ms']:.2f}x"
                  f"{'' if r['prefix_same'] else ', ANSWER DIFFERS'})") if "prefix_cold_ms" in r else "-"
        rss = f"{r['after']['rss_mb']:.0f} ({r['after']['peak_rss_mb']:.0f})" if "after" in r else "-"
        lines.append(
            f"| {q} | {r.get('path', '-')} | {r['right']} | {same} | {kept_s} "
            f"| {r['ttft_p50_ms']:.0f} ms | {r['decode_tok_s']:.1f} | {speedup} "
            f"| {r['agg1_tok_s']:.1f} | {agg8} | {prefix} | {r['weights_mb']:.0f} | {rss} |"
        )
    scaling = data.get("kernel_ms")
    if scaling:
        lines += ["", f"Matmul time per decode step (30 layers + LM head, {data['threads']} thread), ms:", "",
                  f"| weights | 1 row | {CONCURRENT} rows | ratio |", "|---|---|---|---|"]
        for name, ms in scaling.items():
            one, many = ms[1] if 1 in ms else ms["1"], ms[CONCURRENT] if CONCURRENT in ms else ms[str(CONCURRENT)]
            lines.append(f"| {name} | {one:.1f} | {many:.1f} | {many / one:.1f}x |")
    prefix_tokens = next((r["prefix_tokens"] for r in data["results"].values() if "prefix_tokens" in r), None)
    if prefix_tokens:
        lines.append(f"\nprefix cold -> warm: a {prefix_tokens}-token prompt (system prompt of ~1,000 tokens) never seen, then again.")
    return "\n".join(lines)


def _mode(text: str) -> str:
    quantize, _, isa = text.partition("@")
    if quantize not in MODES or isa not in ("", "avx512_vnni", "avx2"):
        raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(MODES)}, optionally @avx512_vnni or @avx2")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", nargs="+", type=_mode, default=["none", "w8a16", "w8a16@avx2", "w8a8", "int8", "int4"],
                        help="modes, each optionally with a kernel build: w8a16@avx2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (fixed, so runs compare)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per speed figure; medians are reported")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: measure one mode, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one_mode(args.one, args.threads, args.repeat)))
        return
    data: dict[str, Any] = {"threads": args.threads, "repeat": args.repeat, "results": {}}
    for quantize in args.quantize:
        cmd = [sys.executable, __file__, "--one", quantize, "--threads", str(args.threads), "--repeat", str(args.repeat)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        data["results"][quantize] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"# {quantize}: done", file=sys.stderr, flush=True)
    data["kernel_ms"] = _kernel_scaling(args.threads)
    data["llama_cpp"] = _llama_cpp(args.threads, args.repeat)
    Path("bench/results").mkdir(parents=True, exist_ok=True)
    Path("bench/results/local_model.json").write_text(json.dumps(data, indent=2))
    print(table(data))


if __name__ == "__main__":
    main()
