"""A fake vLLM replica with a prefix (KV) cache, a batch limit and vLLM's Prometheus gauges, for
the prefix-affinity tests and bench/affinity.py.

Run it as its own process: `python -m tests.fake_replica --port 9101 [options]`, or in-process
with `runner, port = await start(port=0, capacity=2)` (the replica object is
`runner.app[REPLICA]`), or `await FakeReplica(...).start()`.

The model (what an external acceptance check also assumes; keep them in step):

- prompt text: each message's role + content, concatenated (a content that is not a string,
  e.g. a list of parts, is json.dumps'ed);
- the text is cut into blocks of `block_chars`; block i's key is blake2b(key of block i-1 +
  block i's text) (a chained hash, so a key names the whole prefix up to its block's end); only
  full blocks have keys;
- the cached prefix is the longest run of leading block keys present in an LRU of `cache_blocks`
  blocks (the lookup touches the keys it matched); after prefill every full block is inserted;
- at most `capacity` requests are served at once, the others wait FIFO (an asyncio.Semaphore);
  the lookup happens when a request gets its slot;
- TTFT = queue wait + `base_ms` + `prefill_ms_per_kchar` x uncached characters / 1000; then
  `tokens` tokens (or max_tokens, if fewer) `itl_ms` apart; the slot is held until the last one.

Endpoints: POST /v1/chat/completions (JSON, or SSE with stream: true, OpenAI chunk format,
`data: [DONE]` at the end, a usage chunk with stream_options.include_usage), GET /v1/models,
GET /health, GET /metrics (vllm:num_requests_running, vllm:num_requests_waiting (the real queue
+ `report_waiting`), vllm:gpu_cache_usage_perc and vllm:kv_cache_usage_perc (blocks used / cache
size), each with a model_name label; 500 with `fail_metrics`), GET /stats (JSON: requests,
prompt_chars, cached_chars, peak_running, peak_waiting, metrics_scrapes, and the current running,
waiting, cache_blocks_used), POST /reset (empties the cache, zeroes the stats).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tests.servers import serve_app, serve_for

__all__ = ["Options", "FakeReplica", "REPLICA", "prompt_text", "block_keys", "start"]


@dataclass
class Options:
    block_chars: int = 1024  # characters per KV block
    cache_blocks: int = 30  # blocks the prefix cache holds (LRU)
    capacity: int = 4  # requests served at once; the rest wait FIFO
    base_ms: float = 20.0  # TTFT floor (after any queueing)
    prefill_ms_per_kchar: float = 40.0  # TTFT per 1,000 uncached prompt characters
    tokens: int = 8  # tokens per answer (fewer if max_tokens says so)
    itl_ms: float = 5.0  # between two tokens
    report_waiting: int = 0  # extra requests /metrics claims are queued (a replica busy with others)
    fail_metrics: bool = False  # /metrics answers 500
    model: str = "m"  # listed by /v1/models, and the model_name label of /metrics
    name: str = "replica"


_HELP = {
    "block_chars": "characters per KV-cache block",
    "cache_blocks": "blocks the prefix cache holds (LRU)",
    "capacity": "requests served at once; the others wait FIFO",
    "base_ms": "TTFT after any queueing, before prefill",
    "prefill_ms_per_kchar": "TTFT per 1,000 uncached prompt characters",
    "tokens": "tokens per answer (max_tokens may ask fewer)",
    "itl_ms": "milliseconds between two tokens",
    "report_waiting": "extra requests that /metrics reports as waiting",
    "fail_metrics": "/metrics answers 500",
    "model": "the model /v1/models lists and /metrics labels",
    "name": "its name in ids and logs",
}


def prompt_text(messages: Any) -> str:
    """Each message's role + content, concatenated (non-string content json-dumped)."""
    parts: list[str] = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            parts.append(json.dumps(m))
            continue
        role = m.get("role", "")
        content = m.get("content")
        parts.append(role if isinstance(role, str) else json.dumps(role))
        parts.append(content if isinstance(content, str) else json.dumps(content))
    return "".join(parts)


def block_keys(text: str, block_chars: int) -> list[bytes]:
    """The chained keys of the text's full blocks."""
    keys: list[bytes] = []
    prev = b""
    for i in range(len(text) // block_chars):
        block = text[i * block_chars : (i + 1) * block_chars]
        prev = hashlib.blake2b(prev + block.encode("utf-8"), digest_size=16).digest()
        keys.append(prev)
    return keys


@dataclass
class Stats:
    requests: int = 0
    prompt_chars: int = 0
    cached_chars: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    metrics_scrapes: int = 0  # GET /metrics answered (or failed), e.g. a gateway's load scrapes


def _error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


class FakeReplica:
    """One replica. `url` is its OpenAI base URL (…/v1) once started."""

    def __init__(self, options: Options | None = None, **changes: Any) -> None:
        self.options = dataclasses.replace(options or Options(), **changes)
        self.cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.stats = Stats()
        self.running = 0
        self.waiting = 0
        self._sem: asyncio.Semaphore | None = None  # made on the serving loop
        self._runner: web.AppRunner | None = None
        self.host = "127.0.0.1"
        self.port = 0
        self._seq = 0
        self.app = web.Application()
        self.app[REPLICA] = self
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/stats", self._stats),
                web.post("/reset", self._reset),
            ]
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> "FakeReplica":
        self._sem = asyncio.Semaphore(self.options.capacity)
        self._runner, self.port = await serve_app(self.app, host, port)
        self.host = host
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- the cache ---------------------------------------------------------------------------

    def lookup(self, keys: list[bytes]) -> int:
        """How many leading blocks are cached; touches the ones matched."""
        n = 0
        for k in keys:
            if k not in self.cache:
                break
            self.cache.move_to_end(k)
            n += 1
        return n

    def insert(self, keys: list[bytes]) -> None:
        for k in keys:
            self.cache[k] = None
            self.cache.move_to_end(k)
        while len(self.cache) > self.options.cache_blocks:
            self.cache.popitem(last=False)

    def reset(self) -> None:
        self.cache.clear()
        self.stats = Stats(peak_running=self.running, peak_waiting=self.waiting)

    def stats_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.stats),
            "running": self.running,
            "waiting": self.waiting,
            "cache_blocks_used": len(self.cache),
            "cache_blocks": self.options.cache_blocks,
            "name": self.options.name,
        }

    # -- handlers ----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.options.model, "object": "model", "created": 0, "owned_by": "fake-replica"}
        return web.json_response({"object": "list", "data": [model]})

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats_dict())

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"ok": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        self.stats.metrics_scrapes += 1
        if self.options.fail_metrics:
            return web.Response(status=500, text="metrics failed (fail_metrics)\n")
        label = '{model_name="%s"}' % self.options.model.replace("\\", "\\\\").replace('"', '\\"')
        usage = len(self.cache) / self.options.cache_blocks if self.options.cache_blocks else 0.0
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", self.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", self.waiting + self.options.report_waiting),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.", usage),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
        ]
        lines: list[str] = []
        for name, help_, value in gauges:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{label} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            return _error(400, f"request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return _error(400, "'messages' must be a non-empty list", code="invalid_value")
        o = self.options
        n = o.tokens
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                n = min(n, v)
        text = prompt_text(messages)
        keys = block_keys(text, o.block_chars)
        model = body.get("model") if isinstance(body.get("model"), str) else o.model
        stream = bool(body.get("stream"))
        self._seq += 1
        rid = f"chatcmpl-{o.name}-{self._seq}"
        created = int(time.time())
        self.stats.requests += 1

        resp: web.StreamResponse | None = None
        if stream:  # headers at once, as vLLM's streaming response does; content once prefill is done
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)

        assert self._sem is not None
        if self._sem.locked():  # every slot taken (or others already queued): wait in line
            self.waiting += 1
            self.stats.peak_waiting = max(self.stats.peak_waiting, self.waiting)
            try:
                await self._sem.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()  # free slot: returns at once
        try:
            self.running += 1
            self.stats.peak_running = max(self.stats.peak_running, self.running)
            t_slot = time.monotonic()
            cached_blocks = self.lookup(keys)
            cached = cached_blocks * o.block_chars
            uncached = len(text) - cached
            self.stats.prompt_chars += len(text)
            self.stats.cached_chars += cached
            first_at = t_slot + (o.base_ms + o.prefill_ms_per_kchar * uncached / 1000) / 1000
            await _sleep_until(first_at)
            self.insert(keys)  # prefill done: every full block is in the cache now
            words = [f"w{i} " for i in range(n)]
            usage = {
                "prompt_tokens": max(1, len(text) // 4),
                "completion_tokens": n,
                "total_tokens": max(1, len(text) // 4) + n,
                "prompt_tokens_details": {"cached_tokens": cached // 4},
            }
            if resp is None:
                await _sleep_until(first_at + max(0, n - 1) * o.itl_ms / 1000)
                msg = {"role": "assistant", "content": "".join(words)}
                obj = {
                    "id": rid, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": msg, "finish_reason": "length" if n < o.tokens else "stop", "logprobs": None}],
                    "usage": usage,
                }
                return web.json_response(obj)

            def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
                return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

            await resp.write(chunk({"role": "assistant", "content": ""}, None))
            for i, w in enumerate(words):
                if i:
                    await _sleep_until(first_at + i * o.itl_ms / 1000)
                await resp.write(chunk({"content": w}, None))
        finally:
            self.running -= 1
            self._sem.release()
        await resp.write(chunk({}, "length" if n < o.tokens else "stop"))
        opts = body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage"):
            obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [], "usage": usage}
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


REPLICA: web.AppKey[FakeReplica] = web.AppKey("fake_replica", FakeReplica)


async def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def start(port: int = 0, host: str = "127.0.0.1", **options: Any) -> tuple[web.AppRunner, int]:
    """Start a replica on this loop; returns its runner (`runner.app[REPLICA]` is the replica;
    `await runner.cleanup()` stops it) and its port."""
    rep = await FakeReplica(**options).start(port, host)
    assert rep._runner is not None
    return rep._runner, rep.port


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fake_replica",
        description="A fake vLLM replica with a prefix (KV) cache.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9101, help="port to listen on (0: any free one; default: %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="exit by itself after this long (default: %(default)s)")
    for f in dataclasses.fields(Options):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=_HELP[f.name])
            continue
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        parser.add_argument(flag, type=kind, default=f.default, help=f"{_HELP[f.name]} (default: %(default)s)")
    args = parser.parse_args()
    opts = Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})

    serve_for(lambda: FakeReplica(opts).start(args.port, args.host), args.max_seconds,
              lambda rep: f"fake replica {opts.name} on {rep.url} (exits by itself after {args.max_seconds:g} s)")


if __name__ == "__main__":
    main()
