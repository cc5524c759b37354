"""Quota accounting at the edges of a stream: what a tenant is charged when a Responses stream
ends in `response.failed` with the usage it spent, when a client leaves a stream that was
reasoning, when a stream cut mid-answer is continued on another backend, and when items are
added to one conversation by several requests at once. Real sockets: the gateway, backends of
the tests' own (scripted: what each event says is the test's), the fake upstream for conversations.

Each test compares what the quota charged (its window's tokens, or the conversation's recorded
context) with what the backends used."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.pipeline.call import Call
from gateway.web.keys import LIVE
from gateway.wire.tokens import bytes_tokens
from tests.conftest import simple_policy
from tests.procs import redis_server
from tests.servers import Served

KEY = "sk-acme-" + secrets.token_hex(16)
HDR = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "count"}]


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _sse(data: Any, event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


class Scripted(Served):
    """A backend whose streams the test scripts (its attributes), chat and Responses:

    - chat: a role chunk, `reasoning` chunks of reasoning_content ("r "), then the answer's words
      "w0 w1 ..." (`words` of them; a prefill's words are skipped, as a model going on would),
      cut without a finish reason after `cut_after` words when set (the first `cuts` requests
      only), else the finish and, when asked, the usage chunk (`usage_completion`: its
      completion_tokens; default reasoning + words generated; none with `no_usage`) and [DONE];
    - Responses: `response.created`, then `reasoning` summary deltas, then `words` text deltas,
      then `response.failed` carrying `failed_usage` when set, else `response.completed` with usage.
    `sleep_s` between events."""

    def __init__(self, name: str) -> None:
        self.name, self.host, self.port = name, "127.0.0.1", 0
        self.reasoning, self.words, self.sleep_s = 0, 12, 0.0
        self.cut_after: int | None = None
        self.cuts = 1
        self.usage_completion: int | None = None
        self.no_usage = False  # never a usage chunk, even when asked
        self.failed_usage: dict[str, int] | None = None
        self.requests: list[dict[str, Any]] = []
        self.app = web.Application()
        self.app.add_routes([web.post("/v1/chat/completions", self._chat), web.post("/v1/responses", self._responses),
                             web.get("/v1/models", self._models)])

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _pause(self) -> None:
        if self.sleep_s:
            await asyncio.sleep(self.sleep_s)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        msgs = body.get("messages") or []
        had = str(msgs[-1].get("content") or "") if msgs and msgs[-1].get("role") == "assistant" else ""
        start, lead = len(had.split()), " " if had and not had[-1].isspace() else ""
        cut = self.cut_after if len(self.requests) <= self.cuts else None
        head = {"id": f"c-{self.name}", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return _sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        await resp.write(chunk({"role": "assistant", "content": ""}))
        for _ in range(self.reasoning):
            await self._pause()
            await resp.write(chunk({"reasoning_content": "r "}))
        for i in range(start, self.words):
            if cut is not None and i == cut:
                await resp.write_eof()  # cut: no finish reason, no usage
                return resp
            await self._pause()
            word = lead + f"w{i} " if i == start else f"w{i} "
            await resp.write(chunk({"content": word}))
        await resp.write(chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage") and not self.no_usage:
            completion = self.usage_completion
            if completion is None:
                completion = self.reasoning + self.words - start
            usage = {"prompt_tokens": 50, "completion_tokens": completion, "total_tokens": 50 + completion}
            await resp.write(_sse({**head, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        rid = f"resp_{self.name}{len(self.requests)}"
        start = {"id": rid, "object": "response", "created_at": 1, "status": "in_progress", "model": body["model"],
                 "output": [], "usage": None, "store": False}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0

        async def ev(kind: str, **fields: Any) -> None:
            nonlocal seq
            await resp.write(_sse({"type": kind, "sequence_number": seq, **fields}, kind))
            seq += 1

        await ev("response.created", response=start)
        await ev("response.in_progress", response=start)
        if self.reasoning:
            await ev("response.output_item.added", output_index=0,
                     item={"id": "rs_1", "type": "reasoning", "summary": []})
            for _ in range(self.reasoning):
                await self._pause()
                await ev("response.reasoning_summary_text.delta", item_id="rs_1", output_index=0, summary_index=0, delta="r ")
        await ev("response.output_item.added", output_index=1,
                 item={"id": "msg_1", "type": "message", "role": "assistant", "status": "in_progress", "content": []})
        for i in range(self.words):
            await self._pause()
            await ev("response.output_text.delta", item_id="msg_1", output_index=1, content_index=0, delta=f"w{i} ")
        if self.failed_usage is not None:
            err = {"code": "server_error", "message": "the model failed mid-response"}
            await ev("response.failed", response={**start, "status": "failed", "error": err, "usage": self.failed_usage})
        else:
            n = self.reasoning + self.words
            usage = {"input_tokens": 50, "output_tokens": n, "total_tokens": 50 + n}
            await ev("response.completed", response={**start, "status": "completed", "usage": usage})
        await resp.write_eof()
        return resp


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[str], Any]]:
    started: list[Scripted] = []

    async def make(name: str = "a") -> Scripted:
        up = await Scripted(name).start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.stop()


def _policy(*ups: Any, **extra: Any) -> dict[str, Any]:
    p = simple_policy(*ups, model="m", cache={"enabled": False}, **extra)
    p["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": {"tpm": 10_000_000}}}
    p["health"] = {"probe_interval_ms": 600_000}
    return p


class Charges:
    """What the gateway's quota charged each request (its window's tokens before and after), and
    the Call it settled (its prompt estimate, its usage, its reads of the prompt)."""

    def __init__(self, gw: Any) -> None:
        self.q = gw.app[LIVE].runtime.quota
        self.calls: list[Call] = []
        settle = self.q.settle

        def spy(hold: Any, call: Call, spend_of: Any) -> float:
            self.calls.append(call)
            return float(settle(hold, call, spend_of))

        self.q.settle = spy

    async def tokens(self) -> int:
        for _ in range(100):  # the settle comes as the handler ends (a client that left: soon after)
            await self.q.drain()
            if self.calls and (await self.q.usage("acme"))[""].inflight == 0:
                break
            await asyncio.sleep(0.02)
        return int((await self.q.usage("acme"))[""].window_tokens)


# ---- 1. a Responses stream that ends in response.failed -------------------------------------


async def test_a_responses_stream_that_fails_is_charged_the_usage_its_failure_reports(
        scripted: Any, gateway: Any) -> None:
    """A backend that failed after 3 deltas says it spent 40 input and 900 output tokens: charged
    those 940 (before: the prompt estimate + the 3 deltas, as if no usage came)."""
    up = await scripted()
    up.words, up.failed_usage = 3, {"input_tokens": 40, "output_tokens": 900, "total_tokens": 940}
    gw = await gateway(_policy(up))
    charges = Charges(gw)
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", headers=HDR, json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
    assert raw.count(b"output_text.delta") >= 3 and b"response.failed" in raw, raw  # the client got the failure as sent
    charged = await charges.tokens()
    assert charged == 940, (charged, charges.calls[0].out.usage)


async def test_a_failure_before_any_output_fails_over_and_the_answer_settles(scripted: Any, gateway: Any) -> None:
    """A response.failed before the first delta is not the answer: the relay fails over and the
    next backend's usage is what settles (plus the failed attempt's read of the prompt), never
    the failed attempt's figures standing for it."""
    bad, good = await scripted("bad"), await scripted("good")
    bad.words, bad.failed_usage = 0, {"input_tokens": 40, "output_tokens": 900, "total_tokens": 940}
    good.words = 4
    gw = await gateway(_policy(bad, good))
    charges = Charges(gw)
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", headers=HDR, json={"model": "m", "input": "hi", "stream": True}) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
    assert b"response.completed" in raw, raw
    charged = await charges.tokens()
    call = charges.calls[0]
    assert charged == 54 + call.prompt_tokens, (charged, call.out.usage, call.prompt_tokens)


# ---- 2. a stream its client left while the model was reasoning -------------------------------


@pytest.mark.parametrize("api", ["chat", "responses", "responses_via_chat", "messages_via_chat"])
async def test_a_stream_left_after_reasoning_is_charged_the_reasoning_it_was_sent(
        scripted: Any, gateway: Any, api: str) -> None:
    """A reasoning model sends 30 reasoning pieces (chat `reasoning_content`, Responses
    `response.reasoning_summary_text.delta`), then its answer; the client leaves after the 5th
    word (a Responses or Messages client of a chat backend: through the gateway's translation).
    Charged: the prompt estimate and every piece it was sent, reasoning included (at least 35
    tokens), not the 1,000s the whole answer would have used. Not a gap: each reasoning piece is
    output to the relay (wire/chat_monitor.py has_content; any Responses `*.delta`)."""
    up = await scripted()
    up.reasoning, up.words, up.sleep_s = 30, 400, 0.005
    policy = _policy(up)
    if api.endswith("via_chat"):
        policy["backends"][up.name]["endpoints"] = ["chat"]
    gw = await gateway(policy)
    charges = Charges(gw)
    async with aiohttp.ClientSession() as http:
        if api == "chat":
            req, path, word = {"model": "m", "messages": MSG, "stream": True}, "/v1/chat/completions", b'"content":"w'
        elif api == "messages_via_chat":
            req, path, word = {"model": "m", "messages": MSG, "stream": True, "max_tokens": 1000}, "/v1/messages", b'"text":"w'
        else:
            req, path, word = {"model": "m", "input": "count", "stream": True}, "/v1/responses", b'"delta":"w'
        async with http.post(gw.url + path, headers=HDR, json=req) as r:
            assert r.status == 200, await r.text()
            buf = b""
            while buf.count(word) < 5:
                buf += await r.content.readany()
            r.close()
    charged = await charges.tokens()
    call = charges.calls[0]
    assert call.out.usage is None  # left before the usage: charged the estimate
    assert charged - call.prompt_tokens >= 35, (charged, call.prompt_tokens, call.out.streamed_tokens)
    assert charged < call.prompt_tokens + 300, charged


# ---- 3. a stream continued on another backend -------------------------------------------------


@pytest.mark.parametrize("mode", ["restart", "prefill"])
@pytest.mark.parametrize("reasoning", [0, 20])
@pytest.mark.parametrize("reported", [True, False])
async def test_a_continued_stream_is_charged_what_the_cut_backend_generated(
        scripted: Any, gateway: Any, mode: str, reasoning: int, reported: bool) -> None:
    """`a` streams `reasoning` reasoning pieces and 5 of 12 words, then its stream is cut; `b`
    continues it (restart: it generates the whole answer again, its usage counts 12 words and
    its own reasoning; prefill: it goes on from the 5, the usage the client gets counts them).
    Charged: `b`'s usage, `a`'s read of the prompt and everything `a` generated (before: a
    restart was not charged `a`'s 5 words, and neither mode `a`'s reasoning). The client's usage
    is the whole answer's either way (as test_rescue says). Without a usage report (`reported`
    False) the estimate counts the same: each piece delivered, and what `b` generated again."""
    a, b = await scripted("a"), await scripted("b")
    a.reasoning = b.reasoning = reasoning
    b.no_usage = not reported
    a.cut_after = 5
    policy = _policy(a, b)
    policy["backends"]["b"]["prefill"] = mode == "prefill"
    gw = await gateway(policy)
    charges = Charges(gw)
    async with aiohttp.ClientSession() as http:
        req = {"model": "m", "messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(gw.url + "/v1/chat/completions", headers=HDR, json=req) as r:
            assert r.status == 200, await r.text()
            raw = await r.read()
    chunks = [orjson.loads(line[6:]) for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(f"w{i} " for i in range(12)), text
    finish = next(c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason"))
    assert finish["x_gateway"]["continued"] == mode, finish
    charged = await charges.tokens()
    call = charges.calls[0]
    generated_by_a = reasoning + 5
    b_generated = reasoning + (12 if mode == "restart" else 7)
    if reported:
        client_usage = next(c["usage"] for c in chunks if c.get("usage"))
        # b's own usage: its reasoning and the words it generated (restart: all 12; prefill: 7,
        # plus the 5 delivered that the continuation's usage counts for the client)
        assert client_usage["completion_tokens"] == reasoning + 12, client_usage
        used = 50 + b_generated + call.prompt_tokens + generated_by_a  # b's usage, a's prompt read and output
    else:
        used = 2 * call.prompt_tokens + b_generated + generated_by_a
    assert charged == used, (charged, used, call.out.usage, call.prompt_tokens)


# ---- 4. items added to one conversation at once -----------------------------------------------


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_items_added_to_a_conversation_at_once_all_count_in_its_context(
        upstream: Any, gateway: Any, store: str) -> None:
    """Ten POST /v1/conversations/{id}/items at once, each ~1,000 tokens: the conversation's
    recorded context (what its next turn is charged on top of its input) is their sum (before:
    each read the size, added its own and wrote it back, and the writes overwrote each other)."""
    up = await upstream("c", tokens=4)

    async def run(url: str | None) -> None:
        policy = _policy(up)
        if url is not None:
            policy["store"] = {"url": url}
        gw = await gateway(policy)
        rt = gw.app[LIVE].runtime
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/conversations", headers=HDR, json={}) as r:
                assert r.status == 200, await r.text()
                cid = (await r.json())["id"]
            bodies = [orjson.dumps({"items": [{"type": "message", "role": "user", "content": f"{i} " + "word " * 800}]})
                      for i in range(10)]

            async def add(body: bytes) -> None:
                async with http.post(gw.url + f"/v1/conversations/{cid}/items", data=body,
                                     headers={**HDR, "Content-Type": "application/json"}) as r:
                    assert r.status == 200, await r.text()

            await asyncio.gather(*(add(b) for b in bodies))
        recorded = await rt.affinity.context(cid)
        expected = sum(bytes_tokens(b) for b in bodies)
        assert recorded == expected, (recorded, expected)

    if store == "memory":
        await run(None)
    else:
        async with redis_server() as url:
            await run(url)
