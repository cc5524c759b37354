"""The by-id endpoints' backends (api.py): which backend to ask about a response or a
conversation id, from the affinity map, and in the migration mode (`responses.adopt_unknown_ids`)
which ones to search for an id the map has no record of. How a follow-up request is pinned to
the backend holding its state: pipeline/pinning.py.
"""

from __future__ import annotations

from ..config.runtime import Runtime
from ..errors import NotFound
from ..pipeline.pinning import not_yours, usable_or_raise
from ..routing.backends import Backend
from .codec import RESPONSES

__all__ = ["holders_of", "responses_backends"]


def responses_backends(rt: Runtime) -> list[Backend]:
    """Every backend serving /v1/responses that is not starting, in policy order (what the
    migration mode searches)."""
    return [b for b in rt.backends.values() if RESPONSES.name in b.policy.endpoints and b.health.state() != "starting"]


async def holders_of(rid: str, owner: str, rt: Runtime, param: str = "response_id") -> tuple[list[Backend], bool]:
    """The backends to ask about `rid` (a response, or with `param="conversation_id"` a
    conversation) for `owner` (the by-id endpoints), and whether that is a search (only in the
    migration mode, for an id without a record: every backend serving /v1/responses, in policy
    order, until one does not answer 404). Raises NotFound for an id without a record (outside
    the migration mode), another tenant's id or a backend gone from the policy; MapUnavailable
    when the map cannot be read; the errors of usable_or_raise when the holder cannot take traffic."""
    holder = await rt.affinity.lookup(rid)
    what = f"{param.removesuffix('_id')} {rid!r}"
    if holder is None:
        searched = responses_backends(rt) if rt.affinity.adopt_unknown else []
        if not searched:
            raise not_yours(param, rid, RESPONSES.missing_code(param))
        return searched, True
    if holder.owner != owner:
        raise not_yours(param, rid, RESPONSES.missing_code(param))
    backend = rt.backends.get(holder.backend)
    if backend is None:
        raise NotFound(f"{what} was held by backend {holder.backend!r}, which is no longer in the policy",
                       param=param, code=RESPONSES.missing_code(param))
    usable_or_raise(backend, what)
    return [backend], False
