"""The Responses API's by-id endpoints and the conversations endpoints, sent to the backend that
holds the state.

Responses: GET /v1/responses/{id} (a background response polled, or its events streamed again
with `?stream=true`), DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and
GET /v1/responses/{id}/input_items. Conversations: POST /v1/conversations (created on a backend
of the caller's routes and recorded as the caller's), GET/POST/DELETE /v1/conversations/{id},
GET/POST /v1/conversations/{id}/items and GET/DELETE /v1/conversations/{id}/items/{item_id}.

The backend comes from the affinity map (responses_route.py), and the id must be the caller's:
one without a record, or another tenant's, is a 404 before any upstream call (the migration mode,
`responses.adopt_unknown_ids`, searches the backends instead and records the id as the caller's).
Each upstream request takes one request from the tenant's request limits (quota.reserve_request).
The backend's answer (status, JSON or event stream) goes back as it is. A 200 to DELETE drops the
id from the map.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web
from yarl import URL

from .api import _api_key, _error, _read_body, _request_id
from .attempt import MAX_BODY_BYTES
from .auth import Tenant
from .backends import Backend
from .errors import BadRequest, GatewayError, NotFound, UpstreamError, UpstreamTimeout
from .keys import LIVE, METRICS, RELAY
from .quota import Hold, QuotaExceeded
from .responses_route import holders_of, not_yours, serving, usable_or_raise
from .runtime import Runtime
from .upstream_http import UpstreamHTTPError, UpstreamResponse

__all__ = ["routes"]

log = logging.getLogger("gateway.responses")

_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,256}$")  # one path segment, nothing to escape
_PASS_HEADERS = ("Content-Type", "Retry-After")

Found = Callable[[Backend, UpstreamResponse], Awaitable[None]]  # a 200 from that backend, before its release


def _valid_id(value: str, param: str) -> str:
    """A path id that can be sent on as one path segment: `.` and `..` (also sent percent-encoded)
    would be dot segments upstream, so an id of dots only is refused like any malformed one."""
    if not _ID.match(value) or not value.strip("."):
        raise NotFound(f"{param} {value[:80]!r} is not a valid id", param=param, code="not_found")
    return value


class _Calls:
    """One by-id request's upstream calls, each counted against the tenant's request limits."""

    __slots__ = ("rt", "tenant", "headers", "timeout_s", "hold", "_metrics")

    def __init__(self, request: web.Request, rt: Runtime, tenant: Tenant, headers: dict[str, str]) -> None:
        self.rt, self.tenant, self.headers = rt, tenant, headers
        self.timeout_s = rt.server.request_timeout_ms / 1000
        self.hold: Hold | None = None
        self._metrics = request.app[METRICS]

    async def take(self) -> None:
        """One more upstream request: the last one's lease goes back, a new one is taken."""
        quota = self.rt.quota
        if quota is None:
            return
        quota.release(self.hold)
        self.hold = None
        try:
            self.hold = await quota.reserve_request(self.tenant, self.timeout_s, self.headers.__setitem__)
        except QuotaExceeded as err:
            self._metrics.quota_rejections.labels(self.rt.tenants.metric_label(self.tenant.name), err.limit).inc()
            raise

    def done(self) -> None:
        if self.rt.quota is not None:
            self.rt.quota.release(self.hold)


async def _forward(request: web.Request, method: str, kind: str = "response", suffix: str = "") -> web.StreamResponse:
    """Send a by-id call to the backend holding the id in the path (`kind`: response or
    conversation), after checking the id is the caller's."""
    req_id = _request_id(request)
    headers = {"x-request-id": req_id}
    rt = request.app[LIVE].runtime
    calls: _Calls | None = None
    param = f"{kind}_id"
    try:
        tenant = rt.tenants.authenticate(_api_key(request))
        rid = _valid_id(request.match_info["id"], param)
        if "item_id" in request.match_info:
            suffix = suffix.replace("{item_id}", _valid_id(request.match_info["item_id"], "item_id"))
        body = await _read_body(request, rt.server.max_body_bytes) if method == "POST" else b""
        owner = tenant.cache_namespace
        calls = _Calls(request, rt, tenant, headers)
        await calls.take()  # counted before the map is read: refused calls cost the caller too
        backends, search = await holders_of(rid, owner, rt, param)

        async def adopt(backend: Backend, resp: UpstreamResponse) -> None:
            # The migration mode: the id becomes the caller's before its answer is released.
            await rt.affinity.record([rid], backend.name, owner)

        path = f"/{kind}s/{rid}{suffix}"
        for i, backend in enumerate(backends):
            if i:
                await calls.take()  # each backend a search asks is an upstream request of its own
            headers["x-gateway-backend"] = backend.name
            out = await _relay(request, backend, method, path, body, headers, req_id, last=i == len(backends) - 1,
                               on_found=adopt if search else None)
            if out is None:
                continue  # searching: that backend does not have it
            if method == "DELETE" and out.status == 200 and not suffix:
                await rt.affinity.forget(rid)  # a deleted response (conversation) leaves the map
            return out
        raise not_yours(param, rid)
    except GatewayError as err:
        return _error(err, headers)
    finally:
        if calls is not None:
            calls.done()


def _conversation_backend(rt: Runtime, tenant: Tenant, model: str | None) -> Backend:
    """Where a new conversation is made: with `model`, the first usable backend of that model's
    route that serves the Responses API (its later turns must use a model routed there); without,
    the first of the backends of every model the tenant may use, in the policy's order."""
    if model is not None:
        rt.tenants.authorize(tenant, model)
        candidates = serving(rt.route(model))
        if not candidates:
            raise BadRequest(f"no backend of model {model!r} serves the Responses API", param="model", code="unsupported_endpoint")
    else:
        candidates = []
        for name, route in rt.routes.items():
            if tenant.may_use(name):
                candidates += [b for b in serving(route) if b not in candidates]
        if not candidates:
            raise BadRequest("none of the models this key may use has a backend serving the Responses API",
                             param="model", code="unsupported_endpoint")
    for backend in candidates:
        if backend.takes_traffic():
            return backend
    usable_or_raise(candidates[0], "a new conversation")  # says why (ejected, cooling, starting)
    return candidates[0]


def _creation_body(raw: bytes) -> tuple[bytes, str | None]:
    """The body to send upstream (without the gateway's own `model` field), and that model."""
    if not raw.strip():
        return b"{}", None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.pop("model", None)
    if model is not None and not (isinstance(model, str) and model):
        raise BadRequest("invalid field 'model': must be a model name (a non-empty string)", param="model")
    return orjson.dumps(body), model


async def create_conversation(request: web.Request) -> web.StreamResponse:
    """POST /v1/conversations: made on a backend the caller's requests can reach (`model` in the
    body, a gateway field not sent upstream, picks the route), and recorded as the caller's before
    its id is released: later turns with `conversation` go to that backend, and only the caller's."""
    req_id = _request_id(request)
    headers = {"x-request-id": req_id}
    rt = request.app[LIVE].runtime
    calls: _Calls | None = None
    try:
        tenant = rt.tenants.authenticate(_api_key(request))
        body, model = _creation_body(await _read_body(request, rt.server.max_body_bytes))
        calls = _Calls(request, rt, tenant, headers)
        await calls.take()
        backend = _conversation_backend(rt, tenant, model)
        headers["x-gateway-backend"] = backend.name

        async def whole(backend: Backend, resp: UpstreamResponse) -> None:
            if "text/event-stream" in resp.headers.get("Content-Type", ""):
                raise UpstreamError(f"backend {backend.name!r} answered the new conversation with an event stream")

        out = await _relay(request, backend, "POST", "/conversations", body, headers, req_id, on_found=whole)
        assert out is not None  # `last`: a 404 is an answer too
        if not isinstance(out, web.Response) or out.status != 200:
            return out  # the backend's refusal (a bad `items`, say), as it said it (a 200 stream: refused by `whole`)
        try:
            conv = orjson.loads(out.body) if isinstance(out.body, bytes) else None
        except orjson.JSONDecodeError:
            conv = None
        cid = conv.get("id") if isinstance(conv, dict) else None
        if not isinstance(cid, str) or not _ID.match(cid) or not cid.strip("."):
            raise UpstreamError(f"backend {backend.name!r} answered the new conversation without a usable id")
        # Not released unless recorded: an id without an owner would be nobody's (a 404 to all).
        await rt.affinity.record([cid], backend.name, tenant.cache_namespace)
        return out
    except GatewayError as err:
        return _error(err, headers)
    finally:
        if calls is not None:
            calls.done()


async def _relay(
    request: web.Request, backend: Backend, method: str, path: str, body: bytes, headers: dict[str, str], req_id: str,
    *, last: bool = True, on_found: Found | None = None,
) -> web.StreamResponse | None:
    """The backend's answer for the client; None when it answered 404 and it is not the `last` to
    ask. `on_found` runs on a 200 before anything of it is released (a GatewayError it raises is
    the answer instead)."""
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
        if on_found is not None and resp.status == 200:
            await on_found(backend, resp)
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
        # The client learns the kind of failure; the address and the OS error stay in the log.
        log.info("request %s: backend %r failed on %s %s: %s: %s", req_id, backend.name, method, url, type(exc).__name__, exc)
        err = UpstreamError(f"backend {backend.name!r} failed on {method} {path}: {exc.summary}")
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
    return await _forward(request, "POST", suffix="/cancel")


async def input_items(request: web.Request) -> web.StreamResponse:
    return await _forward(request, "GET", suffix="/input_items")


def _conversation(method: str, suffix: str = "") -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await _forward(request, method, "conversation", suffix)

    return handler


def routes() -> list[web.RouteDef]:
    """The by-id routes and the conversations routes (before the gateway's catch-all)."""
    items = "/v1/conversations/{id}/items"
    return [
        web.get("/v1/responses/{id}", get_response),
        web.delete("/v1/responses/{id}", delete_response),
        web.post("/v1/responses/{id}/cancel", cancel_response),
        web.get("/v1/responses/{id}/input_items", input_items),
        web.post("/v1/conversations", create_conversation),
        web.get("/v1/conversations/{id}", _conversation("GET")),
        web.post("/v1/conversations/{id}", _conversation("POST")),
        web.delete("/v1/conversations/{id}", _conversation("DELETE")),
        web.get(items, _conversation("GET", "/items")),
        web.post(items, _conversation("POST", "/items")),
        web.get(items + "/{item_id}", _conversation("GET", "/items/{item_id}")),
        web.delete(items + "/{item_id}", _conversation("DELETE", "/items/{item_id}")),
    ]
