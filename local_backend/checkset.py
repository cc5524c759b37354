"""A fixed set of short factual and instruction prompts with the answer each must contain.

Run greedily in every quantization mode (bench/local_model.py, tests/local_backend/
test_real_model.py): a mode may be the default only if it gets at least as many right as fp32.
Answers are matched by a pattern, never by exact wording: greedy text differs between dtypes.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .protocol import GenerationRequest

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["CHECKS", "Check", "CheckRun", "chat_prompt_ids", "prefix_agreement", "run_checks"]


@dataclass(frozen=True)
class Check:
    """A prompt and a regular expression (case-insensitive) that a right answer matches."""

    prompt: str
    expect: str

    def passes(self, answer: str) -> bool:
        return re.search(self.expect, answer, flags=re.IGNORECASE) is not None


CHECKS: tuple[Check, ...] = (
    Check("What is the capital of France?", r"\bparis\b"),
    Check("What is the capital of Japan?", r"\btokyo\b"),
    Check("What is the capital of Italy?", r"\brome\b"),
    Check("What is the capital of Germany?", r"\bberlin\b"),
    Check("What is 2 + 2?", r"\b(4|four)\b"),
    Check("How many days are in a week?", r"\b(7|seven)\b"),
    Check("How many hours are in a day?", r"\b(24|twenty-four)\b"),
    Check("How many minutes are in an hour?", r"\b(60|sixty)\b"),
    Check("How many legs does a spider have?", r"\b(8|eight)\b"),
    Check("How many continents are there on Earth?", r"\b(7|seven)\b"),
    Check("What color is the sky on a clear day?", r"\bblue\b"),
    Check("What is the opposite of hot?", r"\bcold\b"),
    Check("What planet do we live on?", r"\bearth\b"),
    Check("What is the largest ocean on Earth?", r"\bpacific\b"),
    Check("What language is spoken in Spain?", r"\bspanish\b"),
    Check("What do bees make?", r"\bhoney\b"),
    Check("Who wrote Romeo and Juliet?", r"\bshakespeare\b"),
    Check("Who painted the Mona Lisa?", r"\b(leonardo|da vinci)\b"),
    Check("Which planet is known as the Red Planet?", r"\bmars\b"),
    Check("What is the largest planet in our solar system?", r"\bjupiter\b"),
    Check("What is the tallest mountain in the world?", r"\beverest\b"),
    Check("At what temperature in Celsius does water boil?", r"\b100\b"),
    Check("What is the chemical symbol for water?", r"\bh2o\b|h₂o"),
    Check("What gas do plants absorb from the air?", r"carbon dioxide|\bco2\b|co₂"),
    Check("What is the fastest land animal?", r"\bcheetah"),
    Check("Which animal says moo?", r"\bcows?\b"),
    Check("What is the plural of mouse?", r"\bmice\b"),
    Check("Who was the first president of the United States?", r"\bwashington\b"),
    Check("Translate 'hello' into Spanish.", r"\bhola\b"),
    Check("Name a fruit that is yellow.", r"\b(banana|lemon|pineapple|mango)"),
    Check("Answer yes or no: is the Sun a star?", r"\byes\b"),
    Check("Write the word 'cat' in capital letters.", r"\bCAT\b"),
    Check("Complete the sentence: The sun rises in the", r"\beast\b"),
    Check("What is the main language spoken in Brazil?", r"\bportuguese\b"),
    Check("What do we call frozen water?", r"\bice\b"),
    Check("What is the square root of 16?", r"\b(4|four)\b"),
)


def chat_prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """Token ids of one user message through the chat template, ending with the assistant's turn."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


@dataclass(frozen=True)
class CheckRun:
    """One mode's greedy answers to CHECKS."""

    answers: list[str]
    tokens: list[tuple[int, ...]]

    @property
    def right(self) -> int:
        return sum(c.passes(a) for c, a in zip(CHECKS, self.answers, strict=True))

    def wrong(self) -> list[str]:
        return [c.prompt for c, a in zip(CHECKS, self.answers, strict=True) if not c.passes(a)]


async def run_checks(engine: Engine, max_tokens: int = 40) -> CheckRun:
    """Ask every check at once (greedy; batched answers equal one-at-a-time ones)."""

    async def ask(check: Check) -> tuple[str, tuple[int, ...]]:
        request = GenerationRequest(chat_prompt_ids(engine.tokenizer, check.prompt), max_tokens=max_tokens)
        deltas = [d async for d in engine.submit(request).deltas()]
        return "".join(d.text for d in deltas), deltas[-1].token_ids

    results = await asyncio.gather(*(ask(c) for c in CHECKS))
    return CheckRun([r[0] for r in results], [r[1] for r in results])


def prefix_agreement(reference: list[tuple[int, ...]], other: list[tuple[int, ...]]) -> float:
    """Share of the reference's tokens that ``other`` reproduces before its first differing token."""
    same = total = 0
    for ref, got in zip(reference, other, strict=True):
        total += len(ref)
        for a, b in zip(ref, got):
            if a != b:
                break
            same += 1
    return same / total if total else 1.0
