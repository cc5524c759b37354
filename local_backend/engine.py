"""The continuous-batching engine: one thread runs decode steps over every active sequence.

Between steps it admits waiting requests (each prefilled alone into a free row of the KV cache,
while the cache's byte budget holds them) and drops finished or cancelled ones, so concurrent
requests share each forward pass. A long prompt that arrives while others decode is prefilled a
chunk between two of their steps (`_Fill`), so their streams go on while it is read. Every kernel computes each row on its own, so a request's
tokens do not depend on its batch-mates. A prompt that starts like one seen recently reuses
that prefix's K/V from the prefix cache (llama/prefix.py) and computes only the rest, with the
same tokens as a cold run. Tokens reach asyncio through ``loop.call_soon_threadsafe``; nothing
here blocks the loop. On CPU each forward pass runs on the thread count a ``ThreadPicker``
chooses from live timings (threads.py); the tokens are the same on any count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .llama import LeanLlama
from .llama.prefix import PrefixCache
from .logprobs import TokenText
from .prompts import longest_token_chars
from .protocol import Delta, EngineClosed, GenerationRequest, QueueFull, Sequence, TokenLogprob, TooLong
from .sampling import choose_tokens, logprobs_of, make_generator
from .stats import EngineStats, render_load
from .textstream import TextAssembler
from .threads import ThreadPicker

if TYPE_CHECKING:
    from .quantize import QuantPlan

__all__ = ["Engine"]

# The torch modes' prefix blocks, which are also their prefill chunks (see _prefill_one): dense GEMMs
# and torch's attention give a row bits that depend on the pass's shape, so a warm run must repeat
# the cold run's chunks, and a chunk much smaller than this costs the cold run passes.
_TORCH_PREFIX_BLOCK_TOKENS = 128

# A prompt prefilled while other sequences decode is computed this many tokens between two of their
# decode steps (kernel modes; the torch modes' chunks are their prefix blocks): a chunk of SmolLM2
# at 4,000 positions costs ~170 ms on 2 CPU cores, where a 7,000-token prompt in one pass stopped
# every stream for ~26 s (review helper's repro).
_FILL_CHUNK_TOKENS = 64
# The kernel modes' passes of a prompt read alone: shorter passes keep the attention's working set
# in cache (SmolLM2, 4,000 tokens, 2 cores: 8.8 s in one pass, 6.5 s in passes of 256, 6.7 s of 64).
_PASS_TOKENS = 256


@dataclass(eq=False)
class _Fill:
    """A prompt being prefilled a chunk at a time into the cache's last row, between decode steps."""

    slot: _Slot
    ids: torch.Tensor
    bounds: list[int]  # where each chunk still to compute ends (the last: the prompt's length)
    start: int  # positions of the row computed so far


@dataclass(eq=False)
class _Slot:
    """Engine-thread state of one admitted sequence."""

    seq: Sequence
    assembler: TextAssembler
    generator: torch.Generator | None
    max_tokens: int
    prompt_stored: bool = False  # the prompt's blocks went to the prefix cache
    last_token: int = -1
    generated: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # asked for, not yet delivered with a delta
    done: bool = field(default=False)
    failed: bool = False  # ended by an error: its blocks are not kept for a next turn


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
        kv_cache_bytes: int | None = None,
        prefix_cache_bytes: int = 256 << 20,
        prefix_block_tokens: int = 16,
    ) -> None:
        self.model = model
        self.threads = threads  # CPU: each pass's thread count; None leaves torch's setting alone
        self.tokenizer = tokenizer
        self.longest_token_chars = longest_token_chars(tokenizer)  # the server's length check before tokenizing
        self.vocab_size = len(tokenizer)  # the token ids a logit_bias may name
        self.token_text = TokenText(tokenizer)  # a token's text and bytes, for log probabilities
        self.device = model.device
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_budget_tokens = prefill_budget_tokens
        self.context_length = model.context_length
        self.stop_token_ids = self._stop_token_ids(eos_token_ids)
        self.stats = EngineStats()
        self.plan: QuantPlan | None = None  # how the weights were built (boot.py sets it): /metrics names the path
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._active: list[_Slot] = []  # slot i owns cache row i
        self._fill: _Fill | None = None  # owns the last row, after the active ones: decode steps leave it out
        if self.device.type == "cuda":  # a static cache, decode steps replayed as CUDA graphs
            self._cache = model.new_cache(max_batch, static=True)
            model.use_cuda_graphs(self._cache)
        else:
            self._cache = model.new_cache(max_batch, max_bytes=kv_cache_bytes)
        block = prefix_block_tokens if model.row_invariant else max(prefix_block_tokens, _TORCH_PREFIX_BLOCK_TOKENS)
        self.prefix: PrefixCache | None = None
        if prefix_cache_bytes > 0:
            self.prefix = PrefixCache(layers=len(model.layers), kv_heads=model.kv_heads, head_dim=model.head_dim, dtype=model.kv_dtype,
                                      device=self.device, block_tokens=block, max_bytes=prefix_cache_bytes)
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

    def cache_prefix(self, ids: list[int]) -> int:
        """Pin the K/V of ``ids`` (the chat template's opening, e.g. its default system prompt) in the
        prefix cache, whole blocks of it: every prompt that starts with them skips that much prefill.
        Call before ``start()``. Returns the tokens pinned."""
        if self.prefix is None or len(ids) < self.prefix.block_tokens:
            return 0
        with torch.inference_mode():
            row = self._cache.add_row(len(ids))
            self._run_prefill(ids, row, 0)
            stored = self.prefix.store(ids, len(ids), self._cache, row, pinned=True)
            self._cache.clear()
        return stored * self.prefix.block_tokens

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
        limit = self._limit(request)
        if not self._cache.alone_fits(limit):
            budget = self._cache.budget_positions()
            raise TooLong(f"the prompt ({len(request.prompt_ids)} tokens) and max_tokens ({request.max_tokens}) need up to {limit} "
                          f"positions of KV cache; this server holds at most {min(budget, self.context_length)} for one sequence")
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
                    while not self._closing and not self._active and not self._waiting and self._fill is None:
                        self._cond.wait()
                    if self._closing:
                        break
                    admitted = self._take_waiting() if self._fill is None else []
                try:
                    if self._fill is not None:
                        self._fill_chunk(self._fill)
                    self._prefill(admitted)
                    self._drop_done()
                    if self._active:
                        self._decode_step()
                        self._drop_done()
                except Exception as exc:  # a failed forward pass fails its batch, not the engine
                    for slot in self._running():
                        if not slot.done:
                            self.stats.observe_finish("error")
                            slot.seq.deliver(exc)
                    self._active, self._fill = [], None
                    self._cache.clear()
                self.stats.set_load(len(self._waiting), self._batch())
        for slot in self._running():
            slot.seq.deliver(EngineClosed("the engine stopped"))
        self._active, self._fill = [], None
        self._cache.clear()

    def _running(self) -> list[_Slot]:
        """The admitted sequences: decoding, and the one being prefilled."""
        return self._active if self._fill is None else [*self._active, self._fill.slot]

    def _batch(self) -> int:
        return len(self._active) + (self._fill is not None)

    def _limit(self, request: GenerationRequest) -> int:
        """The most positions a request's sequence may reach: its prompt and max_tokens, within the context."""
        return min(self.context_length, len(request.prompt_ids) + max(0, request.max_tokens))

    def _take_waiting(self) -> list[Sequence]:
        """Pop waiting requests that fit the batch, the KV cache's budget (with the running ones at their
        limits) and this step's prefill budget (at least one prompt's worth), oldest first.

        One that does not fit the KV budget yet does not hold up smaller ones behind it: they go ahead
        while they fit, but at most ``max_batch`` of them overtake it; after that nothing behind it is
        admitted until running sequences finish and it fits (submit refused any that never could), so
        it is never starved either.
        """
        taken: list[Sequence] = []
        limits: list[int] = []
        budget = self.prefill_budget_tokens
        passed: list[Sequence] = []  # waiting requests that did not fit, in order, left in the queue
        kept: deque[Sequence] = deque()
        while self._waiting and len(self._active) + len(taken) < self.max_batch:
            seq = self._waiting.popleft()
            if seq.cancelled:
                self._count_cancelled(1)
                continue
            if taken and len(seq.request.prompt_ids) > budget:
                kept.append(seq)
                break
            limit = self._limit(seq.request)
            if not self._cache.fits(*limits, limit):
                kept.append(seq)
                passed.append(seq)
                continue
            if any(earlier.overtaken >= self.max_batch for earlier in passed):
                kept.append(seq)
                break  # one ahead of it has been overtaken enough: the queue waits for it
            for earlier in passed:
                earlier.overtaken += 1
            budget -= len(seq.request.prompt_ids)
            limits.append(limit)
            taken.append(seq)
        kept.extend(self._waiting)
        self._waiting = kept
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
                holding = {id(slot.seq) for slot in self._running()}
                for later in admitted[k:]:
                    if id(later) not in holding:
                        self.stats.observe_finish("error")
                        later.deliver(exc)
                raise
            if self._fill is not None:  # a long prompt is read between decode steps: the rest wait for it
                with self._cond:
                    self._waiting.extendleft(reversed(admitted[k + 1 :]))
                return

    def _prefill_one(self, seq: Sequence) -> None:
        req = seq.request
        if seq.cancelled:
            self.stats.observe_finish("cancelled")
            return
        prompt = req.prompt_ids
        room = self.context_length - len(prompt)
        slot = _Slot(
            seq=seq,
            assembler=TextAssembler(self.tokenizer, req.stop),
            generator=make_generator(req.sampling, self.device),
            max_tokens=max(0, min(req.max_tokens, room)),
        )
        # Join the batch (cache row len(_active)) before the first token goes out, so a client that
        # sees a token sees a slot; a sequence that is already done leaves again in _drop_done.
        row = self._cache.add_row(len(prompt), self._limit(req))
        start = 0
        if self.prefix is not None:  # at least the last token is computed: its logits pick the first token
            start = self.prefix.load(self.prefix.match(prompt, len(prompt) - 1, req.cache_salt), self._cache, row)
        bounds = self._bounds(len(prompt), start)
        fill = _Fill(slot, torch.tensor(prompt, dtype=torch.long, device=self.device), bounds, start)
        if self._active and len(prompt) - start > _FILL_CHUNK_TOKENS and self.device.type == "cpu":
            # Others are decoding: a chunk between two of their steps. The kernel modes compute any
            # split to the same bits; the torch modes' passes must stay their prefix blocks (the same
            # whether others decode or not: a request's tokens never depend on its batch-mates).
            if self.model.row_invariant:
                fill.bounds = [*range(start + _FILL_CHUNK_TOKENS, len(prompt), _FILL_CHUNK_TOKENS), len(prompt)]
            self._fill = fill
            self._fill_chunk(fill)
            return
        while not self._fill_chunk(fill):
            pass

    def _fill_chunk(self, fill: _Fill) -> bool:
        """Compute the next chunk of ``fill``'s prompt; after its last, the sequence joins the batch
        with its first token. True once it has (or it was cancelled meanwhile, and left)."""
        slot = fill.slot
        row = len(self._active)
        if slot.seq.cancelled:
            self._fill = None
            self.stats.observe_finish("cancelled")
            self._cache.remove(row)  # the last row
            return True
        end = fill.bounds.pop(0)
        with self._timed(("prefill", (end - fill.start).bit_length()), end - fill.start):
            logits = self.model.prefill(fill.ids[:end], self._cache, row, fill.start)
        fill.start = end
        if fill.bounds:
            return False
        self._fill = None
        self._first_token(slot, logits, row)
        return True

    def _first_token(self, slot: _Slot, logits: torch.Tensor, row: int) -> None:
        """A prefilled sequence joins the batch (cache row ``row``) with the token its logits pick."""
        seq, req = slot.seq, slot.seq.request
        prompt = req.prompt_ids
        self._active.append(slot)
        token = choose_tokens(logits[None], [req.sampling], [slot.generator])[0]
        if isinstance(token, Exception):
            self._fail(slot, token)
            return
        self.stats.observe_ttft(time.perf_counter() - seq.submitted_at, len(prompt))
        self.stats.observe_tokens(1, decode_step=False)
        self._emit(slot, token, logprobs_of(logits[None], [req.sampling], [token])[0])
        if self.prefix is not None:  # after the first token went out: the copy does not delay it
            self.prefix.store(prompt, len(prompt), self._cache, row, salt=req.cache_salt)
            slot.prompt_stored = True

    def _bounds(self, n: int, start: int) -> list[int]:
        """Where the passes of a prefill of ``n`` tokens from ``start`` end.

        The kernel modes compute any split of a prompt to the same bits: passes of `_PASS_TOKENS`. The
        torch modes' passes give bits that depend on their shape, so their prefill runs in chunks that
        end on prefix-block boundaries: a warm run (starting at a cached block) then repeats exactly
        the chunks a cold run computed, and the blocks it stores are those chunks.
        """
        if self.model.row_invariant:
            return [*range(start + _PASS_TOKENS, n, _PASS_TOKENS), n]
        if self.prefix is not None:
            b = self.prefix.block_tokens
            return [*range((start // b + 1) * b, n, b), n]
        return [n]

    def _run_prefill(self, ids: list[int], row: int, start: int) -> torch.Tensor:
        """Compute ``ids[start:]`` into ``row`` (which holds the K/V of ``ids[:start]``); the last logits."""
        tensor = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = None
        for end in self._bounds(len(ids), start):
            with self._timed(("prefill", (end - start).bit_length()), end - start):
                logits = self.model.prefill(tensor[:end], self._cache, row, start)
            start = end
        assert logits is not None
        return logits

    def _decode_step(self) -> None:
        ids = torch.tensor([s.last_token for s in self._active], dtype=torch.long, device=self.device)
        with self._timed(("decode", len(self._active)), 1):
            logits = self.model.decode(ids, self._cache)
        params = [s.seq.request.sampling for s in self._active]
        tokens = choose_tokens(logits, params, [s.generator for s in self._active], [s.tokens for s in self._active])
        logprobs = logprobs_of(logits, params, tokens)
        self.stats.observe_tokens(sum(not isinstance(t, Exception) for t in tokens), decode_step=True)
        for slot, token, lp in zip(self._active, tokens, logprobs, strict=True):
            if isinstance(token, Exception):
                self._fail(slot, token)  # that request alone: its row leaves in _drop_done, the others go on
            else:
                self._emit(slot, token, lp)

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

    def _emit(self, slot: _Slot, token: int, logprob: TokenLogprob | None = None) -> None:
        """Account one new token for ``slot`` and send the text it completes (with the log
        probabilities of the tokens since the last delta, when asked for)."""
        slot.last_token = token
        slot.generated += 1
        slot.tokens.append(token)
        finish: str | None = None
        if token in self.stop_token_ids and not slot.seq.request.ignore_eos:
            text, finish = slot.assembler.flush(), "stop"  # the end-of-turn token is no text: no logprob either
        else:
            if logprob is not None:
                slot.logprobs.append(logprob)
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
            logprobs, slot.logprobs = tuple(slot.logprobs), []
            slot.seq.deliver(Delta(text, finish, prompt, slot.generated, tokens, logprobs))

    def _fail(self, slot: _Slot, exc: Exception) -> None:
        """End one sequence with ``exc`` (its row is freed in _drop_done); counted as finish "error"."""
        slot.done = slot.failed = True
        self.stats.observe_finish("error")
        slot.seq.deliver(exc)

    def _drop_done(self) -> None:
        # From the end, so the row that moves into a freed one has already been looked at.
        removed = False
        for i in range(len(self._active) - 1, -1, -1):
            slot = self._active[i]
            if slot.seq.cancelled and not slot.done:
                slot.done = True
                self.stats.observe_finish("cancelled")
            if slot.done:
                self._keep_conversation(slot, i)
                self._cache.remove(i, keep_last=self._fill is not None)
                self._active[i] = self._active[-1]
                self._active.pop()
                removed = True
        if removed:
            self._cache.trim()  # a long sequence's memory goes back once it is gone

    def _keep_conversation(self, slot: _Slot, row: int) -> None:
        """Store a finished sequence's blocks (prompt and answer) for the conversation's next turn. The
        kernel modes only: there a token's K/V are the same bits from a decode step as from a prefill,
        so the next turn continues exactly as a cold prompt would. The row holds the K/V of the prompt
        and of every generated token but the last (sampled, never fed back)."""
        if self.prefix is None or not self.model.row_invariant or not slot.prompt_stored or slot.failed:
            return
        ids = slot.seq.request.prompt_ids + slot.tokens
        self.prefix.store(ids, self._cache.lengths[row], self._cache, row, salt=slot.seq.request.cache_salt)

    def snapshot(self) -> dict[str, Any]:
        """Queue depth, batch size and the KV cache's use right now (any thread)."""
        with self._cond:
            waiting, running = len(self._waiting), self._batch()
        cache = self._cache
        return {
            "queue_depth": waiting,
            "batch_size": running,
            "kv_cache_usage": cache.usage(),
            "kv_cache_bytes": cache.nbytes(),
        }

    def metrics_text(self, model: str) -> str:
        """Everything /metrics shows of this engine, in Prometheus text (any thread)."""
        passes = self.threads.passes() if self.threads is not None else None
        info = {"device": self.device.type}
        if self.plan is not None:
            info.update(mode=self.plan.mode, path=self.plan.path)
        prefix = self.prefix.stats() if self.prefix is not None else None
        return self.stats.render(model, passes) + render_load(model, self.snapshot(), prefix, info)
