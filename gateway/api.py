"""aiohttp handlers: read the request, build a Call, run the pipeline, return what the sink holds."""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from . import pipeline
from .body import read_body
from .cache import cache_control
from .call import ENDPOINTS, Call
from .errors import BadRequest, GatewayError, InternalError, NotFound, Unauthorized
from .keys import ADMISSION, DRAIN, LIVE, METRICS, OBSERVER, PEERS, RELAY, RELOADER, WORKER
from .metrics import refresh_gauges
from .observe import parse_traceparent, server_timing
from .routing import usable
from .responses import ResponsesSink
from .sink import HttpSink

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["LOOPBACK", "backends_view", "routes"]

# Whether the app is bound to a loopback address only (set by create_app from its `host`).
LOOPBACK: web.AppKey[bool] = web.AppKey("loopback", bool)

log = logging.getLogger("gateway.api")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_JSON = "application/json"


def _json(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type=_JSON, headers=headers)


def _error(err: GatewayError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=err.to_body(), status=err.status, content_type=_JSON, headers={**(headers or {}), **err.headers()}
    )


def _api_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    return request.headers.get("api-key") or None  # Azure-style clients


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, at most `limit` bytes as sent and as inflated, within `server.body_timeout_ms`
    (body.read_body). Call it only once the caller is authenticated."""
    return await read_body(request, limit, request.app[LIVE].runtime.server.body_timeout_ms / 1000)


async def _body_if_authenticated(request: web.Request, rt: Runtime) -> bytes:
    """The body when the key in the headers is valid; else nothing is read (b""), and the
    pipeline, which authenticates first, answers (and records) the 401."""
    try:
        rt.tenants.authenticate(_api_key(request))
    except Unauthorized:
        return b""
    return await _read_body(request, rt.server.max_body_bytes)


def _request_id(request: web.Request) -> str:
    """The caller's x-request-id when it is a safe token; otherwise a fresh one (a bad one is never
    echoed back: it could split headers or inject into logs)."""
    rid = request.headers.get("x-request-id")
    if rid and _REQUEST_ID.match(rid):
        return rid
    return os.urandom(12).hex()


def _timeout_ms(asked: str | None, server_timeout_ms: int) -> int:
    """The request's deadline: `x-request-timeout-ms` may shorten the server's, never lengthen it.

    Decimal, not float: `1e400` is a huge finite number (clamped), not an overflow; `inf`, `nan`
    and values <= 0 are 400s."""
    if not asked:
        return server_timeout_ms
    try:
        value = Decimal(asked.strip())
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value <= 0:
        raise BadRequest(
            f"header x-request-timeout-ms must be a positive, finite number of milliseconds, got {asked[:40]!r}",
            param="x-request-timeout-ms",
        )
    if value >= server_timeout_ms:  # compared before int(): int(Decimal("1e999999")) would be huge
        return server_timeout_ms
    return max(1, int(value))


def _new_call(request: web.Request, endpoint_name: str, raw: bytes, server_timeout_ms: int) -> Call:
    h = request.headers
    rid = _request_id(request)
    timeout_ms = _timeout_ms(h.get("x-request-timeout-ms"), server_timeout_ms)
    priority = h.get("x-priority")
    if priority is not None and priority not in ("priority", "default", "flex"):
        raise BadRequest("header x-priority must be one of priority, default, flex", param="x-priority")
    no_cache, no_store = cache_control(h.get("cache-control"))
    now = time.monotonic()  # one reading: the deadline's message says exactly the timeout asked for
    return Call(
        request_id=rid,
        endpoint=ENDPOINTS[endpoint_name],
        raw=raw,
        api_key=_api_key(request),
        deadline=now + timeout_ms / 1000,
        t0_monotonic=now,
        priority=priority,
        no_cache=no_cache,
        no_store=no_store,
        deadline_asked=bool(h.get("x-request-timeout-ms")),
        trace_parent=parse_traceparent(h.get("traceparent")),
    )


async def _proxy(request: web.Request, endpoint_name: str) -> web.StreamResponse:
    rt = request.app[LIVE].runtime  # one snapshot for the whole request
    try:
        raw = await _body_if_authenticated(request, rt)
        call = _new_call(request, endpoint_name, raw, rt.server.request_timeout_ms)
    except GatewayError as err:
        return _error(err, {"x-request-id": _request_id(request)})
    sink = HttpSink(request, {"x-request-id": call.request_id, "x-gateway-queue-ms": "0"}, functools.partial(server_timing, call))
    drain = request.app[DRAIN]
    drain.enter()
    try:
        # Responses streams end a failure with their own `error` event (responses.py).
        await pipeline.run(call, rt, request.app[RELAY], ResponsesSink(sink) if endpoint_name == "responses" else sink)
    finally:
        drain.leave()
        request.app[OBSERVER].done(call, rt)
    assert sink.response is not None
    return sink.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "completions")


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "embeddings")


async def responses(request: web.Request) -> web.StreamResponse:
    return await _proxy(request, "responses")


async def list_models(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    try:
        tenant = rt.tenants.authenticate(_api_key(request))
    except GatewayError as err:
        return _error(err)
    created = int(rt.created)
    data = [
        {"id": m, "object": "model", "created": created, "owned_by": "gateway"}
        for m in rt.public_models
        if tenant.may_use(m)
    ]
    return _json({"object": "list", "data": data})


async def route_explain(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    try:
        raw = await _body_if_authenticated(request, rt)
        call = _new_call(request, _explained_endpoint(raw), raw, rt.server.request_timeout_ms)
        return _json(await pipeline.explain(call, rt, request.app[ADMISSION]), headers={"x-request-id": call.request_id})
    except GatewayError as err:
        return _error(err, {"x-request-id": _request_id(request)})
    except Exception:  # a bug: still an answer in the contract
        rid = _request_id(request)
        log.exception("request %s: internal error in /v1/route/explain", rid)
        return _error(InternalError(f"internal error in the gateway (request id {rid})"), {"x-request-id": rid})


def _explained_endpoint(raw: bytes) -> str:
    """Which body /v1/route/explain was given: a Responses one (`input`, no `messages`), else chat."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "chat"  # parse() answers the 400
    return "responses" if isinstance(body, dict) and "input" in body and "messages" not in body else "chat"


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when every model route can send each request class to some backend, as the router sees
    it (a launched model still loading cannot; an ejected last resort still can)."""
    rt = request.app[LIVE].runtime
    if request.app[DRAIN].draining:  # shutting down: load balancers take this replica out first
        return _json({"status": "draining", "policy_generation": rt.generation}, status=503)
    healthy = [b.name for b in rt.backends.values() if b.takes_traffic()]
    unserved = [
        model
        for model, route in rt.routes.items()
        if not (usable(route.simple.candidates) and usable(route.complex.candidates))
    ]
    # Launched models not up yet, each with why: starting, or a failed launch and when it is retried.
    not_ready = {b.name: b.health.starting_reason() for b in rt.backends.values() if not b.health.ready}
    body: dict[str, object] = {
        "status": "not ready" if unserved else "ready",
        "policy_generation": rt.generation,
        "healthy_backends": healthy,
        "models_without_backend": unserved,
        "backends_not_ready": not_ready,
    }
    if unserved:
        why = "".join(f"; {name}: {reason}" for name, reason in not_ready.items())
        body["detail"] = "no usable backend (starting, or none configured) for: " + ", ".join(unserved) + why
    return _json(body, status=503 if unserved else 200)


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    # Tenant names, tokens and spend: closed beyond loopback unless the policy opens it (auth.Tenants.may_scrape).
    if not rt.tenants.may_scrape(_api_key(request), loopback=request.app[LOOPBACK]):
        return _error(Unauthorized(rt.tenants.scrape_refusal()))
    m = request.app[METRICS]
    refresh_gauges(m, rt, request.app[ADMISSION])
    return web.Response(body=m.exposition(), content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _admin(handler: Handler) -> Handler:
    """An admin endpoint: 401 without an admin key (except in loopback open mode)."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        rt = request.app[LIVE].runtime
        if not rt.tenants.is_admin(_api_key(request), loopback=request.app[LOOPBACK]):
            return _error(Unauthorized("admin endpoints need an admin key (policy `admin.key_sha256`)"))
        return await handler(request)

    return guarded


def backends_view(app: web.Application) -> dict[str, object]:
    """This process's view of its backends and admission (what /admin/backends shows)."""
    rt = app[LIVE].runtime
    worker = app[WORKER]
    out = {}
    for name, b in rt.backends.items():
        snap = b.tracker.snapshot()
        h = b.headline_health()
        out[name] = {
            "url": b.base_url,
            "health": h.state(),
            "ejections_in_a_row": max(h.ejections, b.health.ejections),
            "available_in_s": round(min(h.available_in(), 1e9), 3),
            "consecutive_failures": max(h.consecutive_failures, b.health.consecutive_failures),
            "cooling_s": round(h.cooling_for(), 3),
            **({} if b.health.ready else {"not_ready": b.health.starting_reason()}),
            # Per upstream model: a provider's 429 or errors on one model leave the others alone.
            "models": {
                m: {"health": h.state(), "consecutive_failures": h.consecutive_failures,
                    "cooling_s": round(h.cooling_for(), 3), "available_in_s": round(min(h.available_in(), 1e9), 3)}
                for m, h in b.state.models.items()
            },
            # With N workers each holds its share: the policy's bound holds across them.
            "max_concurrency": b.policy.max_concurrency,
            "max_concurrency_this_worker": b.slots.limit,
            "queued": dict(b.slots.queue.sizes),
            **snap,
        }
    gate = app[ADMISSION].gate
    admission = {"inflight": gate.used, "max_inflight": gate.limit, "queued": dict(gate.queue.sizes),
                 "service_s": round(app[ADMISSION].service_s(), 4)}
    return {"policy_generation": rt.generation, "workers_total": 1 if worker is None else worker.count,
            "admission": admission, "backends": out}


_CONTROL_TIMEOUT_S = 15.0


@_admin
async def admin_backends(request: web.Request) -> web.Response:
    """This process's view; with `--workers N`, also every worker's (`workers`, by index)."""
    from .control import ControlError, ask

    body = backends_view(request.app)
    worker = request.app[WORKER]
    if worker is not None:
        body["worker"] = worker.index
        try:
            body["workers"] = (await ask(worker.supervisor_socket, "GET", "/backends", _CONTROL_TIMEOUT_S))["workers"]
        except ControlError as exc:
            body["workers"] = [{"ok": False, "error": str(exc)}]
    return _json(body)


@_admin
async def admin_tenants(request: web.Request) -> web.Response:
    """Each tenant's limits and current use (window, in flight, today's tokens and spend)."""
    rt = request.app[LIVE].runtime
    out = {}
    for name, tp in rt.policy.tenants.items():
        q = tp.quota
        entry: dict[str, object] = {"limits": None if q is None else q.model_dump(exclude_none=True)}
        if rt.quota is not None and name in rt.quota.plans:
            use = await rt.quota.usage(name)
            entry["use"] = {
                (scope or "tenant"): {
                    "requests_60s": u.window_requests,
                    "tokens_60s": u.window_tokens,
                    "inflight": u.inflight,
                    "tokens_today": u.day_tokens,
                    "spend_today_usd": round(u.day_spend_micro / 1e6, 6),
                }
                for scope, u in use.items()
            }
        out[name] = entry
    return _json({"policy_generation": rt.generation, "tenants": out})


@_admin
async def admin_reload(request: web.Request) -> web.Response:
    """Reload every process of this gateway (all workers, and the replicas on the same Redis);
    the answer lists each one's result. 200 when this replica reloaded everywhere."""
    from .control import ControlError, ask

    app = request.app
    worker = app[WORKER]
    if worker is None:
        ok, detail = await app[RELOADER].reload("admin")
        rt = app[LIVE].runtime
        result = {"ok": ok, "pid": os.getpid(), "worker": None, "policy_generation": rt.generation}
        if not ok:
            result["error"] = detail
        peers = app[PEERS]
        replicas = await peers.announce() if ok and peers is not None else []
        workers = [result]
    else:
        try:
            answer = await ask(worker.supervisor_socket, "POST", "/reload", _CONTROL_TIMEOUT_S)
        except ControlError as exc:
            return _error(InternalError(f"the reload could not reach the other workers: {exc}"))
        ok, workers, replicas = bool(answer.get("ok")), answer.get("workers", []), answer.get("replicas", [])
        sup = answer.get("supervisor", {})
        detail = next((str(r["error"]) for r in [sup, *workers] if r.get("error")), "")
    gen = app[LIVE].runtime.generation
    if ok:
        return _json({"status": "reloaded", "policy_generation": gen, "workers": workers, "replicas": replicas})
    err = BadRequest(f"policy rejected, the previous one stays in force: {detail}", code="invalid_policy")
    return _error(err)


async def not_found(request: web.Request) -> web.Response:
    return _error(NotFound(f"unknown path {request.method} {request.path}"))


def routes() -> list[web.RouteDef]:
    from .responses_api import routes as responses_by_id  # imported here: it uses this module's helpers

    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.post("/v1/embeddings", embeddings),
        web.post("/v1/responses", responses),
        *responses_by_id(),
        web.get("/v1/models", list_models),
        web.post("/v1/route/explain", route_explain),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/admin/backends", admin_backends),
        web.get("/admin/tenants", admin_tenants),
        web.post("/admin/reload", admin_reload),
        web.route("*", "/{tail:.*}", not_found),
    ]
