"""The engine's request/response types, free of torch so the server can start listening first.

The asyncio side submits a GenerationRequest and iterates the Sequence it gets back; the
engine thread pushes Deltas into it with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

__all__ = [
    "GREEDY_BELOW_TEMPERATURE",
    "Delta",
    "EngineClosed",
    "GenerationRequest",
    "QueueFull",
    "SamplingParams",
    "Sequence",
    "TokenLogprob",
    "TooLong",
]


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later."""


class EngineClosed(RuntimeError):
    """The engine stopped before the request finished."""


# Temperatures below this decode greedily (vLLM's _SAMPLING_EPS): logits / 1e-45 overflow to inf, and
# nothing this close to 0 samples differently from argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5


class TooLong(ValueError):
    """The request's prompt and max_tokens need more KV cache than the engine may ever hold for one sequence."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` (or below GREEDY_BELOW_TEMPERATURE) means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # OpenAI's penalties, on the counts of the tokens generated so far: logit -= count x frequency
    # + (count > 0) x presence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # None: no log probabilities; k >= 0: each generated token's, with the k likeliest alternatives.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before a token is picked (penalties or a bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability under the model, and the ``top`` likeliest (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate: prompt token ids and how to decode after them."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks)
    # vLLM's `cache_salt`: requests share prefix-cache blocks only with requests of the same salt
    # (a caller cannot time another's cached prompt); "" shares with every unsalted request.
    cache_salt: str = ""


@dataclass(frozen=True)
class Delta:
    """A piece of output. The last one of a sequence carries ``finish_reason`` (stop|length) and every generated token id."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...] = ()
    # The log probabilities of the tokens generated since the previous delta, when asked for.
    logprobs: tuple[TokenLogprob, ...] = ()


class Sequence:
    """The asyncio side of one request: iterate its deltas, or cancel it."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.submitted_at = time.perf_counter()
        self.cancelled = False  # set on the loop thread, read by the engine thread (a plain bool is atomic)
        self.overtaken = 0  # engine thread: later requests admitted ahead of this one while it did not fit
        self._loop = loop
        self._queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()

    def cancel(self) -> None:
        """Stop generating; the engine frees the slot before its next step."""
        self.cancelled = True

    def deliver(self, item: Delta | BaseException) -> None:
        """Hand a delta (or the error that ended the sequence) to the asyncio side; engine thread only."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancelled = True

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas until the one with a finish reason; raise if the engine failed."""
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
