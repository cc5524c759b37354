"""A bare aiohttp passthrough (server + ClientSession), the floor the gateway is compared with.

    python bench/_minproxy.py UPSTREAM_URL PORT
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
import uvloop
from aiohttp import web
from yarl import URL

TARGET: web.AppKey[URL] = web.AppKey("target")
SESSION: web.AppKey[aiohttp.ClientSession] = web.AppKey("session")


async def passthrough(request: web.Request) -> web.Response:
    body = await request.read()
    async with request.app[SESSION].post(request.app[TARGET], data=body, headers={"Content-Type": "application/json"}) as r:
        data = await r.read()
    return web.Response(body=data, content_type="application/json")


async def session(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


def main() -> None:
    app = web.Application()
    app[TARGET] = URL(sys.argv[1])
    app.cleanup_ctx.append(session)
    app.router.add_post("/v1/chat/completions", passthrough)
    app.router.add_get("/healthz", lambda _r: web.Response(text="ok"))  # type: ignore[arg-type,return-value]
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), access_log=None, print=None)


if __name__ == "__main__":
    main()
