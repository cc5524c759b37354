"""The classifier cascade: the lexical scorer decides what it is sure of, the encoder the rest.

The lexical scorer (classifier.py) runs on every request in microseconds. Its score is trusted
at both ends; requests whose lexical score falls inside the uncertain band go to the encoder
(encoder.py), which runs in a thread of its own over whatever requests wait, as one batch. The
band's decision blends both scores (the blend and the band are fitted offline, on
leave-one-source-out scores, per complex recall target: `encoder.json`). The encoder has a
deadline: a request it has not scored by then goes to the big model (recall first), as does one
that finds too many requests waiting. Without torch, or while the encoder loads, the lexical
scorer decides alone (its own threshold, as before the cascade).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .classifier import COMPLEX, SIMPLE, Stage, Verdict
from .encoder_meta import ENCODER_DIR
from .features import request_text

if TYPE_CHECKING:
    from ..config.policy import EncoderPolicy

__all__ = ["Band", "Cascade", "Blend", "EncoderState", "EncoderWorker", "LEXICAL_ONLY", "band_for", "encoder_text"]

log = logging.getLogger("gateway.classify")


class EncoderState(StrEnum):
    """Where the app's encoder stands (/readyz, explain)."""

    OFF = "off"            # not asked for, or not needed (no route classifies)
    UNAVAILABLE = "unavailable"  # asked for "auto", but torch/tokenizers are not installed
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"      # the weights did not load: the lexical scorer decides alone


@dataclass(frozen=True, slots=True)
class Blend:
    """The band's score: sigmoid(lexical * logit(lexical score) + encoder * logit(encoder
    score) + bias)."""

    lexical: float
    encoder: float
    bias: float

    def __call__(self, lexical: float, encoder: float) -> float:
        z = self.lexical * _logit(lexical) + self.encoder * _logit(encoder) + self.bias
        return 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0


@dataclass(frozen=True, slots=True)
class Band:
    """Lexical scores in [low, high) are uncertain; there the blend decides at `threshold`."""

    low: float
    high: float
    threshold: float
    blend: Blend

    def holds(self, lexical_score: float) -> bool:
        return self.low <= lexical_score < self.high


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1.0 - 1e-6)
    return math.log(p / (1.0 - p))


def band_for(meta: Mapping[str, Any], recall: float) -> Band:
    """The band encoder.json tabulates for a complex recall target: the one for the smallest
    recall at or above it (recall first), else the last row. Raises ValueError on a bad table."""
    table = meta.get("bands")
    b = meta.get("blend")
    if not isinstance(table, list) or not table or not isinstance(b, Mapping):
        raise ValueError("encoder.json: needs `bands` (a list) and `blend`")
    try:
        blend = Blend(float(b["lexical"]), float(b["encoder"]), float(b["bias"]))
        rows = sorted((float(r["recall"]), float(r["low"]), float(r["high"]), float(r["threshold"]))
                      for r in table)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"encoder.json: a malformed `bands` row or `blend`: {e}") from e
    for r, low, high, thr in rows:
        if r >= recall - 1e-9:
            return Band(low, high, thr, blend)
    _, low, high, thr = rows[-1]
    return Band(low, high, thr, blend)


def encoder_text(body: Mapping[str, Any]) -> str:
    """What the encoder reads: the final user message (only the final turn counts)."""
    return request_text(body)[0]


class _Scorer(Protocol):
    def score(self, texts: Sequence[str]) -> list[float]: ...


@dataclass(slots=True)
class _Job:
    text: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[float]
    abandoned: bool = False  # the caller's deadline passed: skip it if not started


class EncoderWorker:
    """The app's encoder: loaded at start (see `start`), run by one thread over the requests waiting
    for it, as one batch each time (up to `max_batch`). At most `max_waiting` requests wait; a
    request past that is not queued (it goes to the big model), so a flood cannot grow memory
    or delay everyone behind it."""

    def __init__(self, settings: EncoderPolicy, observe: Callable[[float], None] | None = None) -> None:
        """`observe`: called with each scored request's wait, queue included (seconds)."""
        self.settings = settings
        self.state = EncoderState.OFF
        self.detail = ""
        self._scorer: _Scorer | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting = 0
        self._thread: threading.Thread | None = None
        self._observe = observe
        self._loaded = threading.Event()
        self._failures = 0

    @property
    def folder(self) -> Path | None:
        return Path(self.settings.weights_dir) if self.settings.weights_dir else None

    def start(self, *, block: bool = False) -> None:
        """Load the encoder and start its thread, unless the policy turns it off. Idempotent.
        `block`: load here, before returning (at start, before the port opens: importing torch
        holds the GIL for a second or two, which would stall a running event loop); else load in
        the worker's thread (a reload that first needs it; /readyz says `loading` meanwhile)."""
        if self._thread is not None or self.settings.enabled is False:
            return
        self.state = EncoderState.LOADING
        if block and not self._load():
            self._loaded.set()
            return
        self._thread = threading.Thread(target=self._run, name="gateway-encoder", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after the batch in progress (requests still waiting get no score)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def wait_loaded(self, timeout_s: float) -> bool:
        """Block until loading ended (ready or not); for tools and tests, never on the loop."""
        return self._loaded.wait(timeout_s)

    @property
    def ready(self) -> bool:
        return self.state is EncoderState.READY

    async def score(self, text: str, timeout_s: float) -> float | None:
        """The encoder's P(complex) for `text`, or None when it is not ready, too busy (too
        many waiting) or not done within `timeout_s`."""
        if self.state is not EncoderState.READY or self._waiting >= self.settings.max_waiting:
            return None
        loop = asyncio.get_running_loop()
        job = _Job(text, loop, loop.create_future())
        self._waiting += 1
        self._jobs.put(job)
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout_s)
        except TimeoutError:
            return None
        finally:  # late, or the request went away: the worker skips it if it has not started it
            job.abandoned = not job.future.done()
            self._waiting -= 1
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)

    def _run(self) -> None:
        if self.state is EncoderState.LOADING and not self._load():
            self._loaded.set()
            return
        self._loaded.set()
        try:
            import torch  # noqa: PLC0415 - loaded above: the optional dependency is there

            # This thread's OpenMP pool only: torch code in other threads keeps its own count.
            torch.set_num_threads(self.settings.threads)
        except ImportError:  # a scorer without torch (tests)
            pass
        while True:
            job = self._jobs.get()
            if job is None:
                return
            batch = [] if job.abandoned else [job]  # a job whose caller gave up is skipped
            while len(batch) < self.settings.max_batch:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._jobs.put(None)  # stop after this batch
                    break
                if not more.abandoned:
                    batch.append(more)
            if batch:
                self._score(batch)

    def _score(self, batch: list[_Job]) -> None:
        try:
            scores: list[float] | None = self._scorer.score([j.text for j in batch])  # type: ignore[union-attr]
        except Exception:  # a bug or a broken model: those requests go to the big model
            self._failures += 1
            if self._failures == 1 or self._failures % 1000 == 0:  # the log is not flooded
                log.exception("classifier encoder: scoring a batch of %d failed (%d failures so far)",
                              len(batch), self._failures)
            scores = None
        for i, j in enumerate(batch):
            try:
                j.loop.call_soon_threadsafe(_settle, j, None if scores is None else scores[i])
            except RuntimeError:  # its loop is closed (shutting down): no one waits for it
                pass

    def _load(self) -> bool:
        s = self.settings
        try:
            from . import encoder as enc  # noqa: PLC0415 - optional: needs torch, tokenizers, safetensors
        except ImportError as e:
            self.state = EncoderState.UNAVAILABLE if s.enabled is None else EncoderState.FAILED
            self.detail = f"torch/tokenizers/safetensors not installed ({e.name or e}): the lexical scorer decides alone"
            (log.info if s.enabled is None else log.warning)("classifier encoder: %s", self.detail)
            return False
        try:
            t0 = time.perf_counter()
            loaded = _shared(enc, self.folder, s.device)
        except Exception as e:
            self.state, self.detail = EncoderState.FAILED, f"{e}: the lexical scorer decides alone"
            log.error("classifier encoder: %s", self.detail)
            return False
        self._scorer = loaded
        self.state, self.detail = EncoderState.READY, f"on {getattr(loaded, 'device', '?')}, {s.threads} thread(s)"
        log.info("classifier encoder: ready in %.1f s (%s)", time.perf_counter() - t0, self.detail)
        return True


# Loaded encoders by (folder, device), per process. The one piece of module state outside the
# app's wiring, kept because the weights are immutable once loaded and a process that makes many
# apps (a test run) would otherwise load them, and stall on it, once per app. Forward passes on
# one model from several threads are safe (inference only).
_LOADED: dict[tuple[str, str], _Scorer] = {}
_LOADING = threading.Lock()


def _shared(enc: Any, folder: Path | None, device: str) -> _Scorer:
    key = (str(folder or ENCODER_DIR), device)
    with _LOADING:
        got = _LOADED.get(key)
        if got is None:
            loaded = enc.Encoder.load(folder, device)
            loaded.score(["warm up"])  # the first call allocates; keep that off a request
            _LOADED[key] = got = loaded
        return got


def _settle(job: _Job, value: float | None) -> None:
    """On the job's loop: its score, or the failure (never for a job no one awaits any more)."""
    if job.future.done() or job.abandoned:
        return
    if value is None:
        job.future.set_exception(RuntimeError("classifier encoder failed"))
    else:
        job.future.set_result(value)


class Cascade:
    """One runtime's cascade: its band (for the policy's recall target) and the app's encoder."""

    __slots__ = ("worker", "band", "deadline_s")

    def __init__(self, worker: EncoderWorker | None, band: Band | None, deadline_s: float) -> None:
        self.worker, self.band, self.deadline_s = worker, band, deadline_s

    def uncertain(self, v: Verdict) -> bool:
        """Whether the encoder should decide `v` (a lexical verdict no rule forced)."""
        return self.band is not None and v.rule is None and self.band.holds(v.score)

    async def decide(self, v: Verdict, body: Mapping[str, Any]) -> Verdict:
        """The class of a request whose lexical verdict is uncertain."""
        band, worker = self.band, self.worker
        assert band is not None
        if worker is None or not worker.ready:
            return v  # loading (or failed): the lexical scorer decides alone, as without one
        try:
            enc = await worker.score(encoder_text(body), self.deadline_s)
        except RuntimeError:  # the batch failed (logged by the worker)
            enc = None
        if enc is None:
            return replace(v, cls=COMPLEX, stage=Stage.DEADLINE, lexical_score=v.score,
                           reasons=["encoder: no score in time (late, busy or failed): complex"])
        s = band.blend(v.score, enc)
        cls = COMPLEX if s >= band.threshold else SIMPLE
        return replace(v, cls=cls, score=s, threshold=band.threshold, stage=Stage.ENCODER,
                       lexical_score=v.score, encoder_score=enc,
                       reasons=[f"encoder: {enc:.2f} (lexical {v.score:.2f} was uncertain)", *v.reasons])


LEXICAL_ONLY = Cascade(None, None, 0.0)  # no band: the lexical scorer decides every request
