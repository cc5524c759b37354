"""The Messages API's own handler besides /v1/messages (which the pipeline answers like any endpoint):
`POST /v1/messages/count_tokens`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from ..errors import BadRequest, GatewayError
from ..tenants.auth import Tenant
from ..wire.codec import Endpoint, validate_legs
from ..web.http_call import api_key, error_response, json_response, read_bounded, request_id
from ..web.keys import LIVE, PIPELINE
from ..wire.openai_wire import bounded_containers, bounded_items, json_object, validate_body
from .codec import MESSAGES
from .translate import estimate_tokens
from .wire import MessagesRequest, gateway_error

if TYPE_CHECKING:
    from ..config.runtime import Route, Runtime

__all__ = ["count_tokens", "estimate_tokens", "routes"]


async def count_tokens(request: web.Request) -> web.Response:
    """`{"input_tokens": N}` for a Messages body (model, messages, system, tools; no max_tokens):
    authenticated and authorized like the request it counts, calling no backend."""
    rt = request.app[LIVE].runtime
    headers = MESSAGES.ids(request_id(request))
    try:
        await rt.tenants.catch_up(api_key(request))
        tenant = rt.tenants.authenticate(api_key(request))
        # One request of the tenant's request limits: it is parsed and validated like one.
        async with request.app[PIPELINE].quota.one_request(rt, tenant, rt.server.request_timeout_ms / 1000):
            tokens = await _count(request, rt, tenant)
    except GatewayError as err:
        return error_response(err, headers, gateway_error(err)[1])
    return json_response({"input_tokens": tokens}, headers=headers)


async def _count(request: web.Request, rt: Runtime, tenant: Tenant) -> int:
    """The body's estimated input tokens, after the checks /v1/messages makes."""
    raw = await read_bounded(request, rt.server.max_body_bytes, tenant.name)
    body = json_object(raw)
    bounded_containers(raw, body)
    if "max_tokens" in body:
        raise BadRequest("max_tokens: Extra inputs are not permitted", param="max_tokens")
    bounded_items(body, rt.server.max_items)
    # The same checks as /v1/messages (pipeline/intake.py): its request model, with the
    # max_tokens count_tokens has no use for, then every translating leg of the route.
    validate_body({**body, "max_tokens": 1}, MessagesRequest)
    model = body["model"]
    rt.tenants.authorize(tenant, model)
    route = rt.route(model)  # an unknown model is a 404, as on /v1/messages
    _validate_legs(route, {**body, "max_tokens": 1})
    return estimate_tokens(body)


def _validate_legs(route: Route, body: dict[str, Any]) -> None:
    """Refuse what a translating leg of the route cannot send, as intake does. The request's class
    is not known here (no classification for a count), so the legs of both classes' pools count."""
    legs: dict[int, Endpoint] = {}
    refusals: list[BadRequest] = []
    for cls in ("simple", "complex"):
        try:  # a final assistant turn: only the backends that continue one (in either class)
            narrowed = route.prefilled(cls, MESSAGES.name) if MESSAGES.ends_in_prefill(body) else route
        except BadRequest as err:
            refusals.append(err)
            continue
        for leg in narrowed.pool(cls, MESSAGES.name).translating.get(MESSAGES.name, ()):
            legs[id(leg)] = leg
    if len(refusals) == 2:
        raise refusals[0]
    validate_legs(legs.values(), body)


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/messages/count_tokens", count_tokens)]
