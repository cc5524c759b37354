"""The Responses API's by-id endpoints and the conversations endpoints, sent to the backend that
holds the state.

Responses: GET /v1/responses/{id} (a background response polled, or its events streamed again
with `?stream=true`), DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and
GET /v1/responses/{id}/input_items. Conversations: POST /v1/conversations (created on a backend
of the caller's routes and recorded as the caller's), GET/POST/DELETE /v1/conversations/{id},
GET/POST /v1/conversations/{id}/items and GET/DELETE /v1/conversations/{id}/items/{item_id}.

The backend comes from the affinity map (route.py), and the id must be the caller's:
one without a record, or another tenant's, is a 404 before any upstream call (the migration mode,
`responses.adopt_unknown_ids`, searches the backends instead and records the id as the caller's).
Each upstream request takes one request from the tenant's request limits (quota.reserve_request)
and holds one of its backend's slots (max_concurrency) while it is relayed (passthrough.py).
The backend's answer (status, JSON or event stream) goes back as it is. A 200 to DELETE drops the
id from the map. Each request is drained, observed and reported like any other (passthrough.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from ..config.runtime import Runtime
from ..errors import BadRequest, GatewayError, NotFound, UpstreamError, shown
from ..pipeline.call import key_live, revoked
from ..pipeline.pinning import not_yours, owned, serving, usable_or_raise
from ..routing.backends import Backend
from ..store.core import StoreError
from ..tenants.auth import Tenant
from ..upstream.client import UpstreamResponse
from ..web.http_call import accounted, read_bounded
from ..web.keys import LIVE
from ..wire.openai_wire import json_object
from ..wire.tokens import bytes_tokens
from .codec import RESPONSES
from .passthrough import Passthrough
from .route import holders_of
from .wire import MAX_ITEM_REFS, held_items, item_ids, item_refs

__all__ = ["routes"]

_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")  # one path segment, nothing to escape (fullmatch: "$" takes a final newline)
# A conversation whose recorded context an items request is adding to (its lock, in the records' store).
_GROWING = "gwr:ctxgrow:v1:"
_GROW_LOCK_S = 2.0  # the lock's TTL, at least: its holder makes two store calls, each within the record timeout
_GROW_PAUSE_S = (0.002, 0.02)  # between tries for a held lock: the first pause, the longest


def _valid_id(value: str, param: str) -> str:
    """A path id that can be sent on as one path segment: `.` and `..` (also sent percent-encoded)
    would be dot segments upstream, so an id of dots only is refused like any malformed one."""
    if not _ID.fullmatch(value) or not value.strip("."):
        raise NotFound(f"{param} {value[:80]!r} is not a valid id", param=param, code="not_found")
    return value


async def _forward(request: web.Request, method: str, kind: str = "response", suffix: str = "") -> web.StreamResponse:
    """Send a by-id call to the backend holding the id in the path (`kind`: response or
    conversation), after checking the id is the caller's."""
    rt = request.app[LIVE].runtime
    by_id = Passthrough(request, rt, kind)
    with accounted(request, by_id.call, rt):
        try:
            return by_id.answered(await _by_id(request, rt, by_id, method, kind, suffix))
        except GatewayError as err:
            return by_id.failed(err)
        finally:
            by_id.done()


async def _by_id(request: web.Request, rt: Runtime, by_id: Passthrough, method: str, kind: str, suffix: str) -> web.StreamResponse:
    param = f"{kind}_id"
    tenant = await by_id.authenticate()
    owner = tenant.cache_namespace
    rid = _valid_id(request.match_info["id"], param)
    if "item_id" in request.match_info:
        suffix = suffix.replace("{item_id}", _valid_id(request.match_info["item_id"], "item_id"))
    body = await read_bounded(request, rt.server.max_body_bytes, tenant.name) if method == "POST" else b""
    await by_id.take()  # counted before the map is read: refused calls cost the caller too
    backends, search = await holders_of(rid, owner, rt, param)
    adding = kind == "conversation" and suffix == "/items" and method == "POST"
    held_tokens = 0
    if adding:  # stored items the new ones name must be the caller's, on the conversation's backend
        holder, held_tokens = await _items_holder(rt, json_object(body).get("items"), owner)
        if holder is not None and not search and holder != backends[0].name:
            raise BadRequest(f"items name stored items held by backend {holder!r}, and conversation {rid!r} is on "
                             f"{backends[0].name!r}: no backend holds both", param="items", code="response_backend_mismatch")

    async def adopt(backend: Backend, resp: UpstreamResponse) -> None:
        # The migration mode: the id becomes the caller's before its answer is released.
        await rt.affinity.record([rid], backend.name, owner)

    async def seen(backend: Backend, data: bytes) -> None:
        # Items the caller sees here (a response's stored output, a listing's items: its input
        # items, a conversation's) are the caller's to name in a later `item_reference`.
        items = shown_items(data)
        if items:
            await asyncio.gather(rt.affinity.record(list(items), backend.name, owner, required=False),
                                 rt.affinity.record_context(items, 0, owner))

    path = f"/{kind}s/{rid}{suffix}"
    for i, backend in enumerate(backends):
        if i:
            await by_id.take()  # each backend a search asks is an upstream request of its own
        out = await by_id.send(backend, method, path, body, last=i == len(backends) - 1, on_found=adopt if search else None,
                               on_read=seen if method != "DELETE" else None)
        if out is None:
            continue  # searching: that backend does not have it
        if method == "DELETE" and out.status == 200 and not suffix:
            await rt.affinity.forget(rid)  # a deleted response (conversation) leaves the map
        if adding and out.status == 200:
            # Its next turn makes the backend read them too: charged with that turn (pinning.pin),
            # as the items a conversation was made with are (added later, they were not).
            await _grow_context(rt, rid, bytes_tokens(body) + held_tokens, owner)
        return _unless_revoked(by_id, out)
    raise not_yours(param, rid, RESPONSES.missing_code(param))


async def _grow_context(rt: Runtime, rid: str, tokens: int, owner: str) -> None:
    """Add `tokens` to conversation `rid`'s recorded context. The store has no increment for it
    (a record is the tokens and the owner, as text): the read, the sum and the write are made
    under a lock in the records' store (SET NX with a TTL, released if still ours), so additions
    to one conversation, on any replica, go one at a time. Read and written freely, two at once
    both wrote their own size over the one they read, and one addition was lost (10 at once
    recorded 2,028 of 10,140 tokens). A lock held past its TTL (its holder stopped mid-way), or
    a store that fails, is gone without: the addition as before, never a failed request."""
    affinity = rt.affinity
    store, key, mine = affinity.store, _GROWING + rid, f"{secrets.token_hex(8)}\n{owner}".encode()
    ttl_s = max(_GROW_LOCK_S, 4 * affinity.timeout_s)
    loop = asyncio.get_running_loop()
    give_up, pause = loop.time() + ttl_s + 1.0, _GROW_PAUSE_S[0]
    held = False
    try:
        while True:
            try:
                async with asyncio.timeout(affinity.timeout_s):
                    held = await store.add(key, mine, ttl_s)
            except (StoreError, TimeoutError):
                break  # the store fails: the read and write below fail alike (and are logged there)
            if held or loop.time() >= give_up:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, _GROW_PAUSE_S[1])
        await affinity.record_context([rid], await affinity.context(rid) + tokens, owner)
    finally:
        if held:
            with contextlib.suppress(StoreError, TimeoutError):
                async with asyncio.timeout(affinity.timeout_s):
                    await store.delete_if(key, mine)


def shown_items(data: bytes) -> dict[str, int]:
    """The items of a by-id answer (a response's stored output items, a list's items): id -> size in tokens."""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(obj, dict):
        return {}
    if obj.get("object") == "list":
        return item_ids(obj.get("data"))
    return held_items(obj) if obj.get("object") == "response" else {}


def _unless_revoked(by_id: Passthrough, out: web.StreamResponse) -> web.StreamResponse:
    """A whole answer goes out only while the caller's key works (a revoke during the call: a 401,
    after the map was kept up to date with what the backend did); a stream stops by itself."""
    if isinstance(out, web.Response) and not key_live(by_id.call):
        raise revoked()
    return out


async def _items_holder(rt: Runtime, items: Any, owner: str) -> tuple[str | None, int]:
    """The backend holding the stored items `items` names (None: it names none), and their size in
    tokens as recorded. Each must be `owner`'s, else a 404 sent nowhere, as on /v1/responses: a
    conversation made or extended with another tenant's item id copied that item into it (review
    helper's repro)."""
    refs = item_refs(items)
    if len(refs) > MAX_ITEM_REFS:
        raise BadRequest(f"at most {MAX_ITEM_REFS} distinct item references (item_reference) a request", param="items")
    held, sizes = await owned(rt, [("items", r) for r in refs], owner, lambda _: RESPONSES.missing_code("input"))
    found = {holder.backend for _, _, holder in held}
    if len(found) > 1:
        raise BadRequest(f"items name stored items held by different backends ({', '.join(sorted(found))}): no backend holds them all",
                         param="items", code="response_backend_mismatch")
    return next(iter(found), None), sum(sizes)


def _conversation_backend(rt: Runtime, tenant: Tenant, model: str | None, holder: str | None = None) -> Backend:
    """Where a new conversation is made: with `model`, the first usable backend of that model's
    route that serves the Responses API (its later turns must use a model routed there); without,
    the first of the backends of every model the tenant may use, in the policy's order. `holder`:
    the backend holding the stored items it is made with, which must be one of those."""
    if model is not None:
        rt.tenants.authorize(tenant, model)
        candidates = serving(rt.route(model), RESPONSES)
        if not candidates:
            raise BadRequest(f"no backend of model {shown(model)} serves the Responses API", param="model", code="unsupported_endpoint")
    else:
        candidates = []
        for name, route in rt.routes.items():
            if tenant.may_use(name):
                candidates += [b for b in serving(route, RESPONSES) if b not in candidates]
        if not candidates:
            raise BadRequest("none of the models this key may use has a backend serving the Responses API",
                             param="model", code="unsupported_endpoint")
    if holder is not None:
        held = [b for b in candidates if b.name == holder]
        if not held:
            raise BadRequest(f"items name stored items held by backend {holder!r}, which no model this conversation may use "
                             "is routed to", param="items", code="response_backend_mismatch")
        candidates = held
    for backend in candidates:
        if backend.takes_traffic():
            return backend
    usable_or_raise(candidates[0], "a new conversation")  # says why (ejected, cooling, starting)
    return candidates[0]


def _creation_body(raw: bytes) -> tuple[bytes, str | None, Any]:
    """The body to send upstream (without the gateway's own `model` field), that model, and its `items`."""
    if not raw.strip():
        return b"{}", None, None
    body = json_object(raw)
    model = body.pop("model", None)
    if model is not None and not (isinstance(model, str) and model):
        raise BadRequest("invalid field 'model': must be a model name (a non-empty string)", param="model")
    return orjson.dumps(body), model, body.get("items")


async def create_conversation(request: web.Request) -> web.StreamResponse:
    """POST /v1/conversations: made on a backend the caller's requests can reach (`model` in the
    body, a gateway field not sent upstream, picks the route), and recorded as the caller's before
    its id is released: later turns with `conversation` go to that backend, and only the caller's."""
    rt = request.app[LIVE].runtime
    by_id = Passthrough(request, rt, "conversation")
    with accounted(request, by_id.call, rt):
        try:
            return by_id.answered(await _create(request, rt, by_id))
        except GatewayError as err:
            return by_id.failed(err)
        finally:
            by_id.done()


async def _create(request: web.Request, rt: Runtime, by_id: Passthrough) -> web.StreamResponse:
    tenant = await by_id.authenticate()
    raw = await read_bounded(request, rt.server.max_body_bytes, tenant.name)
    # Counted before the body is parsed: a 400 for it spends rpm like any request's (a flood of
    # malformed bodies cost nothing and was never refused early: review helper's repro).
    await by_id.take()
    body, model, items = _creation_body(raw)
    holder, held_tokens = await _items_holder(rt, items, tenant.cache_namespace)
    backend = _conversation_backend(rt, tenant, model, holder)

    async def whole(backend: Backend, resp: UpstreamResponse) -> None:
        if "text/event-stream" in resp.headers.get("Content-Type", ""):
            raise UpstreamError(f"backend {backend.name!r} answered the new conversation with an event stream")

    out = await by_id.send(backend, "POST", "/conversations", body, on_found=whole)
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
    if b'"items"' in body:  # what its first turn makes the backend read: charged with that turn (pinning.pin)
        await rt.affinity.record_context([cid], bytes_tokens(body) + held_tokens, tenant.cache_namespace)
    return _unless_revoked(by_id, out)


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
