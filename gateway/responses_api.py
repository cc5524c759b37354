"""The Responses API's by-id endpoints, sent to the backend that holds the response.

GET /v1/responses/{id} (a background response polled, or its events streamed again with
`?stream=true`), DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and
GET /v1/responses/{id}/input_items. The backend comes from the affinity map (responses_route.py);
its answer (status, JSON or event stream) goes back as it is. A 200 to DELETE also drops the id
from the map.
"""

from __future__ import annotations

import asyncio
import logging
import re

from aiohttp import web
from yarl import URL

from .api import _api_key, _error, _request_id
from .attempt import MAX_BODY_BYTES
from .backends import Backend
from .errors import GatewayError, NotFound, UpstreamError, UpstreamTimeout
from .keys import LIVE, RELAY
from .responses_route import holders_of
from .upstream_http import UpstreamHTTPError, UpstreamResponse

__all__ = ["routes"]

log = logging.getLogger("gateway.responses")

_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,256}$")  # one path segment, nothing to escape
_PASS_HEADERS = ("Content-Type", "Retry-After")


async def _forward(request: web.Request, method: str, suffix: str = "") -> web.StreamResponse:
    rid = request.match_info["id"]
    req_id = _request_id(request)
    headers = {"x-request-id": req_id}
    rt = request.app[LIVE].runtime
    try:
        tenant = rt.tenants.authenticate(_api_key(request))
        if not _ID.match(rid):
            raise NotFound(f"response {rid[:80]!r} is not known to this gateway", param="response_id", code="response_not_found")
        backends, search = await holders_of(rid, tenant.cache_namespace, rt)
        body = await request.read() if method == "POST" else b""
        if len(body) > rt.server.max_body_bytes:
            body = b""  # a cancel carries no body worth forwarding
        for i, backend in enumerate(backends):
            headers["x-gateway-backend"] = backend.name
            out = await _relay(request, backend, method, f"/responses/{rid}{suffix}", body, headers, req_id, last=i == len(backends) - 1)
            if out is None:
                continue  # searching: that backend does not have it
            if method == "DELETE" and out.status == 200:
                await rt.affinity.forget(rid)  # a deleted response leaves the map
            elif search and out.status == 200:
                await rt.affinity.remember([rid], backend.name, tenant.cache_namespace)
            return out
        raise NotFound(
            f"response {rid!r} is not known to this gateway, and no backend ({', '.join(repr(b.name) for b in backends)}) has it",
            param="response_id", code="response_not_found",
        )
    except GatewayError as err:
        return _error(err, headers)


async def _relay(
    request: web.Request, backend: Backend, method: str, path: str, body: bytes, headers: dict[str, str], req_id: str,
    *, last: bool = True,
) -> web.StreamResponse | None:
    """The backend's answer for the client; None when it answered 404 and it is not the `last` to ask."""
    t = backend.timeouts
    qs = request.rel_url.raw_query_string
    url = URL(backend.base_url + path + (f"?{qs}" if qs else ""), encoded=True)
    up_headers = {**backend.headers, "X-Request-Id": req_id}
    if not body:
        up_headers.pop("Content-Type", None)
    resp: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(t.first_token_ms / 1000):
            resp = await request.app[RELAY].pool.post(url, body, up_headers, connect_timeout_s=t.connect_ms / 1000, method=method)
        if resp.status == 404 and not last:
            return None
        out_headers = {**headers, **{k: resp.headers[k] for k in _PASS_HEADERS if k in resp.headers}}
        if "text/event-stream" not in resp.headers.get("Content-Type", ""):
            async with asyncio.timeout(t.total_ms / 1000):
                data = await resp.read(max_bytes=MAX_BODY_BYTES)
            resp.release()
            return web.Response(status=resp.status, body=data, headers=out_headers)
        return await _stream(request, resp, out_headers, t.idle_ms / 1000)
    except TimeoutError:
        err: GatewayError = UpstreamTimeout(f"backend {backend.name!r} did not answer {method} {path} in time")
    except UpstreamHTTPError as exc:
        err = UpstreamError(f"backend {backend.name!r} failed on {method} {path}: {exc}")
    finally:
        if resp is not None:
            resp.close()  # a no-op after release()
    return _error(err, headers)


async def _stream(request: web.Request, resp: UpstreamResponse, headers: dict[str, str], idle_s: float) -> web.StreamResponse:
    """An event stream (a background response's events, replayed by its backend), as bytes."""
    out = web.StreamResponse(status=resp.status, headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    await out.prepare(request)
    try:
        while True:
            async with asyncio.timeout(idle_s):
                chunk = await resp.readany()
            if not chunk:
                break
            await out.write(chunk)
    except (TimeoutError, UpstreamHTTPError) as exc:
        # Cut: the client sees the stream stop without response.completed, which is the truth.
        log.warning("request %s: replayed stream from a backend cut: %s", headers.get("x-request-id"), exc)
        return out
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        return out
    await out.write_eof()
    return out


async def get_response(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "GET")


async def delete_response(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "DELETE")


async def cancel_response(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "POST", "/cancel")


async def input_items(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "GET", "/input_items")


def routes() -> list[web.RouteDef]:
    """The by-id routes (before the gateway's catch-all)."""
    return [
        web.get("/v1/responses/{id}", get_response),
        web.delete("/v1/responses/{id}", delete_response),
        web.post("/v1/responses/{id}/cancel", cancel_response),
        web.get("/v1/responses/{id}/input_items", input_items),
    ]
