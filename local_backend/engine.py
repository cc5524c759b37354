"""The continuous-batching engine: one thread runs decode steps over every active sequence.

Between steps it admits waiting requests (each prefilled alone into a free row of the
preallocated KV cache) and drops finished or cancelled ones, so concurrent requests share each
forward pass. Every kernel computes each row on its own, so a request's tokens do not depend on
its batch-mates. Tokens reach asyncio through ``loop.call_soon_threadsafe``; nothing here
blocks the loop. On CPU each forward pass runs on the thread count a ``ThreadPicker`` chooses
from live timings (threads.py); the tokens are the same on any count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .llama import LeanLlama
from .protocol import Delta, EngineClosed, GenerationRequest, QueueFull, Sequence
from .sampling import choose_tokens, make_generator
from .stats import EngineStats
from .textstream import TextAssembler
from .threads import ThreadPicker

__all__ = ["Engine"]


@dataclass(eq=False)
class _Slot:
    """Engine-thread state of one admitted sequence."""

    seq: Sequence
    assembler: TextAssembler
    generator: torch.Generator | None
    max_tokens: int
    last_token: int = -1
    generated: int = 0
    tokens: list[int] = field(default_factory=list)
    done: bool = field(default=False)


class Engine:
    """Owns the model and the engine thread. Create, ``start()``, ``submit()``, ``close()``."""

    def __init__(
        self,
        model: LeanLlama,
        tokenizer: Any,
        *,
        eos_token_ids: Iterable[int] = (),
        max_batch: int = 16,
        max_queue: int = 64,
        prefill_budget_tokens: int = 512,
        threads: ThreadPicker | None = None,
    ) -> None:
        self.model = model
        self.threads = threads  # CPU: each pass's thread count; None leaves torch's setting alone
        self.tokenizer = tokenizer
        self.device = model.device
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_budget_tokens = prefill_budget_tokens
        self.context_length = model.context_length
        self.stop_token_ids = self._stop_token_ids(eos_token_ids)
        self.stats = EngineStats()
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._active: list[_Slot] = []  # slot i owns cache row i
        if self.device.type == "cuda":  # a static cache, decode steps replayed as CUDA graphs
            self._cache = model.new_cache(max_batch, capacity=model.context_length)
            model.use_cuda_graphs(self._cache)
        else:
            self._cache = model.new_cache(max_batch)
        self._prefix_ids: list[int] = []
        self._prefix_kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._closing = False
        self._thread: threading.Thread | None = None
        self._torch_threads = 0  # what this engine last set on its own thread

    def _stop_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        ids: set[int] = set(eos_token_ids)
        for token in (self.tokenizer.eos_token, "<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token) if token else None
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return frozenset(ids)

    def warm_up(self, prompt_ids: list[int]) -> None:
        """Run two prefills and one two-row decode step, so the first request pays no one-time setup."""
        with torch.inference_mode():
            ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
            for _ in range(2):
                self.model.prefill(ids, self._cache, self._cache.add_row(len(prompt_ids)))
            self.model.decode(torch.zeros(2, dtype=torch.long, device=self.device), self._cache)
            self._cache.clear()

    def cache_prefix(self, ids: list[int]) -> None:
        """Keep the K/V of ``ids`` (the chat template's opening, e.g. its default system prompt) for
        prompts that start with them: prefill then computes only the rest. Call before ``start()``.

        The prefix is computed once, so every request that uses it gets the same K/V whatever else runs.
        """
        with torch.inference_mode():
            row = self._cache.add_row(len(ids))
            self.model.prefill(torch.tensor(ids, dtype=torch.long, device=self.device), self._cache, row)
            self._prefix_kv = self._cache.snapshot(row, len(ids))
            self._prefix_ids = list(ids)
            self._cache.clear()

    # ---- asyncio side -------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread."""
        self._thread = threading.Thread(target=self._run, name="local-backend-engine", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; pending requests fail with EngineClosed."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._cond:
            for seq in self._waiting:
                seq.deliver(EngineClosed("the engine stopped"))
            self._waiting.clear()

    def submit(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop | None = None) -> Sequence:
        """Queue a request; raise QueueFull when the waiting queue is at its bound."""
        if not request.prompt_ids:
            raise ValueError("empty prompt")
        seq = Sequence(request, loop or asyncio.get_running_loop())
        with self._cond:
            if self._closing:
                raise EngineClosed("the engine is stopping")
            if len(self._waiting) >= self.max_queue:
                # Requests cancelled while waiting give their place back now, not when the engine gets to them.
                live = [s for s in self._waiting if not s.cancelled]
                self._count_cancelled(len(self._waiting) - len(live))
                self._waiting = deque(live)
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(seq)
            self.stats.set_load(len(self._waiting), len(self._active))
            self._cond.notify()
        return seq

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            self._start_thread_pools()
            while True:
                with self._cond:
                    while not self._closing and not self._active and not self._waiting:
                        self._cond.wait()
                    if self._closing:
                        break
                    admitted = self._take_waiting()
                try:
                    self._prefill(admitted)
                    self._drop_done()
                    if self._active:
                        self._decode_step()
                        self._drop_done()
                except Exception as exc:  # a failed forward pass fails its batch, not the engine
                    for slot in self._active:
                        slot.seq.deliver(exc)
                    self._active = []
                    self._cache.clear()
                self.stats.set_load(len(self._waiting), len(self._active))
        for slot in self._active:
            slot.seq.deliver(EngineClosed("the engine stopped"))
        self._active = []
        self._cache.clear()

    def _take_waiting(self) -> list[Sequence]:
        """Pop waiting requests that fit the batch and this step's prefill budget (at least one)."""
        taken: list[Sequence] = []
        budget = self.prefill_budget_tokens
        while self._waiting and len(self._active) + len(taken) < self.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                self._count_cancelled(1)
                continue
            if taken and len(seq.request.prompt_ids) > budget:
                break
            budget -= len(seq.request.prompt_ids)
            taken.append(self._waiting.popleft())
        return taken

    def _count_cancelled(self, n: int) -> None:
        for _ in range(n):
            self.stats.observe_finish("cancelled")

    def _prefill(self, admitted: list[Sequence]) -> None:
        """Prefill each admitted request alone into its own cache row and send its first token.

        One at a time, so each request's first token goes out as soon as its own prompt is done
        (prefill is compute-bound: one pass for several prompts saves little and makes them all
        wait for the last). If one fails, those admitted with it that were not prefilled yet
        fail with it (they hold no slot for the batch's handler to reach).
        """
        for k, seq in enumerate(admitted):
            try:
                self._prefill_one(seq)
            except Exception as exc:
                holding = {id(slot.seq) for slot in self._active}
                for later in admitted[k:]:
                    if id(later) not in holding:
                        later.deliver(exc)
                raise

    def _prefill_one(self, seq: Sequence) -> None:
        req = seq.request
        if seq.cancelled:
            self.stats.observe_finish("cancelled")
            return
        room = self.context_length - len(req.prompt_ids)
        slot = _Slot(
            seq=seq,
            assembler=TextAssembler(self.tokenizer, req.stop),
            generator=make_generator(req.sampling, self.device),
            max_tokens=max(0, min(req.max_tokens, room)),
        )
        ids = torch.tensor(req.prompt_ids, dtype=torch.long, device=self.device)
        # Join the batch (cache row len(_active)) before the first token goes out, so a client that
        # sees a token sees a slot; a sequence that is already done leaves again in _drop_done.
        row = self._cache.add_row(len(req.prompt_ids))
        start = len(self._prefix_ids)
        if start and len(req.prompt_ids) > start and req.prompt_ids[:start] == self._prefix_ids:
            self._cache.restore(row, self._prefix_kv)
        else:
            start = 0
        key = ("prefill", (len(req.prompt_ids) - start).bit_length())
        with self._timed(key, len(req.prompt_ids) - start):
            logits = self.model.prefill(ids, self._cache, row, start)
        self._active.append(slot)
        token = choose_tokens(logits[None], [req.sampling], [slot.generator])[0]
        self.stats.observe_ttft(time.perf_counter() - seq.submitted_at, len(req.prompt_ids))
        self.stats.observe_tokens(1, decode_step=False)
        self._emit(slot, token)

    def _decode_step(self) -> None:
        ids = torch.tensor([s.last_token for s in self._active], dtype=torch.long, device=self.device)
        with self._timed(("decode", len(self._active)), 1):
            logits = self.model.decode(ids, self._cache)
        params = [s.seq.request.sampling for s in self._active]
        tokens = choose_tokens(logits, params, [s.generator for s in self._active])
        self.stats.observe_tokens(len(tokens), decode_step=True)
        for slot, token in zip(self._active, tokens, strict=True):
            self._emit(slot, token)

    def _start_thread_pools(self) -> None:
        """Have OpenMP start this thread's workers for every count the picker may choose, before
        any pass is timed: creating them costs the first pass on a count several ms (measured up
        to ~2x a step), which would seed its estimate too high."""
        if self.threads is None or not self.threads.adaptive:
            return
        for n in sorted(self.threads.choices, reverse=True):
            torch.set_num_threads(n)
            torch.ones(1 << 20).sum()  # big enough for torch to split it over n threads
        self._torch_threads = self.threads.choices[0]
        torch.set_num_threads(self._torch_threads)

    @contextmanager
    def _timed(self, key: tuple[str, int], units: int) -> Iterator[None]:
        """Run one forward pass of kind ``key`` on the thread count picked for it; report its cost per unit."""
        if self.threads is None:
            yield
            return
        n = self.threads.pick(key)
        if n != self._torch_threads:
            torch.set_num_threads(n)  # this thread's OpenMP setting: the kernels read it per call
            self._torch_threads = n
        started = time.perf_counter()
        yield
        self.threads.record(key, n, (time.perf_counter() - started) / max(1, units))

    def _emit(self, slot: _Slot, token: int) -> None:
        """Account one new token for ``slot`` and send the text it completes."""
        slot.last_token = token
        slot.generated += 1
        slot.tokens.append(token)
        finish: str | None = None
        if token in self.stop_token_ids and not slot.seq.request.ignore_eos:
            text, finish = slot.assembler.flush(), "stop"
        else:
            text = slot.assembler.push(token)
            if slot.assembler.stopped:
                finish = "stop"
            elif slot.generated >= slot.max_tokens:
                text, finish = text + slot.assembler.flush(), "length"
        if finish is not None:
            slot.done = True
            self.stats.observe_finish(finish)
        if text or finish is not None:
            prompt = len(slot.seq.request.prompt_ids)
            tokens = tuple(slot.tokens) if finish is not None else ()
            slot.seq.deliver(Delta(text, finish, prompt, slot.generated, tokens))

    def _drop_done(self) -> None:
        # From the end, so the row that moves into a freed one has already been looked at.
        for i in range(len(self._active) - 1, -1, -1):
            slot = self._active[i]
            if slot.seq.cancelled and not slot.done:
                slot.done = True
                self.stats.observe_finish("cancelled")
            if slot.done:
                self._cache.remove(i)
                self._active[i] = self._active[-1]
                self._active.pop()

    def snapshot(self) -> dict[str, Any]:
        """Queue depth and batch size right now."""
        with self._cond:
            return {"queue_depth": len(self._waiting), "batch_size": len(self._active)}
