"""The admin plane's HTTP API: who am I, virtual keys, the request log, an overview, the policy.

Every endpoint needs an admin or a viewer key (`reads`), or an admin key (`writes`: a viewer gets
403). Request bodies are read only after that check, and bounded.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import BadRequest, Forbidden, GatewayError, RateLimited, Unauthorized, Unavailable
from ..store.core import StoreError
from ..tenants.auth import Role
from ..web.http_call import api_key, error_response, json_response, read_bounded
from ..web.keys import EXPORTS, KEYBOOK, LIVE, LOOPBACK, OVERVIEWS, POLICY_CHECK, REQUEST_LOG, WORKER
from .export import export
from .keys import LIST_DEFAULT, LIST_MAX, KeyCursor
from .log_store import Cursor, Filter
from .policy_check import check_apart
from .policy_view import redacted

__all__ = ["BODY_OWNER", "EXPORTS_AT_ONCE", "reads", "writes", "routes"]


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_MAX_ADMIN_BODY = 64 * 1024
_MAX_POLICY_BODY = 1024 * 1024
_CHECK_TIMEOUT_S = 30.0
EXPORTS_AT_ONCE = 2  # request log exports at a time per process (web/app.py makes the semaphore)
_MAX_EXPIRY_S = 10 * 366 * 86400.0
# The admin plane's bodies count against server.body_read_budget_bytes as one caller of their own
# (web/body.py's BodyBudget): a name no tenant can have (config/policy.py's _NAME: a tenant's
# starts with a letter or a digit), so that a tenant named "admin" does not share its share.
BODY_OWNER = "<admin plane>"
_ROLE = web.RequestKey("admin_role", Role)  # the caller's Role, set on the request by the guard


def _guard(need: Role) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(request: web.Request) -> web.StreamResponse:
            rt = request.app[LIVE].runtime
            role = rt.tenants.role(api_key(request), loopback=request.app[LOOPBACK])
            if role is Role.NONE:
                return error_response(Unauthorized("admin endpoints need an admin key (policy `admin.key_sha256`) "
                                                   "or, to read, a viewer key (`admin.viewer_key_sha256`)"))
            request[_ROLE] = role  # for a handler whose answer depends on it
            if need is Role.ADMIN and role is not Role.ADMIN:
                return error_response(Forbidden("a viewer key reads; this needs an admin key (policy `admin.key_sha256`)",
                                                code="admin_key_required"))
            try:
                resp = await handler(request)
                # What the admin plane answers (keys, the request log, the policy) is no cache's to keep.
                if not resp.prepared and "Cache-Control" not in resp.headers:
                    resp.headers["Cache-Control"] = "no-store"
                return resp
            except GatewayError as err:
                return error_response(err)
            except StoreError as exc:
                return error_response(Unavailable(f"the store did not answer: {exc}", retry_after_s=1))

        return guarded

    return wrap


reads = _guard(Role.VIEWER)  # an admin or a viewer key
writes = _guard(Role.ADMIN)  # an admin key


@reads
async def whoami(request: web.Request) -> web.Response:
    return json_response({"role": request[_ROLE].value})


# ---- virtual keys -------------------------------------------------------------------------------


class _Create(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=200)
    expires_in_s: float | None = Field(None, gt=0, le=_MAX_EXPIRY_S)
    models: list[str] | None = Field(None, min_length=1, max_length=1000)


class _Rotate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grace_s: float = Field(0.0, ge=0)


M = TypeVar("M", bound=BaseModel)


def _parsed(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        raise BadRequest(f"{where}: {err['msg']}", param=where if err["loc"] else None) from None


@reads
async def list_keys(request: web.Request) -> web.Response:
    q = request.query
    limit = _int(q, "limit", LIST_DEFAULT, 1, LIST_MAX) or LIST_DEFAULT
    before = None
    if raw := q.get("before"):
        try:
            before = KeyCursor.parse(raw)
        except ValueError:
            raise BadRequest("before must be a page's `next` cursor", param="before") from None
    page = await request.app[KEYBOOK].page(q.get("tenant") or None, limit, before)
    return json_response({"object": "list", "data": page.data, "next": None if page.next is None else str(page.next)})


@writes
async def create_key(request: web.Request) -> web.Response:
    body = _parsed(_Create, await read_bounded(request, _MAX_ADMIN_BODY, BODY_OWNER))
    tenants = request.app[LIVE].runtime.tenants
    tenant = tenants.tenant(body.tenant)
    if tenant is None:
        raise BadRequest(f"no tenant {body.tenant!r} in the policy", param="tenant")
    if body.models is not None:
        public = set(request.app[LIVE].runtime.public_models)
        bad = [m for m in body.models if m not in public or not tenant.may_use(m)]
        if bad:
            raise BadRequest(f"models: tenant {tenant.name!r} may not use {bad[0][:100]!r} (a key narrows the tenant's models)",
                             param="models")
    models = None if body.models is None else sorted(set(body.models))
    made = await request.app[KEYBOOK].create(tenant.name, body.name, body.expires_in_s, models)
    return json_response(made, status=201, headers={"Cache-Control": "no-store"})


@writes
async def rotate_key(request: web.Request) -> web.Response:
    body = _parsed(_Rotate, await read_bounded(request, _MAX_ADMIN_BODY, BODY_OWNER))
    made = await request.app[KEYBOOK].rotate(request.match_info["id"], body.grace_s)
    return json_response(made, status=201, headers={"Cache-Control": "no-store"})


@writes
async def revoke_key(request: web.Request) -> web.Response:
    await request.app[KEYBOOK].revoke(request.match_info["id"])
    return web.Response(status=204)


# ---- the request log ----------------------------------------------------------------------------


def _digits(raw: str) -> bool:
    """ASCII digits only: str.isdigit() also takes '²' and other digits int() refuses."""
    return raw.isascii() and raw.isdigit()


def _filter(q: Any) -> Filter:
    status = q.get("status") or None
    if status is not None and not (_digits(status) and len(status) == 3):
        raise BadRequest("status must be an HTTP status, e.g. 200 or 429", param="status")
    return Filter(q.get("tenant") or None, q.get("model") or None, None if status is None else int(status))


def _int(q: Any, name: str, default: int | None, low: int, high: int) -> int | None:
    raw = q.get(name)
    if not raw:
        return default
    if not _digits(raw) or len(raw) > len(str(high)) or not low <= int(raw) <= high:
        raise BadRequest(f"{name} must be a whole number from {low} to {high}", param=name)
    return int(raw)


def _cursor(raw: str | None) -> Cursor | None:
    if not raw:
        return None
    try:
        return Cursor.parse(raw)
    except ValueError:
        raise BadRequest("before must be a page's `next` cursor", param="before") from None


@reads
async def list_requests(request: web.Request) -> web.Response:
    q = request.query
    f, limit = _filter(q), _int(q, "limit", 50, 1, 1000)
    at = _cursor(q.get("before"))
    rlog = request.app[REQUEST_LOG]
    await rlog.flush()  # what this process has not written yet is in its own answer
    page = await rlog.store.page(f, limit or 50, at)
    return json_response({"object": "list", "data": page.entries, "next": page.next,
                          "scope": "shared" if _shared(request) else "this process"})


@reads
async def export_requests(request: web.Request) -> web.StreamResponse:
    """The log (filtered) as JSON lines, newest first, streamed; at most `EXPORTS_AT_ONCE` at a time per
    process (each reads the whole log, a page at a time on the event loop: six at once held
    every other request up to 1.6 s), each bounded in time and cut when its client does not keep
    up (export.py: a viewer reading slowly held a slot as long as it liked)."""
    f = _filter(request.query)
    exporting = request.app[EXPORTS]
    if exporting.locked():
        raise RateLimited(f"{EXPORTS_AT_ONCE} exports of the request log are running in this process; try again when one ends",
                          retry_after_s=5)
    async with exporting:
        return await export(request, f)


def _shared(request: web.Request) -> bool:
    """Whether the log holds more than this process's requests (Redis, or the workers' supervisor)."""
    return request.app[LIVE].runtime.policy.store.url is not None or request.app[WORKER] is not None


@reads
async def admin_overview(request: web.Request) -> web.Response:
    return json_response(await request.app[OVERVIEWS].get(request.app[REQUEST_LOG]))


# ---- the policy ---------------------------------------------------------------------------------


@reads
async def admin_policy(request: web.Request) -> web.Response:
    rt = request.app[LIVE].runtime
    return json_response({"policy_generation": rt.generation, "policy": redacted(rt.policy)})


@reads
async def check_policy(request: web.Request) -> web.Response:
    """A pasted policy checked as `gateway check` would (nothing is applied). Parsing and
    validating take CPU in proportion to the text (up to a second or two for a large one): in a
    process of its own (policy_check.py: a thread still held the interpreter's lock, pausing
    every request), one check at a time per process, within _CHECK_TIMEOUT_S."""
    # The body is read before the lock: a viewer sending slowly must not hold everyone's checks (for
    # up to the body timeout, 60 s, every other check was a 429).
    raw = await read_bounded(request, _MAX_POLICY_BODY, BODY_OWNER)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the policy must be UTF-8 text (YAML)") from None
    checking = request.app[POLICY_CHECK]
    if checking.locked():
        raise RateLimited("another policy check is running in this process; try again in a moment", retry_after_s=1)
    async with checking:
        # Only an admin learns which environment variables this host has (their names, in the warnings).
        try:
            answer = await check_apart(text, environment=request[_ROLE] is Role.ADMIN, timeout_s=_CHECK_TIMEOUT_S)
        except TimeoutError:
            raise Unavailable(f"the policy check took more than {_CHECK_TIMEOUT_S:g} s and was stopped", retry_after_s=5) from None
        return json_response(answer)


def routes() -> list[web.RouteDef]:
    return [
        web.get("/admin/whoami", whoami),
        web.get("/admin/keys", list_keys),
        web.post("/admin/keys", create_key),
        web.post("/admin/keys/{id}/rotate", rotate_key),
        web.delete("/admin/keys/{id}", revoke_key),
        web.get("/admin/requests", list_requests),
        web.get("/admin/requests/export", export_requests),
        web.get("/admin/overview", admin_overview),
        web.get("/admin/policy", admin_policy),
        web.post("/admin/policy/check", check_policy),
    ]
