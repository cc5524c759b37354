"""CLI: `gateway serve`, `gateway check`, `gateway hash-key`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("gateway")


def _policy_path(arg: str | None) -> str:
    path = arg or os.environ.get("GATEWAY_POLICY")
    if not path:
        sys.exit("gateway: no policy: pass --policy FILE or set GATEWAY_POLICY")
    return path


def cmd_check(args: argparse.Namespace) -> int:
    from .auth import hash_key  # noqa: F401  (keeps import cost of check low otherwise)
    from .policy import PolicyError, load_policy

    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"{exc.source}: {problem}", file=sys.stderr)
        print(f"{exc.source}: {len(exc.problems)} error(s)", file=sys.stderr)
        return 1
    missing = [
        f"backends.{name}.api_key_env: environment variable {b.api_key_env} is not set here"
        for name, b in policy.backends.items()
        if b.api_key_env and not os.environ.get(b.api_key_env)
    ]
    for line in missing:
        print(f"{args.file}: warning: {line}", file=sys.stderr)
    print(
        f"{args.file}: ok ({len(policy.backends)} backends, {len(policy.public_models())} models, "
        f"{len(policy.tenants)} tenants)"
    )
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    from .auth import hash_key

    print(hash_key(args.key))
    return 0


async def _serve(policy: str, host: str, port: int, reuse_port: bool, access_log: bool) -> None:
    from aiohttp import web

    from .app import create_app

    app = create_app(policy)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=log if access_log else None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    await site.start()
    log.info("gateway (pid %d) serving on http://%s:%d with policy %s", os.getpid(), host, port, policy)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("gateway (pid %d) shutting down", os.getpid())
        await runner.cleanup()


def _run_worker(policy: str, host: str, port: int, reuse_port: bool, access_log: bool) -> None:
    _setup_logging()
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # uvloop is an optional extra
        runner = asyncio.run
    runner(_serve(policy, host, port, reuse_port, access_log))


def cmd_serve(args: argparse.Namespace) -> int:
    policy = _policy_path(args.policy)
    from .policy import PolicyError, load_policy

    try:
        load_policy(policy)  # fail fast, with every error, before binding anything
    except PolicyError as exc:
        print(exc, file=sys.stderr)
        return 1
    if args.workers <= 1:
        _run_worker(policy, args.host, args.port, False, args.access_log)
        return 0
    return _supervise_workers(policy, args)


def _supervise_workers(policy: str, args: argparse.Namespace) -> int:
    """N processes share the port (SO_REUSEPORT); /metrics aggregates them through a shared dir."""
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    workers: list[multiprocessing.process.BaseProcess] = []
    stopping = False

    def spawn() -> multiprocessing.process.BaseProcess:
        p = ctx.Process(target=_run_worker, args=(policy, args.host, args.port, True, args.access_log), daemon=False)
        p.start()
        return p

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for p in workers:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    workers.extend(spawn() for _ in range(args.workers))
    try:
        while workers:
            for i, p in enumerate(list(workers)):
                p.join(timeout=0.5)
                if p.exitcode is None:
                    continue
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(p.pid)
                if stopping:
                    workers.remove(p)
                else:
                    log.error("worker pid %s exited with %s; restarting it", p.pid, p.exitcode)
                    workers[i] = spawn()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def _setup_logging() -> None:
    logging.basicConfig(
        level=os.environ.get("GATEWAY_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="Latency-aware OpenAI-compatible LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--policy", help="policy YAML (default: $GATEWAY_POLICY)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--access-log", action="store_true", help="log every request (off: it costs latency)")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check", help="validate a policy file; exit 1 on error")
    check.add_argument("file")
    check.set_defaults(func=cmd_check)
    hk = sub.add_parser("hash-key", help="print the sha256 to put in a policy's key_sha256 list")
    hk.add_argument("key")
    hk.set_defaults(func=cmd_hash_key)
    args = parser.parse_args(argv)
    _setup_logging()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
