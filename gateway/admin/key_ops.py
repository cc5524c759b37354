"""The changes to the virtual keys' records, as data: made where a request asks for them and
applied where the records are (a Redis transaction, this process's memory, or the supervisor of
`gateway serve --workers N` over its control socket: admin/relayed.py).

`apply(op, records)` is pure: given every record (id -> record), it returns the records to write
(id -> record, None to delete) and the caller's result, or raises Conflict / NotFound (nothing is
written). Every store applies the same function, so they refuse alike.

Applying an op twice is applying it once: an op that is already in the records (its key's id, its
new secret's digest, a revoke) writes nothing the second time and answers as the first did. A
change whose reply was lost is sent again (redis-py retries on a fresh connection) and re-applied
to the records it already changed: a rotation applied twice graced its own new secret and dropped
the old one at once, despite the `grace_s` promised.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import BadRequest, Conflict, NotFound

__all__ = ["Add", "Rotate", "Revoke", "KeyOp", "Writes", "apply", "to_json", "from_json"]

Writes = dict[str, dict[str, Any] | None]


@dataclass(frozen=True, slots=True)
class Add:
    """Add `rec` (a new key); keys ended more than `keep_revoked_s` ago are forgotten on the way,
    and at most `max_keys` remain."""

    rec: dict[str, Any]
    now: float
    keep_revoked_s: float
    max_keys: int


@dataclass(frozen=True, slots=True)
class Rotate:
    """Key `kid` gets the secret with `digest`; its current one works `grace_s` more seconds, and
    any earlier one still in its grace stops now."""

    kid: str
    now: float
    grace_s: float
    digest: str


@dataclass(frozen=True, slots=True)
class Revoke:
    """Revoke key `kid` (every secret of it); revoking twice is fine."""

    kid: str
    now: float


KeyOp = Add | Rotate | Revoke
_KINDS: dict[str, type[Add] | type[Rotate] | type[Revoke]] = {"add": Add, "rotate": Rotate, "revoke": Revoke}


def apply(op: KeyOp, records: dict[str, dict[str, Any]]) -> tuple[Writes, Any]:
    """What `op` writes to `records`, and its result (the record, for a rotation)."""
    if isinstance(op, Add):
        if op.rec["id"] in records:  # ids are random: this very op, applied already
            return {}, None
        writes: Writes = dict.fromkeys(_forgotten(records, op.now, op.keep_revoked_s))
        if len(records) - len(writes) >= op.max_keys:
            raise Conflict(f"there are {len(records)} keys, the most `admin.keys.max_keys` allows: revoke some first "
                           "(revoked keys are forgotten after `admin.keys.keep_revoked_s`)")
        writes[op.rec["id"]] = op.rec
        return writes, None
    if isinstance(op, Rotate):
        done = records.get(op.kid)
        if done is not None and op.digest in (done.get("digests") or {}):  # its secret is new: applied already
            return {}, done
        now = op.now
        rec = _live_record(records, op.kid, now)
        # Only the secret being replaced may keep working (for `grace_s`): every earlier one, still
        # in its own grace, ends now. A rotation "now" after a leak stopped the newest secret only,
        # and graced rotations piled up live secrets (21 after 20 rotations), none of them listed.
        current = [d for d, until in rec["digests"].items() if until is None]
        old = {d: round(now + op.grace_s, 3) for d in current} if op.grace_s > 0 else {}
        rec["digests"] = {**old, op.digest: None}
        rec["rotated_at"] = round(now, 3)
        return {op.kid: rec}, rec
    found = records.get(op.kid)
    if found is None:
        raise NotFound(f"no key {op.kid!r}")
    if found.get("revoked"):
        return {}, None
    found.update(revoked=True, revoked_at=round(op.now, 3), digests={})
    return {op.kid: found}, None


def to_json(op: KeyOp) -> dict[str, Any]:
    kind = next(k for k, cls in _KINDS.items() if isinstance(op, cls))
    return {"op": kind, **asdict(op)}


def from_json(data: Any) -> KeyOp:
    """An op sent over the control socket (BadRequest for anything else)."""
    try:
        kind = _KINDS[data.pop("op")]
        return kind(**data)
    except (KeyError, TypeError, AttributeError) as exc:
        raise BadRequest(f"not a change to the keys: {exc}") from None


def _live_record(records: dict[str, dict[str, Any]], kid: str, now: float) -> dict[str, Any]:
    rec = records.get(kid)
    if rec is None:
        raise NotFound(f"no key {kid!r}")
    if rec.get("revoked"):
        raise Conflict(f"key {kid!r} is revoked: make a new one")
    expires = rec.get("expires_at")
    if isinstance(expires, int | float) and expires <= now:
        # A new secret for it would never work (the expiry stays): answered 201 with a dead key.
        raise Conflict(f"key {kid!r} has expired: make a new one")
    return rec


def _forgotten(records: dict[str, dict[str, Any]], now: float, keep_s: float) -> list[str]:
    """Keys revoked, or expired, more than `keep_s` ago: no longer listed, no longer counted."""
    def ended(r: dict[str, Any]) -> float | None:
        if r.get("revoked"):
            return float(r.get("revoked_at") or 0)
        exp = r.get("expires_at")
        return float(exp) if isinstance(exp, (int, float)) else None

    return [kid for kid, r in records.items() if (end := ended(r)) is not None and end + keep_s < now]
