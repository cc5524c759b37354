"""Response cache: the canonical key, what may be cached, the fail-open Cache, and single flight.

A Redis that stalls (not down: a refused connection fails at once) costs each store call its
whole timeout (`store.timeout_ms`) and a fresh connection: the Cache's breaker (tenants/breaker.py)
skips the store for a moment after a few timeouts in a row (a miss, nothing stored, no
cross-process lock), then lets one call at a time try it again.

What an entry is, how a streamed answer becomes one and how one is replayed: entry.py.
The key is versioned (CACHE_FORMAT): changing the entry format means bumping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NamedTuple, ParamSpec, TypeVar

import orjson

from ..errors import BadRequest
from ..store.core import Store, StoreError
from ..tenants.breaker import Breaker
from .broadcast import Broadcast
from .budget import Budget
from .entry import Entry, is_complete

__all__ = [
    "CACHE_FORMAT",
    "TRANSPORT_FIELDS",
    "cache_key",
    "key_owner",
    "cacheable_request",
    "cache_control",
    "Cache",
    "Skipped",
    "Flight",
    "SingleFlight",
    "Terms",
    "ANY_TERMS",
    "MAX_FLIGHTS",
]

CACHE_FORMAT = "v1"
_KEY_PREFIX = f"gwc:{CACHE_FORMAT}:"

# Body fields that change how an answer travels or is accounted, never what it says: not in the key.
# Everything else is in it, unknown vendor fields included (a needless miss beats a wrong answer).
TRANSPORT_FIELDS = frozenset({
    "model",  # the body's spelling is replaced by the public model passed to cache_key
    "stream",  # streamed and non-streamed requests share one entry
    "stream_options",  # include_usage only adds a usage chunk, which replay_sse emits on demand
    "user",  # abuse-monitoring id, no effect on the answer
    "safety_identifier",  # OpenAI's successor of `user`
    "metadata",  # tags for the caller's own dashboards
    "service_tier",  # priority / latency class, not content
    "store",  # whether OpenAI keeps the completion for distillation
    "prompt_cache_key",  # a routing hint for the provider's prompt cache
})
# 0 and 0.0 mean the same sampling: key them alike.
_FLOAT_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
_WARN_EVERY_S = 60.0
MAX_FLIGHTS = 10_000  # concurrent single flights per process; beyond it, requests go on alone
_P = ParamSpec("_P")
_T = TypeVar("_T")


def cache_key(namespace: str, endpoint: str, model: str, body: Mapping[str, Any], echoed: frozenset[str] = frozenset(),
              headers: tuple[tuple[str, str], ...] = ()) -> str:
    """`gwc:v1:<namespace digest>:<sha256 hex>`: the digest of the canonical JSON (sorted keys) of
    everything that changes the answer, after 16 hex digits of the namespace's own (whose entries
    it is: `key_owner`, for an in-memory store shared fairly among namespaces).

    `namespace` isolates tenants (the tenant name, or a namespace the policy shares between tenants);
    `endpoint` is "chat" or "completions"; `model` is the public model the client asked for;
    `echoed`: transport fields the endpoint's answers repeat back, keyed all the same;
    `headers`: the client's headers that reach the backend and may change its answer (a beta).
    """
    fields = {k: v for k, v in body.items() if k not in TRANSPORT_FIELDS or k in echoed}
    for name in _FLOAT_FIELDS:
        v = fields.get(name)
        if type(v) is int:
            fields[name] = float(v)
    try:
        key = [CACHE_FORMAT, namespace, endpoint, model, fields, *([list(headers)] if headers else [])]
        canonical = orjson.dumps(key, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # orjson reads deeper nesting (1024) than it writes (~255)
        raise BadRequest("the request body is nested too deeply to be re-encoded for the backend") from None
    owner = hashlib.sha256(namespace.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{_KEY_PREFIX}{owner}:{hashlib.sha256(canonical).hexdigest()}"


def key_owner(key: str, value: bytes) -> str:
    """Whose entry a cache key is: its namespace's digest (FairMemoryStore's owner: in memory, one
    tenant's cacheable traffic evicts its own answers, not the others'; 100 of one tenant's
    13 KB answers flushed another's from a 1 MiB cache)."""
    return key[len(_KEY_PREFIX) : len(_KEY_PREFIX) + 16]


def cacheable_request(
    body: Mapping[str, Any],
    *,
    require_deterministic: bool = True,
    default_temperatures: Mapping[str, float] | None = None,
) -> str | None:
    """None when the request may be answered from (and stored in) the cache, else the reason why not.

    One choice only; no logprobs (a streamed replay could not carry them). With
    `require_deterministic`, also temperature 0 or a seed (the policy may drop this per model/tenant).
    A request without temperature is sampled at each backend's default: `default_temperatures`
    (backend name -> its default, for every backend that may answer it) makes it count as
    temperature 0 when all of them decode greedily; None means OpenAI's default of 1.
    """
    n = body.get("n")
    if n is not None and n != 1:
        return "n > 1"
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        return "logprobs requested"
    if require_deterministic and body.get("seed") is None:
        t = body.get("temperature")
        if t is None:
            if default_temperatures is None:
                return "no temperature 0 or seed (default temperature is 1)"
            return _sampled_by_default(default_temperatures)
        if t != 0:
            return "temperature > 0 without seed"
    return None


def _sampled_by_default(defaults: Mapping[str, float]) -> str | None:
    """Why a request without temperature or seed is not deterministic: the backends that sample by default."""
    return _sampled(tuple(defaults.items()))


@functools.lru_cache(maxsize=256)
def _sampled(defaults: tuple[tuple[str, float], ...]) -> str | None:
    """_sampled_by_default, once per set of defaults (the same few, request after request)."""
    sampled = {name: t for name, t in defaults if t != 0}
    if not sampled:
        return None
    named = ", ".join(f"{name!r} ({t:g})" for name, t in sampled.items())
    which = f"backend {named} samples" if len(sampled) == 1 else f"backends {named} sample"
    return f"no temperature 0 or seed, and {which} by default (default_temperature)"


def cache_control(header: str | None) -> tuple[bool, bool]:
    """(no_cache, no_store) from a request's Cache-Control header: skip the lookup / skip the store."""
    if not header:
        return False, False
    tokens = {part.split("=", 1)[0].strip().lower() for part in header.split(",")}
    return "no-cache" in tokens, "no-store" in tokens


class Skipped(StoreError):
    """The cache's breaker is open: its store was not asked (`Cache.call`). Fails open like any
    StoreError: a miss, nothing stored, no cross-process lock."""


class Cache:
    """A Store under the policy's knobs, failing open: a store error is a miss (lookup) or a no-op
    (save), reported to `on_error(op)` every time and logged at most once a minute.

    `breaker`: skips the store while it keeps timing out (see the module's note), for the cache's
    own calls only (`lookup`, `save`, `forget`, and shared_flight's lock through `call`): the
    Responses API's records may use the same Redis store object, and keep their own retries.
    A failure counts toward opening it when it took at least `slow_s` (the store's timeout: a
    refused connection, which fails at once, costs nothing to try again). A skipped call is
    reported as `on_error("skipped")`, never logged; the breaker logs one line when it opens,
    and the store's first answer after failures one more ("answers again")."""

    __slots__ = ("store", "ttl_s", "max_entry_bytes", "_on_error", "_log", "_clock", "_last_warn", "_suppressed", "_failing",
                 "_breaker", "_slow_s")

    def __init__(
        self,
        store: Store,
        *,
        ttl_s: float,
        max_entry_bytes: int,
        on_error: Callable[[str], None] | None = None,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
        breaker: Breaker | None = None,
        slow_s: float = 0.0,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self._on_error = on_error
        self._log = log or logging.getLogger("gateway.cache")
        self._clock = clock
        self._last_warn: float | None = None
        self._suppressed = 0
        self._failing = False
        self._breaker = breaker
        self._slow_s = slow_s

    async def call(self, fn: Callable[_P, Awaitable[_T]], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """`fn(*args, **kwargs)`, one of the store's calls, under the breaker: Skipped at once,
        without asking the store, while it is open (but for one probe at a time after its pause).
        Raises the store's StoreError as it comes."""
        breaker = self._breaker
        if breaker is None:
            return await fn(*args, **kwargs)
        if not breaker.allows():
            raise Skipped("skipped while the cache store keeps timing out")
        t0 = self._clock()
        try:
            result = await fn(*args, **kwargs)
        except BaseException:  # a StoreError, or cancelled (its client left) while it waited
            # A quick failure (a refused connection) is no stall, but a probe must report.
            if breaker.open or self._clock() - t0 >= self._slow_s:
                self._trip(breaker)
            raise
        breaker.succeeded()
        return result

    async def lookup(self, key: str) -> Entry | None:
        """The entry under `key`, or None on a miss or when the store fails.

        An entry that is not a complete answer (bad JSON, truncated, a wrong shape: written by
        another version, or damaged) is a miss: it is deleted and reported as `on_error("corrupt")`.
        """
        try:
            raw = await self.call(self.store.get, key)
        except StoreError as exc:
            self._failed("get", exc)
            return None
        if self._failing:
            self._recovered()
        if raw is None:
            return None
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if not is_complete(obj):
            await self._corrupt(key, raw)
            return None
        return Entry(raw)

    async def save(self, key: str, entry: Entry, *, ttl_s: float | None = None) -> bool:
        """Store `entry` for `ttl_s` (default: the cache's); False when too big or the store failed."""
        if len(entry.body) > self.max_entry_bytes:
            return False
        try:
            await self.call(self.store.set, key, entry.body, self.ttl_s if ttl_s is None else ttl_s)
        except StoreError as exc:
            self._failed("set", exc)
            return False
        if self._failing:
            self._recovered()
        return True

    async def forget(self, key: str) -> None:
        """Delete an entry that must not be answered again (the Response id it hands out is gone);
        a store that fails leaves it to its TTL."""
        try:
            await self.call(self.store.delete, key)
        except StoreError as exc:
            self._failed("delete", exc)

    async def _corrupt(self, key: str, raw: bytes) -> None:
        if self._on_error is not None:
            self._on_error("corrupt")
        self._log.warning("cache entry %s is corrupt (%d bytes), deleted", key, len(raw))
        await self.forget(key)

    def _failed(self, op: str, exc: StoreError) -> None:
        if isinstance(exc, Skipped):
            if self._on_error is not None:
                self._on_error("skipped")
            return
        self._failing = True
        if self._on_error is not None:
            self._on_error(op)
        now = self._clock()
        if self._last_warn is not None and now - self._last_warn < _WARN_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more failures since the last warning)" if self._suppressed else ""
        self._log.warning("cache store failed, answering from upstream: %s%s", exc, more)
        self._last_warn, self._suppressed = now, 0

    def _trip(self, breaker: Breaker) -> None:
        """A call that timed out (or a probe that failed): one line when it opens the breaker."""
        was_open = breaker.open
        breaker.failed()
        if breaker.open and not was_open:
            self._failing = True  # its first answer logs "answers again"
            self._log.warning("cache store keeps timing out: skipped for a moment (requests go upstream, "
                              "uncached) until a probe finds it answering")

    def _recovered(self) -> None:
        self._failing = False
        self._log.info("cache store answers again")


class Terms(NamedTuple):
    """What a caller of a flight lives by: a follower joins only a leader whose terms cover its own."""

    timeout_ms: int  # its whole deadline (Call.timeout_ms()), not when it ends: identical requests a moment apart share
    rank: int  # its band's place in the admission queues (admission.BANDS): 0 is served first

    def covers(self, other: Terms) -> bool:
        """Whether a leader on these terms answers `other` no later than `other` would be answered
        alone: a deadline no shorter (its answer is not cut first) and a band no lower (it does
        not wait in admission behind what `other` would pass)."""
        return other.timeout_ms <= self.timeout_ms and other.rank >= self.rank


ANY_TERMS = Terms(0, 0)  # callers that do not say: they all share


class Flight:
    """One caller's place in a SingleFlight: the leader calls upstream and publishes what it
    stored; a follower reads `entry` (None: the leader failed, stored nothing, or took too long).

    `stream`: the leader's live stream (a flight led by a streamed request). The leader answers
    through `TeeSink(sink, flight.stream)`; a streamed follower gets it at once, without waiting,
    and reads it with `flight.follow(f.stream, call, sink)`.
    `beside`: a leader that goes upstream while another flight for the same key is in progress
    in this process (whose cross-process lock it must not wait on, shared_flight.py).
    """

    __slots__ = ("leader", "entry", "stream", "terms", "beside", "publishes", "abandoned", "_done")

    def __init__(self, leader: bool, entry: Entry | None = None, stream: Broadcast | None = None,
                 done: asyncio.Event | None = None, terms: Terms = ANY_TERMS, beside: bool = False,
                 publishes: bool = True) -> None:
        self.leader = leader
        self.entry = entry
        self.stream = stream
        self.terms = terms  # a registered leader's: who may join it
        self.beside = beside
        self.publishes = publishes  # a registered leader's: False when only its live stream is shared
        self.abandoned = False  # a registered leader's block ended by its cancellation (its client left)
        self._done = done  # set when a registered leader's block ends (only followers of one wait on it)

    def publish(self, entry: Entry) -> None:
        """Hand `entry` to the followers (call it inside the `hold` block, leader only)."""
        self.entry = entry

    def finish(self) -> None:
        """The leader has all it will publish: its followers go on now, not when its block ends
        (after its own client has read the answer). Later callers find the flight finished and
        take its entry, or go on their own."""
        if self._done is not None:
            self._done.set()


class SingleFlight:
    """Per process: concurrent identical misses make one upstream call.

        async with flight.hold(key, wait_s=call.remaining_s()) as f:
            entry = None if f.leader else (f.entry or await cache.lookup(key))
            if entry is None:
                ...call upstream; on a cacheable answer: await cache.save(key, e); f.publish(e)

    Followers wait until the leader's block exits (at most `wait_s`), then proceed on their own if
    nothing was published. Cancelling a leader or a follower leaves nothing behind.

    Streams: `hold(key, stream=True)` by a leader gives its flight a Broadcast (`f.stream`), which
    the block must close (hold does, on exit). A follower that passes `stream=True` to a streamed
    flight is let in at once with `f.stream` set, to follow the live stream (see broadcast.py);
    any other follower waits as above. `include_usage`: whether the caller's stream carries a
    usage chunk: a leader's followers that did not ask for one get it dropped; a follower that
    asked for one, of a leader without it, goes alone (leads a flight nobody joins).

    Who joins: a caller follows the flight in progress only when its leader's `terms` cover its
    own (Terms.covers: a deadline no shorter, a band no lower), else it goes upstream alone, so
    that a leader's short deadline or low band never cuts or delays another caller's answer. One
    alone that covers the leader's terms (and stores its answer) takes the key over: later callers
    join it; the old flight ends for the followers it has. A caller that will not store its answer
    (`stores=False`: cache-control: no-store) never leads a flight others join; it may follow one.
    A streamed leader whose stream is never stored (`publishes=False`: a Messages stream) shares
    it live with the streamed callers that join it; any other caller goes on alone at once (it
    would wait for the whole stream, then find nothing stored).

    At most `max_flights` keys are held at once (a client can send many distinct prompts): a miss
    beyond that leads a flight of its own that nobody can join (`overflows` counts them). The
    streams' histories (for followers that join mid-stream) share one byte budget (broadcast.py).
    """

    __slots__ = ("_flights", "max_flights", "overflows", "budget")

    def __init__(self, max_flights: int = MAX_FLIGHTS, budget: Budget | None = None) -> None:
        self._flights: dict[str, Flight] = {}
        self.max_flights = max_flights
        self.overflows = 0
        self.budget = budget if budget is not None else Budget()

    def __len__(self) -> int:
        return len(self._flights)

    def hold(self, key: str, *, wait_s: float, stream: bool = False, include_usage: bool = False,
             terms: Terms = ANY_TERMS, stores: bool = True, publishes: bool = True, owner: str | None = None) -> _Hold:
        """Lead the flight for `key`, or follow the one in progress (see the class docstring):
        `async with flight.hold(...) as f`. `owner`: the caller's tenant, whom a stream it leads
        counts for in the budget."""
        return _Hold(self, key, wait_s, stream, include_usage, terms, stores and publishes, stores, owner)


class _Hold:
    """`SingleFlight.hold`'s context manager: a class, not a generator (entered once per cache
    miss: a generator-based one costs a few µs more per request)."""

    __slots__ = ("_sf", "_key", "_wait_s", "_stream", "_include_usage", "_terms", "_stores", "_shares", "_owner", "_led",
                 "_deadline")

    def __init__(self, sf: SingleFlight, key: str, wait_s: float, stream: bool, include_usage: bool, terms: Terms,
                 stores: bool, shares: bool, owner: str | None) -> None:
        self._sf, self._key, self._wait_s, self._stream, self._include_usage = sf, key, wait_s, stream, include_usage
        self._owner = owner
        self._terms, self._stores = terms, stores  # stores: it will publish an entry
        self._shares = shares  # it may lead others: it stores, or its live stream is shared (no no-store)
        self._led: Flight | None = None  # the flight this caller registered and leads
        self._deadline: float | None = None  # the loop's time by which a follower stops waiting (set on its first wait)

    async def __aenter__(self) -> Flight:
        while True:
            flight = self._join()
            if flight is not None:
                return flight
            current = self._sf._flights[self._key]  # a registered flight to follow: wait for its answer
            assert current._done is not None
            loop = asyncio.get_running_loop()
            if self._deadline is None:  # only a follower's wait needs one (a leader's miss reads no clock)
                self._deadline = loop.time() + max(0.0, self._wait_s)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(self._deadline):
                    await current._done.wait()
            if not (current.abandoned and current.entry is None and loop.time() < self._deadline):
                return Flight(leader=False, entry=current.entry)
            # Its leader's client left before the answer came (its handler cancelled, the upstream
            # call with it): the followers that waited form a new flight, one of them its leader,
            # instead of each going upstream alone (3 followers, 3 more upstream calls; review
            # helper's repro). A leader that answered, stored nothing or failed is not retried.

    def _join(self) -> Flight | None:
        """This caller's place, decided now; None: follow the registered flight for the key (wait)."""
        flights = self._sf._flights
        current = flights.get(self._key)
        if current is None:
            if not (self._stores or (self._shares and self._stream)):
                return Flight(leader=True)  # it publishes nothing: nobody may wait on it
            if len(flights) >= self._sf.max_flights:
                self._sf.overflows += 1
                return Flight(leader=True)  # alone: not registered, so nobody follows it
            return self._register(beside=False)
        if not current.terms.covers(self._terms):
            # Its leader could cut this caller's answer at its own deadline, or hold it in a lower
            # band's queue: alone. One that covers the leader's terms serves later callers better.
            if self._stores and self._terms.covers(current.terms):
                return self._register(beside=True)
            return Flight(leader=True, beside=True)
        if self._stream and current.stream is not None and current.stream.joinable:
            if current.stream.include_usage or not self._include_usage:
                return Flight(leader=False, stream=current.stream)
            # It asked for a usage chunk that the leader's stream lacks (and its stored answer may
            # too): it goes upstream itself, alone, as when the flights are full.
            return Flight(leader=True, beside=True)
        if not current.publishes:
            # A live stream that is never stored (a streamed follower that could not join it is
            # here too): nothing to wait for. Alone; leading later callers when it stores.
            return self._register(beside=True) if self._stores else Flight(leader=True, beside=True)
        return None

    def _register(self, *, beside: bool) -> Flight:
        """Lead the flight for the key (over one in progress when `beside`: that one keeps its followers)."""
        bc = Broadcast(include_usage=self._include_usage, budget=self._sf.budget, owner=self._owner) if self._stream else None
        flight = Flight(leader=True, stream=bc, done=asyncio.Event(), terms=self._terms, beside=beside, publishes=self._stores)
        self._led = self._sf._flights[self._key] = flight
        return flight

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        flight = self._led
        if flight is None:
            return
        if exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            flight.abandoned = True
        flights = self._sf._flights
        if flights.get(self._key) is flight:
            del flights[self._key]
        bc = flight.stream
        if bc is not None:
            bc.close()
            bc.release()
        assert flight._done is not None
        flight._done.set()
