"""Graceful shutdown's bookkeeping: whether this process is draining, and the requests in flight."""

from __future__ import annotations

import asyncio

__all__ = ["Drain"]


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
