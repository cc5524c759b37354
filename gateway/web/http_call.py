"""A request at the HTTP edge: its key, its id, its deadline, its bounded body, the Call made of
them, JSON answers, and the accounting every API request gets (`accounted`: drain, observer).
Shared by the /v1 handlers (api.py) and the Responses API's by-id handlers (responses/api.py)."""

from __future__ import annotations

import re
import time
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from ..cache.core import cache_control
from ..errors import BadRequest, GatewayError, Unauthorized
from ..observe.observer import parse_traceparent
from ..pipeline.call import Asked, Call, Timing
from ..pipeline.ids import fresh_id
from ..routing.backends import BETA_HEADERS
from ..tenants.auth import Tenant
from ..tenants.priority import Band
from ..wire.codec import Endpoint
from .body import read_body
from .keys import BODY_BUDGET, DRAIN, LIVE, OBSERVER

if TYPE_CHECKING:
    from ..config.runtime import Runtime

__all__ = ["accounted", "api_key", "body_if_authenticated", "error_response", "json_response", "new_call",
           "read_bounded", "request_id"]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # fullmatch: "$" would take a final newline
_BANDS = frozenset(Band)


def json_response(data: object, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json", headers=headers)


def error_response(err: GatewayError, headers: dict[str, str] | None = None, body: bytes | None = None) -> web.Response:
    """`err` as an answer: OpenAI's shape, or `body` (an endpoint's own shape)."""
    return web.Response(
        body=err.to_body() if body is None else body, status=err.status, content_type="application/json", headers={**(headers or {}), **err.headers()}
    )


def api_key(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip() or None
    # Azure-style clients; Anthropic's (its SDK sends a Bearer token, raw clients x-api-key)
    return request.headers.get("api-key") or request.headers.get("x-api-key") or None


async def read_bounded(request: web.Request, limit: int, owner: str) -> bytes:
    """The body, at most `limit` bytes as sent and as inflated, within `server.body_timeout_ms`,
    counted against `owner`'s share of `server.body_read_budget_bytes` while it arrives
    (body.read_body). Call it only once the caller is authenticated (`owner`: its tenant)."""
    app = request.app
    return await read_body(request, limit, app[LIVE].runtime.server.body_timeout_ms / 1000, app[BODY_BUDGET], owner)


async def body_if_authenticated(request: web.Request, rt: Runtime) -> tuple[bytes, Tenant | None]:
    """The body and the caller's tenant when the key in the headers is valid; else nothing is
    read (b"", None), and the pipeline, which authenticates first, answers (and records) the 401.
    The tenant goes into the Call (`new_call`): intake does not hash the key a second time."""
    key = api_key(request)
    await rt.tenants.catch_up(key)
    try:
        tenant = rt.tenants.authenticate(key)
    except Unauthorized:
        return b"", None
    return await read_bounded(request, rt.server.max_body_bytes, tenant.name), tenant


def request_id(request: web.Request) -> str:
    """The caller's x-request-id when it is a safe token; otherwise a fresh one (a bad one is never
    echoed back: it could split headers or inject into logs)."""
    rid = request.headers.get("x-request-id")
    if rid and _REQUEST_ID.fullmatch(rid):
        return rid
    return fresh_id(96)


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


def _beta(name: str, value: str) -> str:
    """A beta header's value as it goes upstream: printable ASCII (a byte that is not UTF-8 came as
    a lone surrogate, and sending it upstream raised: a 500 with a traceback, counted against a
    backend never called; review helper's repro)."""
    if not value.isascii() or not value.isprintable():
        raise BadRequest(f"header {name} must be printable ASCII (beta names, comma-separated)", param=name)
    return value


def new_call(request: web.Request, endpoint: Endpoint, raw: bytes, server_timeout_ms: int, rid: str | None = None,
             tenant: Tenant | None = None) -> Call:
    """The Call for one request (BadRequest for a bad x-request-timeout-ms or x-priority);
    `tenant`: the caller, when its key was already authenticated against the same runtime."""
    h = request.headers
    timeout_ms = _timeout_ms(h.get("x-request-timeout-ms"), server_timeout_ms)
    priority = h.get("x-priority")
    if priority is not None and priority not in _BANDS:
        raise BadRequest("header x-priority must be one of priority, default, flex", param="x-priority")
    no_cache, no_store = cache_control(h.get("cache-control"))
    now = time.monotonic()  # one reading: the deadline's message says exactly the timeout asked for
    asked = Asked(priority, no_cache, no_store, bool(h.get("x-request-timeout-ms")), parse_traceparent(h.get("traceparent")))
    if "anthropic-beta" in h or "openai-beta" in h:  # BETA_HEADERS, spelled out: two lookups, no loop on every request
        asked.betas = tuple((name, _beta(name, ", ".join(h.getall(name)))) for name in BETA_HEADERS if name in h)
    return Call(
        request_id=rid or request_id(request),
        endpoint=endpoint,
        raw=raw,
        api_key=api_key(request),
        deadline=now + timeout_ms / 1000,
        asked=asked,
        timing=Timing(t0_monotonic=now),
        tenant=tenant,
    )


class accounted:  # noqa: N801 (used as `with accounted(...)`)
    """What every API request gets around its work: counted in flight for a graceful shutdown
    (drain.py), and observed once it ended (observe/observer.py: stage histograms, access log, tracing)."""

    __slots__ = ("_app", "_call", "_rt", "_drain")

    def __init__(self, request: web.Request, call: Call, rt: Runtime) -> None:
        self._app, self._call, self._rt = request.app, call, rt
        self._drain = self._app[DRAIN]

    def __enter__(self) -> None:
        self._drain.enter()

    def __exit__(self, *exc: object) -> None:
        self._drain.leave()
        self._app[OBSERVER].done(self._call, self._rt)
