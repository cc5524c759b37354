"""Cached Responses API answers: which responses may be cached, and a hit replayed as a stream.

An entry is the final Response object as JSON (a non-streamed answer's bytes, or the `response`
of a stream's `response.completed` event). A non-streamed hit sends it back as it is; a streamed
hit replays it as the event sequence a backend sends (`response.created`, `response.in_progress`,
per output item `response.output_item.added` ... deltas ... `response.output_item.done`, then
`response.completed`), which the official SDKs parse into the same text.
"""

from __future__ import annotations

from typing import Any

import orjson

__all__ = ["replayable", "replay_events"]

_PARTS = frozenset({"output_text", "refusal"})


def _item_ok(item: Any) -> bool:
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        return False
    kind = item.get("type")
    if kind == "message":
        content = item.get("content")
        return isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") in _PARTS and isinstance(p.get(p["type"] if p["type"] == "refusal" else "text"), str)
            for p in content
        )
    if kind == "function_call":
        return isinstance(item.get("arguments"), str) and isinstance(item.get("call_id"), str)
    return kind == "reasoning"


def replayable(obj: Any) -> bool:
    """A completed Response whose output items can all be replayed faithfully (messages with text
    or refusal parts, function calls, reasoning items): what may be cached. Also the check that an
    entry read back from the store is not corrupt."""
    if not isinstance(obj, dict) or obj.get("object") != "response" or obj.get("status") != "completed":
        return False
    if not isinstance(obj.get("id"), str):
        return False
    output = obj.get("output")
    return isinstance(output, list) and all(_item_ok(i) for i in output)


class _Events:
    __slots__ = ("out", "seq")

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.seq = 0

    def add(self, kind: str, **fields: Any) -> None:
        data = orjson.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        self.out.append(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")


def _pieces(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)] if text else []


def replay_events(body: bytes, chunk_chars: int = 64) -> bytes:
    """The stream of a streamed cache hit for a stored Response (`replayable` ones only)."""
    resp: dict[str, Any] = orjson.loads(body)
    ev = _Events()
    start = {**resp, "status": "in_progress", "output": [], "usage": None}
    ev.add("response.created", response=start)
    ev.add("response.in_progress", response=start)
    for oi, item in enumerate(resp["output"]):
        kind, iid = item["type"], item["id"]
        if kind == "message":
            ev.add("response.output_item.added", output_index=oi, item={**item, "status": "in_progress", "content": []})
            for ci, part in enumerate(item["content"]):
                ptype = part["type"]
                field = "refusal" if ptype == "refusal" else "text"
                empty = {**part, field: ""}
                if ptype == "output_text":
                    empty["annotations"] = []
                ev.add("response.content_part.added", item_id=iid, output_index=oi, content_index=ci, part=empty)
                where = {"item_id": iid, "output_index": oi, "content_index": ci}
                if ptype == "output_text":
                    for piece in _pieces(part["text"], chunk_chars):
                        ev.add("response.output_text.delta", **where, delta=piece, logprobs=[])
                    ev.add("response.output_text.done", **where, text=part["text"], logprobs=[])
                else:
                    for piece in _pieces(part["refusal"], chunk_chars):
                        ev.add("response.refusal.delta", **where, delta=piece)
                    ev.add("response.refusal.done", **where, refusal=part["refusal"])
                ev.add("response.content_part.done", item_id=iid, output_index=oi, content_index=ci, part=part)
        elif kind == "function_call":
            ev.add("response.output_item.added", output_index=oi, item={**item, "status": "in_progress", "arguments": ""})
            for piece in _pieces(item["arguments"], chunk_chars):
                ev.add("response.function_call_arguments.delta", item_id=iid, output_index=oi, delta=piece)
            ev.add("response.function_call_arguments.done", item_id=iid, output_index=oi, arguments=item["arguments"],
                   name=item.get("name"))
        else:  # reasoning: whole, as backends announce an item they do not stream
            ev.add("response.output_item.added", output_index=oi, item=item)
        ev.add("response.output_item.done", output_index=oi, item=item)
    ev.add("response.completed", response=resp)
    return b"".join(ev.out)
