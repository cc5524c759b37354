"""Admission control: bounded concurrency with a priority queue that is fair across tenants.

A Gate admits at most `limit` holders; the rest wait in a FairQueue:
- bands `priority` > `default` > `flex`: a higher band is always dispatched first, except that
  while a lower band waits, one dispatch in every 1/`starvation_share` goes to the lower band
  whose head has waited longest (the starvation guard);
- inside a band, deficit round robin across tenants, weighted by tokens (each waiter costs its
  token estimate; each visit adds `quantum x tenant weight`), so a tenant sending 10x its share
  cannot push a quiet tenant's wait up.

Shedding is the callers' decision, from `predicted_wait_s()`: a request whose predicted wait plus
its predicted TTFT exceeds its deadline is refused at once (503 + Retry-After), never left to time
out in the queue; one whose deadline comes while it waits leaves the queue (504), unsent. The
global gate is the pipeline's admission stage (`Admission`); each backend's slots are a Gate too
(backends.Slots).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["BANDS", "MAX_COST", "MAX_RETRY_AFTER_S", "Ticket", "FairQueue", "Gate", "Admission", "Shed", "reserve_slots"]

log = logging.getLogger("gateway.admission")

BANDS = ("priority", "default", "flex")
_AT_OR_ABOVE = {b: BANDS[: i + 1] for i, b in enumerate(BANDS)}  # asked on every admission: no slicing then
_QUANTUM = 256  # tokens of credit per round-robin visit (x the tenant's weight)
# A waiter's cost at most (a trillion tokens, past any answer): the credit is a float, exact at
# this size, and a max_tokens of 2^63 would have been past what a quantum can still add to.
MAX_COST = 1 << 40
# A request may be predicted to wait at most this share of what is left of its deadline (after
# its first token): later arrivals of higher bands and quieter tenants overtake it, so the real
# wait of a lower band runs longer than predicted, and a standing queue only adds latency.
MAX_WAIT_SHARE = 0.6
# The longest Retry-After a shed advertises: a predicted wait or a service time past a minute says
# "overloaded", not when to come back (a measured 600 s hold once told clients to wait 10 minutes).
MAX_RETRY_AFTER_S = 60.0
# The admission gate's service time is the median hold of the last _HOLDS admitted requests; once
# that window is full it is sorted again at most every _RESORT_S (every waiting arrival reads it).
_HOLDS = 64
_RESORT_S = 0.5


class Shed(Exception):
    """Refused by admission: `reason` is queue_full or deadline (metrics), `retry_after_s` a hint,
    `waited_s` how long it had waited in the queue (0: refused as it came; refuse_waiter sets it)."""

    def __init__(self, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.waited_s = 0.0


@dataclass(slots=True)
class Ticket:
    """Who would wait, in which band, for how many tokens: a request's (call.ticket), and a place
    in a FairQueue. Gate.acquire queues a copy of the caller's, so a request's own ticket is never
    in a queue and may wait at one gate after another."""

    band: str = "default"
    tenant: str = ""
    cost: int = 1
    weight: float = 1.0
    fut: asyncio.Future[None] | None = None
    enqueued: float = field(default_factory=time.monotonic)
    gone: bool = False  # left the queue (cancelled or timed out): skipped when popped


class FairQueue:
    """Waiters by band, deficit round robin across tenants inside a band. O(1) push and pop
    (cancelled waiters are skipped lazily, and swept out of a tenant's queue once they outnumber
    its live ones); `position()` and `push_out()` are O(tenants waiting in the band), and only
    run when a request would have to wait. `name` says whose queue it is in the log."""

    def __init__(self, starvation_share: float = 0.1, name: str = "queue") -> None:
        self.starvation_share = starvation_share
        self.name = name
        self._q: dict[str, dict[str, deque[Ticket]]] = {b: {} for b in BANDS}
        self._rr: dict[str, deque[str]] = {b: deque() for b in BANDS}
        self._deficit: dict[str, dict[str, float]] = {b: {} for b in BANDS}
        self.sizes: dict[str, int] = dict.fromkeys(BANDS, 0)  # live waiters per band
        self._live: dict[str, dict[str, int]] = {b: {} for b in BANDS}  # live waiters per band and tenant
        self._weight: dict[str, dict[str, float]] = {b: {} for b in BANDS}  # each waiting tenant's (its newest's)
        self._since_lower = 0

    def __len__(self) -> int:
        return sum(self.sizes.values())

    def push(self, t: Ticket) -> None:
        band = self._q[t.band]
        q = band.get(t.tenant)
        if q is None:
            q = band[t.tenant] = deque()
            self._rr[t.band].append(t.tenant)
            self._deficit[t.band][t.tenant] = 0.0
        q.append(t)
        self.sizes[t.band] += 1
        live = self._live[t.band]
        live[t.tenant] = live.get(t.tenant, 0) + 1
        self._weight[t.band][t.tenant] = max(t.weight, 1e-9)

    def leave(self, t: Ticket) -> None:
        """`t` stops waiting (cancelled, timed out, pushed out): it no longer counts. A head that
        leaves is dropped at once with the credit it banked; one behind a live head is skipped
        later, or swept out with the others once the departed outnumber the live."""
        if t.gone:
            return
        t.gone = True
        self._uncount(t)
        q = self._q[t.band].get(t.tenant)
        if not q:
            return
        if q[0] is t:
            # The credit a tenant banked while its head was unaffordable was for that head: kept,
            # its cheap requests behind went 100 in a row ahead of everyone (a MAX_COST head parked,
            # then cancelled). DRR resets a queue that empties; one whose head leaves keeps at most
            # the quantum of one visit. (A head is never a departed ticket: they are dropped here.)
            while q and q[0].gone:
                q.popleft()
            deficit = self._deficit[t.band]
            deficit[t.tenant] = min(deficit[t.tenant], _QUANTUM * q[0].weight) if q else 0.0
        if len(q) > 3 * self._live[t.band].get(t.tenant, 0) + 16:
            # More than twice as many departed as live behind a live head (one parked head kept
            # 50,000 cancelled waiters, 14.5 MB): sweep them out. Amortized O(1) a departure; the
            # head stays, so the credit, the counts and the order of the live ones do too.
            keep = [w for w in q if not w.gone]
            q.clear()
            q.extend(keep)

    def _uncount(self, t: Ticket) -> None:
        sizes, live = self.sizes, self._live[t.band]
        n = live.get(t.tenant, 0) - 1
        if n < 0 or sizes[t.band] <= 0:
            # A safety net, never meant to catch: a waiter counted out twice drove a band's size to
            # -1 (its waiters then got 503 for good) and raised KeyError out of another's release().
            log.error("%s: a %s waiter of tenant %r was counted out again (one ticket queued twice?); its counts stay at zero",
                      self.name, t.band, t.tenant)
            return
        sizes[t.band] -= 1
        if n:
            live[t.tenant] = n
        else:
            del live[t.tenant], self._weight[t.band][t.tenant]

    def next_band(self) -> str | None:
        """The band pop() would serve now (None when nobody waits)."""
        waiting = [b for b in BANDS if self.sizes[b] > 0]
        if not waiting:
            return None
        if len(waiting) > 1 and self.starvation_share > 0 and self._since_lower + 1 >= self._guard_every():
            return max(waiting[1:], key=self._head_wait)
        return waiting[0]

    def pop(self, band: str | None = None) -> Ticket | None:
        """The next waiter to dispatch (None when nobody waits): of `band`, else of next_band()."""
        band = band or self.next_band()
        if band is None:
            return None
        lower_waits = any(self.sizes[b] for b in BANDS[BANDS.index(self._top()) + 1 :])
        if lower_waits and self.starvation_share > 0:
            self._since_lower = 0 if band != self._top() else self._since_lower + 1
        else:
            self._since_lower = 0
        return self._pop_band(band)

    def pop_newest_lowest(self) -> Ticket | None:
        """Take out the waiter a standing queue sheds: in the lowest band that waits, the newest of
        the tenant with the most waiting for its weight (its backlog made the queue stand). The
        newest across tenants shed a tenant with one request waiting as often as the one that
        queued thirty (50 % of its requests against 23 %: review helper's repro)."""
        band = next((b for b in reversed(BANDS) if self.sizes[b] > 0), None)
        return None if band is None else self._take_heaviest(band)

    def push_out(self, band: str, tenant: str, weight: float = 1.0) -> Ticket | None:
        """The queue is full and a (band, tenant) request arrives: the waiter it displaces, taken
        out of the queue, or None (the newcomer is refused). A lower band's waiter goes first (as a
        standing queue sheds: the newest of the tenant with the most waiting for its weight); in
        the newcomer's own band, the newest of the tenant holding the most of it for its weight,
        if that is more than the newcomer's tenant would hold with it. A full queue refused every
        newcomer: one tenant that filled it locked every other tenant out until it drained."""
        lowest = next((b for b in reversed(BANDS) if self.sizes[b] > 0), None)
        if lowest is None:
            return None
        if BANDS.index(lowest) > BANDS.index(band):
            return self._take_heaviest(lowest)
        return self._take_heaviest(band, above=(self._live[band].get(tenant, 0) + 1) / max(weight, 1e-9))

    def _take_heaviest(self, band: str, above: float = -1.0) -> Ticket | None:
        """Take out the newest waiter of the tenant of `band` with the most waiting for its weight
        (the later newest on a tie), if that share is over `above`; None otherwise. The shares are
        counts: only the heaviest tenants' queues are looked into (every tenant's, and at a full
        queue's every arrival, cost ~6 ms with 4,096 tenants waiting)."""
        live, weight = self._live[band], self._weight[band]
        top = max((n / weight[t] for t, n in live.items()), default=None)
        if top is None or top <= above:
            return None
        queues = self._q[band]
        victim: Ticket | None = None
        for tenant, n in live.items():
            if n / weight[tenant] == top:
                q = queues[tenant]
                while q[-1].gone:  # skipped when popped anyway; a live one is behind them
                    q.pop()
                if victim is None or q[-1].enqueued > victim.enqueued:
                    victim = q[-1]
        assert victim is not None
        self.leave(victim)
        return victim

    def waiting_at_or_above(self, band: str) -> bool:
        """Whether anyone of `band` or a higher band waits."""
        sizes = self.sizes
        for b in _AT_OR_ABOVE[band]:
            if sizes[b]:
                return True
        return False

    def top(self) -> str | None:
        """The highest band that waits (None when nobody does)."""
        return next((b for b in BANDS if self.sizes[b] > 0), None)

    def _top(self) -> str:
        return next(b for b in BANDS if self.sizes[b] > 0)

    def _guard_every(self) -> int:
        return max(1, round(1 / self.starvation_share))

    def position(self, band: str, tenant: str, weight: float = 1.0) -> int:
        """About how many waiters would be dispatched before a new one of (band, tenant)."""
        ahead = sum(self.sizes[b] for b in BANDS[: BANDS.index(band)])
        live = self._live[band]
        mine = live.get(tenant, 0)
        turns = int((mine + 1) / max(weight, 1e-9)) + 1
        for name, n in live.items():
            if name != tenant:  # round robin: each other tenant gets about as many turns as we wait
                ahead += min(n, turns)
        return ahead + mine

    def _head_wait(self, band: str) -> float:
        heads = [q[0].enqueued for q in self._q[band].values() if q]
        return time.monotonic() - min(heads) if heads else 0.0

    def _pop_band(self, band: str) -> Ticket | None:
        queues, rr, deficit = self._q[band], self._rr[band], self._deficit[band]
        idle = 0  # visits in a row that dispatched nobody
        while rr:
            tenant = rr[0]
            q = queues[tenant]
            while q and q[0].gone:
                q.popleft()
            if not q:
                del queues[tenant], deficit[tenant]
                rr.popleft()
                idle = 0
                continue
            head = q[0]
            if deficit[tenant] < head.cost:
                deficit[tenant] += _QUANTUM * head.weight
                if deficit[tenant] < head.cost:
                    rr.rotate(-1)  # not enough credit yet: the next tenant's turn
                    idle += 1
                    if idle >= len(rr):
                        self._skip_rounds(queues, rr, deficit)
                        idle = 0
                    continue
            q.popleft()
            head.gone = True  # dispatched: it no longer counts as waiting (its leave() is a no-op)
            deficit[tenant] -= head.cost
            self._uncount(head)
            while q and q[0].gone:
                q.popleft()
            if not q:
                del queues[tenant], deficit[tenant]
                rr.popleft()
            elif deficit[tenant] < q[0].cost:
                rr.rotate(-1)  # its turn ends
            return head
        return None


    @staticmethod
    def _skip_rounds(queues: dict[str, deque[Ticket]], rr: deque[str], deficit: dict[str, float]) -> None:
        """A whole round dispatched nobody: add at once the credit of the rounds that would
        dispatch nobody either (each tenant's quantum per round), up to the one where a head
        fits. One visit a round cost a waiter's cost / 256 turns: a max_tokens of 2.5 billion
        stalled the event loop 2.3 s, 2^63 for good."""
        rounds = min(int((queues[t][0].cost - deficit[t]) // (_QUANTUM * queues[t][0].weight)) for t in rr)
        if rounds > 1:
            for t in rr:
                deficit[t] += (rounds - 1) * _QUANTUM * queues[t][0].weight


def _granted(fut: asyncio.Future[None]) -> bool:
    """Whether a waiter's future holds a slot handed over (not cancelled, not shed)."""
    return fut.done() and not fut.cancelled() and fut.exception() is None


class _Counter(Protocol):
    inflight: int


class _Count:
    __slots__ = ("inflight",)

    def __init__(self) -> None:
        self.inflight = 0


class Gate:
    """At most `limit` holders (counted in `counter.inflight`); the others wait in a FairQueue.
    Whoever acquires releases in the same try/finally; a slot released while others wait passes
    straight to the next one the queue picks.

    `reserve` slots are held back for the `priority` band while it has been active in the last
    RESERVE_ACTIVE_S: lower bands fill at most `limit - reserve`, so a priority request finds a
    free slot instead of waiting for one to end (with no recent priority traffic, nothing is
    held back)."""

    RESERVE_ACTIVE_S = 10.0

    def __init__(
        self, limit: int, counter: _Counter | None = None, *, starvation_share: float = 0.1, reserve: int = 0,
        name: str = "a backend's slots",
    ) -> None:
        self.limit = limit
        self.reserve = reserve
        self.counter: _Counter = counter if counter is not None else _Count()
        self.queue = FairQueue(starvation_share, name)
        self._priority_at = -1e18  # when a priority request last took a slot
        self.priority_held = 0  # slots held by the priority band (the reserve is theirs)
        # Standing-queue control (CoDel-style): while every waiter dispatched for `standing_interval_s`
        # had waited longer than `standing_target_s`, shed the newest of the lowest band each interval.
        self.standing_target_s: float | None = None
        self.standing_interval_s = 5.0
        self._above_since: float | None = None

    @property
    def used(self) -> int:
        return self.counter.inflight

    def _room(self, band: str, inflight: int) -> bool:
        """Whether `band` may take one more slot with `inflight` held: any free slot for the
        priority band; lower bands together hold at most `limit - reserve` while the reserve is
        active (the slots priority holds are not theirs to count)."""
        if inflight >= self.limit:
            return False
        if band == BANDS[0] or self.reserve <= 0 or time.monotonic() - self._priority_at > self.RESERVE_ACTIVE_S:
            return True
        return inflight - self.priority_held < max(1, self.limit - self.reserve)

    def cap(self, band: str) -> int:
        """How many slots `band` can count on (for predicted waits)."""
        if band == BANDS[0] or self.reserve <= 0 or time.monotonic() - self._priority_at > self.RESERVE_ACTIVE_S:
            return self.limit
        return max(1, self.limit - self.reserve)

    def free(self, band: str = "default") -> bool:
        """True when try_acquire(band) would succeed now."""
        return self._room(band, self.counter.inflight) and not self.queue.waiting_at_or_above(band)

    def try_acquire(self, band: str = "default") -> bool:
        if self.free(band):
            self.counter.inflight += 1
            self._took(band)
            return True
        return False

    def _took(self, band: str) -> None:
        if band == BANDS[0]:
            self.priority_held += 1
            self._priority_at = time.monotonic()

    async def acquire(self, timeout_s: float, ticket: Ticket | None = None) -> bool:
        """Wait up to timeout_s for a slot as a waiter like `ticket` (its band, tenant, cost and
        weight); False when none came in time.

        The queue holds a ticket of its own for each wait, never the caller's: one request waits
        at several gates in turn (admission then a backend, context fallbacks one after another),
        and a ticket that left one queue stays in it, marked gone, until skipped there. Queued
        again at the next gate, the same object came back to life at the first: counted out
        twice, and a phantom waiter at the second (both backends 503 until a restart)."""
        band = ticket.band if ticket is not None else BANDS[1]
        if self.try_acquire(band):
            return True
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        t = Ticket(band, ticket.tenant, ticket.cost, ticket.weight, fut) if ticket is not None else Ticket(fut=fut)
        self.queue.push(t)
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await fut
            return True  # release() handed its slot over to us
        except TimeoutError:
            # Granted in the same loop iteration as the timeout: the slot is ours.
            return _granted(fut)
        except BaseException:
            if _granted(fut):
                self.release(band)  # granted, then cancelled before we ran: pass the slot on
            raise
        finally:
            if not fut.done():
                fut.cancel()
            self.queue.leave(t)

    def release(self, band: str = "default") -> None:
        """Give back a slot held by a request of `band`: to the next waiter, or free."""
        if band == BANDS[0]:
            self.priority_held -= 1
        self.counter.inflight -= 1
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to waiters, as long as their band has room (also after the limit was
        raised, e.g. by a reload)."""
        while (band := self._dispatchable()) is not None:
            t = self.queue.pop(band)
            if t is None:
                return
            if t.fut is not None and not t.fut.done():
                self.counter.inflight += 1
                self._took(t.band)
                t.fut.set_result(None)  # the slot passes to the waiter
                self._standing(time.monotonic() - t.enqueued)

    def _dispatchable(self) -> str | None:
        """The band a free slot goes to now: the queue's choice when that band has room, else
        (the starvation guard's lower band, held back by the priority reserve) the highest band
        that waits, when it has room: a free slot never idles while a band that may take it waits."""
        band = self.queue.next_band()
        if band is None:
            return None
        inflight = self.counter.inflight
        if self._room(band, inflight):
            return band
        top = self.queue.top()
        return top if top is not None and top != band and self._room(top, inflight) else None

    def _standing(self, waited_s: float) -> None:
        """CoDel-style: a queue whose every dispatch waited over the target for a whole interval
        is standing, not absorbing a burst: shed the newest waiter of the lowest band, once per
        interval while it stands (503 `overloaded`, reason standing_queue)."""
        target = self.standing_target_s
        if target is None:
            return
        now = time.monotonic()
        if waited_s <= target:
            self._above_since = None
        elif self._above_since is None:
            self._above_since = now
        elif now - self._above_since >= self.standing_interval_s:
            self._above_since = now
            victim = self.queue.pop_newest_lowest()
            if victim is not None:
                refuse_waiter(victim, Shed("standing_queue", f"overloaded: the queue has stood above {target * 1000:.0f} ms", target))

    def predicted_wait_s(self, band: str, tenant: str, service_s: float, weight: float = 1.0) -> float:
        """About how long a new (band, tenant) waiter would wait: the waiters dispatched before it
        and the one it needs, at the band's share of parallel services of `service_s` each."""
        if self.free(band):
            return 0.0
        return (self.queue.position(band, tenant, weight) + 1) * service_s / max(1, self.cap(band))

    def position(self, band: str, tenant: str, weight: float = 1.0) -> int:
        """0 when a (band, tenant) request would get a slot now, else its place in the queue."""
        return 0 if self.free(band) else self.queue.position(band, tenant, weight)


def refuse_waiter(t: Ticket, why: Shed) -> None:
    """Refuse a waiter taken out of its queue: its acquire() raises `why`, which says how long it
    waited (its request's queue stage)."""
    if t.fut is not None and not t.fut.done():
        why.waited_s = time.monotonic() - t.enqueued
        t.fut.set_exception(why)


def reserve_slots(limit: int, pct: float) -> int:
    """Slots of a bound of `limit` held back for the priority band (rounded; none for tiny bounds)."""
    return min(limit - 1, round(limit * pct / 100)) if limit > 1 else 0


class Admission:
    """The pipeline's admission stage: at most `max_inflight` requests relayed at once across the
    process, at most `max_queue` waiting; deadline-aware shedding from the measured service time."""

    def __init__(
        self,
        max_inflight: int,
        max_queue: int,
        *,
        starvation_share: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gate = Gate(max_inflight, starvation_share=starvation_share, name="the admission gate")
        self.max_queue = max_queue
        self.enabled = True  # False (admission.enabled: false): relay without the gate or shedding
        self._clock = clock
        self._holds: deque[float] = deque(maxlen=_HOLDS)  # how long the last admitted requests held their place
        # Requests relayed while admission was off, still in flight (`enter_off`), and how many of
        # them count in the gate since a reload turned admission on (`configure`): else the gate
        # started from 0 beside them and let max_inflight more in.
        self.off_inflight = 0
        self._carried = 0
        self._service_s: float | None = None  # their median, as of `_sorted_at`
        self._stale = False  # holds came since
        self._sorted_at = -1e18

    def configure(
        self,
        max_inflight: int,
        max_queue: int,
        starvation_share: float,
        enabled: bool = True,
        reserve_pct: float = 0.0,
        standing: tuple[float | None, float] = (None, 5.0),
    ) -> None:
        """New limits from a reloaded policy; the queue and its waiters stay. Turned on, the
        requests relayed while it was off and still in flight take places in the gate."""
        if enabled and self.off_inflight > self._carried:
            self.gate.counter.inflight += self.off_inflight - self._carried
            self._carried = self.off_inflight
        self.enabled = enabled
        self.gate.standing_target_s, self.gate.standing_interval_s = standing
        self.gate.limit = max_inflight
        self.gate.reserve = reserve_slots(max_inflight, reserve_pct)
        self.gate.dispatch()  # a raised limit lets waiters in now, not one per release
        self.max_queue = max_queue
        self.gate.queue.starvation_share = starvation_share

    def service_s(self) -> float:
        """How long an admitted request holds its place: the median of the last _HOLDS holds (1 s
        before the first). A median, not a moving average: the average of every hold let one
        tenant's two 5 s answers raise it 15 ms -> 965 ms, and other tenants' requests with short
        deadlines were shed whenever anyone queued. Sorted again at most every _RESORT_S once
        the window is full: every arrival that would wait reads it."""
        if self._stale:
            holds, now = self._holds, self._clock()
            if len(holds) < _HOLDS or now - self._sorted_at >= _RESORT_S:
                self._service_s = sorted(holds)[(len(holds) - 1) // 2]
                self._stale, self._sorted_at = False, now
        return self._service_s if self._service_s is not None else 1.0

    def predicted_wait_s(self, ticket: Ticket) -> float:
        return self.gate.predicted_wait_s(ticket.band, ticket.tenant, self.service_s(), ticket.weight)

    async def enter(
        self,
        ticket: Ticket,
        remaining_s: float,
        downstream: Callable[[int], float] | None = None,
        first_token_s: float = 0.0,
    ) -> float:
        """Take a place (waiting in the queue if need be); returns the seconds waited. Raises Shed
        at once when the queue is full or the predicted wait cannot meet the deadline (later, with
        its `waited_s`, when pushed out of the queue), or TimeoutError when the deadline comes
        while it waits.

        `downstream(ahead)`: the predicted wait at the backend once admitted, with `ahead` more
        requests (those admitted first) before it; `first_token_s`: the backend's predicted TTFT.
        Refused when the longer of the two waits exceeds MAX_WAIT_SHARE of the time left after
        the first token."""
        queue = self.gate.queue
        free = self.gate.free(ticket.band)
        ahead = 0 if free else queue.position(ticket.band, ticket.tenant, ticket.weight)
        wait = 0.0 if free else (ahead + 1) * self.service_s() / max(1, self.gate.cap(ticket.band))
        if downstream is not None:
            wait = max(wait, downstream(ahead))
        if wait > 0 and wait > MAX_WAIT_SHARE * (remaining_s - first_token_s):
            raise Shed(
                "deadline",
                f"overloaded: the predicted wait of {wait * 1000:.0f} ms and first token of {first_token_s * 1000:.0f} ms "
                f"exceed the {remaining_s * 1000:.0f} ms left of the request's deadline",
                min(wait, MAX_RETRY_AFTER_S),
            )
        if self.gate.try_acquire(ticket.band):
            return 0.0
        if len(queue) >= self.max_queue:
            victim = queue.push_out(ticket.band, ticket.tenant, ticket.weight)
            retry_s = min(self.service_s(), MAX_RETRY_AFTER_S)
            if victim is None:
                raise Shed("queue_full", f"the admission queue is full ({self.max_queue} waiting)", retry_s)
            # Its place goes to a request of a higher band, or of a tenant holding less of the queue.
            refuse_waiter(victim, Shed("queue_full", f"the admission queue is full ({self.max_queue} waiting): its place went to "
                              "a request of a higher priority or of a tenant with fewer waiting", retry_s))
        started = self._clock()
        if not await self.gate.acquire(remaining_s - first_token_s, ticket):
            raise TimeoutError
        return self._clock() - started

    def enter_off(self) -> None:
        """A request relayed while admission is off (no gate, no wait): counted aside, for a
        reload that turns admission on while it is in flight."""
        self.off_inflight += 1

    def leave_off(self) -> None:
        """A request `enter_off` counted has ended; the gate's place it was carried into (if a
        reload turned admission on meanwhile) goes to the next waiter."""
        self.off_inflight -= 1
        if self._carried > self.off_inflight:
            self._carried -= 1
            self.gate.counter.inflight -= 1
            self.gate.dispatch()

    def leave(self, held_s: float, band: str = "default") -> None:
        """Give the place back after holding it `held_s` (teaches the service time)."""
        self._holds.append(held_s)
        self._stale = True
        self.gate.release(band)
