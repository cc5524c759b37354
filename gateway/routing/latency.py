"""Latency tracking per (backend, upstream model): TTFT, inter-token gaps, durations, errors and
timeouts.

Two views of the same measurements:

- *Windowed quantiles* (P50/P95/P99 over the last `window_s`) for operators and for the first-token
  deadline: a bounded ring of recent samples, sorted lazily when read.
- *A prediction* of the next request's TTFT for the selector: an online fit of
  ``TTFT = a + b * prompt_tokens`` in which the slope `b` is a slow, count-decayed least-squares fit
  and the level `a` is a peak-sensitive EWMA: it rises at once on a slow sample and falls back over
  ~`decay_s` seconds of fast ones. Nothing decays while a backend is idle: an idle backend keeps the
  last estimate it earned (decaying it is what keeps sending traffic back to a degraded backend).

One tenant cannot slow a backend down for the others (`corroborate`). The tracker keeps a *base*:
the level as no one tenant alone raised it. It follows the level down at once; up at once only as
far as another tenant's latest sample (of the last `_SPIKE_WINDOW_S`) agrees, and for a tenant
alone (no other's sample within the window) over ~`_BASE_RISE_S` of its samples (at most about 2x
in 80 s of samples at least a second apart; idle time counts for nothing), so that a model only it
uses still shows its backend's real slow-downs. A tenant's sample above the
level raises it at most to twice the base, or to another tenant's latest sample if that is
higher, whatever the step size; past that, it fits nothing and leaves the tracker idle as far as
exploration goes. One request whose prompt made its own first token slow (an image its provider
fetched from a slow server) raised every backend it failed over to from ~8 ms to 1-2 s, and a
dozen samples of 1.9x the level each, under a cap that looked only at the level of the moment,
raised one from 5.9 to 543 ms (review helper's repros). Likewise one tenant's failures of the
kinds a request can cause (`asked`: a 500 on what it sent) teach the error rate only once another
tenant's agree within the window: one such request added ~100 ms to a 5 ms backend's score and
moved another tenant's traffic off it.

Each backend has one Tracker of its own (the `parent`: its in-flight count, and the figures
/admin/backends and /metrics show for the backend as a whole) and one per upstream model it
serves (`for_model()`), which the selector, the deadlines and hedging read: a model's figures are
its own, so one model's fast or slow first tokens do not move another's estimate or deadline (a
flood of a 5 ms model on a backend shrank its big model's first-token deadline to the floor, and
ordinary requests timing out there ejected it). A model's tracker reports every sample to its
parent too; until it has learned anything itself it predicts what its parent does.

State stays in process (per replica): a shared, stale view makes replicas herd onto one backend.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["Tracker", "Window", "quantile"]

_SORT_EVERY_S = 0.25  # hot-path quantile reads may be this stale; sorting 512 floats costs ~15 us
_SPIKE_WINDOW_S = 30.0  # how long one tenant's sample or failure stands to agree with another's
_BASE_RISE_S = 120.0  # time constant of the base's rise without another tenant's agreement
_BASE_STEP_S = 1.0  # the most time one sample counts for in that rise
_MIN_BASE_S = 1e-3  # the base, as a usual prompt's predicted TTFT, is at least this
_MAX_CLAIMS = 16  # tenants whose latest sample is kept (the most recent ones)


def quantile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile of an already sorted sequence (None when empty)."""
    if not sorted_values:
        return None
    idx = min(len(sorted_values) - 1, max(0, int(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[idx]


class Window:
    """Samples of the last `span_s` seconds (at most `max_samples`), with a lazily sorted copy."""

    __slots__ = ("span_s", "_samples", "_sorted", "_dirty", "_sorted_at")

    def __init__(self, span_s: float, max_samples: int) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._sorted: list[float] = []
        self._dirty = False
        self._sorted_at = -math.inf

    def add(self, now: float, value: float) -> None:
        """Record one sample; O(1) amortised."""
        self._samples.append((now, value))
        self._dirty = True

    def sorted(self, now: float, max_age_s: float = 0.0) -> list[float]:
        """The window's values in order. With max_age_s > 0 a sorted copy up to that old is reused,
        so per-request readers do not sort on every write."""
        samples = self._samples
        horizon = now - self.span_s
        while samples and samples[0][0] < horizon:
            samples.popleft()
            self._dirty = True
        # Small windows are always exact (sorting a few dozen floats costs ~2 us): a young
        # backend's count and quantiles must not lag behind its first samples.
        if self._dirty and (max_age_s <= 0 or len(samples) < 64 or now - self._sorted_at >= max_age_s):
            self._sorted = sorted(v for _, v in samples)
            self._dirty = False
            self._sorted_at = now
        return self._sorted

    def __len__(self) -> int:
        return len(self._samples)


class Tracker:
    """Latency state of one backend (`parent` None) or of one upstream model on it; every update
    is O(1).

    The backend's slots count `inflight` (a model's tracker reads and writes its parent's).
    """

    def __init__(
        self,
        window_s: float = 60.0,
        max_samples: int = 512,
        clock: Callable[[], float] = time.monotonic,
        *,
        decay_s: float = 3.0,
        rise: float = 0.5,
        slope_memory: int = 64,
        error_memory: int = 10,
        parent: Tracker | None = None,
    ) -> None:
        """decay_s: time constant of the level's fall (about 97% recovered after 10 s of fast samples).
        rise: share of an upward gap closed by one slow sample (0.5: a 20x spike shows as 10x at once,
        while a lone outlier on a noisy backend does not erase its history).
        slope_memory / error_memory: samples (not seconds) of memory, so idle time changes nothing.
        parent: the backend's tracker, for a model's (see the module's note)."""
        self.window_s = window_s
        self.max_samples = max_samples
        self.clock = clock
        self.decay_s = decay_s
        self.rise = rise
        self.parent = parent
        if parent is None:  # a model's tracker reads and writes its backend's (_ModelTracker)
            self.inflight = 0
        self._memory = (slope_memory, error_memory)
        self.ttft = Window(window_s, max_samples)
        self.itl = Window(window_s, max_samples)
        self.duration = Window(window_s, max_samples)
        self.whole = Window(window_s, max_samples)  # durations of answered non-streamed requests
        self.outcomes: deque[tuple[float, bool, bool]] = deque(maxlen=max_samples)  # (t, ok, timeout)
        self.total_requests = 0
        self.total_errors = 0
        self.total_timeouts = 0
        self.last_sample_at = -math.inf  # when the prediction last learned something
        # Prediction: level (peak-EWMA of TTFT - slope * prompt_tokens) and slope fit.
        self._level: float | None = None
        self._slope = 0.0
        self._fitted = False
        self._keep = 1.0 - 1.0 / slope_memory
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._itl_ewma: float | None = None
        self._streamed = False  # a stream's first token was ever timed here
        self._err_keep = 1.0 - 1.0 / error_memory
        self.error_ewma = 0.0  # share of recent attempts that failed (count-decayed)
        # One tenant's rising samples and `asked` failures move the level and the error rate only
        # so far until another's agree (see the module's note). The runtime turns it on for
        # policies with several tenants.
        self.corroborate = False
        # The base and the claims are in terms of a usual prompt's TTFT (level + slope x mean
        # prompt), which a refit of the slope leaves as it was.
        self._base = 0.0  # the level no one tenant alone raised
        self._base_at = -math.inf
        self._claims: dict[str, tuple[float, float]] = {}  # tenant -> (its latest sample, when), oldest first
        self._fail_tenant: str | None = None  # whose `asked` failure waits for another's to agree
        self._fail_at = -math.inf

    def for_model(self) -> Tracker:
        """A new tracker for one of this backend's models, with this one's settings and as its parent."""
        slope_memory, error_memory = self._memory
        t = _ModelTracker(self.window_s, self.max_samples, self.clock, decay_s=self.decay_s, rise=self.rise,
                          slope_memory=slope_memory, error_memory=error_memory, parent=self)
        t.corroborate = self.corroborate
        return t

    # -- reports from the relay ------------------------------------------------------------------

    def observe_ttft(self, seconds: float, prompt_tokens: int | None = None, tenant: str | None = None) -> None:
        """A streamed request's first content token arrived `seconds` after it was sent (`tenant`:
        whose request it was; None: the gateway's own)."""
        if self.parent is not None:
            self.parent.observe_ttft(seconds, prompt_tokens, tenant)
        self._streamed = True
        now = self.clock()
        self.ttft.add(now, seconds)
        self._learn(now, seconds, prompt_tokens, fit=True, tenant=tenant)

    def observe_itl(self, seconds: float) -> None:
        """The gap between two content tokens of a stream."""
        if self.parent is not None:
            self.parent.observe_itl(seconds)
        self.itl.add(self.clock(), seconds)
        e = self._itl_ewma
        self._itl_ewma = seconds if e is None else e + 0.05 * (seconds - e)

    def observe_done(
        self,
        seconds: float,
        ok: bool,
        *,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        streamed: bool = True,
        timeout: bool = False,
        open_ended: bool = False,
        tenant: str | None = None,
        asked: bool = False,
    ) -> None:
        """An attempt ended after `seconds`: answered (ok) or failed.

        streamed=False with ok: the answer's TTFT is inferred as `seconds - completion_tokens * ITL`,
        so non-streamed traffic teaches the prediction too. Without the decode time (no completion
        count, or no inter-token time yet) the duration stands for it while the backend has only
        answered whole; once streams have shown real TTFTs, such an answer teaches nothing.
        timeout=True marks a first-token (or whole-answer) deadline: `seconds` is then a lower
        bound of the TTFT and raises the level, so a stuck backend ranks last even though it never
        produced a sample. `open_ended` with a timeout: a whole answer the request set no length
        limit on, cut at its deadline: counted (errors, timeouts), but neither the error rate nor
        the TTFT learns from it (how long it ran was the caller's choice: one such answer raised
        the predicted TTFT 7 ms -> 1 s and moved every tenant's traffic; review helper's repro).
        `asked`: a failure of a kind the request may have caused (health.OUTCOMES); with
        `corroborate`, one tenant's such failures teach the error rate only once another tenant's
        agree (`_agreed_failure`).
        """
        if self.parent is not None:
            self.parent.observe_done(seconds, ok, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                     streamed=streamed, timeout=timeout, open_ended=open_ended, tenant=tenant, asked=asked)
        now = self.clock()
        self.duration.add(now, seconds)
        self.outcomes.append((now, ok, timeout))
        self.total_requests += 1
        # A timeout of a prompt far larger than this backend's usual says more about the prompt:
        # neither an error nor a TTFT bound for everyone's prediction (see outsized()).
        outsized = timeout and (open_ended or (prompt_tokens is not None and self.outsized(prompt_tokens)))
        if not ok:
            self.total_errors += 1
            if not outsized:
                self._failure(now, tenant if asked else None)
        else:
            self.error_ewma *= self._err_keep
        if timeout:
            self.total_timeouts += 1
            if not outsized:
                self._learn(now, seconds, prompt_tokens, fit=False, tenant=tenant)
        elif ok and not streamed:
            self.whole.add(now, seconds)
            itl = self._itl_ewma
            if completion_tokens == 0:  # nothing decoded (embeddings): all of it was the wait
                ttft = seconds
            elif completion_tokens is not None and itl is not None:
                ttft = max(seconds - completion_tokens * itl, 0.0)
            elif not self._streamed:  # whole answers only: the prediction ranks them by duration
                ttft = seconds
            else:  # streams taught it real TTFTs: a duration of unknown decode time would read as a spike
                return
            self._learn(now, ttft, prompt_tokens, fit=True, tenant=tenant)

    # -- prediction ----------------------------------------------------------------------------

    def _learn(self, now: float, ttft: float, prompt_tokens: int | None, *, fit: bool, tenant: str | None = None) -> None:
        x = self._mean_x() if prompt_tokens is None else float(prompt_tokens)
        if not self._fitted and prompt_tokens is not None and self.outsized(prompt_tokens):
            # Before the slope is fitted the level holds whole TTFTs: one far larger prompt's
            # prefill would read as the backend slowing down for every prompt. It teaches the fit.
            if fit:
                self._fit(x, ttft)
            return
        residual = ttft - self._slope * x
        level = self._level
        # What another tenant's latest sample agrees with of this one (as a usual prompt's TTFT;
        # -inf: no other tenant's within the window, or not corroborating).
        agreed = -math.inf
        corroborating = self.corroborate
        if corroborating and tenant is not None:
            usual = self._slope * self._mean_x()
            if level is not None and math.isinf(self._base_at):  # corroboration just began: the base is the level
                self._base, self._base_at = level + usual, now
            others = self._claim(now, tenant, residual + usual)
            agreed = min(residual + usual, others)
            if level is not None and residual > level:
                allowed = max(2.0 * max(self._base, _MIN_BASE_S), others) - usual
                if residual > allowed:
                    # One tenant's, past what the base and the others allow: a bounded rise, nothing
                    # fitted, and no sample as far as idleness goes.
                    if allowed > level:
                        self._level = level + self.rise * (allowed - level)
                    self._follow(now, tenant, agreed)
                    return
        if level is None:
            self._level = residual
        elif residual > level:
            self._level = level + self.rise * (residual - level)
        else:
            # Weight by elapsed time: ~decay_s of samples replace the level, whatever the rate.
            w = 1.0 - math.exp(-(now - self.last_sample_at) / self.decay_s)
            if residual > 0.0 and level > 0.0:
                # Geometric, since latencies differ by factors: a 20x gap closes as fast as a 2x one.
                self._level = level * (residual / level) ** w
            else:
                self._level = level + w * (residual - level)
        if corroborating:
            self._follow(now, tenant, agreed)
        else:
            self._base_at = -math.inf  # not kept meanwhile: it restarts from the level
        self.last_sample_at = now
        if fit and prompt_tokens is not None:
            self._fit(x, ttft)

    def _claim(self, now: float, tenant: str, u: float) -> float:
        """Record `tenant`'s latest sample (`u`, as a usual prompt's TTFT); the highest latest
        sample of another tenant within `_SPIKE_WINDOW_S` (-inf: none)."""
        claims = self._claims
        horizon = now - _SPIKE_WINDOW_S
        claims.pop(tenant, None)
        while claims:  # oldest first: the stale ones, and the oldest past _MAX_CLAIMS - 1, go
            oldest = next(iter(claims))
            if claims[oldest][1] >= horizon and len(claims) < _MAX_CLAIMS:
                break
            del claims[oldest]
        others = -math.inf
        for v, _ in claims.values():  # a plain loop: ~2x a max() over a generator, per sample
            if v > others:
                others = v
        claims[tenant] = (u, now)
        return others

    def _follow(self, now: float, tenant: str | None, agreed: float) -> None:
        """Move the base after the level moved: down with it at once; up at once as far as this
        sample and another tenant's latest both go (`agreed`); for a tenant alone (no other's
        sample within `_SPIKE_WINDOW_S`), up over ~`_BASE_RISE_S`; to the level for the gateway's
        own sample, or without `corroborate`."""
        assert self._level is not None
        level = self._level + self._slope * self._mean_x()
        base = self._base
        if tenant is None or not self.corroborate or level <= base or math.isinf(self._base_at):
            base = level
        elif math.isinf(agreed):  # idle time counts for nothing: waiting raises no base
            base += (1.0 - math.exp(-min(now - self._base_at, _BASE_STEP_S) / _BASE_RISE_S)) * (level - base)
        else:
            base = max(base, min(level, agreed))
        self._base, self._base_at = base, now

    def _failure(self, now: float, tenant: str | None) -> None:
        """A failure for the error rate. `tenant`: whose request met a failure of a kind a request
        can cause (None: the backend's own kind, or the gateway's request). With `corroborate`, one
        tenant's such failure waits until another tenant's agrees within `_SPIKE_WINDOW_S`, and then
        both count; until then it neither raises the rate nor lets it decay."""
        n = 1
        if tenant is not None and self.corroborate:
            held = self._fail_tenant
            if held is None or held == tenant or now - self._fail_at > _SPIKE_WINDOW_S:
                self._fail_tenant, self._fail_at = tenant, now
                return
            self._fail_tenant, n = None, 2
        keep = self._err_keep
        for _ in range(n):
            self.error_ewma = self.error_ewma * keep + (1.0 - keep)

    def _fit(self, x: float, y: float) -> None:
        k = self._keep
        self._sw = self._sw * k + 1.0
        self._sx = self._sx * k + x
        self._sy = self._sy * k + y
        self._sxx = self._sxx * k + x * x
        self._sxy = self._sxy * k + x * y
        var_x = self._sxx * self._sw - self._sx * self._sx
        # Refit only once prompt sizes actually vary (std >= 32 tokens), else the slope is noise.
        if self._sw >= 8 and var_x > (32.0 * self._sw) ** 2:
            slope = max(0.0, (self._sxy * self._sw - self._sx * self._sy) / var_x)
            if not self._fitted:
                # Until now the level held whole TTFTs, peaks of long prompts included: restart it
                # from the fit's intercept.
                self._fitted = True
                self._level = (self._sy - slope * self._sx) / self._sw
            elif self._level is not None:
                self._level -= (slope - self._slope) * self._mean_x()  # keep the mean prediction
            self._slope = slope

    def _mean_x(self) -> float:
        return self._sx / self._sw if self._sw else 0.0

    def outsized(self, prompt_tokens: int) -> bool:
        """Whether a prompt is far beyond the sizes this backend's answers were measured on (more
        than 4x their mean and 2,048 tokens over it): its timeout says more about the prompt than
        about the backend, and must not raise everyone's predicted TTFT (two 300 KB prompts moved
        another tenant's traffic off a backend). Unknown (fewer than 8 answers): no."""
        if self._sw < 8:
            return False
        mean = self._mean_x()
        return prompt_tokens > 4 * mean and prompt_tokens > mean + 2048

    def predict_ttft(self, prompt_tokens: int | None = None) -> float | None:
        """Expected TTFT in seconds for a prompt of this size; None before the first sample (a
        model's tracker: its backend's prediction until then)."""
        level = self._level
        if level is None:
            return None if self.parent is None else self.parent.predict_ttft(prompt_tokens)
        x = self._mean_x() if prompt_tokens is None else prompt_tokens
        return max(level + self._slope * x, 0.0)

    @property
    def slope_s_per_token(self) -> float:
        """Fitted prefill cost per prompt token, in seconds (0 until prompt sizes vary)."""
        return self._slope

    def idle_s(self) -> float:
        """Seconds since the prediction last learned something (inf when it never did; a model's
        tracker that never did: its backend's, whose prediction it stands on until then)."""
        if self._level is None and self.parent is not None:
            return self.parent.idle_s()
        return self.clock() - self.last_sample_at

    def first_token_deadline_s(
        self,
        default_s: float,
        floor_s: float = 2.0,
        *,
        prompt_tokens: int | None = None,
        mult: float = 2.0,
        min_samples: int = 20,
        cold_s: float | None = None,
    ) -> float:
        """How long to wait for this backend's first token: mult x its live TTFT P95, at least
        floor_s, at most default_s (the configured timeout). Until min_samples exist: cold_s (at
        most default_s), else default_s.

        Only answered requests count towards the P95 (timeouts are censored), so a stuck backend
        does not stretch its own deadline. A prompt longer than usual adds its fitted prefill time.
        """
        ttft = self.ttft.sorted(self.clock(), _SORT_EVERY_S)
        if len(ttft) < min_samples:
            return default_s if cold_s is None else min(default_s, cold_s)
        p95 = quantile(ttft, 0.95) or 0.0
        if prompt_tokens is not None:
            p95 += self._slope * max(0.0, prompt_tokens - self._mean_x())
        return min(default_s, max(floor_s, mult * p95))

    def token_deadline_s(self, cold_s: float, *, mult: float = 2.0, min_samples: int = 20) -> float:
        """How long one generated token may take within a whole (non-streamed) answer: mult x the
        live inter-token P99; cold_s until min_samples exist."""
        itl = self.itl.sorted(self.clock(), _SORT_EVERY_S)
        if len(itl) < min_samples:
            return cold_s
        return mult * (quantile(itl, 0.99) or 0.0)

    def whole_deadline_s(self, *, mult: float = 2.0, min_samples: int = 20) -> float:
        """mult x the live P95 of this backend's answered non-streamed requests' durations; 0
        until min_samples exist."""
        whole = self.whole.sorted(self.clock(), _SORT_EVERY_S)
        if len(whole) < min_samples:
            return 0.0
        return mult * (quantile(whole, 0.95) or 0.0)

    def idle_deadline_s(self, default_s: float, floor_s: float, cold_s: float, *, mult: float = 20.0, min_samples: int = 20) -> float:
        """How long a stream of this backend may pause mid-answer before it counts as stalled:
        mult x its live inter-token P99, at least floor_s, at most default_s; cold_s (at most
        default_s) until min_samples exist."""
        itl = self.itl.sorted(self.clock(), _SORT_EVERY_S)
        if len(itl) < min_samples:
            return min(default_s, cold_s)
        return min(default_s, max(floor_s, mult * (quantile(itl, 0.99) or 0.0)))

    def ttft_p95_s(self, prompt_tokens: int | None = None, min_samples: int = 10) -> float | None:
        """The live TTFT P95 for a prompt of this size (None until min_samples exist): when a
        first token is later than this, a hedge may start."""
        ttft = self.ttft.sorted(self.clock(), _SORT_EVERY_S)
        if len(ttft) < min_samples:
            return None
        p95 = quantile(ttft, 0.95) or 0.0
        if prompt_tokens is not None:
            p95 += self._slope * max(0.0, prompt_tokens - self._mean_x())
        return p95

    # -- reporting -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, float | int | None]:
        """The numbers /admin/backends and /v1/route/explain show (exact, not cached)."""
        now = self.clock()
        ttft = self.ttft.sorted(now)
        itl = self.itl.sorted(now)
        dur = self.duration.sorted(now)
        outcomes = self.outcomes
        horizon = now - self.window_s
        while outcomes and outcomes[0][0] < horizon:
            outcomes.popleft()
        n = len(outcomes)
        errors = sum(1 for _, ok, _ in outcomes if not ok)
        timeouts = sum(1 for _, _, to in outcomes if to)
        predicted = self.predict_ttft()
        return {
            "inflight": self.inflight,
            "requests": n,
            "errors": errors,
            "error_rate": round(errors / n, 4) if n else 0.0,
            "timeouts": timeouts,
            "timeout_rate": round(timeouts / n, 4) if n else 0.0,
            "ttft_p50_ms": _ms(quantile(ttft, 0.5)),
            "ttft_p95_ms": _ms(quantile(ttft, 0.95)),
            "ttft_p99_ms": _ms(quantile(ttft, 0.99)),
            "inter_token_p50_ms": _ms(quantile(itl, 0.5)),
            "inter_token_p95_ms": _ms(quantile(itl, 0.95)),
            "inter_token_p99_ms": _ms(quantile(itl, 0.99)),
            "duration_p50_ms": _ms(quantile(dur, 0.5)),
            "duration_p95_ms": _ms(quantile(dur, 0.95)),
            "duration_p99_ms": _ms(quantile(dur, 0.99)),
            "predicted_ttft_ms": _ms(predicted),
            "ttft_ms_per_1k_prompt_tokens": round(self._slope * 1e6, 2),
            "error_ewma": round(self.error_ewma, 4),
            "idle_s": None if math.isinf(self.last_sample_at) else round(now - self.last_sample_at, 3),
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


class _ModelTracker(Tracker):
    """A model's tracker: attempts in flight are its backend's (the backend's slots count them
    there), read and written through; a plain attribute on the backend's own, the hot path's."""

    @property
    def inflight(self) -> int:
        assert self.parent is not None
        return self.parent.inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        assert self.parent is not None
        self.parent.inflight = n
