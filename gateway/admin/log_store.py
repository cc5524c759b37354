"""Where the request log lives: a Redis sorted set (shared by every replica) or this process's memory.

Entries are ordered by the time a request ended (microseconds since the epoch: the score), newest
first when read. A page is read from a cursor (`Cursor`: the score of the last entry seen and how
many entries of that score were seen, so requests that ended in the same microsecond, as replicas'
and workers' often do under load, are neither skipped nor repeated at a page's edge; equal scores
come in a fixed order: in Redis, of their bytes; in memory, the order they came in, a sequence
number each, so an entry that comes later at a page's edge score goes after what the cursor has
passed) and filtered by tenant (an index of its own: a tenant's page never scans other tenants'
entries), model and status (read in chunks and filtered; a page scans at most `_MAX_SCAN`
entries, and its cursor then says where to go on; the entries a cursor skips are not scanned).

Bounded by `size` entries, fairly: a full log evicts the oldest entry of a tenant holding the most
entries (among those holding as many, the oldest of theirs), so a tenant that floods the log
(requests for unknown models, 429s from its own quota: each is logged) evicts its own entries, not
the others' recent history; a tenant holding fewer than `size` / N entries (N: the tenants in the
log) loses none. Where tenants hold as many, that is the log's oldest entry, as a plain bound.
In memory, the bytes bound (`max_bytes`) is fair the same way in bytes: the tenants holding the
most bytes come down together, so a tenant with few large entries (its payloads logged) evicts
its own, not a busy tenant's small ones.
"""

from __future__ import annotations

import asyncio
import bisect
import heapq
import os
from array import array
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

import orjson


from ..config.policy import StoreTlsPolicy
from ..store.connect import ADMIN_CONNECTIONS, close_client, connect
from ..store.holdings import Holdings
from ..store.redis_store import bounded
from .entry import decode

__all__ = ["Cursor", "Filter", "Page", "LogStore", "MemoryLogStore", "RedisLogStore"]

_MAX_SCAN = 20_000  # entries one page may read past while filtering (bounded work per request)
_PAUSE_EVERY = 1_000  # entries a memory page reads between two pauses (~1.6 ms)
_CHUNK = 500
_PART, _PART_BYTES = 256, 256 << 10  # a tenant's part grows to this by merging (a page merges every part)


@dataclass(frozen=True, slots=True)
class Filter:
    tenant: str | None = None
    model: str | None = None
    status: int | None = None
    # Bytes every stored entry this filter keeps holds (its model as JSON writes it, its status's
    # digits): an entry without one of them is passed over undecoded (a filter that matches
    # nothing read 20,000 entries a page at ~6 us each on the event loop).
    needles: tuple[bytes, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        needles = [] if self.model is None else [orjson.dumps(self.model)]
        if self.status is not None:
            needles.append(str(self.status).encode())
        object.__setattr__(self, "needles", tuple(needles))

    def keeps(self, e: dict[str, Any]) -> bool:
        return ((self.tenant is None or e.get("tenant") == self.tenant) and (self.model is None or e.get("model") == self.model)
                and (self.status is None or e.get("status") == self.status))

    def matching(self, raw: bytes) -> dict[str, Any] | None:
        """The stored entry `raw` as the API shows it when this filter keeps it, else None."""
        if self.needles and not all(needle in raw for needle in self.needles):
            return None
        e = decode(raw)
        return e if self.keeps(e) else None


@dataclass(frozen=True, slots=True)
class Cursor:
    """Where the next page starts: the entries of `score` after the first `skip` of them (in the
    log's order: equal scores in a fixed order, see the module's doc), then every older one."""

    score: int
    skip: int = 0

    def __str__(self) -> str:
        return f"{self.score}:{self.skip}"

    @classmethod
    def parse(cls, text: str) -> Cursor:
        """A page's `next`. A bare score (an earlier version's cursor) means older than it.
        Raises ValueError."""
        score, sep, skip = text.partition(":")
        if not (score.isascii() and score.isdigit()) or (sep and not (skip.isascii() and skip.isdigit())):
            raise ValueError(f"not a cursor: {text[:40]!r}")
        if not sep:
            return cls(max(0, int(score) - 1))
        if len(score) > 19 or len(skip) > 9:
            raise ValueError(f"not a cursor: {text[:40]!r}")
        return cls(int(score), int(skip))


class _Run:
    """The entries a page has read past at the lowest score so far: its next page's cursor."""

    __slots__ = ("score", "count")

    def __init__(self, at: Cursor | None) -> None:
        self.score, self.count = (at.score, at.skip) if at is not None else (-1, 0)

    def passed(self, score: int) -> None:
        if score == self.score:
            self.count += 1
        else:
            self.score, self.count = score, 1

    def cursor(self) -> str:
        return str(Cursor(self.score, self.count))


@dataclass(frozen=True, slots=True)
class Page:
    entries: list[dict[str, Any]]
    next: str | None  # the cursor of the next (older) page; None at the end


class LogStore(Protocol):
    size: int  # entries kept

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        """Add entries: (score, tenant, the entry as JSON)."""
        ...

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Page:
        """Up to `limit` entries from `at` (None: the newest), newest first."""
        ...

    async def close(self) -> None:
        ...


async def scan(store: LogStore, f: Filter, at: Cursor | None = None, chunk: int = 1000) -> AsyncIterator[dict[str, Any]]:
    """Every entry matching `f`, newest first, page after page (the export)."""
    while True:
        page = await store.page(f, chunk, at)
        for e in page.entries:
            yield e
        if page.next is None:
            return
        at = Cursor.parse(page.next)
        # A page that suspends nowhere (a short one in memory) still lets other requests go on
        # between pages: a filter that matches nothing scans the whole log.
        await asyncio.sleep(0)


def _in_order(rows: list[tuple[int, int, bytes]]) -> list[tuple[int, int, bytes]]:
    """(score, seq, entry) rows in a part's order: by score, and among equal scores the later
    (higher seq) first, so that a page, reading a part from its end, reads them in the order they came."""
    return sorted(rows, key=lambda r: (r[0], -r[1]))


class _Part:
    """Entries of one tenant, in score order, in one blob (one allocation for the allocator, not one
    per entry: many small long-lived objects pin the memory arenas that each request's garbage goes
    to, and the process grows), their scores, sequence numbers (the store's count of entries when
    each came: unique, so every entry has one place in the log's order) and ends in arrays (see
    `_in_order`). Those before `start` were evicted (their bytes go with the part)."""

    __slots__ = ("scores", "seqs", "ends", "blob", "start")

    def __init__(self, scores: array[int], seqs: array[int], ends: array[int], blob: bytes) -> None:
        self.scores, self.seqs, self.ends, self.blob, self.start = scores, seqs, ends, blob, 0

    @classmethod
    def of(cls, rows: list[tuple[int, int, bytes]]) -> _Part:
        """A part of (score, seq, entry) rows in a part's order (`_in_order`)."""
        scores, seqs = array("q", (r[0] for r in rows)), array("q", (r[1] for r in rows))
        return cls(scores, seqs, array("q", accumulate(len(r[2]) for r in rows)), b"".join(r[2] for r in rows))

    def __len__(self) -> int:
        return len(self.scores) - self.start

    def entry(self, i: int) -> bytes:
        return self.blob[self.ends[i - 1] if i else 0 : self.ends[i]]

    def compacted(self) -> _Part:
        """This part without the evicted entries' bytes (a copy of the kept ones). A new part: a
        page that pauses mid-read keeps reading the one it holds (only `start` ever moves in one)."""
        cut = self.ends[self.start - 1] if self.start else 0
        if not cut:
            return self
        return _Part(self.scores[self.start :], self.seqs[self.start :], array("q", (e - cut for e in self.ends[self.start :])),
                     self.blob[cut:])

    def then(self, newer: _Part) -> _Part:
        """This part's kept entries and then `newer`'s, in one part (merged in score order when
        they overlap, or meet at one score: the supervisor's workers' batches interleave)."""
        a, cut = self.start, self.ends[self.start - 1] if self.start else 0
        if newer.scores[0] <= self.scores[-1]:
            rows = [(self.scores[i], self.seqs[i], self.entry(i)) for i in range(a, len(self.scores))]
            rows += [(newer.scores[i], newer.seqs[i], newer.entry(i)) for i in range(len(newer.scores))]
            return _Part.of(_in_order(rows))
        ends = self.ends[a:] if not cut else array("q", (e - cut for e in self.ends[a:]))
        last = ends[-1]
        ends.extend(e + last for e in newer.ends)
        return _Part(self.scores[a:] + newer.scores, self.seqs[a:] + newer.seqs, ends, self.blob[cut:] + newer.blob)


class MemoryLogStore:
    """The log in this process: each tenant's entries in parts, in the order they came (merged as
    they come, up to `_PART` entries, so that a page merges few of them). Past `size` entries or
    `max_bytes`, a tenant holding the most entries (past `max_bytes`: the most bytes) loses its
    first ones: in time order, as one process writes (the supervisor's workers' batches
    interleave by up to a flush)."""

    def __init__(self, size: int, max_bytes: int = 64 << 20) -> None:
        self._size, self._max_bytes = size, max_bytes
        self._parts: dict[str, deque[_Part]] = {}
        self._held = Holdings()  # entries per tenant
        self._count = 0
        self._bytes = 0  # the parts' blobs: an evicted entry's bytes go with its part
        self._tenant_bytes: dict[str, int] = {}  # the same, per tenant
        self._seq = 0  # entries ever appended: each one's sequence number (its place among equal scores)

    @property
    def size(self) -> int:
        """Entries kept (a smaller one, from a reloaded policy, applies at once)."""
        return self._size

    @size.setter
    def size(self, size: int) -> None:
        self._size = size
        self._trim()

    @property
    def max_bytes(self) -> int:
        """The bytes of the entries kept."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._trim()

    def __len__(self) -> int:
        return self._count

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        by_tenant: dict[str, list[tuple[int, int, bytes]]] = {}
        for seq, (score, tenant, entry) in enumerate(batch, self._seq + 1):
            by_tenant.setdefault(tenant, []).append((score, seq, entry))
        self._seq += len(batch)
        for tenant, rows in by_tenant.items():
            part = _Part.of(_in_order(rows))
            self._grow(tenant, len(part.blob))
            parts = self._parts.setdefault(tenant, deque())
            # Merged into the last part while that is no larger (an entry is copied at most
            # log2(_PART) times) and both fit in a part: a tenant holds about n / _PART + log2(_PART).
            while (parts and len(parts[-1]) <= len(part) and len(parts[-1]) + len(part) <= _PART
                   and len(parts[-1].blob) + len(part.blob) <= _PART_BYTES):
                last = parts.pop()
                merged = last.then(part)
                self._grow(tenant, len(merged.blob) - len(last.blob) - len(part.blob))
                part = merged
            parts.append(part)
            self._count += len(rows)
            self._move(tenant, len(rows))
        self._trim()

    def _grow(self, tenant: str, by: int) -> None:
        self._bytes += by
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + by

    def _trim(self) -> None:
        over = self._count - self._size
        if over > 0:
            self._evict(over, compact=False)  # an evicted entry's bytes go with its part
        while self._bytes > self._max_bytes and self._count > 1:
            self._shed_bytes(self._bytes - self._max_bytes)

    def _shed_bytes(self, over: int) -> None:
        """Free at least `over` bytes (or all but one entry) from the tenants holding the most
        bytes: they come down together to one level (a water level over the tenants' sizes), each
        losing its first entries, so a tenant of few large entries sheds its own."""
        sizes = sorted(self._tenant_bytes.items(), key=lambda kv: kv[1], reverse=True)
        total, level, top = 0, 0, len(sizes)
        for i, (_, b) in enumerate(sizes):
            total += b
            nxt = sizes[i + 1][1] if i + 1 < len(sizes) else 0
            if total - (i + 1) * nxt >= over:  # the first i + 1 come down to a level between b and nxt
                level, top = max(nxt, (total - over) // (i + 1)), i + 1
                break
        for tenant, b in sizes[:top]:
            if self._count <= 1:
                return
            self._shed(tenant, max(1, b - level))

    def _shed(self, tenant: str, amount: int) -> None:
        """Evict `tenant`'s first entries until at least `amount` of its bytes are freed (never the
        log's last entry): how many, read from its parts' ends; evicted and compacted by _drop."""
        k, freed = 0, 0
        for part in self._parts[tenant]:
            if freed + len(part.blob) <= amount:  # the whole part goes (its evicted prefix too)
                k, freed = k + len(part), freed + len(part.blob)
                continue
            # The entries whose ends reach the bytes still to free (compacting frees the part's
            # first bytes, those of entries evicted before, too).
            k += bisect.bisect_left(part.ends, amount - freed, part.start) - part.start + 1
            break
        k = min(k, self._held.held(tenant), self._count - 1)
        if k > 0:
            self._drop(tenant, k, compact=True)

    def _evict(self, n: int, compact: bool) -> None:
        """Evict `n` entries as if one by one, each the first of a tenant holding the most: the
        tenants on top come down together to the next count, level after level (O(tenants moved))."""
        while n > 0:
            level, group = self._held.top()
            floor = self._held.below_top()
            if n >= len(group) * (level - floor):
                each, extra = level - floor, 0
            else:  # they stop between: the one more each goes from those whose first entry is oldest
                each, extra = divmod(n, len(group))
                if extra:
                    group.sort(key=self._first)
            for i, tenant in enumerate(group):
                k = each + (i < extra)
                if k:
                    self._drop(tenant, k, compact)
                    n -= k

    def _first(self, tenant: str) -> int:
        part = self._parts[tenant][0]
        return part.scores[part.start]

    def _drop(self, tenant: str, k: int, compact: bool) -> None:
        """Evict `tenant`'s first `k` entries (`compact`: and free their bytes now)."""
        parts, left = self._parts[tenant], k
        while left:
            part = parts[0]
            m = min(left, len(part))
            part.start += m
            left -= m
            if not len(part):
                parts.popleft()
                self._grow(tenant, -len(part.blob))
        if compact and parts:
            kept = parts[0].compacted()
            self._grow(tenant, len(kept.blob) - len(parts[0].blob))
            parts[0] = kept
        self._count -= k
        self._move(tenant, -k)

    def _move(self, tenant: str, by: int) -> None:
        """`tenant` holds `by` entries more (or fewer): the counts stay sorted (O(log tenants))."""
        if not self._held.move(tenant, by):
            del self._parts[tenant]
            self._bytes -= self._tenant_bytes.pop(tenant, 0)  # nothing: its parts went with its entries

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Page:
        # The parts' entries merged newest first (a tenant's page reads its own parts only): each
        # part is in time order, several tenants' and the supervisor's workers' interleave. Equal
        # scores come in the order they came (their sequence numbers: unique, and no append, merge
        # or eviction changes them).
        if f.tenant is None:
            parts = [p for ps in self._parts.values() for p in ps]
        else:
            parts = list(self._parts.get(f.tenant, ()))
        ends = [len(p.scores) for p in parts] if at is None else _after(parts, at)
        heads: list[tuple[int, int, int, int]] = []  # (-score, seq, part, index) of each part's next entry
        for n, (part, i) in enumerate(zip(parts, ends)):
            if i > part.start:
                heads.append((-part.scores[i - 1], part.seqs[i - 1], n, i - 1))
        heapq.heapify(heads)
        out: list[dict[str, Any]] = []
        run = _Run(at)
        scanned = 0
        while heads:
            neg, _, n, i = heads[0]
            if scanned >= _MAX_SCAN:
                return Page(out, run.cursor())  # the next page starts with this entry
            scanned += 1
            if not scanned % _PAUSE_EVERY:
                # Other requests go on. What this page holds stays readable: parts are replaced,
                # never rewritten (an eviction meanwhile only ends a part's read sooner).
                await asyncio.sleep(0)
            part = parts[n]
            raw = part.entry(i)
            if i > part.start:
                heapq.heapreplace(heads, (-part.scores[i - 1], part.seqs[i - 1], n, i - 1))
            else:
                heapq.heappop(heads)
            run.passed(-neg)
            e = f.matching(raw)
            if e is not None:
                out.append(e)
                if len(out) == limit:
                    return Page(out, run.cursor())
        return Page(out, None)

    async def close(self) -> None:
        return None


def _after(parts: list[_Part], at: Cursor) -> list[int]:
    """Where each part's read starts from `at` (its entries before the index: older than the
    cursor's place): past the `at.skip` first entries of `at.score`, counted in the log's order
    across the parts, at once. (Skipped one by one, they counted against the page's scan: past
    `_MAX_SCAN` entries of one score, a page read none and gave back its own cursor, for ever.)"""
    his = [bisect.bisect_right(p.scores, at.score, p.start) for p in parts]
    if not at.skip:
        return his
    los = [bisect.bisect_left(p.scores, at.score, p.start, hi) for p, hi in zip(parts, his)]
    # A part holds its entries of one score latest first: the first read are at the run's end.
    seqs = sorted(s for p, lo, hi in zip(parts, los, his) for s in p.seqs[lo:hi])
    if at.skip >= len(seqs):
        return los
    first = seqs[at.skip]  # the first entry of the score not yet passed
    out = []
    for p, lo, hi in zip(parts, los, his):
        while hi > lo and p.seqs[hi - 1] < first:
            hi -= 1
        out.append(hi)
    return out


# Add a batch, then evict past `size` fairly, as if one by one: the oldest entry of a tenant holding
# the most (among equals, the one whose oldest is oldest), from its index and the log alike; the
# tenants on top come down together to the next count, level after level. KEYS[1]: the log, KEYS[2]: the tenant index prefix,
# KEYS[3]: the tenants by entries held (a sorted set: O(log n) to find the top one). ARGV[1]: size;
# ARGV[2]: the batch, one "score TAB tenant TAB entry" line per entry (one argument: the gateway
# encodes one string, not three per entry; JSON from orjson holds no raw tab or newline, a tenant
# name neither). A tenant's count is set to its index's size wherever the index changed, so counts
# heal where something else changed the index (a replica of an older version, which trimmed the
# log oldest-first); a log without counts (written by an older version) is counted once, here.
_APPEND = r"""
local size = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[3]) == 0 and redis.call('ZCARD', KEYS[1]) > 0 then
  local found, start = {}, 0
  while true do
    local rows = redis.call('ZRANGE', KEYS[1], start, start + 999)
    for _, raw in ipairs(rows) do
      -- a row: [version, id, time, tenant, ...] (read without decoding it where plain); an object before
      local t = string.match(raw, '^%[1,"[^"\\]*",[^,]*,"([^"\\]*)"')
      if not t then
        local ok, e = pcall(cjson.decode, raw)
        t = ok and type(e) == 'table' and (e[4] or e.tenant)
      end
      found[type(t) == 'string' and t or ''] = true
    end
    if #rows < 1000 then break end
    start = start + 1000
  end
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
  for t, _ in pairs(found) do
    local idx = KEYS[2] .. t
    redis.call('ZREMRANGEBYSCORE', idx, '-inf', '(' .. oldest)  -- what the log lost before
    local held = redis.call('ZCARD', idx)
    if held > 0 then redis.call('ZADD', KEYS[3], held, t) end
  end
end
local touched = {}
for score, tenant, entry in string.gmatch(ARGV[2], "(%d+)\t([^\t\n]*)\t([^\n]*)\n") do
  redis.call('ZADD', KEYS[1], score, entry)
  redis.call('ZADD', KEYS[2] .. tenant, score, entry)
  touched[tenant] = true
end
for t, _ in pairs(touched) do
  redis.call('ZADD', KEYS[3], redis.call('ZCARD', KEYS[2] .. t), t)
end
local excess = redis.call('ZCARD', KEYS[1]) - size
while excess > 0 do
  local top = redis.call('ZREVRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if #top == 0 then  -- entries no count covers: oldest first
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
    break
  end
  local level = tonumber(top[2])
  local group = redis.call('ZRANGEBYSCORE', KEYS[3], level, level)
  local below = redis.call('ZREVRANGEBYSCORE', KEYS[3], '(' .. level, '-inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local each, extra = level - tonumber(below[2] or 0), 0
  if excess < #group * each then  -- they stop between: one more from those whose oldest is oldest
    each, extra = math.floor(excess / #group), excess % #group
    if extra > 0 then
      local first = {}
      for _, t in ipairs(group) do
        first[t] = tonumber(redis.call('ZRANGE', KEYS[2] .. t, 0, 0, 'WITHSCORES')[2] or 0)
      end
      table.sort(group, function(a, b) return first[a] < first[b] or (first[a] == first[b] and a < b) end)
    end
  end
  for i, t in ipairs(group) do
    local n = each + (i <= extra and 1 or 0)
    if n > 0 then
      local idx = KEYS[2] .. t
      local old = redis.call('ZRANGE', idx, 0, n - 1)
      redis.call('ZREMRANGEBYRANK', idx, 0, n - 1)
      for j = 1, #old, 1000 do
        excess = excess - redis.call('ZREM', KEYS[1], unpack(old, j, math.min(j + 999, #old)))
      end
      local held = redis.call('ZCARD', idx)
      if held > 0 then redis.call('ZADD', KEYS[3], held, t) else redis.call('ZREM', KEYS[3], t) end
    end
  end
end
return 1
"""


class RedisLogStore:
    """The log in Redis: `{prefix}{log}` (every entry), `{prefix}{log}:t:{tenant}` (a tenant's) and
    `{prefix}{log}:held` (each tenant's count of entries, for the eviction): one hash slot (the
    `{log}` tag), so the append script, which names the tenants' keys itself, runs on a Cluster too
    (on one of its nodes: the log is bounded by `size`)."""

    def __init__(
        self, url: str, size: int, *, prefix: str = "gateway:", timeout_s: float = 1.0, tls: StoreTlsPolicy | None = None
    ) -> None:
        self.size = size
        self._redis: Any = connect(url, tls, timeout_s=timeout_s, max_connections=ADMIN_CONNECTIONS,
                                   name=f"gw-log-{os.getpid()}")
        self._timeout_s = timeout_s
        self._log, self._by_tenant, self._held = f"{prefix}{{log}}", f"{prefix}{{log}}:t:", f"{prefix}{{log}}:held"
        self._append = self._redis.register_script(_APPEND)

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        lines = b"".join(b"%d\t%s\t%s\n" % (score, tenant.encode(), entry) for score, tenant, entry in batch)
        keys = [self._log, self._by_tenant, self._held]
        await self._call("write the request log", self._append(keys=keys, args=[self.size, lines]))

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Page:
        key = self._log if f.tenant is None else self._by_tenant + f.tenant
        # From `at`'s score down, past the first `skip` entries of it (equal scores come in reverse
        # order of their bytes: a fixed order); each read goes on where the last one stopped.
        top, skip = ("+inf", 0) if at is None else (str(at.score), at.skip)
        run = _Run(at)
        out: list[dict[str, Any]] = []
        scanned = 0
        # Unfiltered (or by tenant alone: its own index), a page is one read of `limit` entries.
        n = limit if f.model is None and f.status is None else _CHUNK
        while True:
            rows = await self._call("read the request log",
                                    self._redis.zrevrangebyscore(key, top, "-inf", start=skip, num=n, withscores=True))
            for member, score in rows:
                scanned += 1
                run.passed(int(score))
                e = f.matching(member)
                if e is not None:
                    out.append(e)
                    if len(out) == limit:
                        return Page(out, run.cursor())
            if len(rows) < n:
                return Page(out, None)  # the oldest entry was read
            if scanned >= _MAX_SCAN:
                return Page(out, run.cursor())  # a short page: the cursor goes on from here
            top, skip = str(run.score), run.count

    async def close(self) -> None:
        await close_client(self._redis)

    async def _call(self, what: str, aw: Any) -> Any:
        return await bounded(what, aw, self._timeout_s)
