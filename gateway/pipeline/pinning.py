"""Where a request that builds on state a backend holds goes: the backend that holds it.

An endpoint whose answers make a backend hold state (codec.Endpoint.stateful: the Responses API's
responses and conversations) records each answer's ids in the affinity map (responses/affinity.py). A later
request that refers to such an id (`Endpoint.stateful_refs`: `previous_response_id`,
`conversation`) can only be answered by the backend that holds it. `pin()` checks every such
reference against the map (each must be the caller's: stored items named by `item_reference`
too) and narrows the request's candidates to the
one backend holding them: no failover (no other backend has the state), and a clear error instead
of a wrong backend's 404 when it cannot be reached.

An id the map has no record of (made before the gateway was in front, expired, or never answered
through it) is nobody's: a 404, and no backend is asked. Only the policy's migration mode
(`responses.adopt_unknown_ids`) searches for it: the request is routed as usual, a backend without
it answers 404, which fails over to the next candidate, and the one that has it answers (and its
record names the caller from then on). An id the map gives to another tenant is a 404 at once,
worded as for an unknown one.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..config.runtime import Route, Runtime
from ..errors import AllBackendsFailed, BadRequest, GatewayError, NotFound, RateLimited, Unavailable, UpstreamError, shown
from ..responses.affinity import Holder
from ..routing.backends import Backend
from ..wire.codec import Endpoint
from .call import Call

__all__ = ["Pinned", "owned", "pin", "not_yours", "serving", "usable_or_raise"]


def _is_404(err: GatewayError) -> bool:
    """The backend answered 404 (it does not hold the id): a failover, not an answer."""
    return isinstance(err, UpstreamError) and err.upstream_status == 404


@dataclass(frozen=True, slots=True)
class Pinned:
    """A follow-up and where it goes: the backend that holds its state, or (None, only in the
    migration mode) a search of the route's candidates when the map has no record of the id."""

    field: str  # previous_response_id | conversation
    ref: str  # the id
    backend: str | None
    route: Route  # with `backend` its only candidate; the request's own route when searching
    code: str  # the error code for a state that is not found

    def failed(self, err: AllBackendsFailed) -> GatewayError:
        """The relay's failure, said in terms of the state the request builds on."""
        if self.backend is None:
            # Every backend asked said 404 (the others were not asked: ejected, cooling, full).
            if any(_is_404(e) for _, e in err.failures) and all(
                _is_404(e) or isinstance(e, (Unavailable, RateLimited)) for _, e in err.failures
            ):
                tried = ", ".join(repr(name) for name, e in err.failures if _is_404(e))
                return NotFound(f"{_unknown(self.field, self.ref)}, and no backend tried ({tried}) has it",
                                param=self.field, code=self.code)
            return err
        for _, e in err.failures:
            if _is_404(e):  # the backend that held it no longer has it (deleted, or its retention ran out)
                return NotFound(f"{self.field} {self.ref!r} is not found on backend {self.backend!r}, which held it: {e.message}",
                                param=self.field, code=self.code)
        err.message = f"{self.field} {self.ref!r} is held by backend {self.backend!r}, and only it can answer: {err.message}"
        err.args = (err.message,)
        return err


def _unknown(field: str, rid: str) -> str:
    """The words for an id that is not the caller's: the same whether another tenant holds it or
    nobody does, so a 404 tells nothing about other tenants' ids."""
    return (f"{field} {rid[:80]!r} is not known to this gateway for this caller (not answered or created through it "
            "by this tenant, or its record expired after responses.affinity_ttl_s)")


def not_yours(field: str, rid: str, code: str) -> NotFound:
    """The 404 for an id without a record, or another tenant's."""
    return NotFound(_unknown(field, rid), param=field, code=code)


def serving(route: Route, endpoint: Endpoint) -> list[Backend]:
    """The backends of a route (either class) that serve `endpoint` natively: state (a response,
    a conversation) lives only on a backend that speaks its API, never behind a translation."""
    out: list[Backend] = []
    for cls in ("simple", "complex"):
        try:
            pool = route.pool(cls, endpoint.name)
        except BadRequest:
            continue
        out += [b for b in pool.backends if b not in out and endpoint.toward(b.kind, b.policy.endpoints) is endpoint]
    return out


def usable_or_raise(backend: Backend, what: str, model: str | None = None) -> None:
    """Raise a clear 503/429 when `backend` (the only one holding `what`) cannot take traffic now
    (for `model`: that model's health there, else the backend's own)."""
    health = backend.health if model is None else backend.health_for(model)
    state = health.state()
    wait = health.available_in()
    if state == "starting":
        raise Unavailable(f"{what} is held by backend {backend.name!r}, which is starting", retry_after_s=5)
    if state == "ejected":
        raise Unavailable(
            f"{what} is held by backend {backend.name!r}, which is ejected after failures (back in about {wait:.0f} s); "
            "no other backend has it",
            code="response_backend_unavailable", retry_after_s=max(1.0, wait),
        )
    if state == "cooling":
        raise RateLimited(
            f"{what} is held by backend {backend.name!r}, which asked for a pause of {wait:.1f} s more",
            retry_after_s=max(1.0, wait),
        )


async def owned(rt: Runtime, refs: list[tuple[str, str]], owner: str,
                code_of: Callable[[str], str]) -> tuple[list[tuple[str, str, Holder]], list[int]]:
    """Each (field, id) reference's holder, which must be `owner`'s (else the 404 `not_yours`, with
    `code_of(field)`; in the migration mode an id without a record passes, held by nobody yet: the
    backends are searched, and the answer adopts it), and the stored context each makes its
    backend read (a response's, a conversation's, an item's size; 0: unknown): looked up at once."""
    holders, sizes = await asyncio.gather(
        asyncio.gather(*(rt.affinity.lookup(rid) for _, rid in refs)),
        asyncio.gather(*(rt.affinity.context(rid) for _, rid in refs)),
    )
    held: list[tuple[str, str, Holder]] = []
    for (field, rid), holder in zip(refs, holders, strict=True):
        if holder is None and rt.affinity.adopt_unknown:
            continue
        if holder is None or holder.owner != owner:
            raise not_yours(field, rid, code_of(field))
        held.append((field, rid, holder))
    return held, list(sizes)


async def pin(call: Call, route: Route, rt: Runtime, owner: str) -> Pinned | None:
    """Where a follow-up goes (None for a request that builds on nothing stored). Every stateful
    reference must be `owner`'s, and all must be held by one backend. Raises NotFound, BadRequest,
    Unavailable or RateLimited when it cannot be answered now, saying why."""
    endpoint = call.endpoint
    refs = endpoint.stateful_refs(call.body)
    if not refs:
        return None
    held, sizes = await owned(rt, refs, owner, endpoint.missing_code)
    # Its prompt is the new input, the context it builds on (a response's, or a conversation's,
    # which includes the response's) and the stored items it names (the quota charges them when
    # no usage comes back: a stream left early on a 100,000-token conversation cost its few new
    # tokens, and one naming a 50,000-token stored item 33).
    builds = [n for (field, _), n in zip(refs, sizes, strict=True) if field != "input"]
    call.prompt_tokens += max(builds, default=0) + sum(n for (field, _), n in zip(refs, sizes, strict=True) if field == "input")
    if not held:
        field, rid = refs[0]
        return Pinned(field, rid, None, route, endpoint.missing_code(field))  # search: see the module docstring
    field, rid, holder = held[0]
    for other_field, other_id, other in held[1:]:
        if other.backend != holder.backend:
            raise BadRequest(
                f"{field} {rid!r} is held by backend {holder.backend!r} and {other_field} {other_id!r} by "
                f"{other.backend!r}: no backend holds both",
                param=other_field, code="response_backend_mismatch",
            )
    return Pinned(field, rid, holder.backend, _narrowed(call, route, rt, field, rid, holder), endpoint.missing_code(field))


def _narrowed(call: Call, route: Route, rt: Runtime, field: str, rid: str, holder: Holder) -> Route:
    """The route with the holder as its only candidate on this endpoint, once it can take the request."""
    backend = rt.backends.get(holder.backend)
    what = f"{field} {rid!r}"
    if backend is None:
        raise NotFound(f"{what} is held by backend {holder.backend!r}, which is no longer in the policy",
                       param=field, code=call.endpoint.missing_code(field))
    if backend not in serving(route, call.endpoint):
        raise BadRequest(
            f"{what} is held by backend {backend.name!r}, which does not serve model {shown(call.model)} on /v1{call.endpoint.path}: "
            "send the follow-up with a model routed to that backend",
            param="model", code="response_backend_mismatch",
        )
    usable_or_raise(backend, what, call.model)
    pool = rt.single_pool(route.model, backend.name)
    return dataclasses.replace(route, by_endpoint={**route.by_endpoint, call.endpoint.name: (pool, pool)})
