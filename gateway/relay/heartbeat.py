"""SSE comment heartbeats while a stream waits for its first token."""

from __future__ import annotations

import asyncio
import contextlib

from ..config.policy import ServerPolicy
from ..web.sink import Sink
from ..wire.openai_wire import SSE_HEARTBEAT
from .attempt import Progress

__all__ = ["Heartbeat"]


class Heartbeat:
    """SSE comments while a stream waits for its first token, so idle-timeout proxies keep it open.

    They start only after heartbeat_after_ms (a fast failure still gets a real HTTP status), and
    only then does a task exist: most streams never need one, and a timer is cheaper than a task."""

    __slots__ = ("_sink", "_server", "progress", "_timer", "_task")

    def __init__(self, sink: Sink, server: ServerPolicy, progress: Progress) -> None:
        self._sink, self._server, self.progress = sink, server, progress
        self._task: asyncio.Task[None] | None = None
        self._timer = asyncio.get_running_loop().call_later(server.heartbeat_after_ms / 1000, self._start)

    def _start(self) -> None:
        if not self.progress.first_sent:
            self._task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while not self.progress.first_sent:
            await self._sink.write(SSE_HEARTBEAT)
            await asyncio.sleep(self._server.heartbeat_interval_ms / 1000)

    async def stop(self) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await self._task


