"""The classifier cascade: the lexical scorer decides what it is sure of, the encoder the rest.

The lexical scorer (classifier.py) runs on every request in microseconds. Its score is trusted
at both ends; requests whose lexical score falls inside the uncertain band go to the encoder
(encoder.py), which runs in a thread of its own over whatever requests wait, as one batch. The
band's decision blends both scores (the blend and the band are fitted offline, on
leave-one-source-out scores, per complex recall target: `encoder.json`). The encoder has a
deadline: a request it has not scored by then goes to the big model (recall first), as does one
that finds too many requests waiting. Work that cannot end in time is not done: the worker
knows what a batch costs (batch_cost.py), so a request whose turn would come too late is told
at once instead of at its deadline, and a batch is only as large as its earliest deadline
allows. With two tenants or more, tenants take turns in the queue (one request each, round
robin), so a tenant keeping many requests waiting delays another's by one request, not by its
whole queue. Without torch, or while the encoder loads, the lexical scorer decides alone (its own
threshold, as before the cascade).
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .batch_cost import BatchCost, text_units
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


class _Loaded(_Scorer, Protocol):
    window_tokens: int  # tokens read from a text at most


_SWITCH_INTERVAL_S = 0.001  # the GIL switch interval while an encoder runs (see EncoderWorker.start)
_PROBE_S = 0.25  # how often an idle encoder takes a request it expects to be late (see _late)
_LAG_WEIGHT = 0.2  # of each new loop-lag sample in its moving average
_MARGIN_S = 0.001  # a score must reach its caller's loop before the deadline, not just be computed by then
_CALIBRATION = ("warm up", "calibrate " * 400)  # a short window and a full one: the cost line's two ends


@dataclass(slots=True)
class _Job:
    text: str
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[float | None]  # None: not scored in time (the worker gave up on it)
    due: float  # time.monotonic() when its caller stops waiting
    units: int  # the window it costs (batch_cost.text_units)
    tenant: str = ""  # whose turn it takes in the queue ("": one caller, first come first served)
    abandoned: bool = False  # the caller's deadline passed: skip it if not started
    sent: float = 0.0  # time.monotonic() when the worker handed it back


class _Turns:
    """The requests taken off the queue and not yet batched (worker thread only), in turns: each
    tenant's oldest first, one request per tenant per turn (round robin). With one tenant this is
    first come, first served; with several, a tenant's hundredth request waits behind each other
    tenant's first, not before them. Every operation is O(1)."""

    __slots__ = ("_of", "_count")

    def __init__(self) -> None:
        self._of: dict[str, deque[_Job]] = {}  # by tenant; insertion order is the turn order
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, job: _Job) -> None:
        mine = self._of.get(job.tenant)
        if mine is None:  # a tenant with nothing pending joins at the end of the turns
            self._of[job.tenant] = mine = deque()
        mine.append(job)
        self._count += 1

    def first(self) -> _Job:
        """The request whose turn is next (the pending set is not empty)."""
        return next(iter(self._of.values()))[0]

    def pop(self) -> _Job:
        """Take the request whose turn is next; its tenant's next one waits for the others'."""
        tenant, mine = next(iter(self._of.items()))
        job = mine.popleft()
        del self._of[tenant]
        if mine:
            self._of[tenant] = mine  # to the end of the turns
        self._count -= 1
        return job


class EncoderWorker:
    """The app's encoder: loaded at start (see `start`), run by one thread over the requests waiting
    for it, as one batch each time (up to `max_batch`). At most `max_waiting` requests wait; a
    request past that is not queued (it goes to the big model), so a flood cannot grow memory
    or delay everyone behind it. Nor is one whose turn would come after its deadline, by what
    the batches so far cost, and a batch holds only as many as end before the first one's.
    Tenants given a `share` take turns (see _Turns), so a tenant's queue delays another's
    request by at most one request per turn."""

    def __init__(self, settings: EncoderPolicy, observe: Callable[[float], None] | None = None) -> None:
        """`observe`: called with each scored request's wait, queue included (seconds)."""
        self.settings = settings
        self.state = EncoderState.OFF
        self.detail = ""
        self._scorer: _Scorer | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._waiting = 0
        self._waiting_of: dict[str, int] = {}  # by tenant, while some wait (loop-only: no lock)
        self._thread: threading.Thread | None = None
        self._observe = observe
        self._loaded = threading.Event()
        self._failures = 0
        self._cost = BatchCost()  # written by the worker thread only
        self._window = 64  # the encoder's window (tokens), from its config once loaded
        self._busy_until = 0.0  # time.monotonic() when the batch in progress should end (worker-written)
        self._started = -math.inf  # time.monotonic() when the last batch started (worker-written)
        # How late the loop runs what the worker hands back (seconds, moving average; loop-written):
        # a busy loop adds it to every wait, and a request is late by the loop's clock.
        self._loop_lag_s = 0.0
        # The share of recent scores that reached their callers too late (moving average, weight
        # 1/2: two late in a row are a trend, one is noise; loop-written).
        self._late_share = 0.0
        # Requests queued and not yet taken (in a batch, given up or skipped), and their units:
        # each counter has one writer (the loop puts, the worker takes), so no lock is needed.
        self._put_jobs = self._put_units = 0
        self._took_jobs = self._took_units = 0

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
        # The encoder thread takes the GIL back a few times a batch (after tokenizing, the forward
        # pass, handing scores back); next to a busy event loop each take waits up to the switch
        # interval (5 ms by default: one request's 5 ms of scoring took 22 ms, 9.6 ms at 1 ms).
        # The process's interval is lowered to 1 ms, never raised.
        sys.setswitchinterval(min(sys.getswitchinterval(), _SWITCH_INTERVAL_S))
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

    async def score(self, text: str, timeout_s: float, tenant: str = "", share: int | None = None) -> float | None:
        """The encoder's P(complex) for `text`, or None when it is not ready, too busy (too
        many waiting, `tenant` has `share` of its requests waiting already, or its turn would end
        past `timeout_s`) or not done within `timeout_s`. `share` keeps one tenant's flood from
        filling the queue, whose length makes every later request late, other tenants' too."""
        if self.state is not EncoderState.READY or self._waiting >= self.settings.max_waiting:
            return None
        mine = self._waiting_of.get(tenant, 0)
        if share is not None and mine >= share:
            return None
        units = text_units(text, self._window)
        now = time.monotonic()
        # Tenants take turns only where they have shares (two tenants or more): else one caller.
        turn = tenant if share is not None else ""
        if self._late(now, units, timeout_s, turn, mine):
            return None  # it would be late: the big model now rather than at the deadline
        loop = asyncio.get_running_loop()
        job = _Job(text, loop, loop.create_future(), now + timeout_s, units, turn)
        self._waiting += 1
        self._waiting_of[tenant] = mine + 1
        self._put_jobs += 1
        self._put_units += units
        self._jobs.put(job)
        t0 = time.perf_counter()
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout_s)
        except TimeoutError:
            return None
        finally:  # late, or the request went away: the worker skips it if it has not started it
            job.abandoned = not job.future.done()
            self._waiting -= 1
            left = self._waiting_of[tenant] - 1
            if left:
                self._waiting_of[tenant] = left
            else:
                del self._waiting_of[tenant]  # the map holds only tenants with requests waiting
            if self._observe is not None:
                self._observe(time.perf_counter() - t0)

    def _late(self, now: float, units: int, timeout_s: float, turn: str = "", mine: int = 0) -> bool:
        """Whether a request of `units` queued now would be scored after `timeout_s`: the batch in
        progress, then what is queued ahead of it, in batches of `max_batch`. Ahead of it: all
        that is queued, first come first served (`turn` ""); else, tenants taking turns, its
        tenant's `mine` waiting and at most `mine` + 1 of each other tenant's. An idle encoder
        takes the request unless most of its recent scores came too late, and then still one
        every `_PROBE_S`: the estimates are only corrected by what it scores, and stale ones (from
        a burst of load) would otherwise refuse everything for good."""
        queued = self._put_jobs - self._took_jobs
        if queued == 0 and self._busy_until <= now:
            return self._late_share > 0.5 and now - self._started < _PROBE_S
        ahead, ahead_units = queued, self._put_units - self._took_units
        if turn and queued > mine:
            # Round robin: its tenant's own, then up to one more than that of each other tenant
            # (counts include requests in the batch in progress: an upper bound, capped by what is
            # queued). Stops once it reaches that cap: O(tenants waiting) at worst.
            ahead = mine
            for tenant, waiting in self._waiting_of.items():
                if tenant != turn:
                    ahead += min(waiting, mine + 1)
                    if ahead >= queued:
                        break
            if ahead < queued:  # their units are not counted by tenant: the queue's mean
                ahead_units = -(-ahead_units * ahead // queued)
            ahead = min(ahead, queued)
        batches = -(-(ahead + 1) // self.settings.max_batch)
        wait = max(0.0, self._busy_until - now) + self._cost.predict(ahead_units + units, batches)
        return wait + self._loop_lag_s > timeout_s - _MARGIN_S

    def _run(self) -> None:
        if self.state is EncoderState.LOADING and not self._load():
            self._loaded.set()
            return
        try:
            import torch  # noqa: PLC0415 - loaded above: the optional dependency is there

            # This thread's OpenMP pool only: torch code in other threads keeps its own count.
            torch.set_num_threads(self.settings.threads)
        except ImportError:  # a scorer without torch (tests)
            pass
        self._calibrate()  # with this thread's settings: what requests will meet
        self._loaded.set()
        pending = _Turns()  # taken off the queue, not yet batched
        while True:
            if not pending:
                job = self._jobs.get()
                if job is None:
                    return
                pending.add(job)
            stop = self._drain(pending)
            batch = self._batch(pending)
            if batch:
                self._score(batch)
            if stop:
                return  # requests still pending get no score: their callers' deadlines end their waits

    def _calibrate(self) -> None:
        """Time a short window and a full one (twice each, against a noisy pass), so the first
        requests already meet a cost line."""
        for text in (*_CALIBRATION, *_CALIBRATION):
            try:
                t0 = time.perf_counter()
                self._scorer.score([text])  # type: ignore[union-attr]
            except Exception:  # a broken model shows on the first request, and is logged there
                return
            self._cost.observe(text_units(text, self._window), time.perf_counter() - t0)

    def _drain(self, pending: _Turns) -> bool:
        """Move what waits in the queue to `pending`; whether a stop came."""
        while True:
            try:
                more = self._jobs.get_nowait()
            except queue.Empty:
                return False
            if more is None:
                return True
            pending.add(more)

    def _take(self, job: _Job) -> None:
        self._took_jobs += 1
        self._took_units += job.units

    def _batch(self, pending: _Turns) -> list[_Job]:
        """The next batch: the requests next in turn (the oldest, with one tenant) whose batch
        ends before the earliest of their deadlines. One that cannot make it even alone is given
        up at once when others wait behind it (its caller goes on now, not at its deadline; the
        last one is tried: see _late); one whose caller left is skipped."""
        now, limit = time.monotonic(), self.settings.max_batch
        batch: list[_Job] = []
        width, due = 0, math.inf
        while pending and len(batch) < limit:
            j = pending.first()
            if j.abandoned:
                self._take(pending.pop())
                continue
            w = max(width, j.units)
            end = now + self._cost.predict(w * (len(batch) + 1)) + _MARGIN_S
            if end > min(due, j.due):
                if batch:
                    break  # it waits for the next batch
                if len(pending) > 1 or not self._jobs.empty():
                    self._take(pending.pop())
                    self._send(j, None)  # too late even alone: its caller goes on now
                    continue
                # The only one waiting: tried all the same, which measures the cost anew.
            self._take(pending.pop())
            batch.append(j)
            width, due = w, min(due, j.due)
        if batch:
            self._busy_until = now + self._cost.predict(width * len(batch))
            self._started = now
        return batch

    def _score(self, batch: list[_Job]) -> None:
        t0 = time.perf_counter()
        try:
            scores: list[float] | None = self._scorer.score([j.text for j in batch])  # type: ignore[union-attr]
        except Exception:  # a bug or a broken model: those requests go to the big model
            self._failures += 1
            if self._failures == 1 or self._failures % 1000 == 0:  # the log is not flooded
                log.exception("classifier encoder: scoring a batch of %d failed (%d failures so far)",
                              len(batch), self._failures)
            scores = None
        else:
            self._cost.observe(max(j.units for j in batch) * len(batch), time.perf_counter() - t0)
        self._busy_until = 0.0
        for i, j in enumerate(batch):
            self._send(j, None if scores is None else scores[i], failed=scores is None)

    def _send(self, job: _Job, value: float | None, *, failed: bool = False) -> None:
        """From the worker thread: hand `job` its score, None (given up: it would be late) or the
        failure, on its loop."""
        job.sent = time.monotonic()
        try:
            job.loop.call_soon_threadsafe(self._settle, job, value, failed)
        except RuntimeError:  # its loop is closed (shutting down): no one waits for it
            pass

    def _settle(self, job: _Job, value: float | None, failed: bool) -> None:
        """On the job's loop: its score, None, or the failure (never for a job no one awaits any
        more), and how late the loop came to it."""
        now = time.monotonic()
        self._loop_lag_s += (now - job.sent - self._loop_lag_s) * _LAG_WEIGHT
        if value is not None:
            self._late_share += (float(now > job.due) - self._late_share) * 0.5
        if job.future.done() or job.abandoned:
            return
        if failed:
            job.future.set_exception(RuntimeError("classifier encoder failed"))
        else:
            job.future.set_result(value)

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
        self._window = loaded.window_tokens
        self.state, self.detail = EncoderState.READY, f"on {getattr(loaded, 'device', '?')}, {s.threads} thread(s)"
        log.info("classifier encoder: ready in %.1f s (%s)", time.perf_counter() - t0, self.detail)
        return True


# Loaded encoders by (folder, device), per process. The one piece of module state outside the
# app's wiring, kept because the weights are immutable once loaded and a process that makes many
# apps (a test run) would otherwise load them, and stall on it, once per app. Forward passes on
# one model from several threads are safe (inference only).
_LOADED: dict[tuple[str, str], _Loaded] = {}
_LOADING = threading.Lock()


def _shared(enc: Any, folder: Path | None, device: str) -> _Loaded:
    key = (str(folder or ENCODER_DIR), device)
    with _LOADING:
        got = _LOADED.get(key)
        if got is None:
            loaded = enc.Encoder.load(folder, device)
            loaded.score(["warm up"])  # the first call allocates; keep that off a request
            _LOADED[key] = got = loaded
        return got


class Cascade:
    """One runtime's cascade: its band (for the policy's recall target), the app's encoder and
    each tenant's `share` of the encoder's queue (None: no limit, as with one tenant)."""

    __slots__ = ("worker", "band", "deadline_s", "share")

    def __init__(self, worker: EncoderWorker | None, band: Band | None, deadline_s: float, share: int | None = None) -> None:
        self.worker, self.band, self.deadline_s, self.share = worker, band, deadline_s, share

    def uncertain(self, v: Verdict) -> bool:
        """Whether the encoder should decide `v` (a lexical verdict no rule forced)."""
        return self.band is not None and v.rule is None and self.band.holds(v.score)

    async def decide(self, v: Verdict, body: Mapping[str, Any], tenant: str = "") -> Verdict:
        """The class of a request of `tenant` whose lexical verdict is uncertain."""
        band, worker = self.band, self.worker
        assert band is not None
        if worker is None or not worker.ready:
            return v  # loading (or failed): the lexical scorer decides alone, as without one
        try:
            enc = await worker.score(encoder_text(body), self.deadline_s, tenant, self.share)
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
