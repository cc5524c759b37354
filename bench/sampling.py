"""Benchmark the local model's token choice per decode step (not a test): the engine thread's cost
of picking the next token for a batch of 8 rows, greedy, sampled, and sampled with top_p, against
the previous sampler (a full sort of the vocabulary for top_p, torch.multinomial to draw) measured
in the same run.

The logits are SmolLM2-135M-Instruct's own (49,152 tokens) for 8 different chat prompts, so the
nucleus sizes are a real model's. Every sampled row of a batch pays its own row's choice, on the
one engine thread, before any row's next token: the step's cost is every batch-mate's latency.

    flock /tmp/bench.lock .venv/bin/python bench/sampling.py [--steps 200] [--threads 1]

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from local_backend.checkset import chat_prompt_ids  # noqa: E402
from local_backend.models import DEFAULT_MODEL, load_model  # noqa: E402
from local_backend.protocol import SamplingParams  # noqa: E402
from local_backend.sampling import choose_tokens  # noqa: E402

ROWS = 8
PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?", "Tell me a story about a dragon.",
           "List three uses of copper.", "How do I boil an egg?", "Describe your ideal weekend.",
           "Why is the sky blue?", "Suggest a name for a cat."]


def _previous(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampler before: softmax, a full sort for top_p, torch.multinomial to draw."""
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        drop[0] = False
        pick = torch.multinomial(sorted_probs.masked_fill(drop, 0.0), 1, generator=generator)
        return int(order[pick].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def _logits() -> torch.Tensor:
    loaded = load_model(DEFAULT_MODEL, device="cpu", dtype=torch.float32, progress=lambda _: None)
    rows = []
    with torch.inference_mode():
        for prompt in PROMPTS[:ROWS]:
            ids = torch.tensor([chat_prompt_ids(loaded.tokenizer, prompt)])
            rows.append(loaded.model(ids).logits[0, -1])
    return torch.stack(rows)


def _per_step(step: Callable[[], object], steps: int) -> float:
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per row of the table")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the engine's default on this machine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logits = _logits()
    print(f"{ROWS} rows of SmolLM2-135M-Instruct logits ({logits.shape[-1]} tokens), {args.threads} torch thread(s), "
          f"{args.steps} steps each\n")
    print("| the batch's rows | now: ms a step | before: ms a step | before / now |")
    print("|---|---:|---:|---:|")
    for label, params in (("greedy", SamplingParams()), ("temperature 1", SamplingParams(temperature=1.0)),
                          ("temperature 0.7, top_p 0.9", SamplingParams(temperature=0.7, top_p=0.9)),
                          ("temperature 1, top_p 0.95", SamplingParams(temperature=1.0, top_p=0.95))):
        gens = [torch.Generator().manual_seed(i) for i in range(ROWS)]
        rows = [params] * ROWS
        now = _per_step(lambda: choose_tokens(logits, rows, list(gens)), args.steps)
        if params.greedy:
            before = now  # unchanged: one argmax for the batch
        else:
            before = _per_step(lambda: [_previous(logits[r], params, gens[r]) for r in range(ROWS)], args.steps)
        print(f"| {ROWS} x {label} | {now:.2f} | {before:.2f} | {before / now:.1f}x |")


if __name__ == "__main__":
    main()
