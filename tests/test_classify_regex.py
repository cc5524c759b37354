"""The classifier's arithmetic pattern never starts inside a run of digits: trying each start
backtracked through the whole run, so a 1,400-digit prompt (the window the lexical scorer reads)
held the event loop ~70 ms a request, on /v1/chat/completions and on /v1/route/explain alike
(review helper's repro). The pattern finds the same chains as before."""

from __future__ import annotations

import re
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.classify import features

# The pattern as it was: what the shipped weights were fitted on.
_BEFORE = re.compile(r"\d+(?:\.\d+)?(?:\s*[-+*/×÷^x]\s*\d+(?:\.\d+)?)+")


@settings(max_examples=3000, deadline=None)
@given(st.text(alphabet="0123456789.+-*/x× ^ab\n", max_size=40))
def test_the_arithmetic_pattern_finds_the_same_chains_as_before(text: str) -> None:
    assert features._ARITH_RE.findall(text) == _BEFORE.findall(text)


def _cost_ms(text: str) -> float:
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        features.extract(body)
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def test_a_run_of_digits_costs_about_what_as_much_text_does() -> None:
    """Measured against ordinary text of the same length in the same run (the ratio, not a time):
    ~9x before, ~1x after."""
    digits, words = _cost_ms("1" * 1400), _cost_ms(("lorem ipsum " * 120)[:1400])
    assert digits < 3 * words + 0.5, (digits, words)
