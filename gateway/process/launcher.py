"""Run a local backend as a child process: start it, wait until healthy, restart it if it dies, stop it.

The gateway never imports torch: the model lives in ``python -m local_backend serve``, a child
process this module supervises. Nothing from ``local_backend`` is imported here.

Whatever answers the child's port is checked to be that child: each launch gets a random token
in the child's environment, and only a /healthz answer that proves it counts (launch_proof.py).
A worker follows the children another process launched with `launched.watch_launched`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from ..config.policy import LaunchPolicy
from .launch_proof import HEALTH_TOKEN_ENV, check as _check, other_answers as _other_answers

__all__ = ["HEALTH_TOKEN_ENV", "NOT_ANSWERING", "ChildBackend", "Children", "LaunchError", "LaunchSpec", "LaunchState"]

log = logging.getLogger("gateway.launcher")

_POLL_INTERVAL_S = 0.2
_STOP_GRACE_S = 5.0
_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 30.0
_STABLE_AFTER_S = 60.0  # a child that ran this long resets the restart backoff
_TAIL_LINES = 20
# Once ready, the child's /healthz is checked every _HEALTH_EVERY_S; after _HEALTH_FAILURES failed
# checks in a row (no 200 with the launch's proof within _HEALTH_TIMEOUT_S) it is killed and
# restarted: a hung engine (alive, answering nothing) would otherwise hold its port for good. A
# hung child is caught within about 12 s. No stricter: a kill cuts every request in flight, and a
# loaded but working server answers at once (it serves /healthz from its event loop, the engine
# runs in a thread of its own).
_HEALTH_EVERY_S = 1.0
_HEALTH_TIMEOUT_S = 3.0
_HEALTH_FAILURES = 3
# Why a launched model that was up is not ready now while it still runs: the same words from the
# launching process (which restarts it) and from a worker (which only sees its /healthz fail).
NOT_ANSWERING = "the model stopped answering its health check (/healthz)"


class LaunchError(RuntimeError):
    """The child exited or did not become healthy in time. `summary`: why, in one line (the
    message itself adds the command and the child's last stderr lines)."""

    def __init__(self, message: str, summary: str | None = None) -> None:
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]


@dataclass(frozen=True, slots=True)
class LaunchState:
    """Where one launched backend stands: ready, starting, or failed and waiting to try again.

    `failure`: why the last start failed or the child exited (one line; None while it simply
    starts or is ready); `retry_at`: when the next try starts (time.monotonic()); `failures`:
    failed starts and exits in a row; `health_token`: the running launch's (see the module's doc)."""

    ready: bool
    failure: str | None = None
    retry_at: float = 0.0
    failures: int = 0
    # The running launch's health token (see the module's doc): how a worker, which polls the
    # model's /healthz itself, tells it from another process on its port. Not a part of the state.
    health_token: str | None = field(default=None, repr=False, compare=False)

    def retry_in_s(self) -> float:
        return max(0.0, self.retry_at - time.monotonic())

    def describe(self) -> str:
        """One line: ready, starting, or `could not be launched: <why>; retrying in N s`."""
        if self.ready:
            return "ready"
        if self.failure is None:
            return "starting"
        wait = self.retry_in_s()
        return f"could not be launched: {self.failure}; " + (f"retrying in {wait:.0f} s" if wait >= 0.5 else "retrying now")

    def to_json(self) -> dict[str, Any]:
        """For the control socket (the supervisor tells its workers): times relative, so no clock is
        shared. It carries the health token: the control socket is the gateway's own (mode 0700)."""
        data: dict[str, Any] = {
            "ready": self.ready, "failure": self.failure, "retry_in_s": round(self.retry_in_s(), 3), "failures": self.failures,
        }  # fmt: skip
        if self.health_token is not None:
            data["health_token"] = self.health_token
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "LaunchState":
        failure = data.get("failure")
        retry_in = data.get("retry_in_s")
        token = data.get("health_token")
        return cls(
            ready=bool(data.get("ready")),
            failure=str(failure) if failure else None,
            retry_at=time.monotonic() + (float(retry_in) if isinstance(retry_in, (int, float)) else 0.0),
            failures=int(data.get("failures") or 0),
            health_token=token if isinstance(token, str) and token else None,
        )


def _ignore(_state: LaunchState) -> None:
    pass


class ChildBackend:
    """Starts ``python -m local_backend serve ...`` as a child process, waits until its /healthz is
    200 with the proof of this launch's token, restarts it if it dies, stops it on shutdown."""

    def __init__(
        self,
        name: str,
        url: str,
        model: str,
        *,
        quantize: str = "auto",
        device: str = "auto",
        threads: int | None = None,
        default_temperature: float | None = None,
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
        # An IPv6 literal keeps its brackets in a URL (`http://::1:8001/` is no URL at all).
        self.where = f"{f'[{self.host}]' if ':' in self.host else self.host}:{self.port}"
        self.health_url = f"http://{self.where}/healthz"
        self.startup_timeout_s = startup_timeout_s
        self.command = [
            python, "-m", "local_backend", "serve",
            "--model", model,
            "--host", self.host,
            "--port", str(self.port),
            "--quantize", quantize,
            "--device", device,
            *(["--threads", str(threads)] if threads else []),
            # The gateway's cache decides by this value: the server must not pick its own.
            *(["--default-temperature", str(default_temperature)] if default_temperature is not None else []),
            *extra_args,
        ]  # fmt: skip
        self._prefix = log_prefix or f"[{name}]"
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._started_at = 0.0
        self._stopping = False
        self._token: str | None = None  # this launch's health token, new for each start

    @property
    def health_token(self) -> str | None:
        """The running launch's health token (None before the first start)."""
        return self._token

    @property
    def running(self) -> bool:
        """True while the child process is alive (healthy or still loading)."""
        return self._proc is not None and self._proc.returncode is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        """Spawn the child and wait until its /healthz answers 200 with the proof of this launch's
        token; raise LaunchError if it cannot (it exits, times out, or something else answers)."""
        if self.running:
            return
        self._stopping = False
        self._check_port_free()
        await self._end_pump(1.0)  # the last child's: done once its stderr closed
        self._tail.clear()
        self._token = secrets.token_urlsafe(32)
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

    async def supervise(self, on_change: Callable[[LaunchState], None] = _ignore) -> None:
        """Run until cancelled or stopped: start the child unless it runs, and whenever a start
        fails, the child dies, or it stops answering /healthz (then it is killed), back off
        (exponentially, capped) and start it again, so a backend whose port was taken comes up
        once it is free. `on_change` hears each change (ready; or failed, why, and when the next
        try is)."""
        backoff = _BACKOFF_START_S
        failures = 0
        while not self._stopping:
            if not self.running:
                try:
                    await self.start()
                except LaunchError as exc:
                    failures += 1
                    log.error("%s could not be launched (try %d; next in %.1f s): %s", self._prefix, failures, backoff, exc)
                    on_change(LaunchState(False, exc.summary, time.monotonic() + backoff, failures))
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _BACKOFF_MAX_S)
                    continue
            on_change(LaunchState(True, health_token=self._token))
            proc = self._proc
            assert proc is not None
            hung = await self._until_exit_or_hung(proc)
            if self._stopping:
                return
            if time.monotonic() - self._started_at >= _STABLE_AFTER_S:
                backoff, failures = _BACKOFF_START_S, 0
            failures += 1
            retry_at = time.monotonic() + backoff
            if hung is not None:
                log.warning(
                    "%s pid %d failed %d health checks in a row (%s); killing it, restarting in %.1f s",
                    self._prefix, proc.pid, _HEALTH_FAILURES, self.health_url, backoff,
                )  # fmt: skip
                # Not ready from now on, not once it is gone: a hung child may take the grace period.
                on_change(LaunchState(False, hung, retry_at, failures))
                await self._terminate()
            else:
                if self._pump is not None:  # its last lines explain the exit
                    await asyncio.wait({self._pump}, timeout=1.0)
                log.warning("%s exited with code %s; restarting in %.1f s", self._prefix, proc.returncode, backoff)
                on_change(LaunchState(False, self._summary(f"exited with code {proc.returncode}"), retry_at, failures))
            await asyncio.sleep(max(0.0, retry_at - time.monotonic()))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def stop(self) -> None:
        """SIGTERM, wait a few seconds, then SIGKILL. Safe to call more than once."""
        self._stopping = True
        await self._terminate()

    # ---- internals ---------------------------------------------------------------------------

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        env["LOCAL_BACKEND_PARENT_PID"] = str(os.getpid())  # the child exits when we do (Linux)
        if self._token is not None:
            env[HEALTH_TOKEN_ENV] = self._token  # its /healthz proves it is this launch's child
        # In a source checkout, local_backend/ sits next to gateway/: make it importable.
        root = Path(__file__).resolve().parent.parent
        if (root / "local_backend" / "__main__.py").is_file():
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
        return env

    def _check_port_free(self) -> None:
        """Refuse to start when something else holds the port, before spawning a child that could
        not listen (the health checks would not take the holder for the model: see `_other`)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            if probe.connect_ex((self.host, self.port)) == 0:
                where = f"{self.host}:{self.port} is already in use (another process listens there)"
                raise LaunchError(f"backend {self.name!r}: {where}", where)

    async def _forward_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:
                # A line over the reader's limit (64 KiB), dropped. Read on: a pump that stopped
                # here would leave the pipe to fill up, and the child would block on its next write.
                log.info("%s (a stderr line too long to log, skipped)", self._prefix)
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if text:
                self._tail.append(text)
                log.info("%s %s", self._prefix, text)

    async def _end_pump(self, wait_s: float) -> None:
        """Give the stderr pump up to `wait_s` to read the child's last lines, then end it; a
        failure of its own is logged, not lost."""
        pump, self._pump = self._pump, None
        if pump is None:
            return
        if not (await asyncio.wait({pump}, timeout=wait_s))[0]:
            pump.cancel()
            await asyncio.wait({pump})  # not `await pump`: a cancellation of ours must propagate
        if not pump.cancelled() and (exc := pump.exception()) is not None:
            log.error("%s stderr could not be read: %s", self._prefix, exc, exc_info=exc)

    async def _wait_healthy(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        timeout = aiohttp.ClientTimeout(total=2.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                if proc.returncode is not None:
                    if self._pump is not None:  # let the last lines in
                        await asyncio.wait({self._pump}, timeout=1.0)
                    raise self._error(f"exited with code {proc.returncode} before becoming healthy")
                found = await _check(session, self.health_url, self._token)
                if found == "ok":
                    return
                if found == "other":
                    # Our child answers with the proof from its first 200: a 200 without it comes
                    # from another process (it may have taken the port since the look before the
                    # spawn, and our child then cannot listen). Not the model: stop and say so.
                    raise self._error(self._other())
                if time.monotonic() >= deadline:
                    raise self._error(f"not healthy after {self.startup_timeout_s:.0f} s")
                await asyncio.sleep(_POLL_INTERVAL_S)

    async def _until_exit_or_hung(self, proc: asyncio.subprocess.Process) -> str | None:
        """Wait while the ready child runs: None once it exited; once it failed _HEALTH_FAILURES
        health checks in a row while still running (the caller kills it), why: NOT_ANSWERING (hung),
        or, when the last check got a 200 without this launch's proof, that something else answers."""
        exited = asyncio.ensure_future(proc.wait())
        failed = 0
        other = False  # the last check's answer came from another process (logged once in a row)
        timeout = aiohttp.ClientTimeout(total=_HEALTH_TIMEOUT_S)
        try:
            async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as session:
                while True:
                    if (await asyncio.wait({exited}, timeout=_HEALTH_EVERY_S))[0]:
                        return None
                    # A child that exits meanwhile fails this check at once (its socket closes):
                    # the next round's wait then sees the exit, so an exit is never taken for a hang.
                    found = await _check(session, self.health_url, self._token)
                    if found == "other" and not other:
                        log.warning("%s pid %d: %s", self._prefix, proc.pid, self._other())
                    other = found == "other"
                    failed = 0 if found == "ok" else failed + 1
                    if failed >= _HEALTH_FAILURES and proc.returncode is None:
                        return self._other() if other else NOT_ANSWERING
        finally:
            exited.cancel()

    def _other(self) -> str:
        """Why a 200 from the port is not taken for the model: one line, naming the port."""
        return _other_answers(self.where)

    def _error(self, what: str) -> LaunchError:
        tail = "\n  ".join(self._tail) or "(no output)"
        message = f"backend {self.name!r} {what}\n command: {' '.join(self.command)}\n last stderr lines:\n  {tail}"
        return LaunchError(message, self._summary(what))

    def _summary(self, what: str) -> str:
        """`what` and the child's last stderr line, which usually says why (a taken port, an unknown model)."""
        last = self._tail[-1] if self._tail else ""
        return f"{what}: {last}" if last else what

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
        await self._end_pump(1.0)


# (name, url, launch policy): what a launched backend is; a change of any part restarts it.
LaunchSpec = tuple[str, str, LaunchPolicy]


class Children:
    """The launched backends of one policy: started, supervised, restarted on change, stopped.

    `on_change(name, state)` hears when one became ready, went away, or failed to start and
    when it is retried (in a single process: the backend's routing readiness and the reason its
    503s and /readyz give; in a supervisor: nothing, its workers ask `states()` through the
    control socket). Owned by whoever launches: the one gateway process, or the supervisor of
    `--workers N` (its workers only watch, see `watch_launched`)."""

    def __init__(self, on_change: Callable[[str, LaunchState], None]) -> None:
        self._tasks: dict[str, tuple[tuple[str, LaunchPolicy], asyncio.Task[None]]] = {}
        self._states: dict[str, LaunchState] = {}
        self._on_change = on_change

    def states(self) -> dict[str, LaunchState]:
        """Each launched backend's current state, by name."""
        return dict(self._states)

    async def reconcile(self, specs: Iterable[LaunchSpec]) -> None:
        """Start children new to this policy; stop those that left it or changed."""
        wanted = {name: (url, launch) for name, url, launch in specs}
        stale = [n for n, (spec, _) in self._tasks.items() if wanted.get(n) != spec]
        await self.stop(stale)
        for name, spec in wanted.items():
            if name not in self._tasks:
                self._set(name, LaunchState(False))  # not routed to until its /healthz answers
                task = asyncio.create_task(self._run(name, *spec), name=f"launch-{name}")
                task.add_done_callback(_log_failure)  # ends only when stopped, unless it fails
                self._tasks[name] = (spec, task)

    async def stop(self, names: list[str] | None = None) -> None:
        """Stop the named children (all by default) and wait until they exited."""
        tasks = [self._tasks.pop(n)[1] for n in (list(self._tasks) if names is None else names) if n in self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # a failure: logged by _log_failure

    def _set(self, name: str, state: LaunchState) -> None:
        self._states[name] = state
        self._on_change(name, state)

    async def _run(self, name: str, url: str, lp: LaunchPolicy) -> None:
        child = ChildBackend(
            name, url, lp.model, quantize=lp.quantize, device=lp.device, threads=lp.threads,
            default_temperature=lp.default_temperature, startup_timeout_s=lp.startup_timeout_s,
            extra_args=(*lp.server_args(), *lp.extra_args),
        )  # fmt: skip

        def changed(state: LaunchState) -> None:
            if state.ready:
                log.info("backend %s: local model %s is ready at %s", name, lp.model, url)
            self._set(name, state)

        try:
            await child.supervise(changed)
        finally:
            self._states.pop(name, None)
            self._on_change(name, LaunchState(False))
            await asyncio.shield(child.stop())


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("%s failed: %s", task.get_name(), exc, exc_info=exc)
