"""Hot reload: on file change, on SIGHUP and on POST /admin/reload.

A reload builds a complete new Runtime and swaps one reference, applying its live limits at that
moment (`Live.swap`); a policy that fails validation or its build is rejected with a logged error
and a metric, and the old one stays with every limit as it was. Requests in flight keep the
Runtime they started with.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

from ..observe.metrics import Metrics
from ..process.control import ASKED_BECAUSE
from .policy import Policy, PolicyError, read_policy
from .runtime import Runtime

__all__ = ["Live", "Reloader"]

log = logging.getLogger("gateway.reload")


class Live:
    """Holds the Runtime in force. Read `.runtime` once per request.

    `activate` puts a built runtime's limits in force on what outlives it (the backends' state,
    the stores, the admission gate): called once per runtime, for the first here and for each
    later one at its `swap`."""

    __slots__ = ("runtime", "_activate")

    def __init__(self, runtime: Runtime, activate: Callable[[Runtime], None]) -> None:
        self._activate = activate
        activate(runtime)
        self.runtime = runtime

    def swap(self, runtime: Runtime) -> None:
        """Put a newly built runtime in force: its limits apply and the next request reads it, at
        one moment (no await between)."""
        self._activate(runtime)
        self.runtime = runtime


class Reloader:
    """Loads a policy file into a new Runtime and swaps it in; watches the file and SIGHUP."""

    def __init__(
        self,
        path: Path | None,
        live: Live,
        build: Callable[[Policy, int], Runtime],
        metrics: Metrics,
        on_swap: Callable[[Runtime], Awaitable[None]] | None = None,
        source: str | None = None,
        loaded: bytes | None = None,
    ) -> None:
        self.path = path
        self.source = source or str(path)  # what errors and logs call it (a worker reads the supervisor's copy)
        self.live = live
        self.build = build
        self.metrics = metrics
        self.on_swap = on_swap
        self._lock = asyncio.Lock()
        # The digest of the bytes the policy in force was read from (`loaded`), not of the file
        # now: a save during the start is a change the watcher sees.
        self._digest = hashlib.sha256(loaded).hexdigest() if loaded is not None else (_digest(path) if path else None)
        self._tasks: set[asyncio.Task[None]] = set()

    async def reload(self, trigger: str, *, if_changed: bool = False) -> tuple[bool, str]:
        """Reload from the file; (True, "") on success, (False, why) when the old policy stays.

        `if_changed`: only when the file's bytes differ from those the policy in force was read
        from (else (True, "") with nothing done): a worker of `--workers N` catching up, once its
        control socket is up, on a reload fanned out while it was starting."""
        # Asked over the control channel (a worker, by its supervisor): the supervisor's reason
        # (SIGHUP, a file change, a replica's announcement, a rollback...) names it, not the handler's.
        trigger = ASKED_BECAUSE.get() or trigger
        if self.path is None:
            return False, "the gateway was started without a policy file"
        async with self._lock:
            if if_changed and await asyncio.to_thread(_digest, self.path) == self._digest:
                return True, ""
            try:
                policy, data = await asyncio.to_thread(read_policy, self.path, self.source)
                runtime = self.build(policy, self.live.runtime.generation + 1)
            except (PolicyError, ValueError) as exc:
                self.metrics.policy_reloads.labels("error").inc()
                log.error("policy reload (%s) rejected, keeping generation %d: %s", trigger, self.live.runtime.generation, exc)
                return False, str(exc)
            # The digest of what was parsed: a save during the build is a change the watcher sees
            # (a second read here took its digest for the one in force).
            self._digest = hashlib.sha256(data).hexdigest()
            self.live.swap(runtime)
            self.metrics.policy_reloads.labels("ok").inc()
            log.info("policy reloaded (%s): generation %d from %s", trigger, runtime.generation, self.source)
            if self.on_swap is not None:
                await self.on_swap(runtime)
            return True, ""

    async def watch(self, interval_s: float | None = None) -> None:
        """Poll the file (cheap: a stat, and a hash only when the stat changed) until cancelled.

        The policy in force decides each poll (as the supervisor of `--workers N` does): a reload
        that sets `reload.watch: false` stops the reloads on a change, one that sets a new
        `reload.interval_ms` sets the pace. `interval_s`: the first wait (None: the policy's)."""
        assert self.path is not None
        last = _stat(self.path)
        wait = interval_s
        while True:
            await asyncio.sleep(self.live.runtime.policy.reload.interval_ms / 1000 if wait is None else wait)
            wait = None
            if not self.live.runtime.policy.reload.watch:
                continue  # until a reload by SIGHUP or /admin/reload puts `watch: true` back in force
            now = _stat(self.path)
            if now == last:
                continue
            last = now
            if now is not None and _digest(self.path) != self._digest:
                await self.reload("file change")

    def install_sighup(self) -> bool:
        """Reload on SIGHUP (main thread only; False where signals are not available)."""
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
            return True
        except (NotImplementedError, RuntimeError, ValueError):
            return False

    def remove_sighup(self) -> None:
        try:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
        except (NotImplementedError, RuntimeError, ValueError):
            pass

    def _on_sighup(self) -> None:
        task = asyncio.get_running_loop().create_task(self._reload_quietly("SIGHUP"))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reload_quietly(self, trigger: str) -> None:
        await self.reload(trigger)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _stat(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
