"""Running the app: one worker in this process, or N worker processes sharing the port."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

__all__ = ["run_worker", "setup_logging", "supervise_workers"]

log = logging.getLogger("gateway")

_CRASH_WINDOW_S = 5.0  # a worker dying this soon after its start counts as a crash loop
_MAX_QUICK_CRASHES = 5


async def _serve(policy: str, host: str, port: int, reuse_port: bool, access_log: bool) -> None:
    from aiohttp import web

    from .app import create_app

    app = create_app(policy, host)
    # handler_cancellation: a client that disconnects cancels its handler, so the upstream
    # request is abandoned at once and every slot is returned.
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


def setup_logging() -> None:
    """Log to stderr at $GATEWAY_LOG_LEVEL (INFO by default)."""
    logging.basicConfig(
        level=os.environ.get("GATEWAY_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_worker(policy: str, host: str, port: int, reuse_port: bool, access_log: bool) -> None:
    """Serve until SIGTERM/SIGINT, on uvloop when it is installed."""
    setup_logging()
    try:
        import uvloop

        uvloop.run(_serve(policy, host, port, reuse_port, access_log))
    except ImportError:  # uvloop is an optional extra
        asyncio.run(_serve(policy, host, port, reuse_port, access_log))


def supervise_workers(policy: str, host: str, port: int, workers: int, access_log: bool) -> int:
    """N processes share the port (SO_REUSEPORT); /metrics aggregates them through a shared dir.

    Signals are forwarded (SIGHUP reloads every worker); a worker that dies is restarted, unless
    workers keep dying right after start, which means the configuration cannot work."""
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    ctx = multiprocessing.get_context("spawn")
    procs: list[tuple[multiprocessing.process.BaseProcess, float]] = []
    stopping = False
    quick_crashes = 0

    def spawn() -> tuple[multiprocessing.process.BaseProcess, float]:
        p = ctx.Process(target=run_worker, args=(policy, host, port, True, access_log))
        p.start()
        return p, time.monotonic()

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        if sig in (signal.SIGTERM, signal.SIGINT):
            stopping = True
        for p, _ in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    procs.extend(spawn() for _ in range(workers))
    code = 0
    try:
        from prometheus_client import multiprocess

        while procs:
            for i, (p, started) in enumerate(list(procs)):
                p.join(timeout=0.2)
                if p.exitcode is None:
                    continue
                multiprocess.mark_process_dead(p.pid)
                if stopping:
                    procs.remove((p, started))
                    continue
                quick_crashes = quick_crashes + 1 if time.monotonic() - started < _CRASH_WINDOW_S else 0
                if quick_crashes >= _MAX_QUICK_CRASHES:
                    log.error("workers keep exiting right after start; giving up")
                    stopping, code = True, 1
                    forward(signal.SIGTERM, None)
                    procs.remove((p, started))
                    continue
                log.error("worker pid %s exited with %s; restarting it", p.pid, p.exitcode)
                procs[procs.index((p, started))] = spawn()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
