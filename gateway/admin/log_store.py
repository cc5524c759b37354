"""Where the request log lives: a Redis sorted set (shared by every replica) or this process's memory.

Entries are ordered by the time a request ended (microseconds since the epoch: the score), newest
first when read. A page is read from a cursor (`before`: the score of the last entry seen) and
filtered by tenant (an index of its own: a tenant's page never scans other tenants' entries),
model and status (read in chunks and filtered; a page scans at most `_MAX_SCAN` entries, and its
cursor then says where to go on). The log keeps its newest `size` entries.
"""

from __future__ import annotations

import bisect
import heapq
import os
from array import array
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Protocol


from ..config.policy import StoreTlsPolicy
from ..store.connect import ADMIN_CONNECTIONS, close_client, connect
from ..store.redis_store import bounded
from .entry import decode

__all__ = ["Filter", "Page", "LogStore", "MemoryLogStore", "RedisLogStore"]

_MAX_SCAN = 20_000  # entries one page may read past while filtering (bounded work per request)
_CHUNK = 500


@dataclass(frozen=True, slots=True)
class Filter:
    tenant: str | None = None
    model: str | None = None
    status: int | None = None

    def keeps(self, e: dict[str, Any]) -> bool:
        return ((self.tenant is None or e.get("tenant") == self.tenant) and (self.model is None or e.get("model") == self.model)
                and (self.status is None or e.get("status") == self.status))


@dataclass(frozen=True, slots=True)
class Page:
    entries: list[dict[str, Any]]
    next: str | None  # the cursor of the next (older) page; None at the end


class LogStore(Protocol):
    size: int  # entries kept

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        """Add entries: (score, tenant, the entry as JSON)."""
        ...

    async def page(self, f: Filter, limit: int, before: int | None) -> Page:
        """Up to `limit` entries older than `before` (None: the newest), newest first."""
        ...

    async def close(self) -> None:
        ...


async def scan(store: LogStore, f: Filter, before: int | None = None, chunk: int = 1000) -> AsyncIterator[dict[str, Any]]:
    """Every entry matching `f`, newest first, page after page (the export)."""
    while True:
        page = await store.page(f, chunk, before)
        for e in page.entries:
            yield e
        if page.next is None:
            return
        before = int(page.next)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One written batch, in score order: its entries in one blob (one allocation for the
    allocator, not one per entry: many small long-lived objects pin the memory arenas that
    each request's garbage goes to, and the process grows), its scores and ends in arrays."""

    scores: array[int]
    ends: array[int]  # where each entry ends in `blob`
    tenants: tuple[str, ...]
    blob: bytes

    def entry(self, i: int) -> bytes:
        return self.blob[self.ends[i - 1] if i else 0 : self.ends[i]]


class MemoryLogStore:
    """The log in this process: the written batches in the order they came (each in time order;
    several writers' batches may interleave), the oldest dropped whole once the newer ones hold
    `size` entries or the log passes `max_bytes`."""

    def __init__(self, size: int, max_bytes: int = 64 << 20) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self._chunks: deque[_Chunk] = deque()
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return min(self._count, self.size)

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        if not batch:
            return
        batch = sorted(batch, key=lambda b: b[0])
        chunk = _Chunk(array("q", (b[0] for b in batch)), array("q", accumulate(len(b[2]) for b in batch)),
                       tuple(b[1] for b in batch), b"".join(b[2] for b in batch))
        self._chunks.append(chunk)
        self._count += len(batch)
        self._bytes += len(chunk.blob)
        while len(self._chunks) > 1 and (self._count - len(self._chunks[0].scores) >= self.size or self._bytes > self.max_bytes):
            old = self._chunks.popleft()
            self._count -= len(old.scores)
            self._bytes -= len(old.blob)

    async def page(self, f: Filter, limit: int, before: int | None) -> Page:
        # The batches' entries merged newest first: one process writes its batches in time order,
        # but the supervisor's log (admin/relayed.py) takes every worker's, and theirs interleave.
        chunks = list(self._chunks)
        heads: list[tuple[int, int, int]] = []  # (-score, chunk, index) of each chunk's next entry
        seen = scanned = 0  # entries newer than this one (the log shows the newest `size`); entries read
        for n, chunk in enumerate(chunks):
            i = len(chunk.scores) if before is None else bisect.bisect_left(chunk.scores, before)
            seen += len(chunk.scores) - i
            if i:
                heads.append((-chunk.scores[i - 1], n, i - 1))
        heapq.heapify(heads)
        out: list[dict[str, Any]] = []
        while heads:
            neg, n, i = heads[0]
            seen += 1
            if seen > self.size:
                return Page(out, None)
            if scanned >= _MAX_SCAN:
                return Page(out, str(-neg + 1))  # the next page starts with this entry
            scanned += 1
            chunk = chunks[n]
            if i:
                heapq.heapreplace(heads, (-chunk.scores[i - 1], n, i - 1))
            else:
                heapq.heappop(heads)
            if f.tenant is not None and chunk.tenants[i] != f.tenant:
                continue
            e = decode(chunk.entry(i))
            if f.keeps(e):
                out.append(e)
                if len(out) == limit:
                    return Page(out, str(chunk.scores[i]))
        return Page(out, None)

    async def close(self) -> None:
        return None


# Add a batch and keep the newest `size`; a tenant's index loses what the log lost. KEYS[1]: the
# log, KEYS[2]: the tenant index prefix. ARGV[1]: size; ARGV[2]: the batch, one "score TAB tenant
# TAB entry" line per entry (one argument: the gateway encodes one string, not three per entry;
# JSON from orjson holds no raw tab or newline, a tenant name neither).
_APPEND = r"""
local size = tonumber(ARGV[1])
local touched = {}
for score, tenant, entry in string.gmatch(ARGV[2], "(%d+)\t([^\t\n]*)\t([^\n]*)\n") do
  redis.call('ZADD', KEYS[1], score, entry)
  redis.call('ZADD', KEYS[2] .. tenant, score, entry)
  touched[tenant] = true
end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -size - 1)
local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
if oldest then
  for t, _ in pairs(touched) do
    redis.call('ZREMRANGEBYSCORE', KEYS[2] .. t, '-inf', '(' .. oldest)
  end
end
return 1
"""


class RedisLogStore:
    """The log in Redis: `{prefix}{log}` (every entry) and `{prefix}{log}:t:{tenant}` (a tenant's):
    one hash slot (the `{log}` tag), so the append script, which names the tenants' keys itself,
    runs on a Cluster too (on one of its nodes: the log is bounded by `size`)."""

    def __init__(
        self, url: str, size: int, *, prefix: str = "gateway:", timeout_s: float = 1.0, tls: StoreTlsPolicy | None = None
    ) -> None:
        self.size = size
        self._redis: Any = connect(url, tls, timeout_s=timeout_s, max_connections=ADMIN_CONNECTIONS,
                                   name=f"gw-log-{os.getpid()}")
        self._timeout_s = timeout_s
        self._log, self._by_tenant = f"{prefix}{{log}}", f"{prefix}{{log}}:t:"
        self._append = self._redis.register_script(_APPEND)

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        lines = b"".join(b"%d\t%s\t%s\n" % (score, tenant.encode(), entry) for score, tenant, entry in batch)
        await self._call("write the request log", self._append(keys=[self._log, self._by_tenant], args=[self.size, lines]))

    async def page(self, f: Filter, limit: int, before: int | None) -> Page:
        key = self._log if f.tenant is None else self._by_tenant + f.tenant
        top: str = "+inf" if before is None else f"({before}"
        out: list[dict[str, Any]] = []
        scanned = 0
        # Unfiltered (or by tenant alone: its own index), a page is one read of `limit` entries.
        n = limit if f.model is None and f.status is None else _CHUNK
        while True:
            rows = await self._call("read the request log",
                                    self._redis.zrevrangebyscore(key, top, "-inf", start=0, num=n, withscores=True))
            last = 0
            for member, score in rows:
                scanned += 1
                last = int(score)
                e = decode(member)
                if f.keeps(e):
                    out.append(e)
                    if len(out) == limit:
                        return Page(out, str(last))
            if len(rows) < n:
                return Page(out, None)  # the oldest entry was read
            if scanned >= _MAX_SCAN:
                return Page(out, str(last))  # a short page: the cursor goes on from here
            top = f"({last}"

    async def close(self) -> None:
        await close_client(self._redis)

    async def _call(self, what: str, aw: Any) -> Any:
        return await bounded(what, aw, self._timeout_s)
