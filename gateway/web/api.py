"""aiohttp handlers: read the request, build a Call, run the pipeline, return what the sink holds."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from ..errors import BadRequest, GatewayError, InternalError, ModelNotFound, NotFound, Unauthorized, Unavailable
from ..observe.metrics import refresh_gauges
from ..observe.observer import server_timing
from ..process.control import ControlError, ask, rejections
from ..admin.api import reads, routes as admin_routes, writes
from ..classify.cascade import EncoderState
from ..config.runtime import Runtime
from ..console.routes import routes as console_routes
from ..messages.api import routes as messages_extra
from ..responses.api import routes as responses_by_id
from ..routing.selector import usable
from ..store.target import hide_password
from ..tenants.auth import Tenant
from ..wire.codec import Endpoint
from ..wire.endpoints import ENDPOINTS, at_path, explained
from .http_call import accounted, api_key, body_if_authenticated, error_response, json_response, new_call, request_id
from .keys import ADMISSION, DRAIN, ENCODER, LIVE, LOOPBACK, METRICS, PEERS, PIPELINE, RELOADER, WORKER
from .origin import foreign
from .sink import HttpSink

__all__ = ["backends_view", "routes"]

log = logging.getLogger("gateway.api")

Handler = Callable[[web.Request], Awaitable[web.Response]]


def _proxy(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of one endpoint (/v1 + its path): a Call through the pipeline, answered by what
    the endpoint's sink holds."""

    async def handler(request: web.Request) -> web.StreamResponse:
        rt = request.app[LIVE].runtime  # one snapshot for the whole request
        try:
            raw, tenant = await body_if_authenticated(request, rt)
            call = new_call(request, endpoint, raw, rt.server.request_timeout_ms, tenant=tenant)
        except GatewayError as err:
            return error_response(err, endpoint.ids(request_id(request)), endpoint.error_body(err))
        headers = endpoint.ids(call.request_id)
        headers["x-gateway-queue-ms"] = "0"
        sink = HttpSink(request, headers, functools.partial(server_timing, call))
        with accounted(request, call, rt):
            await request.app[PIPELINE].run(call, rt, endpoint.wrap(sink))
        assert sink.response is not None
        return sink.response

    handler.__name__ = f"{endpoint.name}_handler"
    return handler


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models: the public models the caller's tenant may use."""
    try:
        rt, tenant = await _caller(request)
    except GatewayError as err:
        return error_response(err)
    data = [_model(rt, m) for m in rt.public_models if tenant.may_use(m)]
    return json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: one model of the list (the SDKs' models.retrieve); a 404
    `model_not_found` for a model the caller may not use, as for one that does not exist."""
    try:
        rt, tenant = await _caller(request)
        model = request.match_info["id"]
        if model not in rt.public_models or not tenant.may_use(model):
            raise ModelNotFound(f"the model {model[:200]!r} does not exist or you do not have access to it", param="model")
    except GatewayError as err:
        return error_response(err)
    return json_response(_model(rt, model))


async def _caller(request: web.Request) -> tuple[Runtime, Tenant]:
    """The runtime and the caller's tenant (Unauthorized for a key it does not know)."""
    rt = request.app[LIVE].runtime
    await rt.tenants.catch_up(api_key(request))
    return rt, rt.tenants.authenticate(api_key(request))


def _model(rt: Runtime, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(rt.created), "owned_by": "gateway"}


async def route_explain(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    try:
        raw, tenant = await body_if_authenticated(request, rt)
        call = new_call(request, _explained(request.query.get("endpoint"), raw), raw, rt.server.request_timeout_ms,
                        tenant=tenant)
        return json_response(await request.app[PIPELINE].explain(call, rt), headers={"x-request-id": call.request_id})
    except GatewayError as err:
        return error_response(err, {"x-request-id": request_id(request)})
    except Exception:  # a bug: still an answer in the contract
        rid = request_id(request)
        log.exception("request %s: internal error in /v1/route/explain", rid)
        return error_response(InternalError(f"internal error in the gateway (request id {rid})"), {"x-request-id": rid})


def _explained(named: str | None, raw: bytes) -> Endpoint:
    """Which endpoint's body /v1/route/explain was given: the one its `?endpoint=` names (an
    embeddings body and a Responses one look alike), else the one that recognises the body
    (endpoints.explained), else chat's."""
    if named is not None:
        if named not in ENDPOINTS:
            raise BadRequest(f"endpoint {named[:64]!r} is not one of the gateway's: {', '.join(sorted(ENDPOINTS))}",
                             param="endpoint")
        return ENDPOINTS[named]
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None  # parse() answers the 400
    return explained(body if isinstance(body, dict) else {})


async def healthz(request: web.Request) -> web.Response:
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """200 when every model route can send each request class to some backend, as the router sees
    it (a launched model still loading cannot; an ejected last resort still can)."""
    rt = request.app[LIVE].runtime
    if request.app[DRAIN].draining:  # shutting down: load balancers take this replica out first
        return json_response({"status": "draining", "policy_generation": rt.generation}, status=503)
    healthy = [b.name for b in rt.backends.values() if b.takes_traffic()]
    unserved = [
        model
        for model, route in rt.routes.items()
        if not (usable(route.simple.candidates) and usable(route.complex.candidates))
    ]
    # Launched models not up yet, each with why: starting, or a failed launch and when it is retried.
    not_ready = {b.name: b.health.starting_reason() for b in rt.backends.values() if not b.health.ready}
    # The classifier's encoder still loading: requests would be classified by the lexical scorer
    # alone for a second or two, so a load balancer waits (a failed load does not hold it back).
    encoder = request.app[ENCODER]
    loading = rt.cascade.band is not None and encoder.state is EncoderState.LOADING
    body: dict[str, object] = {
        "status": "not ready" if unserved or loading else "ready",
        "policy_generation": rt.generation,
        "healthy_backends": healthy,
        "models_without_backend": unserved,
        "backends_not_ready": not_ready,
        "classifier_encoder": encoder.state.value if rt.cascade.band is not None else EncoderState.OFF.value,
    }
    if unserved:
        why = "".join(f"; {name}: {reason}" for name, reason in not_ready.items())
        body["detail"] = "no usable backend (starting, or none configured) for: " + ", ".join(unserved) + why
    elif loading:
        body["detail"] = "the classifier's encoder is loading"
    return json_response(body, status=503 if unserved or loading else 200)


async def metrics(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    # Tenant names, tokens and spend: closed beyond loopback unless the policy opens it (auth.Tenants.may_scrape).
    # Loopback's trust is for this machine's programs, not for a page its browser opened (origin.py).
    why = foreign(request.headers) if request.app[LOOPBACK] else None
    if not rt.tenants.may_scrape(api_key(request), loopback=request.app[LOOPBACK] and why is None):
        return error_response(Unauthorized(rt.tenants.scrape_refusal() if why is None else
                                           f"/metrics is open on loopback to this machine's programs; refused: {why}"))
    m = request.app[METRICS]
    refresh_gauges(m, rt, request.app[ADMISSION])
    return web.Response(body=m.exposition(), content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


def backends_view(app: web.Application) -> dict[str, object]:
    """This process's view of its backends and admission (what /admin/backends shows)."""
    rt = app[LIVE].runtime
    worker = app[WORKER]
    out = {}
    for name, b in rt.backends.items():
        snap = b.tracker.snapshot()
        h = b.headline_health()
        out[name] = {
            "url": hide_password(b.base_url),  # a viewer reads this: no credentials in it
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
            "local": b.local,
            # The model server's own gauges from its metrics_url (null without one).
            "load": None if b.metrics_url is None else b.state.load.view(time.monotonic(), rt.routing.load_signals.stale_ms / 1000),
            **snap,
        }
    gate = app[ADMISSION].gate
    admission = {"inflight": gate.used, "max_inflight": gate.limit, "queued": dict(gate.queue.sizes),
                 "service_s": round(app[ADMISSION].service_s(), 4)}
    return {"policy_generation": rt.generation, "workers_total": 1 if worker is None else worker.count,
            "admission": admission, "backends": out}


# How long a worker waits for its supervisor on the control socket (the supervisor answers
# /admin/reload within it: process/serve.py).
CONTROL_TIMEOUT_S = 15.0


@reads
async def admin_backends(request: web.Request) -> web.Response:
    """This process's view; with `--workers N`, also every worker's (`workers`, by index)."""
    body = backends_view(request.app)
    worker = request.app[WORKER]
    if worker is not None:
        body["worker"] = worker.index
        try:
            body["workers"] = (await ask(worker.supervisor_socket, "GET", "/backends", CONTROL_TIMEOUT_S))["workers"]
        except ControlError as exc:
            body["workers"] = [{"ok": False, "error": str(exc)}]
    return json_response(body)


@reads
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
    return json_response({"policy_generation": rt.generation, "tenants": out})


@writes
async def admin_reload(request: web.Request) -> web.Response:
    """Reload every process of this gateway (all workers, and the replicas on the same Redis);
    the answer lists each one's result. 200 when this replica reloaded everywhere."""
    app = request.app
    worker = app[WORKER]
    sup: dict[str, object] = {}
    if worker is None:
        ok, detail = await app[RELOADER].reload("admin")
        rt = app[LIVE].runtime
        result: dict[str, object] = {"ok": ok, "pid": os.getpid(), "worker": None, "policy_generation": rt.generation}
        if not ok:
            result["error"] = detail
        peers = app[PEERS]
        replicas = await peers.announce() if ok and peers is not None else []
        workers = [result]
    else:
        try:
            answer = await ask(worker.supervisor_socket, "POST", "/reload", CONTROL_TIMEOUT_S)
        except ControlError as exc:
            return error_response(InternalError(f"the reload could not reach the other workers: {exc}"))
        ok, workers, replicas = bool(answer.get("ok")), answer.get("workers", []), answer.get("replicas", [])
        sup = answer.get("supervisor", {})
        detail = next((str(r["error"]) for r in [sup, *workers] if r.get("error")), "")
    gen = app[LIVE].runtime.generation
    if ok:
        return json_response({"status": "reloaded", "policy_generation": gen, "workers": workers, "replicas": replicas})
    return error_response(reload_failure(sup, workers, detail))


def reload_failure(supervisor: Mapping[str, object], workers: list[dict[str, object]], detail: str) -> GatewayError:
    """Why a reload did not succeed everywhere: a process rejected the policy (400
    invalid_policy: it stays on the previous one), or only some processes did not answer (503
    reload_incomplete: the policy is in force in every one that did; a worker restarting reads
    the supervisor's copy of the policy in force)."""
    failed = [r for r in workers if not r.get("ok")]
    if supervisor.get("ok", True) is not False and failed and not rejections(failed):
        missing = ", ".join(str(r.get("socket", "?")) for r in failed)
        return Unavailable(f"the policy is in force in every process that answered; {missing} did not answer "
                           f"({detail}): retry the reload", code="reload_incomplete")
    return BadRequest(f"policy rejected, the previous one stays in force: {detail}", code="invalid_policy")


async def not_found(request: web.Request) -> web.Response:
    """A path nothing serves, in the shape of the API it is under (/v1/messages...: Anthropic's)."""
    err = NotFound(f"unknown path {request.method} {request.path}")
    return error_response(err, body=at_path(request.path).error_body(err))


def routes() -> list[web.RouteDef]:
    return [
        *(web.post("/v1" + e.path, _proxy(e)) for e in ENDPOINTS.values()),
        *responses_by_id(),
        *messages_extra(),
        web.get("/v1/models", list_models),
        web.get("/v1/models/{id:.+}", retrieve_model),  # an id may hold slashes (org/model)
        web.post("/v1/route/explain", route_explain),
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/admin/backends", admin_backends),
        web.get("/admin/tenants", admin_tenants),
        web.post("/admin/reload", admin_reload),
        *admin_routes(),
        *console_routes(),
        web.route("*", "/{tail:.*}", not_found),
    ]
