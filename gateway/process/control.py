"""The control channel of `gateway serve --workers N`: small JSON HTTP over unix sockets.

Each worker listens on `<dir>/worker-<i>.sock` (reload, its admin view); the supervisor on
`<dir>/supervisor.sock`. A worker asked on its public port to reload, or for every worker's view,
asks the supervisor, which asks every worker and answers with all of their results. Unix sockets
in a private directory (mode 0700): nothing outside this machine's user can reach them, and no
port is taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import orjson
from aiohttp import web

__all__ = ["ASKED_BECAUSE", "ControlError", "DataHandler", "Handler", "ask", "ask_all", "rejections", "serve_unix", "why"]

log = logging.getLogger("gateway.control")

Handler = Callable[[], Awaitable[dict[str, Any]]]
# A handler of a request with a JSON body (the supervisor's shared admin stores: admin/relayed.py).
DataHandler = Callable[[Any], Awaitable[dict[str, Any]]]
_MAX_BODY = 64 << 20  # a private socket; a request log batch of a busy worker is a few MB at most

# While a handler runs: the `why` its request named (the supervisor's reason for a reload: SIGHUP,
# a file change, /admin/reload, a replica's announcement...), else None. The worker's reload
# handler names no trigger of its own that would be right for all of them (config/reload.py reads this).
ASKED_BECAUSE: contextvars.ContextVar[str | None] = contextvars.ContextVar("gateway_control_why", default=None)


def why(route: str, reason: str) -> str:
    """`route` asked with `reason` (seen by its handler as ASKED_BECAUSE)."""
    return f"{route}?{urlencode({'why': reason})}"


class ControlError(RuntimeError):
    """A process on the control channel did not answer."""


async def serve_unix(
    path: Path, handlers: dict[tuple[str, str], Handler], data_handlers: dict[tuple[str, str], DataHandler] | None = None
) -> web.AppRunner:
    """Serve `handlers` ((method, path) -> coroutine returning JSON) on a unix socket at `path`;
    `data_handlers` are given the request's JSON body."""

    def wrap(fn: Handler) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            token = ASKED_BECAUSE.set(request.query.get("why") or None)
            try:
                return web.Response(body=orjson.dumps(await fn()), content_type="application/json")
            finally:
                ASKED_BECAUSE.reset(token)

        return handle

    def wrap_data(fn: DataHandler) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            try:
                data = orjson.loads(await request.read())
            except orjson.JSONDecodeError as exc:
                return web.Response(status=400, text=f"not JSON: {exc}")
            return web.Response(body=orjson.dumps(await fn(data)), content_type="application/json")

        return handle

    app = web.Application(client_max_size=_MAX_BODY)
    for (method, route), fn in handlers.items():
        app.router.add_route(method, route, wrap(fn))
    for (method, route), dfn in (data_handlers or {}).items():
        app.router.add_route(method, route, wrap_data(dfn))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a socket left by a worker that died
    site = web.UnixSite(runner, str(path))
    await site.start()
    os.chmod(path, 0o600)
    return runner


async def ask(path: Path, method: str, route: str, timeout_s: float, data: Any = None) -> dict[str, Any]:
    """One JSON request (with `data` as its JSON body, when given) to the process listening on
    `path`; ControlError when it cannot answer."""
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(path)), timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as http:
            body = None if data is None else orjson.dumps(data)
            async with http.request(method, f"http://gateway{route}", data=body) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise ControlError(f"{path.name} answered {method} {route} with HTTP {resp.status}")
                out: dict[str, Any] = orjson.loads(body)
                return out
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, orjson.JSONDecodeError) as exc:
        raise ControlError(f"{path.name} did not answer {method} {route}: {type(exc).__name__}: {exc}") from None


def rejections(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answers of `ask_all` that refused what was asked (not those that could not answer)."""
    return [r for r in results if not r.get("ok") and not r.get("unreachable")]


async def ask_all(
    paths: list[Path], method: str, route: str, timeout_s: float,
    on_answer: Callable[[Path, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Ask every process at once; one that cannot answer gives {"error": ...} in its place.
    `on_answer(path, answer)`: as each one answers (or is found unable to), before all have."""

    async def one(path: Path) -> dict[str, Any]:
        try:
            out = await ask(path, method, route, timeout_s)
        except ControlError as exc:  # not a verdict on what was asked: it was never answered
            out = {"ok": False, "error": str(exc), "socket": path.name, "unreachable": True}
        if on_answer is not None:
            on_answer(path, out)
        return out

    return list(await asyncio.gather(*(one(p) for p in paths)))
