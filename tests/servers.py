"""Serving an aiohttp app on loopback for the fakes and tests (one way, so they all stop alike)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Self

from aiohttp import web


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, **runner_kw: Any) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0: a free port); the runner (to `cleanup()`) and the port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


class Served:
    """A fake that serves its `app` on `host:port` (0 until started): its URL, start and stop."""

    app: web.Application
    host: str
    port: int
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self) -> Self:
        self._runner, self.port = await serve_app(self.app, self.host, self.port)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def serve_for(start: Callable[[], Awaitable[Any]], seconds: float, banner: Callable[[Any], str]) -> None:
    """Run a fake as a script: start it, print `banner(fake)`, serve for `seconds` (it exits by
    itself: no fake outlives a test run), then stop it. uvloop when installed."""

    async def run() -> None:
        fake = await start()
        print(banner(fake), flush=True)
        try:
            await asyncio.sleep(seconds)
        finally:
            await fake.stop()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
