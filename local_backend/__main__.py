"""``python -m local_backend serve``: the OpenAI-compatible server over the local model.

The port opens at once and /healthz answers 503 {"status": "loading"} while the model loads in
a background thread (progress lines go to stderr); then 200. SIGTERM or SIGINT stops it.
Launched by a gateway, $LOCAL_BACKEND_HEALTH_TOKEN holds that launch's secret: /healthz proves it
(X-Health-Proof, see server.healthz), so the launcher tells this server from another on the port.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .models import ModelNotFound, check_model_name
from .server import HEALTH_TOKEN_ENV, BackendState, create_app, sampling_defaults

if TYPE_CHECKING:  # both import torch: at run time, only once the port is open
    from .boot import EngineSettings
    from .engine import Engine

log = logging.getLogger("local_backend")

_QUANTIZE = ("auto", "none", "int8", "w8a16", "w8a8", "int4")  # quantize.QUANTIZE_CHOICES, without importing torch here
_KERNELS = ("auto", "avx512_vnni", "avx2")  # llama.native.ISAS


def _non_negative_int(text: str) -> int:
    """argparse type for sizes where 0 means off."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def _positive_int(text: str) -> int:
    """argparse type for counts: 0 threads would silently mean "pick for me", so it is refused."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m local_backend", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over the OpenAI API")
    serve.add_argument("--model", default="smollm2-135m-instruct", help="registry name (smollm2-135m-instruct, tiny-random), model folder, or .gguf file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8001)
    serve.add_argument("--quantize", choices=_QUANTIZE, default="auto", help="auto: the measured best for the device")
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads per forward pass (default: picked per pass among 1, 2, 4, ..., cores - 1 and cores by live timings)",
    )
    serve.add_argument(
        "--kernel",
        choices=_KERNELS,
        default="auto",
        help="the int8 kernel build of w8a16/w8a8 on CPU (auto: the best this CPU runs; both give the same tokens)",
    )
    serve.add_argument("--kv-cache-mb", type=_positive_int, default=1024,
                       help="the running sequences' KV cache, at most (requests wait while it is full)")
    serve.add_argument("--prefix-cache-mb", type=_non_negative_int, default=256,
                       help="K/V of recently seen prompt prefixes, reused by prompts that start alike (0: off)")
    serve.add_argument("--prefix-block-tokens", type=_positive_int, default=16, help="the prefix cache's block, in tokens")
    serve.add_argument("--max-batch", type=int, default=16, help="sequences decoded together")
    serve.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    serve.add_argument("--served-name", default=None, help="the model id clients send (default: the model name)")
    serve.add_argument("--default-max-tokens", type=int, default=512, help="chat max_tokens when the request sets none")
    serve.add_argument("--max-tokens-cap", type=_positive_int, default=2048,
                       help="the most tokens one request generates: a larger max_tokens is clamped to it (finish_reason length)")
    serve.add_argument(
        "--default-temperature",
        type=_temperature,
        default=None,
        help="temperature when the request sets none (default: the model's generation config's when it samples, else 0: greedy)",
    )
    serve.add_argument(
        "--default-top-p",
        type=_top_p,
        default=None,
        help="top_p when the request sets none (default: the model's generation config's when it samples, else 1)",
    )
    return parser


def _temperature(text: str) -> float:
    """argparse type: a temperature the API accepts (0 to 2)."""
    value = float(text)
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2, not {text}")
    return value


def _top_p(text: str) -> float:
    """argparse type: a top_p the API accepts (above 0, at most 1)."""
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1, not {text}")
    return value


def _generation_config(model: str) -> dict[str, object] | None:
    """The model folder's generation_config.json (read as JSON: torch is not imported yet), or None.

    Registry names and .gguf files carry none here: they decode greedily unless told otherwise."""
    path = Path(model).expanduser() / "generation_config.json"
    if not (path.parent / "config.json").is_file() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s (sampling defaults from the command line or greedy): %s", path, exc)
        return None
    return data if isinstance(data, dict) else None


def _die_with_parent() -> None:
    """When a gateway launched us (it sets LOCAL_BACKEND_PARENT_PID), get SIGTERM if it dies (Linux)."""
    parent = os.environ.get("LOCAL_BACKEND_PARENT_PID")
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # the parent died before prctl took effect
        sys.exit("local_backend: the launching process is gone")


def _served_name(model: str) -> str:
    return model if "/" not in model and not model.endswith(".gguf") else Path(model).name


def _load_in_thread(settings: EngineSettings, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Engine]:
    """Build the engine on a daemon thread, so a SIGTERM during a load does not wait for it."""
    from .boot import build_engine  # imports torch: after the port is open

    future: asyncio.Future[Engine] = loop.create_future()

    def progress(line: str) -> None:
        log.info("%s", line)

    def loaded(engine: Engine) -> None:
        if not future.done():
            future.set_result(engine)

    def failed(error: BaseException) -> None:
        if not future.done():
            future.set_exception(error)

    def work() -> None:
        try:
            engine = build_engine(settings, progress)
        except BaseException as exc:  # noqa: BLE001 - reported to the awaiting coroutine
            loop.call_soon_threadsafe(failed, exc)
        else:
            loop.call_soon_threadsafe(loaded, engine)

    threading.Thread(target=work, name="local-backend-load", daemon=True).start()
    return future


async def _serve(args: argparse.Namespace) -> int:
    from .boot import EngineSettings

    defaults = sampling_defaults(args.default_temperature, args.default_top_p, _generation_config(args.model))
    state = BackendState(
        served_name=args.served_name or _served_name(args.model),
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        default_temperature=defaults.temperature,
        default_top_p=defaults.top_p,
        # Taken out of the environment: no process this one starts (the kernel build's compiler) inherits it.
        health_token=os.environ.pop(HEALTH_TOKEN_ENV, "") or None,
    )
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:  # e.g. the port is taken: one line (the launcher shows it as the reason)
        await runner.cleanup()
        where = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        # asyncio rewraps a bind error with the address in its text: the system's words are enough.
        code = exc.errno
        plain = code is not None and code > 0 and not isinstance(exc, socket.gaierror)
        why = os.strerror(code) if code is not None and plain else (exc.strerror or str(exc))
        print(f"local_backend: cannot listen on {where}: {why[:1].lower()}{why[1:]}", file=sys.stderr)
        return 1
    log.info("listening on http://%s:%d/v1 (model %s loading)", args.host, args.port, args.model)
    log.info("a request without temperature / top_p is decoded with %s", defaults.describe())

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    settings = EngineSettings(
        args.model, args.quantize, args.device, args.threads, args.max_batch, args.max_queue,
        kernel=None if args.kernel == "auto" else args.kernel, kv_cache_mb=args.kv_cache_mb, prefix_cache_mb=args.prefix_cache_mb,
        prefix_block_tokens=args.prefix_block_tokens,
    )
    load = _load_in_thread(settings, loop)
    stopping = asyncio.ensure_future(stop.wait())
    either: set[asyncio.Future[Any]] = {load, stopping}
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if load.done() and load.exception() is not None:
        state.load_error = f"{type(load.exception()).__name__}: {load.exception()}"
        log.error("loading %s failed: %s", args.model, state.load_error)
        code = 1
    elif load.done():
        state.engine = load.result()
        log.info("ready: serving %r", state.served_name)
        await stopping
    stopping.cancel()
    log.info("shutting down")
    if state.engine is not None:
        await asyncio.to_thread(state.engine.close)  # pending requests end with 503
    await runner.cleanup()
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m local_backend``."""
    args = _parser().parse_args(argv)
    _die_with_parent()
    try:
        check_model_name(args.model)
    except ModelNotFound as exc:
        _parser().error(str(exc))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for bound in ("max_batch", "max_queue", "port", "default_max_tokens"):
        if getattr(args, bound) < (0 if bound == "port" else 1):
            _parser().error(f"--{bound.replace('_', '-')} must be positive")
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
