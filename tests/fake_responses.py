"""The fake upstream's Responses API (/v1/responses and the by-id endpoints), for tests and benchmarks.

Answers the same words as chat ("w0 w1 ... "), with the same fault modes (fake_upstream.py), in the
Responses API's shapes: a Response object, or its event stream. Every response is kept (by id) so
follow-ups and GET/DELETE/cancel/input_items work on the backend that made it, and only there
(the latest 10,000):
a `previous_response_id` this fake did not issue is a 404 (previous_response_not_found), as is a
`conversation` whose id does not start with `conv_<name>`. POST /v1/conversations makes one
(`conv_<name>_<n>`, the body kept), GET/DELETE /v1/conversations/{id} read and delete the ones it
made, POST /v1/conversations/{id}/items adds items to one. `background: true` answers `queued`
at once; the response completes after the time its tokens would take (cancel stops it).
Modes for streams, at `fail_after` deltas: stall_mid, disconnect, cut (the body ends without
response.completed), error_event (a Responses `error` event), failed (`response.failed`),
malformed (a broken event among good ones); stall: created, then silence; garbage: non-JSON 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from types import SimpleNamespace
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

__all__ = ["ResponsesFake"]


def _text(n: int) -> str:
    return "".join(f"w{i} " for i in range(n))


@dataclass
class _Kept:
    obj: dict[str, Any]
    items: list[dict[str, Any]]
    done_at: float  # monotonic time at which a background response completes
    cancelled: bool = False


@dataclass
class ResponsesFake:
    """The Responses state of one fake backend named `name`."""

    name: str
    kept: dict[str, _Kept] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    conversations: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> the body it was made with
    replay_itl_ms: float = 0.0  # a GET ?stream=true replay's pause between deltas

    def _keep(self, rid: str, kept: _Kept) -> None:
        self.kept[rid] = kept
        if len(self.kept) > 10_000:  # bounded (benchmarks send many): the oldest go first
            del self.kept[next(iter(self.kept))]

    def _obj(self, rid: str, model: str, text: str | None, status: str, n: int, size: int, body: dict[str, Any]) -> dict[str, Any]:
        output = []
        if text is not None:
            output.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                           "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
        obj: dict[str, Any] = {
            "id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "previous_response_id": body.get("previous_response_id"), "background": bool(body.get("background")),
            "store": body.get("store") is not False,  # as OpenAI's: whether it is kept for follow-ups
            "usage": None if status != "completed" else {
                "input_tokens": size // 4, "output_tokens": n, "total_tokens": size // 4 + n,
                "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
        conv = body.get("conversation")
        if conv:
            obj["conversation"] = {"id": conv if isinstance(conv, str) else conv.get("id")}
        return obj

    def refuse(self, body: dict[str, Any]) -> web.Response | None:
        """A 404 for state this backend does not hold (what a real one says), else None."""
        prev = body.get("previous_response_id")
        if prev and prev not in self.kept:
            return _error(404, f"Previous response with id '{prev}' not found.", "previous_response_id", "previous_response_not_found")
        conv = body.get("conversation")
        cid = conv.get("id") if isinstance(conv, dict) else conv
        if cid and not str(cid).startswith(f"conv_{self.name}"):
            return _error(404, f"Conversation with id '{cid}' not found.", "conversation", "conversation_not_found")
        refs = body.get("input") if isinstance(body.get("input"), list) else []
        for ref in refs:
            if isinstance(ref, dict) and ref.get("type") == "item_reference" and not self._holds_item(str(ref.get("id"))):
                return _error(404, f"Item with id '{ref.get('id')}' not found.", "input", None)
        return None

    def _holds_item(self, iid: str) -> bool:
        """An output item (msg_<response id>) or an input item (item_<response id>_<n>) of a kept response."""
        if iid.startswith("msg_"):
            return iid[4:] in self.kept
        return iid.startswith("item_") and iid[5:].rpartition("_")[0] in self.kept

    async def respond(self, request: web.Request, body: dict[str, Any], b: Any, mode: str, n: int, ttft_s: float, size: int) -> web.StreamResponse:
        """Answer POST /v1/responses (after the shared fault modes: errors, hang, reset, close)."""
        refused = self.refuse(body)
        if refused is not None:
            return refused
        model = b.model or body.get("model", "fake")
        rid = f"resp_{self.name}_{next(self.ids)}"
        text = _text(n)
        items = body.get("input")
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}] if isinstance(items, str) else (items or [])
        items = [{**it, "id": f"item_{rid}_{i}"} for i, it in enumerate(items) if isinstance(it, dict)]
        final = self._obj(rid, model, text, "completed", n, size, body)
        if body.get("background") and not body.get("stream"):
            self._keep(rid, _Kept(final, items, time.monotonic() + ttft_s + b.itl_ms * n / 1000))
            return web.json_response(self._obj(rid, model, None, "queued", n, size, body))
        if body.get("background"):  # streamed as any other, and finished whether the client stays or not (as OpenAI's)
            self._keep(rid, _Kept(final, items, time.monotonic() + ttft_s + b.itl_ms * n / 1000))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            with contextlib.suppress(ConnectionError):
                await _events(resp, self._obj(rid, model, None, "in_progress", n, size, body), final, text, n, b, mode, ttft_s)
            return resp
        self._keep(rid, _Kept(final, items, 0.0))
        if not body.get("stream"):
            await asyncio.sleep(ttft_s + b.itl_ms * n / 1000)
            if mode == "garbage":
                return web.Response(body=b"<html>oops</html>", content_type="text/html")
            return web.Response(body=orjson.dumps(final), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await _events(resp, self._obj(rid, model, None, "in_progress", n, size, body), final, text, n, b, mode, ttft_s)
        return resp

    def _current(self, rid: str) -> _Kept | None:
        kept = self.kept.get(rid)
        if kept is not None and kept.done_at and not kept.cancelled and time.monotonic() < kept.done_at:
            return _Kept({**kept.obj, "status": "in_progress", "output": [], "usage": None}, kept.items, kept.done_at)
        return kept

    async def get(self, request: web.Request) -> web.StreamResponse:
        kept = self._current(request.match_info["id"])
        if kept is None:
            return _error(404, f"Response with id '{request.match_info['id']}' not found.", "response_id", "not_found")
        if request.query.get("stream") == "true":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            obj = kept.obj
            pace = SimpleNamespace(itl_ms=self.replay_itl_ms, fail_after=None) if self.replay_itl_ms else None
            with contextlib.suppress(ConnectionError):
                await _events(resp, {**obj, "status": "in_progress", "output": [], "usage": None}, obj, _output_text(obj), None, pace, "ok", 0.0)
            return resp
        return web.json_response(kept.obj)

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        if self.kept.pop(rid, None) is None:
            return _error(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        kept = self.kept.get(rid)
        if kept is None:
            return _error(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
        if not kept.done_at:
            return _error(400, "Only background responses can be cancelled.", None, None)
        kept.cancelled = True
        kept.obj = {**kept.obj, "status": "cancelled", "output": [], "usage": None}
        return web.json_response(kept.obj)

    async def input_items(self, request: web.Request) -> web.Response:
        kept = self.kept.get(request.match_info["id"])
        if kept is None:
            return _error(404, f"Response with id '{request.match_info['id']}' not found.", "response_id", "not_found")
        data = list(reversed(kept.items))
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": False})

    async def create_conversation(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read() or b"{}")
        cid = f"conv_{self.name}_{next(self.ids)}"
        self.conversations[cid] = body
        return web.json_response({"id": cid, "object": "conversation", "created_at": int(time.time()),
                                  "metadata": body.get("metadata") or {}})

    async def get_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        if cid not in self.conversations:
            return _error(404, f"Conversation with id '{cid}' not found.", None, "conversation_not_found")
        return web.json_response({"id": cid, "object": "conversation", "created_at": 1, "metadata": {}})

    async def delete_conversation(self, request: web.Request) -> web.Response:
        cid = request.match_info["id"]
        if self.conversations.pop(cid, None) is None:
            return _error(404, f"Conversation with id '{cid}' not found.", None, "conversation_not_found")
        return web.json_response({"id": cid, "object": "conversation.deleted", "deleted": True})

    async def add_items(self, request: web.Request) -> web.Response:
        """POST /v1/conversations/{id}/items: the items join the conversation (kept in its body's `items`)."""
        cid = request.match_info["id"]
        if cid not in self.conversations:
            return _error(404, f"Conversation with id '{cid}' not found.", None, "conversation_not_found")
        items = orjson.loads(await request.read() or b"{}").get("items") or []
        self.conversations[cid].setdefault("items", []).extend(items)
        data = [{**it, "id": f"item_{cid}_{i}"} for i, it in enumerate(items) if isinstance(it, dict)]
        return web.json_response({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                                  "last_id": data[-1]["id"] if data else None, "has_more": False})

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/conversations/{id}/items", self.add_items),
            web.get("/v1/responses/{id}", self.get),
            web.delete("/v1/responses/{id}", self.delete),
            web.post("/v1/responses/{id}/cancel", self.cancel),
            web.get("/v1/responses/{id}/input_items", self.input_items),
            web.post("/v1/conversations", self.create_conversation),
            web.get("/v1/conversations/{id}", self.get_conversation),
            web.delete("/v1/conversations/{id}", self.delete_conversation),
        ]


def _output_text(obj: dict[str, Any]) -> str:
    return "".join(p.get("text", "") for it in obj.get("output", []) for p in it.get("content", []))


def _error(status: int, message: str, param: str | None, code: str | None) -> web.Response:
    err = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return web.Response(status=status, body=orjson.dumps(err), content_type="application/json")


async def _events(resp: web.StreamResponse, start: dict[str, Any], final: dict[str, Any], text: str,
                  n: int | None, b: Any, mode: str, ttft_s: float) -> None:
    """A Responses event stream for `final`, one delta per word, with the fault `mode`."""
    seq = itertools.count()
    rid = final["id"]
    iid = f"msg_{rid}"

    async def ev(kind: str, **fields: Any) -> None:
        data = orjson.dumps({"type": kind, "sequence_number": next(seq), **fields})
        await resp.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")

    await ev("response.created", response=start)
    await ev("response.in_progress", response=start)
    if mode == "stall":
        await asyncio.sleep(3600)
    if ttft_s:
        await asyncio.sleep(ttft_s)
    item = {"type": "message", "id": iid, "status": "in_progress", "role": "assistant", "content": []}
    await ev("response.output_item.added", output_index=0, item=item)
    await ev("response.content_part.added", item_id=iid, output_index=0, content_index=0,
             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    words = [w + " " for w in text.split(" ") if w]
    where = {"item_id": iid, "output_index": 0, "content_index": 0}
    for i, w in enumerate(words):
        if i and b is not None and b.itl_ms:
            await asyncio.sleep(b.itl_ms / 1000)
        if b is not None and i == b.fail_after:
            if mode == "stall_mid":
                await asyncio.sleep(3600)
            if mode == "disconnect":
                assert resp._req is not None and resp._req.transport is not None
                resp._req.transport.close()
                return
            if mode == "cut":
                await resp.write_eof()
                return
            if mode == "error_event":
                await ev("error", code="server_error", message="fake upstream failed mid-stream", param=None)
                await resp.write_eof()
                return
            if mode == "failed":
                err = {"code": "server_error", "message": "fake upstream failed mid-response"}
                await ev("response.failed", response={**start, "status": "failed", "error": err})
                await resp.write_eof()
                return
            if mode == "malformed":
                await resp.write(b"event: response.output_text.delta\ndata: {not json\n\n")
        await ev("response.output_text.delta", **where, delta=w, logprobs=[])
    await ev("response.output_text.done", **where, text=text, logprobs=[])
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    await ev("response.content_part.done", **where, part=part)
    await ev("response.output_item.done", output_index=0, item={**item, "status": "completed", "content": [part]})
    await ev("response.completed", response=final)
    await resp.write_eof()
