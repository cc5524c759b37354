"""The request log: every API request's metadata, written off the request path.

A request that ends costs a tuple of its values and a deque append (`RequestLog.add`, entry.py);
a writer task makes rows of what came, encodes them and sends them to the store
(admin/log_store.py) every `request_log.flush_ms`. Bounded when the store is slow or down: at
most `request_log.queue` entries wait, more are dropped and counted
(`gateway_request_log_dropped_total{reason="queue_full"}`), and a batch the store does not take
within `write_timeout_ms` is dropped and counted (`reason="store"`): never a blocked request,
never a queue that grows without bound. An entry the writer cannot make a row of (a bug) is
dropped, counted (`reason="encode"`) and logged; the writer goes on.

Prompts and answers are kept only for tenants with `log_payloads: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..config.policy import RequestLogPolicy
from ..pipeline.call import Call
from .entry import Taken, encode, row_of, take
from .log_store import LogStore

if TYPE_CHECKING:
    from ..config.runtime import Runtime

__all__ = ["RequestLog"]

log = logging.getLogger("gateway.admin.request_log")


class RequestLog:
    """One per process: a bounded queue in front of the store, and its writer."""

    def __init__(self, store: LogStore, policy: RequestLogPolicy, on_drop: Callable[[str, int], None]) -> None:
        self.store = store
        self.policy = policy
        self._q: deque[Taken] = deque()  # finished requests, made rows and encoded by the writer
        self._on_drop = on_drop
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._failing = False

    def add(self, call: Call, rt: Runtime, end: float, spend_usd: float) -> None:
        """Queue one finished request (dropped and counted when the queue is full)."""
        if len(self._q) >= self.policy.queue:  # checked first: a full queue costs no row
            self._on_drop("queue_full", 1)
            return
        self._q.append(take(call, rt, end, spend_usd))

    def put(self, taken: Taken) -> bool:
        """Queue one finished request as `entry.take` keeps it; False when the queue is full
        (dropped, counted)."""
        if len(self._q) >= self.policy.queue:
            self._on_drop("queue_full", 1)
            return False
        self._q.append(taken)
        return True

    def configure(self, policy: RequestLogPolicy) -> None:
        """A reloaded policy's settings (the store stays the one named at start)."""
        self.policy = policy
        self.store.size = policy.size

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    async def close(self) -> None:
        """Write what is queued (within one write timeout), then stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()
        await self.store.close()

    async def flush(self) -> None:
        """Write what is queued now (the admin API reads its own writes)."""
        await self._flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.flush_ms / 1000)
            await self._flush()

    def _rows(self, n: int) -> list[tuple[int, str, bytes]]:
        """The next `n` queued entries as the store takes them. One that fails is dropped and
        counted, not the writer: a task that raised would leave the log silent for good."""
        out, failed = [], 0
        for _ in range(n):
            taken = self._q.popleft()
            try:
                out.append(encode(row_of(taken)))
            except Exception:
                failed += 1
                if failed == 1:  # one traceback a batch, however many fail
                    log.exception("request log: cannot make an entry of request %r; it is dropped", taken[0])
        if failed:
            self._on_drop("encode", failed)
        return out

    async def _flush(self) -> None:
        # What is queued now, in batches of at most 1,000; what comes while they are written waits
        # for the next flush. (Draining until the queue is empty chased the requests' tail on a
        # store with round trips: ~150 small writes a second at 5,000 req/s instead of 5.)
        left = len(self._q)
        while left > 0 and self._q:
            n = min(left, len(self._q), 1000)
            left -= n
            batch = self._rows(n)
            if not batch:  # every entry of it failed (dropped and counted): nothing to send
                continue
            try:
                async with asyncio.timeout(self.policy.write_timeout_ms / 1000):
                    await self.store.append(batch)
                if self._failing:
                    log.warning("request log: the store takes entries again")
                self._failing = False
            except Exception as exc:  # slow or down: this batch is lost, counted, and the next one tries again
                self._on_drop("store", len(batch))
                if not self._failing:
                    log.warning("request log: cannot write to the store, entries are dropped and counted: %s", exc)
                self._failing = True
                return
