"""What an HTTP server costs per request, before any gateway work: the floor under the request core.

    python bench/http_server.py [--duration 5] [--rounds 3]

The same POST (a chat body in, a 250-byte JSON answer out, keep-alive, wrk -c32) against four
servers that answer at once, each in a process of its own on core 0, wrk on core 1; CPU per
request of the server process from /proc. Medians over rounds whose order alternates:

- aiohttp's app: a route and a handler returning a `web.Response` with the five headers the
  gateway adds (as `gateway serve` answers, minus the gateway);
- the same with the router skipped (gateway/web/edge.py `_Dispatch`);
- aiohttp's low-level `web.Server` (no Application, no router);
- a bare asyncio protocol on httptools (the parser the upstream client uses), answering from a
  task per request as a handler would.

The difference between the first and the last is what a server of our own could save per request;
the gateway's whole cost per request is in `bench/gateway_overhead.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench._load import lua_post  # noqa: E402
from bench._procs import cpu_seconds, free_port, start, stop  # noqa: E402

ANSWER = (b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-test","choices":[{"index":0,'
          b'"message":{"role":"assistant","content":"Hello there, how are you?"},"finish_reason":"stop"}],'
          b'"usage":{"prompt_tokens":10,"completion_tokens":7,"total_tokens":17}}')
HEADERS = {"x-request-id": "6631eace0f869bf49604709a", "x-gateway-queue-ms": "0", "x-gateway-cache": "bypass",
           "x-gateway-backend": "up", "Server-Timing": "gateway;dur=0.61, queue;dur=0.00, total;dur=1.79"}
PATH = "/v1/chat/completions"
KINDS = {
    "app": "aiohttp app (router, web.Response)",
    "dispatch": "aiohttp app, plain route without the router",
    "lowlevel": "aiohttp low-level web.Server",
    "httptools": "asyncio protocol on httptools, a task each",
}


async def _serve(kind: str, port: int) -> None:
    import httptools
    from aiohttp import web

    from gateway.web.edge import _Dispatch

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=ANSWER, headers={**HEADERS, "Content-Type": "application/json"})

    loop = asyncio.get_running_loop()
    if kind == "httptools":
        head = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
        whole = f"HTTP/1.1 200 OK\r\n{head}Content-Type: application/json\r\nContent-Length: {len(ANSWER)}\r\n\r\n".encode() + ANSWER

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport, self.parser, self.body = transport, httptools.HttpRequestParser(self), bytearray()

            def data_received(self, data: bytes) -> None:
                self.parser.feed_data(data)

            def on_body(self, body: bytes) -> None:
                self.body += body

            def on_message_complete(self) -> None:
                self.body = bytearray()
                loop.create_task(self.answer())

            async def answer(self) -> None:
                self.transport.write(whole)

        await loop.create_server(Protocol, "127.0.0.1", port)
    elif kind == "lowlevel":
        await loop.create_server(web.Server(handler, access_log=None), "127.0.0.1", port)  # type: ignore[arg-type]
    else:
        app = web.Application()
        app.router.add_post(PATH, handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        server = runner.server
        assert server is not None
        if kind == "dispatch":
            server.request_handler = _Dispatch.of(app, server.request_handler)
        await loop.create_server(server, "127.0.0.1", port)
    await asyncio.Event().wait()


def _wrk(url: str, seconds: int, script: Path) -> int:
    out = subprocess.run(["taskset", "-c", "1", "wrk", "-t1", "-c32", f"-d{seconds}s", "-s", str(script), url],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]


def _measure(kind: str, seconds: int, script: Path) -> float:
    port = free_port()
    proc = start([os.path.abspath(__file__), "--serve", kind, str(port)], cpus="0")
    try:
        time.sleep(1.5)
        url = f"http://127.0.0.1:{port}{PATH}"
        _wrk(url, 1, script)  # warm-up
        c0 = cpu_seconds(proc.pid)
        n = _wrk(url, seconds, script)
        return (cpu_seconds(proc.pid) - c0) / n * 1e6
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", nargs=2, metavar=("KIND", "PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        import uvloop

        uvloop.run(_serve(args.serve[0], int(args.serve[1])))
        return
    script = Path(tempfile.mkdtemp(prefix="bench-http-")) / "post.lua"
    script.write_text(lua_post(b'{"model":"gpt-test","messages":[{"role":"user","content":"Say hello in one word."}],"max_tokens":16}'))
    runs: dict[str, list[float]] = {k: [] for k in KINDS}
    for i in range(args.rounds):
        for kind in (list(KINDS) if i % 2 == 0 else list(reversed(KINDS))):
            runs[kind].append(_measure(kind, args.duration, script))
    first = statistics.median(runs["app"])
    print(f"{'server, answering at once (wrk -c32, pinned)':48} {'CPU us/request':>15} {'vs app':>7}")
    for kind, label in KINDS.items():
        us = statistics.median(runs[kind])
        print(f"{label:48} {us:15.1f} {us / first:7.2f}")


if __name__ == "__main__":
    main()
