"""A fake OpenAI-compatible upstream with latency and fault knobs, for tests and benchmarks.

Run it as its own process: `python -m tests.fake_upstream --port 9001 --ttft-ms 80 --itl-ms 5`,
or in-process with `FakeUpstream(...).start()`. `POST /_control` changes its behaviour at run
time (JSON with any Behaviour field); `GET /_stats` reports what it saw.

Load and faults: `capacity` (> 0) lets at most that many requests generate at once; the rest wait
in FIFO order before their TTFT starts, so queueing shows up as TTFT (0: unlimited). `fail_pct`
(a share, 0..1) answers that share of requests 500 at once, before the first byte, chosen by a
counter (deterministic: 0.2 fails every 5th request), without taking a capacity slot.

Modes: ok, error_NNN (any status: error_500, error_429, error_503, error_400, error_404, ...;
`error_body` replaces the JSON error body, e.g. an OpenAI `context_length_exceeded` error, and a
body that is not JSON goes out as text/plain), hang (reads the request, never answers), reset (reads
the request, then resets the connection (RST) before any response byte), close (the same with an
orderly close), stall (headers, role chunk, then silence), stall_mid (streams `fail_after` tokens,
then silence), disconnect (drops the connection after `fail_after` tokens), cut (ends the stream
after `fail_after` tokens, no finish reason), no_done (finish reason, then EOF without [DONE]),
malformed (a broken chunk among good ones), error_event (an error event after `fail_after`
tokens), garbage (200 with a non-JSON body).

Continuation: a chat request whose last message is an assistant turn (a prefill) continues that
answer after the words it already has (the answer is always w0 w1 ... w{tokens-1}); with
`prefill` false it is refused with a 400, as providers that do not take a prefill do.

POST /v1/responses answers in the Responses API's shapes with the same knobs and modes (plus
`failed`), and keeps its responses for follow-ups and GET/DELETE/cancel/input_items by id:
tests/fake_responses.py.

When the mode applies: `fault_count` (> 0) limits it to the next that many chat/completions/responses
requests after start or the last `set()` (later ones answer `ok`); `flap_ms` (> 0) alternates
phases of that length, starting healthy: `ok` in even phases, the mode in odd ones (GET /models
follows the phase too). `endpoints` (None: all) lists the OpenAI paths served (chat, completions,
embeddings, responses, models); the others answer a plain 404, as a server without that route does.
`Stats.by_path` counts every request to an OpenAI path (embeddings and /models included).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.fake_responses import ResponsesFake
from tests.servers import Served

__all__ = ["Behaviour", "FakeUpstream"]


@dataclass
class Behaviour:
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    tokens: int = 8
    mode: str = "ok"
    fail_after: int = 2
    retry_after_s: float | None = None
    model: str | None = None  # the model name to answer with; None: echo the request's
    prompt_ms_per_kchar: float = 0.0  # extra TTFT per 1,000 prompt characters
    capacity: int = 0  # > 0: at most this many requests generate at once, the rest queue (FIFO) before their TTFT
    fail_pct: float = 0.0  # share (0..1) of requests answered 500 at once, before the first byte (counter-chosen)
    error_body: str | None = None  # error_NNN modes: the body to answer with (None: an OpenAI-shaped error)
    fault_count: int = 0  # > 0: the mode applies to the next this many requests only, then `ok`
    flap_ms: float = 0.0  # > 0: alternate `ok` / the mode every flap_ms, starting with `ok`
    endpoints: tuple[str, ...] | None = None  # OpenAI paths served (chat, completions, embeddings, responses, models); None: all
    prefill: bool = True  # continues a trailing assistant message; False: such a request gets a 400
    ignore_usage: bool = False  # streams never carry the usage chunk, even when asked (stream_options.include_usage)


@dataclass
class Stats:
    requests: int = 0
    active: int = 0
    peak_active: int = 0  # the most requests in flight at once (since start or the last reset)
    generating: int = 0  # holding a capacity slot (or all active ones without a capacity)
    queued: int = 0  # waiting for a capacity slot
    failed: int = 0  # answered 500 by fail_pct
    completed: int = 0
    cancelled: int = 0  # the client (the gateway) went away mid-answer
    models: list[str] = field(default_factory=list)
    by_path: dict[str, int] = field(default_factory=dict)  # every request to an OpenAI path, by path
    embeddings: int = 0
    faults: int = 0  # requests answered with the (non-ok) mode
    last_headers: dict[str, str] = field(default_factory=dict)
    last_body: dict[str, Any] = field(default_factory=dict)
    last_raw: str = ""  # the last body as it came (text: /_stats serves these stats as JSON)
    calls: list[list[Any]] = field(default_factory=list)  # [monotonic time, model, prefill?] per chat/completions request


def _word(i: int) -> str:
    return f"w{i} "


def _text_of(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content or "")


class FakeUpstream(Served):
    """One fake backend. `url` is its OpenAI base URL (…/v1) once started."""

    def __init__(self, behaviour: Behaviour | None = None, *, name: str = "fake", host: str = "127.0.0.1", port: int = 0) -> None:
        self.behaviour = behaviour or Behaviour()
        self.name = name
        self.host = host
        self.port = port
        self.stats = Stats()
        self._runner: web.AppRunner | None = None
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()  # FIFO capacity queue
        self._fail_acc = 0.0  # fail_pct counter: a request fails each time this passes 1
        self._faults_since_set = 0  # fault_count: requests the mode applied to since the last set()
        self._set_at = time.monotonic()  # flap_ms: phases count from here
        self.responses = ResponsesFake(name)  # the Responses API's kept responses (fake_responses.py)
        self.app = web.Application(middlewares=[self._count_and_gate])
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.post("/v1/completions", self._completions),
                web.post("/v1/embeddings", self._embeddings),
                web.post("/v1/responses", self._responses),
                *self.responses.routes(),
                web.get("/v1/models", self._models),
                web.get("/healthz", self._healthz),
                web.post("/_control", self._control),
                web.get("/_stats", self._stats),
            ]
        )



    def set(self, **changes: Any) -> None:
        if isinstance(changes.get("endpoints"), list):
            changes["endpoints"] = tuple(changes["endpoints"])
        self.behaviour = dataclasses.replace(self.behaviour, **changes)
        self._faults_since_set = 0
        self._set_at = time.monotonic()
        self._wake()  # a larger (or no) capacity lets queued requests start now

    def _phase_mode(self) -> str:
        """The mode in force now (fault_count and flap_ms applied), without using up a fault."""
        b = self.behaviour
        if b.mode == "ok":
            return "ok"
        if b.fault_count > 0 and self._faults_since_set >= b.fault_count:
            return "ok"
        if b.flap_ms > 0 and int((time.monotonic() - self._set_at) * 1000 / b.flap_ms) % 2 == 0:
            return "ok"
        return b.mode

    def _take_mode(self) -> str:
        """The mode for a request arriving now; a fault counts towards fault_count."""
        mode = self._phase_mode()
        if mode != "ok":
            self._faults_since_set += 1
            self.stats.faults += 1
        return mode

    _PATHS = {
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/embeddings": "embeddings",
        "/v1/responses": "responses",
        "/v1/models": "models",
    }

    @web.middleware
    async def _count_and_gate(self, request: web.Request, handler: Any) -> web.StreamResponse:
        endpoint = self._PATHS.get(request.path)
        if endpoint is None and request.path.startswith("/v1/"):
            endpoint = "other"
        if endpoint is not None:
            self.stats.by_path[request.path] = self.stats.by_path.get(request.path, 0) + 1
            served = self.behaviour.endpoints
            if served is not None and endpoint not in served:
                await request.read()
                return web.Response(status=404, text="404: Not Found")  # what a server without the route says
        return await handler(request)

    # -- handlers ---------------------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        mode = self._phase_mode()
        if mode.startswith("error_") and mode[6:].isdigit() and int(mode[6:]) >= 500:
            return web.json_response({"error": {"message": "down"}}, status=int(mode[6:]))  # down everywhere
        return web.json_response({"object": "list", "data": [{"id": self.behaviour.model or "fake", "object": "model"}]})

    async def _control(self, request: web.Request) -> web.Response:
        self.set(**await request.json())
        return web.json_response(dataclasses.asdict(self.behaviour))

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.stats))

    async def _embeddings(self, request: web.Request) -> web.Response:
        self.stats.embeddings += 1
        body = orjson.loads(await request.read())
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3]} for i in range(len(inputs))]
        return web.Response(
            body=orjson.dumps({"object": "list", "data": data, "model": body["model"], "usage": {"prompt_tokens": 3, "total_tokens": 3}}),
            content_type="application/json",
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False, responses=True)

    async def _answer(self, request: web.Request, chat: bool, responses: bool = False) -> web.StreamResponse:
        b = self.behaviour
        st = self.stats
        st.requests += 1
        st.active += 1
        st.peak_active = max(st.peak_active, st.active)
        raw = await request.read()
        body = orjson.loads(raw)
        st.models.append(body.get("model", ""))
        st.last_headers = dict(request.headers)
        st.last_body, st.last_raw = body, raw.decode("utf-8", "replace")
        msgs = body.get("messages") if chat else None
        prefill = bool(msgs) and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant"
        st.calls.append([time.monotonic(), body.get("model", ""), prefill])
        try:
            if b.fail_pct > 0:
                self._fail_acc += b.fail_pct
                if self._fail_acc >= 1.0:
                    self._fail_acc -= 1.0
                    st.failed += 1
                    err = {"error": {"message": f"fake upstream {self.name} failed (fail_pct)", "type": "server_error", "param": None, "code": None}}
                    return web.Response(status=500, body=orjson.dumps(err), content_type="application/json")
            mode = self._take_mode()
            await self._acquire()
            try:
                resp = await self._respond(request, body, chat, dataclasses.replace(self.behaviour, mode=mode), len(raw), responses)
            finally:
                self._release()
            st.completed += 1
            return resp
        except (asyncio.CancelledError, ConnectionError):
            # The client went away mid-answer: the handler is cancelled, or a write finds the
            # connection reset first (which of the two depends on timing).
            st.cancelled += 1
            raise
        finally:
            st.active -= 1

    # -- capacity: a FIFO gate in front of generation -----------------------------------------

    async def _acquire(self) -> None:
        """Take a generation slot, waiting in FIFO order while `capacity` are taken."""
        cap = self.behaviour.capacity
        if cap <= 0 or (not self._waiters and self.stats.generating < cap):
            self.stats.generating += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self.stats.queued += 1
        try:
            await fut  # _wake() counts the slot as ours before resolving
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # a slot was handed over just as the client went away: pass it on
            else:
                self._waiters.remove(fut)
            raise
        finally:
            self.stats.queued -= 1

    def _release(self) -> None:
        self.stats.generating -= 1
        self._wake()

    def _wake(self) -> None:
        cap = self.behaviour.capacity
        while self._waiters and (cap <= 0 or self.stats.generating < cap):
            fut = self._waiters.popleft()
            if not fut.done():
                self.stats.generating += 1
                fut.set_result(None)

    async def _respond(
        self, request: web.Request, body: dict[str, Any], chat: bool, b: Behaviour, size: int, responses: bool = False
    ) -> web.StreamResponse:
        model = b.model or body.get("model", "fake")
        mode = b.mode
        if mode.startswith("error_") and mode[6:].isdigit():
            status = int(mode.split("_")[1])
            headers = {"Retry-After": str(b.retry_after_s)} if b.retry_after_s is not None else {}
            err = {"error": {"message": f"fake upstream {self.name} says {status}", "type": "invalid_request_error" if status == 400 else "server_error", "param": None, "code": None}}
            await asyncio.sleep(b.ttft_ms / 1000)
            if b.error_body is not None:
                try:
                    orjson.loads(b.error_body)
                    ctype = "application/json"
                except orjson.JSONDecodeError:
                    ctype = "text/plain"
                return web.Response(status=status, body=b.error_body.encode(), content_type=ctype, headers=headers)
            return web.Response(status=status, body=orjson.dumps(err), content_type="application/json", headers=headers)
        msgs = body.get("messages") if chat else None
        start = 0  # words of the answer the request already has (an assistant prefill)
        lead = ""  # a prefill that ends in a word: the next one starts with a space, as a model's would
        if msgs and isinstance(msgs[-1], dict) and msgs[-1].get("role") == "assistant":
            if not b.prefill:
                err = {"error": {"message": "this model does not support assistant prefill", "type": "invalid_request_error",
                                 "param": "messages", "code": "prefill_unsupported"}}
                return web.Response(status=400, body=orjson.dumps(err), content_type="application/json")
            had = _text_of(msgs[-1].get("content"))
            start, lead = len(had.split()), " " if had and not had[-1].isspace() else ""
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode in ("reset", "close"):
            transport = request.transport
            if transport is not None:
                sock = transport.get_extra_info("socket")
                if mode == "reset" and sock is not None:
                    # linger 0: close() sends RST instead of FIN, as a crashed or overloaded proxy does
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                transport.abort() if mode == "reset" else transport.close()
            await asyncio.sleep(3600)  # the handler is cancelled: the connection is gone
        ttft = b.ttft_ms + b.prompt_ms_per_kchar * size / 1000
        n = int(body.get("max_tokens") or body.get("max_output_tokens") or b.tokens)
        if body.get("max_completion_tokens"):  # an upper bound, as a real model's (a gateway may add one)
            n = min(n, int(body["max_completion_tokens"]))
        n = min(n, b.tokens)
        if responses:
            return await self.responses.respond(request, body, b, mode, n, ttft / 1000, size)
        rid = f"chatcmpl-{self.name}-{self.stats.requests}"
        created = int(time.time())
        if not body.get("stream"):
            if ttft:
                await asyncio.sleep((ttft + b.itl_ms * n) / 1000)
            if mode == "garbage":
                return web.Response(body=b"<html>oops</html>", content_type="text/html")
            text = lead + "".join(_word(i) for i in range(start, n)) if start < n else ""
            usage = {"prompt_tokens": size // 4, "completion_tokens": n - start, "total_tokens": size // 4 + n - start}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop", "logprobs": None}
                obj = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                obj = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice], "usage": usage}
            return web.Response(body=orjson.dumps(obj), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        obj_name = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict[str, Any] | None, text: str | None, finish: str | None) -> bytes:
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return b"data: " + orjson.dumps({"id": rid, "object": obj_name, "created": created, "model": model, "choices": [choice]}) + b"\n\n"

        if chat:
            await resp.write(chunk({"role": "assistant", "content": ""}, None, None))
        if mode == "stall":
            await asyncio.sleep(3600)
        if ttft:
            await asyncio.sleep(ttft / 1000)
        for i in range(start, n):
            if i > start and b.itl_ms:
                await asyncio.sleep(b.itl_ms / 1000)
            if i == b.fail_after:
                if mode == "stall_mid":
                    await asyncio.sleep(3600)
                if mode == "disconnect":
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                if mode == "cut":
                    await resp.write_eof()
                    return resp
                if mode == "error_event":
                    await resp.write(b'data: {"error": {"message": "fake upstream failed mid-stream", "type": "server_error"}}\n\n')
                    await resp.write_eof()
                    return resp
                if mode == "malformed":
                    await resp.write(b"data: {not json\n\n")
            word = lead + _word(i) if i == start else _word(i)
            await resp.write(chunk({"content": word}, word, None))
        await resp.write(chunk({}, "", "stop"))
        opts = body.get("stream_options") or {}
        if opts.get("include_usage") and not b.ignore_usage:
            usage = {"prompt_tokens": size // 4, "completion_tokens": n - start, "total_tokens": size // 4 + n - start}
            await resp.write(b"data: " + orjson.dumps({"id": rid, "object": obj_name, "created": created, "model": model, "choices": [], "usage": usage}) + b"\n\n")
        if mode != "no_done":
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


_HELP = {
    "ttft_ms": "milliseconds before the first token (after any capacity queueing)",
    "itl_ms": "milliseconds between two tokens of a stream",
    "tokens": "content tokens per answer (words w0 w1 ...)",
    "mode": "ok, or a fault: error_NNN, hang, reset, close, stall, stall_mid, disconnect, cut, no_done, "
    "malformed, error_event, garbage (see below)",
    "fail_after": "tokens sent before stall_mid / disconnect / cut / error_event strike",
    "retry_after_s": "the Retry-After header of error_429 / error_503 answers",
    "model": "the model name to answer with (default: echo the request's)",
    "prompt_ms_per_kchar": "extra TTFT per 1,000 prompt characters (prefill that grows with the prompt)",
    "capacity": "at most this many requests generate at once; the rest queue FIFO (0: unlimited)",
    "fail_pct": "share (0..1) of requests answered 500 before the first byte, every 1/share-th one",
    "error_body": "error_NNN modes: the body to answer with instead of an OpenAI-shaped error",
    "fault_count": "the mode applies to the next this many requests only, then ok (0: always)",
    "flap_ms": "alternate ok and the mode every this many ms, starting ok (0: no flapping)",
    "endpoints": "comma-separated OpenAI paths served (chat,completions,embeddings,responses,models); others 404",
    "prefill": "true: continue a trailing assistant message after its words; false: answer such a request 400",
    "ignore_usage": "true: streams carry no usage chunk even when the request asks for one",
}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fake_upstream",
        description="A fake OpenAI-compatible upstream with latency and fault knobs.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9001, help="port to listen on (default: %(default)s)")
    parser.add_argument("--name", default="fake", help="its name in logs and stats (default: %(default)s)")
    for f in dataclasses.fields(Behaviour):
        kind = {"float": float, "int": int, "str": str}.get(str(f.type).split(" ")[0], str)
        if f.name == "retry_after_s":
            kind = float
        if f.name == "endpoints":
            kind = lambda v: tuple(x for x in v.split(",") if x)  # noqa: E731  --endpoints chat,completions
        if f.name in ("prefill", "ignore_usage"):
            kind = lambda v: v.lower() in ("1", "true", "yes")  # noqa: E731  --prefill false
        parser.add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f"{_HELP[f.name]} (default: %(default)s)"
        )
    args = parser.parse_args()
    behaviour = Behaviour(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Behaviour)})

    async def run() -> None:
        up = await FakeUpstream(behaviour, name=args.name, host=args.host, port=args.port).start()
        print(f"fake upstream {args.name} on {up.url}", flush=True)
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())


if __name__ == "__main__":
    main()
