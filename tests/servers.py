"""Serving an aiohttp app on loopback for the fakes and tests (one way, so they all stop alike)."""

from __future__ import annotations

from typing import Any

from aiohttp import web


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0, **runner_kw: Any) -> tuple[web.AppRunner, int]:
    """Start `app` on host:port (0: a free port); the runner (to `cleanup()`) and the port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, **runner_kw)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
