"""Graceful shutdown's bookkeeping: whether this process is draining, and the requests in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from ..errors import Unavailable

__all__ = ["Drain", "SHUTDOWN_CUT", "cut_by_shutdown", "end_in_flight", "shutdown_error"]

# Task.cancel's message for the requests still in flight once `server.shutdown_timeout_ms` ran
# out: the relay ends such a stream as it ends any stream cut mid-answer, with its endpoint's error
# event naming the shutdown (relay/core.py), where a plain cancellation closed the connection
# mid-stream, which clients cannot tell from a network failure.
SHUTDOWN_CUT = "this gateway process is shutting down"


def cut_by_shutdown(exc: asyncio.CancelledError) -> bool:
    """Whether `exc` is a shutdown's cut (end_in_flight), not a client that left."""
    return bool(exc.args) and exc.args[0] == SHUTDOWN_CUT


def shutdown_error() -> Unavailable:
    """What a request the shutdown cut is told (a 503, or its endpoint's error event mid-stream)."""
    return Unavailable(f"{SHUTDOWN_CUT}: the request was still running after server.shutdown_timeout_ms; "
                       "retry the request", retry_after_s=1)


async def end_in_flight(tasks: Collection[asyncio.Task[None]], grace_s: float) -> None:
    """Cancel the handlers still answering after the shutdown timeout with SHUTDOWN_CUT, and give
    them up to `grace_s` to write their error endings and settle (quota, request log); the caller
    cancels whatever is left as before (a client that reads nothing must not hold the exit)."""
    for task in tasks:
        task.cancel(SHUTDOWN_CUT)
    if tasks:
        await asyncio.wait(tasks, timeout=grace_s)


class Drain:
    """`draining` turns /readyz to 503 (load balancers stop sending new requests); `closed` (the
    port closed, after the drain delay) refuses the API requests still arriving on open keep-alive
    connections (a 503 with `Connection: close`, never counted here); `inflight` counts the API
    requests being answered, so shutdown can wait for them (streams included)."""

    __slots__ = ("draining", "closed", "inflight", "_idle")

    def __init__(self) -> None:
        self.draining = False
        self.closed = False
        self.inflight = 0
        self._idle: asyncio.Event | None = None

    def enter(self) -> None:
        self.inflight += 1

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight, at most `timeout_s`; True when none is left."""
        if self.inflight == 0:
            return True
        self._idle = asyncio.Event()
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._idle.wait()
            return True
        except TimeoutError:
            return self.inflight == 0
        finally:
            self._idle = None
