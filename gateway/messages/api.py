"""The Messages API's own handler besides /v1/messages (which the pipeline answers like any endpoint):
`POST /v1/messages/count_tokens`."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from ..errors import BadRequest, GatewayError
from ..web.http_call import api_key, error_response, json_response, read_bounded, request_id
from ..web.keys import LIVE
from ..wire.openai_wire import json_object
from .translate import messages_to_chat
from .wire import gateway_error

__all__ = ["count_tokens", "estimate_tokens", "routes"]

_CHARS_PER_TOKEN = 4  # the gateway has no tokenizer for every backend's model: the usual estimate


def estimate_tokens(body: dict[str, Any]) -> int:
    """Input tokens of a Messages body, estimated from its text (system, messages, tools)."""
    chars = 0
    for key in ("system", "messages", "tools"):
        value = body.get(key)
        if isinstance(value, str):
            chars += len(value)
        elif value is not None:
            chars += len(orjson.dumps(value))
    return max(1, chars // _CHARS_PER_TOKEN)


async def count_tokens(request: web.Request) -> web.Response:
    """`{"input_tokens": N}` for a Messages body (model, messages, system, tools; no max_tokens):
    authenticated and authorized like the request it counts, calling no backend."""
    rt = request.app[LIVE].runtime
    headers = {"x-request-id": request_id(request)}
    try:
        await rt.tenants.catch_up(api_key(request))
        tenant = rt.tenants.authenticate(api_key(request))
        body = json_object(await read_bounded(request, rt.server.max_body_bytes))
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise BadRequest("field 'model' is required: a string", param="model")
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("field 'messages' is required: a non-empty list", param="messages")
        if "max_tokens" in body:
            raise BadRequest("max_tokens: Extra inputs are not permitted", param="max_tokens")
        rt.tenants.authorize(tenant, model)
        rt.route(model)  # an unknown model is a 404, as on /v1/messages
        messages_to_chat({**body, "max_tokens": 1})  # the same checks as the request itself
    except GatewayError as err:
        return error_response(err, headers, gateway_error(err)[1])
    return json_response({"input_tokens": estimate_tokens(body)}, headers=headers)


def routes() -> list[web.RouteDef]:
    return [web.post("/v1/messages/count_tokens", count_tokens)]
