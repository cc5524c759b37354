"""One request log entry: taken on the request path as a row of values, stored as a JSON array,
read back as an object.

The request path only keeps a request's values and small parts (`take`); the log's writer makes
them rows and encodes them, in batches, and reading turns seconds into milliseconds and rounds.
Stored rows are arrays, not objects: a third the size, and the field names are paid once, here. The
first element is the row's version: rows of another layout, and objects, still read back.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from ..pipeline.call import Call

if TYPE_CHECKING:
    from ..config.runtime import Runtime

__all__ = ["FIELDS", "take", "row_of", "encode", "decode"]

_VERSION = 1
FIELDS = (
    "id", "time", "tenant", "key_id", "endpoint", "model", "backend", "class", "cache", "status", "stream", "ttft_ms",
    "duration_ms", "prompt_tokens", "completion_tokens", "cost_usd", "attempts", "finish", "rule", "reasons", "error",
)  # fmt: skip
# Positions in a row (its version first): time and durations are stored in seconds, unrounded.
_TIME, _TENANT = 2, 3
Row = tuple[Any, ...]  # the version, FIELDS' values, then a dict of extras (affinity, payloads) or None
Taken = tuple[Any, ...]  # what `take` keeps on the request path, for `row_of`


def take(call: Call, rt: Runtime, end: float, spend_usd: float) -> Taken:
    """What the request path keeps of a finished request: its values and references to small parts
    of it, no copies and no formatting; the writer turns a batch of them into rows (`row_of`), one
    after the other, where that work runs with the CPU's caches warm: side by side
    (bench/side_by_side.py) that cost the request path less than building each row as its request
    ended. Nothing here holds the Call, its body, or a string whose size the caller chose (the
    model asked for, an error that quotes it: cut here): a finished request keeps no more of its
    memory while it waits. A `log_payloads` tenant's prompt and answer are cut here too."""
    t, out, v = call.tenant, call.out, call.verdict
    payloads = _payloads(call, rt.policy.request_log.max_payload_chars) if t is not None and t.log_payloads else None
    return (call.request_id, time.time(), t, call.endpoint, call.model[:200], call.stream, call.cls, call.reasons,
            None if v is None else v.rule, call.cache.result, out.backend, out.status, out.attempts, out.usage,
            out.finish, out.affinity, out.error[:300] if out.error else None, call.timing, end, spend_usd,
            payloads)  # fmt: skip


def row_of(taken: Taken) -> Row:
    """What the log keeps of one finished request (`take`'s), unencoded."""
    (rid, at, t, endpoint, model, stream, cls, reasons, rule, cache, backend, status, attempts, usage, finish, affinity,
     error, timing, end, spend_usd, payloads) = taken  # fmt: skip
    usage = usage or {}
    extras: dict[str, Any] | None = None
    if affinity is not None:
        extras = {"affinity": affinity.view()}
    if payloads is not None:
        extras = {**(extras or {}), **payloads}
    return (
        _VERSION, rid, at, None if t is None else t.name, None if t is None else t.key_id, endpoint.name, model, backend,
        cls, cache.value, status, stream, timing.ttft_s, end - timing.t0, usage.get("prompt_tokens"),
        usage.get("completion_tokens"), spend_usd, tuple(attempts), None if finish is None else finish.value, rule,
        tuple(reasons), error, extras,
    )  # fmt: skip


def encode(row: Row) -> tuple[int, str, bytes]:
    """A row as the store keeps it: (score: the time in microseconds, tenant, JSON array)."""
    return int(row[_TIME] * 1e6), row[_TENANT] or "", orjson.dumps(row, default=str)


def decode(raw: bytes) -> dict[str, Any]:
    """A stored entry as the API shows it."""
    data = orjson.loads(raw)
    if isinstance(data, dict) or not isinstance(data, list) or data[:1] != [_VERSION]:
        return data if isinstance(data, dict) else {"unreadable": True}
    e = dict(zip(FIELDS, data[1:], strict=False))
    extras = data[len(FIELDS) + 1] if len(data) > len(FIELDS) + 1 else None
    if isinstance(extras, dict):
        e.update(extras)
    e["time"] = _rounded(e.get("time"), 1, 6)
    e["ttft_ms"] = _rounded(e.get("ttft_ms"), 1000, 2)
    e["duration_ms"] = _rounded(e.get("duration_ms"), 1000, 2)
    e["cost_usd"] = _rounded(e.get("cost_usd"), 1, 8)
    return e


def _rounded(v: Any, scale: float, digits: int) -> Any:
    return round(v * scale, digits) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _payloads(call: Call, limit: int) -> dict[str, Any]:
    body = call.body
    out: dict[str, Any] = {}
    _cut(out, "prompt", body.get("messages", body.get("prompt", body.get("input"))), limit)
    _cut(out, "answer", None if call.cache.entry is None else _text(call.cache.entry.answer()), limit)
    return out


def _cut(e: dict[str, Any], name: str, value: Any, limit: int) -> None:
    """`value` under `name`, or its JSON text cut to `limit` characters (and `{name}_truncated`)."""
    if value is None or (isinstance(value, str) and len(value) <= limit):
        e[name] = value
        return
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    if len(text) <= limit:
        e[name] = value
    else:
        e[name], e[f"{name}_truncated"] = text[:limit], True


def _text(obj: dict[str, Any]) -> str | None:
    """An answer's text, in any of the shapes the gateway speaks (chat, completions, a Response,
    a Message)."""
    if isinstance(obj.get("output_text"), str):
        return str(obj["output_text"])
    parts: list[str] = []
    for c in obj.get("choices") or ():
        if isinstance(c, dict):
            m = c.get("message")
            text = m.get("content") if isinstance(m, dict) else c.get("text")
            if isinstance(text, str):
                parts.append(text)
    for block in obj.get("content") or ():
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
    for item in obj.get("output") or ():
        for block in (item.get("content") or ()) if isinstance(item, dict) else ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
    return "".join(parts) if parts else None
