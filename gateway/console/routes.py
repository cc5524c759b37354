"""Serving the console's static files: read once when the routes are built, answered with a
strict Content-Security-Policy (`default-src 'self'`: no inline script or style, no other
origin) and the headers that keep it out of frames, caches and referrers. No key is needed:
the files hold no data, the page asks for a key before it calls the /admin API."""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from importlib import resources

from aiohttp import web

__all__ = ["HEADERS", "routes"]

HEADERS = {
    "Content-Security-Policy": "default-src 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",  # revalidated on each load (ETag): a new gateway serves its own console
}

# URL path -> (file in this package, content type)
_FILES = {
    "/console": ("index.html", "text/html; charset=utf-8"),
    "/console/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/console/app.css": ("app.css", "text/css; charset=utf-8"),
    "/favicon.ico": ("favicon.ico", "image/x-icon"),
}


def _static(body: bytes, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = {**HEADERS, "Content-Type": content_type, "ETag": etag}

    async def handler(request: web.Request) -> web.Response:
        if etag in request.headers.get("If-None-Match", ""):
            return web.Response(status=304, headers={k: v for k, v in headers.items() if k != "Content-Type"})
        return web.Response(body=body, headers=headers)

    return handler


async def _to_console(request: web.Request) -> web.Response:
    return web.Response(status=302, headers={**HEADERS, "Location": "/console"})


def routes() -> list[web.RouteDef]:
    """GET (and HEAD) /console, its script and style sheet, and /favicon.ico; /console/ leads to /console."""
    files = resources.files("gateway.console")
    return [
        *(web.get(path, _static(files.joinpath(name).read_bytes(), ctype)) for path, (name, ctype) in _FILES.items()),
        web.get("/console/", _to_console),
    ]
