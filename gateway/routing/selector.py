"""Pure ranking of a request's candidate backends; no I/O, no clock of its own.

`Selector.rank()` orders the candidates: the eligible ones first, the pick first of all, then the
rest best first (the failover order); the ineligible ones last, least bad first, each with the
reason it was skipped. Health decides eligibility, the tracker predicts, the selector only ranks.

The `latency` strategy scores a candidate as

    predicted_ttft(prompt_tokens) * (1 + queue_weight * inflight + waiting / max(1, running))
        + error_penalty_s * error_ewma + cost_weight_s * cost

(`waiting` and `running` from the backend's metrics_url while its scrape is fresh, else 0), and picks at random among those within `tie_pct` of the best (so replicas with the same view do
not herd), or, with `p2c_min` or more eligible candidates, the better of two drawn at random from
those within `p2c_band` of the best. Two exceptions keep estimates honest without letting an idle
degraded backend look good (its estimate never decays while idle):

- cold start: a candidate without samples is scored at the median of the others' predictions, and
  gets one request at once if nothing is in flight to it;
- exploration: an eligible candidate that has learned nothing for `explore_after_s` and has nothing
  in flight gets one request, at most once every `explore_every` picks of this selector, so a
  healed backend is noticed within seconds while a degraded one costs well under 5% of traffic.

`Selector.peeking()` ranks for /v1/route/explain: what the next rank() would say, changing nothing
(the counters are a copy's, and where the pick is drawn at random it names what it is drawn from).
"""

from __future__ import annotations

import copy
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from .health import Health
from .latency import Tracker
from .load import Load, LoadSample

__all__ = ["Candidate", "Ranked", "Selector", "STRATEGIES", "skip_reason", "usable"]

STRATEGIES = ("latency", "round_robin", "least_inflight", "weighted", "ordered")

_MIN_BASE_S = 1e-3  # so that in-flight load still orders candidates predicted at ~0 s


@dataclass(frozen=True, slots=True)
class Candidate:
    """One backend as the selector sees it. Holds live references: build it once per route."""

    name: str
    tracker: Tracker  # its route's upstream model's on the backend (`inflight`: the backend's)
    health: Health
    weight: float = 1.0  # for `weighted`
    cost: float = 0.0  # in any unit; Selector.cost_weight_s says how many seconds one unit is worth
    load: Load | None = None  # the model server's own load gauges (metrics_url), when scraped
    local: bool = False  # a local model (routing.simple: local_first)

    def _sample(self, now: float, stale_s: float) -> LoadSample | None:
        return None if self.load is None else self.load.fresh(now, stale_s)

    def queued(self, now: float, stale_s: float) -> float:
        """Requests its model server reports waiting, by a fresh scrape (0 without one)."""
        s = self._sample(now, stale_s)
        return 0.0 if s is None else s.waiting

    def outstanding(self, now: float, stale_s: float) -> float:
        """Requests on it: ours in flight, or what its metrics report (running + waiting, everyone's,
        ours among them) when a fresh scrape says more."""
        s = self._sample(now, stale_s)
        mine = float(self.tracker.inflight)
        return mine if s is None else max(mine, s.running + s.waiting)

    def queue_rounds(self, now: float, stale_s: float) -> float:
        """The server's queue in rounds of its batch (waiting / running, at least 1 running): how
        many predicted first tokens a new request waits behind, roughly."""
        s = self._sample(now, stale_s)
        return 0.0 if s is None else s.waiting / max(1.0, s.running)


class Ranked(NamedTuple):
    """A candidate's place in the ranking. `index` points into the sequence given to rank().

    A NamedTuple, not a frozen dataclass: rank() builds one per candidate per request, and a frozen
    dataclass's __init__ costs ~3 us on the hot path where a tuple costs ~0.3 us."""

    name: str
    index: int  # type: ignore[assignment]  # the field, not tuple.index
    predicted_ttft_s: float | None  # the tracker's prediction for this prompt (None: no samples)
    score: float  # the strategy's sort key, lower ranks earlier; inf when skipped
    skipped: str | None = None  # why it is not eligible: starting, ejected, cooling, probing
    note: str | None = None  # why it is where it is: tie, p2c, explore, prior, last resort
    last_resort: bool = False  # skipped, but the one to try when no candidate is available
    explore: bool = False  # picked to refresh its estimate (cold start, exploration): keep it first


def skip_reason(c: Candidate) -> str | None:
    """Why `c` should get no traffic now (None when it may)."""
    state = c.health.state()
    if state == "healthy":
        return None
    if state == "probing":
        # Half-open: one trial request at a time decides whether it is back.
        return "probing: a trial request is in flight" if c.tracker.inflight > 0 else None
    return state


def _least_bad_key(c: Candidate) -> tuple[float, int, int]:
    return (c.health.available_in(), c.health.consecutive_failures, c.tracker.inflight)


def usable(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates that may take traffic, in the given order.

    When none may, the least bad one alone (the soonest back, then the fewest failures): health
    never takes the last backend out of a route, since an answer from a doubtful backend beats a
    certain error. Backends still starting are never returned: they cannot answer at all.
    """
    ok = [c for c in candidates if skip_reason(c) is None]
    if ok:
        return ok
    rest = [c for c in candidates if c.health.is_ready()]
    return [min(rest, key=_least_bad_key)] if rest else []


class Selector:
    """Ranks candidates with one strategy. Keeps a little state (round-robin position, exploration
    budget), so keep one per model route and replace it with the route on reload."""

    def __init__(
        self,
        strategy: str = "latency",
        *,
        rng: random.Random | None = None,
        tie_pct: float = 0.05,
        cost_weight_s: float = 0.0,
        queue_weight: float = 0.1,
        error_penalty_s: float = 1.0,
        explore_after_s: float = 3.0,
        explore_every: int = 50,
        p2c_min: int = 6,
        p2c_band: float = 0.5,
        load_stale_s: float = 5.0,
    ) -> None:
        """queue_weight: each request in flight adds this share of the predicted TTFT (1.0 is the
        classic peak-EWMA; measured TTFT already reflects load, so a small share only breaks ties
        and stops herding between measurements). error_penalty_s: seconds added at a 100% recent
        error rate. explore_after_s=0 turns exploration off (cold start still explores)."""
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown routing strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
        self.strategy = strategy
        self.rng = rng or random.Random()
        self.tie_pct = tie_pct
        self.cost_weight_s = cost_weight_s
        self.queue_weight = queue_weight
        self.error_penalty_s = error_penalty_s
        self.explore_after_s = explore_after_s
        self.explore_every = explore_every
        self.p2c_min = p2c_min
        self.p2c_band = p2c_band
        self.load_stale_s = load_stale_s
        self._rr = 0
        self._since_explore = explore_every  # a silent backend may be explored on the first pick
        # A peeking copy (peeking()): draws nothing from `rng`; `drawn` names the candidates the
        # live selector's pick would be drawn from at random (empty: its pick is certain).
        self._peeking = False
        self.drawn: tuple[str, ...] = ()

    def peeking(self) -> Selector:
        """A copy that ranks as this selector's next rank() would, changing nothing here (for
        /v1/route/explain: an explain that advanced the round-robin position, the exploration
        budget or the random draws moved the real traffic, and never said where the next request
        goes). Its counters are the copy's own; it draws nothing at random: where this selector
        draws its pick (best of two, a tie, least_inflight's equally loaded, weighted), the copy
        ranks best first (the lowest score, the least loaded, the heaviest) and its `drawn`
        names the candidates the pick is drawn from (one rank() per copy: a certain pick leaves it
        empty)."""
        peek = copy.copy(self)
        peek._peeking = True
        peek.drawn = ()
        return peek

    def rank(self, candidates: Sequence[Candidate], prompt_tokens: int | None = None) -> list[Ranked]:
        """All candidates, eligible first (the pick first, then best first), skipped ones last."""
        eligible: list[tuple[int, Candidate, float | None]] = []
        skipped: list[tuple[int, Candidate, float | None, str]] = []
        for i, c in enumerate(candidates):
            pred = c.tracker.predict_ttft(prompt_tokens)
            h = c.health
            # Fast path for the common case (fully healthy); skip_reason() decides the rest.
            if h.clear(h.clock()):
                eligible.append((i, c, pred))
                continue
            reason = skip_reason(c)
            if reason is None:
                eligible.append((i, c, pred))
            else:
                skipped.append((i, c, pred, reason))
        if self.strategy == "latency":
            out = self._latency(eligible)
        elif self.strategy == "round_robin":
            out = self._round_robin(eligible)
        elif self.strategy == "least_inflight":
            out = self._least_inflight(eligible)
        elif self.strategy == "ordered":
            out = [Ranked(c.name, i, p, float(k)) for k, (i, c, p) in enumerate(eligible)]
        else:
            out = self._weighted(eligible)
        skipped.sort(key=lambda s: _least_bad_key(s[1]))
        for n, (i, c, pred, reason) in enumerate(skipped):
            last = not out and n == 0 and c.health.is_ready()
            out.append(Ranked(c.name, i, pred, math.inf, reason, "last resort: no candidate is available" if last else None, last))
        return out

    # -- strategies ------------------------------------------------------------------------------

    def _latency(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        if not eligible:
            return []
        prior = None
        if any(p is None for _, _, p in eligible):
            known = sorted(p for _, _, p in eligible if p is not None)
            prior = known[len(known) // 2] if known else None
        qw, ep, cw = self.queue_weight, self.error_penalty_s, self.cost_weight_s
        now, stale = time.monotonic(), self.load_stale_s
        scored: list[tuple[float, int, Candidate, float | None]] = []
        for i, c, pred in eligible:
            base = pred if pred is not None else prior
            if base is None or base < _MIN_BASE_S:
                base = _MIN_BASE_S
            t = c.tracker
            # A queue the server reports (other clients' load too) delays the first token by about
            # one predicted TTFT per round of its batch.
            ld = c.load
            if ld is not None and ld.sample is not None and now - ld.at <= stale:  # inline: per candidate, per request
                score = base * (1.0 + qw * t.inflight + ld.sample.waiting / max(1.0, ld.sample.running))
            else:
                score = base * (1.0 + qw * t.inflight)
            score += ep * t.error_ewma + cw * c.cost
            scored.append((score, i, c, pred))
        scored.sort(key=itemgetter(0))
        self._since_explore += 1
        pick, note = self._explore(scored)
        explored = pick is not None
        if pick is None:
            pick, note = self._pick_best(scored)
        first = scored.pop(pick)
        ranked = [Ranked(first[2].name, first[1], first[3], first[0], None, note or _prior_note(first[3]), False, explored)]
        ranked += [Ranked(c.name, i, p, s, None, _prior_note(p)) for s, i, c, p in scored]
        return ranked

    def _explore(self, scored: list[tuple[float, int, Candidate, float | None]]) -> tuple[int | None, str | None]:
        """A candidate owed a request to refresh its estimate: never measured, or silent too long."""
        budget = self.explore_after_s > 0 and self._since_explore >= self.explore_every
        best: tuple[int, float] | None = None
        # The natural pick (0) last: prefix affinity may pass it over, and then only this keeps it measured.
        for n in (*range(1, len(scored)), 0):
            if n == 0 and best is not None:
                break
            c = scored[n][2]
            t = c.tracker
            if t.inflight or not (budget or t.total_requests == 0):
                continue
            if c.load is not None and c.queued(time.monotonic(), self.load_stale_s) > 0:
                continue  # its own metrics say it is busy: nothing to learn by adding to its queue
            idle = t.idle_s()
            cold = t.total_requests == 0 and math.isinf(idle)
            if cold or (budget and idle >= self.explore_after_s):
                if best is None or idle > best[1]:
                    best = (n, idle)
        if best is None:
            return None, None
        n, idle = best
        tracker = scored[n][2].tracker
        if tracker.total_requests == 0 and math.isinf(idle):
            return n, "cold start: no samples yet"
        self._since_explore = 0
        return n, "explore: no sample yet" if math.isinf(idle) else f"explore: no sample for {idle:.1f} s"

    def _pick_best(self, scored: list[tuple[float, int, Candidate, float | None]]) -> tuple[int, str | None]:
        best = scored[0][0]
        if len(scored) >= self.p2c_min:
            band = best * (1.0 + self.p2c_band)
            within = 1
            while within < len(scored) and scored[within][0] <= band:
                within += 1
            if within >= 2:
                if self._peeking:
                    return self._peek_two(scored, within)
                rnd = self.rng.random
                a, b = int(rnd() * within), int(rnd() * (within - 1))
                a, b = (a, b + 1) if b >= a else (b, a)  # two distinct draws, a < b
                if scored[b][0] <= scored[a][0] * (1.0 + self.tie_pct):
                    a = self.rng.choice((a, b))  # a near tie: either, or equal scores starve one
                return a, "best of two"
        limit = best * (1.0 + self.tie_pct)
        ties = 1
        while ties < len(scored) and scored[ties][0] <= limit:
            ties += 1
        if ties == 1:
            return 0, None
        if self._peeking:
            self.drawn = tuple(c.name for _, _, c, _ in scored[:ties])
            return 0, f"tie among {ties}: drawn at random"
        return self.rng.randrange(ties), f"tie among {ties}"

    def _peek_two(self, scored: list[tuple[float, int, Candidate, float | None]], within: int) -> tuple[int, str]:
        """_pick_best's best of two, without drawing: the best first, and the candidates either draw
        may pick in `drawn`. The lower of two distinct draws among the `within` wins, so any but
        the last of them may; the last only as a near tie with the one before it."""
        last = within - 1
        n = within if scored[last][0] <= scored[last - 1][0] * (1.0 + self.tie_pct) else last
        if n > 1:
            self.drawn = tuple(c.name for _, _, c, _ in scored[:n])
            return 0, f"best of two drawn at random among {n}"
        return 0, "best of two"

    def _round_robin(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        n = len(eligible)
        if not n:
            return []
        start = self._rr % n
        self._rr += 1
        order = eligible[start:] + eligible[:start]
        return [Ranked(c.name, i, p, float(k)) for k, (i, c, p) in enumerate(order)]

    def _least_inflight(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        if self._peeking:
            return self._peek_least_inflight(eligible)
        rnd = self.rng.random
        keyed = sorted(((c.tracker.inflight, rnd(), i, c, p) for i, c, p in eligible), key=lambda k: (k[0], k[1]))
        return [Ranked(c.name, i, p, float(load)) for load, _, i, c, p in keyed]

    def _peek_least_inflight(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        """_least_inflight without drawing: equally loaded ones in the given order, and the least
        loaded ones (which the live one orders at random) in `drawn`."""
        keyed = sorted(eligible, key=lambda e: e[1].tracker.inflight)
        low = [c.name for _, c, _ in keyed if c.tracker.inflight == keyed[0][1].tracker.inflight] if keyed else []
        self.drawn = tuple(low) if len(low) > 1 else ()
        out = [Ranked(c.name, i, p, float(c.tracker.inflight)) for i, c, p in keyed]
        if self.drawn:
            out[0] = out[0]._replace(note=f"least in flight: drawn at random among {len(low)}")
        return out

    def _weighted(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        if self._peeking:
            return self._peek_weighted(eligible)
        if not eligible:
            return []
        total = sum(max(c.weight, 0.0) for _, c, _ in eligible)
        pick = 0
        if total > 0:
            r = self.rng.random() * total
            for pick, (_, c, _) in enumerate(eligible):
                r -= max(c.weight, 0.0)
                if r < 0:
                    break
        rest = sorted(eligible[:pick] + eligible[pick + 1 :], key=lambda e: -e[1].weight)
        order = [eligible[pick], *rest]
        return [Ranked(c.name, i, p, float(k)) for k, (i, c, p) in enumerate(order)]

    def _peek_weighted(self, eligible: list[tuple[int, Candidate, float | None]]) -> list[Ranked]:
        """_weighted without drawing: the heaviest first, the rest as the live one orders them, and
        every candidate with a weight (what the live one draws from, by weight) in `drawn`."""
        if not eligible:
            return []
        heavy = [c.name for _, c, _ in eligible if c.weight > 0]
        pick = 0
        if heavy:  # no weight at all: the live one takes the first
            pick = max(range(len(eligible)), key=lambda k: eligible[k][1].weight)
        self.drawn = tuple(heavy) if len(heavy) > 1 else ()
        rest = sorted(eligible[:pick] + eligible[pick + 1 :], key=lambda e: -e[1].weight)
        order = [eligible[pick], *rest]
        out = [Ranked(c.name, i, p, float(k)) for k, (i, c, p) in enumerate(order)]
        if self.drawn:
            out[0] = out[0]._replace(note=f"weighted: drawn at random among {len(heavy)}, by weight")
        return out


def _prior_note(pred: float | None) -> str | None:
    return "no samples: scored at the median of the others" if pred is None else None
