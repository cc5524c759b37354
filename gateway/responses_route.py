"""Where a Responses request that builds on stored state goes: the backend that holds it.

A request with `previous_response_id` (or `conversation`) can only be answered by the backend
that made that response (extended that conversation). `pin()` finds it in the affinity map and
narrows the request's candidates to it alone: no failover (no other backend has the state), and a
clear error instead of a wrong backend's 404 when it cannot be reached. `holders_of()` does the
same for the by-id endpoints (GET/DELETE/cancel/input_items).

When the map does not know an id (created before the gateway was in front, expired, or the
store lost it), the request is routed as usual: a backend without it answers 404, which fails
over to the next candidate, and the one that has it answers (and is learned). When none of
those tried has it, the client gets a 404 that says so. An id the map gives to another tenant
is a 404 at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .backends import Backend
from .errors import AllBackendsFailed, BadRequest, GatewayError, NotFound, RateLimited, Unavailable, UpstreamError
from .responses import followup_id
from .runtime import Route, Runtime

__all__ = ["Pinned", "pin", "holders_of", "usable_or_raise"]


def _is_404(err: GatewayError) -> bool:
    # attempt._refuse reports an upstream 404 (fails over) as UpstreamError("HTTP 404: ...")
    return isinstance(err, UpstreamError) and err.message.startswith("HTTP 404")


@dataclass(frozen=True, slots=True)
class Pinned:
    """A follow-up and where it goes: the backend that holds its state, or (None) a search of the
    route's candidates when the map does not know the id."""

    field: str  # previous_response_id | conversation
    ref: str  # the id
    backend: str | None
    route: Route  # with `backend` its only candidate; the request's own route when searching

    def failed(self, err: AllBackendsFailed) -> GatewayError:
        """The relay's failure, said in terms of the state the request builds on."""
        code = _missing_code(self.field)
        if self.backend is None:
            # Every backend asked said 404 (the others were not asked: ejected, cooling, full).
            if any(_is_404(e) for _, e in err.failures) and all(
                _is_404(e) or isinstance(e, (Unavailable, RateLimited)) for _, e in err.failures
            ):
                tried = ", ".join(repr(name) for name, e in err.failures if _is_404(e))
                return NotFound(
                    f"{self.field} {self.ref!r} is not known to this gateway (not answered through it, expired after "
                    f"responses.affinity_ttl_s, or its record was lost), and no backend tried ({tried}) has it",
                    param=self.field, code=code,
                )
            return err
        for _, e in err.failures:
            if _is_404(e):  # the backend that held it no longer has it (deleted, or its retention ran out)
                return NotFound(f"{self.field} {self.ref!r} is not found on backend {self.backend!r}, which held it: {e.message}",
                                param=self.field, code=code)
        err.message = f"{self.field} {self.ref!r} is held by backend {self.backend!r}, and only it can answer: {err.message}"
        err.args = (err.message,)
        return err


def _missing_code(field: str) -> str:
    return "previous_response_not_found" if field == "previous_response_id" else "conversation_not_found"


def _serving(route: Route) -> list[Backend]:
    """The backends of a route (either class) that serve /v1/responses."""
    out: list[Backend] = []
    for cls in ("simple", "complex"):
        try:
            pool = route.pool(cls, "responses")
        except BadRequest:
            continue
        out += [b for b in pool.backends if b not in out]
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


async def pin(call_body: dict[str, object], model: str, owner: str, route: Route, rt: Runtime) -> Pinned | None:
    """Where a follow-up goes (None for a request that builds on nothing stored). Raises NotFound,
    BadRequest, Unavailable or RateLimited when it cannot be answered now, saying why."""
    ref = followup_id(call_body)
    if ref is None:
        return None
    field, rid = ref
    holder = await rt.affinity.lookup(rid)
    if holder is None:
        return Pinned(field, rid, None, route)  # search: see the module docstring
    if holder.owner != owner:
        raise NotFound(f"{field} {rid!r} is not known to this gateway", param=field, code=_missing_code(field))
    serving = _serving(route)
    backend = rt.backends.get(holder.backend)
    what = f"{field} {rid!r}"
    if backend is None:
        raise NotFound(f"{what} is held by backend {holder.backend!r}, which is no longer in the policy",
                       param=field, code=_missing_code(field))
    if backend not in serving:
        raise BadRequest(
            f"{what} is held by backend {backend.name!r}, which does not serve model {model!r} on /v1/responses: "
            "send the follow-up with a model routed to that backend",
            param="model", code="response_backend_mismatch",
        )
    usable_or_raise(backend, what, model)
    pool = rt.single_pool(route.model, backend.name)
    pinned = dataclasses.replace(route, by_endpoint={**route.by_endpoint, "responses": (pool, pool)})
    return Pinned(field, rid, backend.name, pinned)


async def holders_of(rid: str, owner: str, rt: Runtime) -> tuple[list[Backend], bool]:
    """The backends to ask about response `rid` for `owner` (the by-id endpoints), and whether
    that is a search (the map does not know it: every backend serving /v1/responses, in policy
    order, until one does not answer 404). Raises NotFound for another tenant's id or a backend
    gone from the policy, and the errors of usable_or_raise when the holder cannot take traffic."""
    holder = await rt.affinity.lookup(rid)
    what = f"response {rid!r}"
    if holder is None:
        serving = [b for b in rt.backends.values() if "responses" in b.policy.endpoints and b.health.state() != "starting"]
        if not serving:
            raise NotFound(f"{what} is not known to this gateway", param="response_id", code="response_not_found")
        return serving, True
    backend = rt.backends.get(holder.backend)
    if holder.owner != owner or backend is None:
        gone = "" if backend is not None else f": it was held by backend {holder.backend!r}, which is no longer in the policy"
        raise NotFound(f"{what} is not known to this gateway{gone}", param="response_id", code="response_not_found")
    usable_or_raise(backend, what)
    return [backend], False
