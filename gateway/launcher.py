"""Run a local backend as a child process: start it, wait until healthy, restart it if it dies, stop it.

The gateway never imports torch: the model lives in ``python -m local_backend serve``, a child
process this module supervises. Nothing from ``local_backend`` is imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from .policy import LaunchPolicy

__all__ = ["ChildBackend", "Children", "LaunchError", "LaunchSpec", "watch_launched"]

log = logging.getLogger("gateway.launcher")

_POLL_INTERVAL_S = 0.2
_STOP_GRACE_S = 5.0
_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 30.0
_STABLE_AFTER_S = 60.0  # a child that ran this long resets the restart backoff
_TAIL_LINES = 20


class LaunchError(RuntimeError):
    """The child exited or did not become healthy in time."""


class ChildBackend:
    """Starts ``python -m local_backend serve ...`` as a child process, waits until /healthz is 200,
    restarts it if it dies, stops it on shutdown."""

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        *,
        quantize: str = "auto",
        device: str = "auto",
        threads: int | None = None,
        startup_timeout_s: float = 300.0,
        extra_args: Sequence[str] = (),
        python: str = sys.executable,
        log_prefix: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"backend {name!r}: a launched backend needs an http://host:port URL, not {url!r}")
        self.name = name
        self.host = parts.hostname
        self.port = parts.port or 80
        self.health_url = f"http://{self.host}:{self.port}/healthz"
        self.startup_timeout_s = startup_timeout_s
        self.command = [
            python, "-m", "local_backend", "serve",
            "--model", model,
            "--host", self.host,
            "--port", str(self.port),
            "--quantize", quantize,
            "--device", device,
            *(["--threads", str(threads)] if threads else []),
            *extra_args,
        ]  # fmt: skip
        self._prefix = log_prefix or f"[{name}]"
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._started_at = 0.0
        self._stopping = False

    @property
    def running(self) -> bool:
        """True while the child process is alive (healthy or still loading)."""
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Spawn the child and wait until /healthz answers 200; raise LaunchError if it cannot."""
        if self.running:
            return
        self._stopping = False
        self._check_port_free()
        self._tail.clear()
        self._proc = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=self._child_env(),
            start_new_session=True,  # a Ctrl-C to the gateway's terminal reaches the child through stop(), once
        )
        self._started_at = time.monotonic()
        self._pump = asyncio.create_task(self._forward_stderr(self._proc), name=f"{self.name}-stderr")
        log.info("%s started pid %d: %s", self._prefix, self._proc.pid, " ".join(self.command))
        try:
            await self._wait_healthy(self._proc)
        except BaseException:
            await self._terminate()
            raise
        log.info("%s healthy after %.1f s", self._prefix, time.monotonic() - self._started_at)

    async def supervise(self) -> None:
        """Run until cancelled: whenever the child dies, back off (exponentially, capped) and restart it."""
        backoff = _BACKOFF_START_S
        while True:
            proc = self._proc
            if proc is not None:
                code = await proc.wait()
                if self._stopping:
                    return
                if time.monotonic() - self._started_at >= _STABLE_AFTER_S:
                    backoff = _BACKOFF_START_S
                log.warning("%s exited with code %s; restarting in %.1f s", self._prefix, code, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            if self._stopping:
                return
            try:
                await self.start()
            except LaunchError as exc:
                log.error("%s restart failed: %s", self._prefix, exc)

    async def stop(self) -> None:
        """SIGTERM, wait a few seconds, then SIGKILL. Safe to call more than once."""
        self._stopping = True
        await self._terminate()

    # ---- internals ---------------------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["LOCAL_BACKEND_PARENT_PID"] = str(os.getpid())  # the child exits when we do (Linux)
        # In a source checkout, local_backend/ sits next to gateway/: make it importable.
        root = Path(__file__).resolve().parent.parent
        if (root / "local_backend" / "__main__.py").is_file():
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        return env

    def _check_port_free(self) -> None:
        """Refuse to start when something else holds the port: its /healthz would fool the poll."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            if probe.connect_ex((self.host, self.port)) == 0:
                raise LaunchError(f"backend {self.name!r}: {self.host}:{self.port} is already in use")

    async def _forward_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            if text:
                self._tail.append(text)
                log.info("%s %s", self._prefix, text)

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if proc.returncode is not None:
                    if self._pump is not None:  # let the last lines in
                        await asyncio.wait({self._pump}, timeout=1.0)
                    raise self._error(f"exited with code {proc.returncode} before becoming healthy")
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.health_url) as resp:
                        if resp.status == 200:
                            return
                if time.monotonic() >= deadline:
                    raise self._error(f"not healthy after {self.startup_timeout_s:.0f} s")
                await asyncio.sleep(_POLL_INTERVAL_S)

    def _error(self, what: str) -> LaunchError:
        tail = "\n  ".join(self._tail) or "(no output)"
        return LaunchError(f"backend {self.name!r} {what}\n command: {' '.join(self.command)}\n last stderr lines:\n  {tail}")

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), _STOP_GRACE_S)
            except asyncio.TimeoutError:
                log.warning("%s did not stop in %.0f s; killing it", self._prefix, _STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if self._pump is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._pump, 1.0)
            self._pump = None


# (name, url, launch policy): what a launched backend is; a change of any part restarts it.
LaunchSpec = tuple[str, str, LaunchPolicy]


class Children:
    """The launched backends of one policy: started, supervised, restarted on change, stopped.

    `on_ready(name, ready)` hears when one became healthy or went away (in a single process, the
    backend's routing readiness; in a supervisor, a log line). Owned by whoever launches: the one
    gateway process, or the supervisor of `--workers N` (its workers only watch, see
    `watch_launched`)."""

    def __init__(self, on_ready: Callable[[str, bool], None]) -> None:
        self._tasks: dict[str, tuple[tuple[str, LaunchPolicy], asyncio.Task[None]]] = {}
        self._on_ready = on_ready

    async def reconcile(self, specs: Iterable[LaunchSpec]) -> None:
        """Start children new to this policy; stop those that left it or changed."""
        wanted = {name: (url, launch) for name, url, launch in specs}
        stale = [n for n, (spec, _) in self._tasks.items() if wanted.get(n) != spec]
        await self.stop(stale)
        for name, spec in wanted.items():
            if name not in self._tasks:
                self._on_ready(name, False)  # not routed to until its /healthz answers
                task = asyncio.create_task(self._run(name, *spec), name=f"launch-{name}")
                self._tasks[name] = (spec, task)

    async def stop(self, names: list[str] | None = None) -> None:
        """Stop the named children (all by default) and wait until they exited."""
        tasks = [self._tasks.pop(n)[1] for n in (list(self._tasks) if names is None else names) if n in self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, name: str, url: str, lp: LaunchPolicy) -> None:
        child = ChildBackend(
            name, url, lp.model, quantize=lp.quantize, device=lp.device, threads=lp.threads,
            startup_timeout_s=lp.startup_timeout_s, extra_args=lp.extra_args,
        )  # fmt: skip
        try:
            await child.start()
            self._on_ready(name, True)
            log.info("backend %s: local model %s is ready at %s", name, lp.model, url)
            await child.supervise()
        except LaunchError as exc:
            log.error("backend %s could not be launched: %s", name, exc)
        finally:
            self._on_ready(name, False)
            await asyncio.shield(child.stop())


_WATCH_READY_S = 1.0  # between polls of a ready launched backend
_WATCH_STARTING_S = 0.2  # between polls while it starts: traffic waits for this
_WATCH_FAILURES = 3  # failed polls in a row before a ready backend counts as gone


async def watch_launched(backends: Callable[[], Iterable[tuple[str, str, Callable[[bool], None]]]]) -> None:
    """In a worker: follow the readiness of the backends another process launched, by polling
    their /healthz (`backends()` yields name, base URL and a setter, read anew each round so it
    follows reloads). Runs until cancelled."""
    failures: dict[str, int] = {}
    ready: dict[str, bool] = {}
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as http:
        while True:
            current = list(backends())
            results = await asyncio.gather(*(_healthy(http, url) for _, url, _ in current))
            for (name, _, set_ready), ok in zip(current, results, strict=True):
                failures[name] = 0 if ok else failures.get(name, 0) + 1
                now = ok or (ready.get(name, False) and failures[name] < _WATCH_FAILURES)
                if now != ready.get(name):
                    log.info("backend %s: launched model %s", name, "ready" if now else "not ready")
                ready[name] = now
                set_ready(now)
            starting = any(not ready.get(name, False) for name, _, _ in current)
            await asyncio.sleep(_WATCH_STARTING_S if starting else _WATCH_READY_S)


async def _healthy(http: aiohttp.ClientSession, base_url: str) -> bool:
    parts = urlsplit(base_url)
    url = f"{parts.scheme}://{parts.netloc}/healthz"
    try:
        async with http.get(url) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return False
