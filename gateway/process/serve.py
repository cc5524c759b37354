"""Running the app: one worker in this process, or a supervisor over N worker processes.

The supervisor of `--workers N` owns what must exist once per machine: the launched local models
(workers only route to them), the control socket through which a reload or an admin view reaches
every worker, and the policy-reload announcements between replicas (peers.py). Workers share the
port with SO_REUSEPORT.

Shutdown (SIGTERM): each worker turns /readyz to 503, keeps serving for `server.drain_delay_ms`,
closes its port, gives the requests in flight up to `server.shutdown_timeout_ms` (streams still
going then end with their endpoint's error event naming the shutdown), and exits; the supervisor
then stops the local models. SIGINT (Ctrl-C) does the same without the drain delay.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import multiprocess

from ..admin.relayed import SharedAdmin
from ..observe.log_lines import OneLineFormatter
from ..config.policy import Policy, PolicyError, read_policy
from ..config.reload import _digest, _stat
from ..store.connect import warn_over_budget
from ..web import api as web_api
from ..web.app import create_app
from ..web.drain import end_in_flight
from ..web.edge import EdgeRunner
from ..web.keys import DRAIN, LIVE, RELAY
from . import control
from .launcher import Children
from .peers import Peers
from .workers import WorkerInfo, worker_socket

__all__ = ["ListenError", "listen_problem", "run_worker", "setup_logging", "supervise_workers"]

log = logging.getLogger("gateway")

_CRASH_WINDOW_S = 5.0  # a worker dying this soon after its start counts as a crash loop
_MAX_QUICK_CRASHES = 5
_FANOUT_TIMEOUT_S = 10.0  # a worker's reload (policy parse, classifier load) well within this
# /admin/reload through a worker: the supervisor answers this much before the worker stops
# waiting (web/api.py's CONTROL_TIMEOUT_S, 15 s; then it answers 500), reload done or not. One
# queued behind another reload, then its fan-out (up to _FANOUT_TIMEOUT_S) and its announcement
# to the replicas (up to 5 s) can take longer, and go on and succeed.
_ANSWER_MARGIN_S = 3.0
ADMIN_TRIGGER = "/admin/reload"
# How long the requests cut at the shutdown timeout get to write their error endings (as the
# runner's own grace for a handler, below): a client that reads nothing does not hold the exit.
_CUT_GRACE_S = 1.0


class ListenError(RuntimeError):
    """The port could not be opened (taken, not permitted, an unknown host): one line says why."""


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _why(exc: OSError) -> str:
    """The system's words for the error: asyncio rewraps a bind error with the address in its text."""
    if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:
        text = exc.strerror or str(exc)
    else:
        text = os.strerror(exc.errno)
    return text[:1].lower() + text[1:]


def listen_problem(host: str, port: int, *, reuse_port: bool) -> str | None:
    """Why `host:port` cannot be listened on right now (e.g. another process holds it), or None.

    Binds and closes a socket per address, with the options asyncio's create_server sets, so a
    port held by another process is found before anything starts (launched models, workers)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return f"cannot listen on {_where(host, port)}: {_why(exc)}"
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(addr)
        except OSError as exc:
            return f"cannot listen on {_where(host, port)}: {_why(exc)}"
        # SO_REUSEPORT binds beside another process of ours that set it too (another gateway
        # with --workers): the kernel would then split the connections between the two.
        if reuse_port and _answers(family, addr):
            return f"cannot listen on {_where(host, port)}: address already in use (another process listens there)"
    return None


def _answers(family: int, addr: tuple[Any, ...]) -> bool:
    """Whether something accepts connections at `addr` (a wildcard address: on loopback)."""
    wildcard = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    target = (wildcard.get(addr[0], addr[0]), *addr[1:])
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(target) == 0


async def _serve(policy: str, host: str, port: int, reuse_port: bool, access_log: bool, worker: WorkerInfo | None) -> None:
    app = create_app(policy, host, worker=worker, access_log=access_log)
    # handler_cancellation: a client that disconnects cancels its handler, so the upstream
    # request is abandoned at once and every slot is returned. Shutdown waits for requests
    # itself (below); what is left after that gets one more second. EdgeRunner: the header
    # timeout, the per-address connection cap and JSON for malformed requests (web/edge.py).
    runner = EdgeRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port, backlog=2048)
    try:
        await site.start()
    except OSError as exc:  # taken since `listen_problem` looked: one line, not a traceback
        await runner.cleanup()
        raise ListenError(f"cannot listen on {_where(host, port)}: {_why(exc)}") from None
    log.info("gateway (pid %d) serving on http://%s:%d with policy %s", os.getpid(), host, port,
             worker.policy_source if worker is not None and worker.policy_source else policy)
    settle_heap()
    stop = asyncio.Event()
    how: list[int] = []

    def on_signal(sig: int) -> None:
        how.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    orphaned = None if worker is None else asyncio.create_task(_until_orphaned(worker.supervisor_pid, on_signal))
    try:
        await stop.wait()
        server = app[LIVE].runtime.server
        drain = app[DRAIN]
        drain.draining = True
        delay_s = server.drain_delay_ms / 1000 if how[0] == signal.SIGTERM else 0.0
        log.info("gateway (pid %d) draining: /readyz is 503; the port closes in %.1f s", os.getpid(), delay_s)
        await asyncio.sleep(delay_s)
        await site.stop()  # no new connections from here on
        # Nor new requests on those kept alive: a 503 to what arrives (edge._closing), and
        # the idle ones closed now (the others once their request is answered), as aiohttp's cleanup
        # would, after the requests that came with the port's last connections have started.
        drain.closed = True
        await asyncio.sleep(0)
        if runner.server is not None:
            runner.server.pre_shutdown()
        if not await drain.wait_idle(server.shutdown_timeout_ms / 1000):
            log.warning("gateway (pid %d): %d requests still in flight after %d ms; cutting them",
                        os.getpid(), drain.inflight, server.shutdown_timeout_ms)
            # Cut as any stream broken mid-answer is: its endpoint's error event, and accounted as
            # a cut; a plain cancellation (the runner's cleanup) closed the connection mid-stream.
            await end_in_flight(_handlers(runner), _CUT_GRACE_S)
            # aiohttp no longer tracks a handler whose client left; those still streaming to
            # single-flight followers end here, before the upstream pool and stores close.
            await app[RELAY].cancel_carried()
    finally:
        if orphaned is not None:
            orphaned.cancel()
        log.info("gateway (pid %d) shutting down", os.getpid())
        await runner.cleanup()


def _handlers(runner: web.BaseRunner) -> list[asyncio.Task[None]]:
    """The tasks of the connections answering a request now (aiohttp runs a connection's handler
    in the connection's task); read once, at shutdown, so no request pays for tracking them."""
    server = runner.server
    if server is None:
        return []
    return [t for conn in server.connections
            if conn._request_in_progress and (t := conn._task_handler) is not None and not t.done()]


_PARENT_CHECK_S = 0.5


async def _until_orphaned(parent: int, on_signal: Callable[[int], None]) -> None:
    """A worker whose supervisor (`parent`) is gone (killed, crashed: nothing told the worker)
    stops as on SIGINT: no drain delay, requests in flight finish. Else it would go on serving on
    the shared port with nobody to reload, restart or stop it."""
    while os.getppid() == parent:
        await asyncio.sleep(_PARENT_CHECK_S)
    log.warning("gateway worker (pid %d): its supervisor (pid %d) is gone; stopping", os.getpid(), parent)
    on_signal(signal.SIGINT)


def setup_logging() -> None:
    """Log to stderr at $GATEWAY_LOG_LEVEL (INFO by default), one line a record (log_lines.py)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=os.environ.get("GATEWAY_LOG_LEVEL", "INFO").upper(), handlers=[handler])


# The cyclic garbage collector's young-generation threshold while serving (CPython's default: 700).
_GC_GEN0 = 10_000


def settle_heap() -> None:
    """Once serving: what start-up built (modules, the policy, the classifier, the app) leaves the
    collector's view (gc.freeze), and young collections run every _GC_GEN0 allocations instead of
    700. Measured (bench/gateway_overhead.py): full collections walking that start-up heap cost
    ~10 % of a request's CPU, and the request log's extra allocations made it worse. A request's
    garbage is mostly freed by reference counting; the few cycles wait a little longer."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_GEN0, 20, 20)


def raise_fd_limit() -> None:
    """Lift this process's soft limit on open files to its hard limit: each stream holds a client
    and an upstream connection, and the usual soft limit (1024) would refuse connections long
    before `server.max_connections_per_client` or memory do."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:  # a container that forbids it: the soft limit stays
        log.warning("could not raise the open-file limit from %s to %s: %s", soft, target, exc)


def run_worker(
    policy: str, host: str, port: int, reuse_port: bool, access_log: bool, worker: WorkerInfo | None = None
) -> int:
    """Serve until SIGTERM/SIGINT, on uvloop when it is installed. Returns the exit code: 0, or 1
    when the port could not be opened (said in one line on stderr)."""
    setup_logging()
    raise_fd_limit()
    try:
        try:
            import uvloop
        except ImportError:  # uvloop is an optional extra
            asyncio.run(_serve(policy, host, port, reuse_port, access_log, worker))
        else:
            uvloop.run(_serve(policy, host, port, reuse_port, access_log, worker))
    except ListenError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    return 0


def _worker_process(policy: str, host: str, port: int, access_log: bool, info: WorkerInfo) -> None:
    """A worker's process: its exit code tells the supervisor how it ended."""
    sys.exit(run_worker(policy, host, port, True, access_log, info))


def supervise_workers(policy: str, host: str, port: int, workers: int, access_log: bool) -> int:
    """N processes share the port (SO_REUSEPORT); /metrics aggregates them through a shared dir.

    A worker that dies is restarted, unless workers keep dying right after start, which means the
    configuration cannot work. Returns the exit code."""
    metrics_dir = tempfile.mkdtemp(prefix="gateway-metrics-")
    control_dir = Path(tempfile.mkdtemp(prefix="gateway-control-"))  # mode 0700: ours alone
    # Read by prometheus_client when a process first imports it (the workers: spawned, they import
    # after this is set) and by mark_process_dead when called; the supervisor itself records no metric.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        return asyncio.run(_Supervisor(Path(policy), host, port, workers, access_log, control_dir).run())
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(control_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, policy: Path, host: str, port: int, workers: int, access_log: bool, control_dir: Path) -> None:
        self.path = policy
        self.host, self.port, self.count, self.access_log = host, port, workers, access_log
        self.control_dir = control_dir
        self.policy, self.data = read_policy(policy)
        # The digest of the policy in force (of `data`): what the file watcher compares the file
        # with, whichever reload (the watcher's, SIGHUP, /admin/reload, a replica's) put it in force.
        self.digest = hashlib.sha256(self.data).hexdigest()
        self.generation = 1
        # The policy in force, as the bytes the supervisor parsed: workers read this copy, at start
        # and on each reload, never the file (one started after a crash read a later, rejected
        # edit and failed in a loop that took the whole gateway down; a save during a fan-out or
        # a start could leave workers on different policies).
        self.snapshot = control_dir / "policy.yaml"
        _write_snapshot(self.snapshot, self.data)
        # The launcher logs; workers watch /healthz and ask `/launched` why one is not ready.
        self.children = Children(lambda name, state: None)
        self.ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, tuple[Any, float]] = {}  # index -> (process, started)
        self.stopping = asyncio.Event()
        self._lock = asyncio.Lock()
        # Here, not in run(): the control socket may ask for a reload (reload_everywhere) before
        # the subscription is up. Started in run().
        self.peers = Peers(self.policy, on_reload=self.reload_all)
        # Without Redis the virtual keys and the request log live here, shared by the workers
        # (admin/relayed.py); a `store.url` set later takes a restart, as in every process.
        rp = self.policy.request_log
        self.admin = SharedAdmin(rp.size, rp.memory_max_bytes) if self.policy.store.url is None else None
        self._tasks: set[asyncio.Task[Any]] = set()  # the policy watcher, SIGHUP reloads: see _background

    # ---- life ---------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop, sig)
        loop.add_signal_handler(signal.SIGHUP, lambda: self._background(self._reload_noted("SIGHUP"), "reload-SIGHUP"))
        server = await control.serve_unix(
            self.control_dir / "supervisor.sock",
            {
                ("POST", "/reload"): self.answer_reload,
                ("GET", "/backends"): self.views,
                ("GET", "/launched"): self.launched,
                **(self.admin.handlers() if self.admin else {}),
            },
            self.admin.data_handlers() if self.admin else None,
        )
        await self.children.reconcile(self._launch_specs())
        for i in range(self.count):
            self._spawn(i)
        await self.peers.start()
        self._background(self._watch_file(), "policy-watch")
        self._background(warn_over_budget(self.policy.store, self.count), "store-budget")
        code = 0
        try:
            code = await self._monitor()
        finally:
            await self._end_background()
            await self.peers.close()
            await self._wait_workers()
            await self.children.stop()
            await server.cleanup()
        return code

    def _background(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` in a task this supervisor owns: kept until it ends (a task nobody holds may
        be collected mid-run), its failure logged, cancelled at shutdown (_end_background)."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("supervisor: %s failed: %s", task.get_name(), exc, exc_info=exc)

    async def _end_background(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # failures: logged by _ended

    def _stop(self, sig: int) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            for p, _ in self.procs.values():
                if p.pid is not None and p.is_alive():
                    os.kill(p.pid, sig)

    def _spawn(self, index: int) -> None:
        info = WorkerInfo(index, self.count, self.control_dir, os.getpid(), self.generation, str(self.path))
        p = self.ctx.Process(target=_worker_process, args=(str(self.snapshot), self.host, self.port, self.access_log, info))
        p.start()
        self.procs[index] = (p, time.monotonic())

    async def _monitor(self) -> int:
        quick_crashes = 0
        while not self.stopping.is_set():
            await asyncio.sleep(0.2)
            for index, (p, started) in list(self.procs.items()):
                if p.exitcode is None or self.stopping.is_set():
                    continue
                multiprocess.mark_process_dead(p.pid)
                quick_crashes = quick_crashes + 1 if time.monotonic() - started < _CRASH_WINDOW_S else 0
                if quick_crashes >= _MAX_QUICK_CRASHES:
                    log.error("workers keep exiting right after start; giving up")
                    del self.procs[index]
                    self._stop(signal.SIGTERM)
                    return 1
                log.error("worker pid %s exited with %s; restarting it", p.pid, p.exitcode)
                self._spawn(index)
        return 0

    async def _wait_workers(self) -> None:
        """Wait for the workers to drain and exit; kill those past every bound."""
        s = self.policy.server
        deadline = time.monotonic() + (s.drain_delay_ms + s.shutdown_timeout_ms) / 1000 + 5.0
        while any(p.exitcode is None for p, _ in self.procs.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p, _ in self.procs.values():
            if p.exitcode is None:
                log.warning("worker pid %s did not exit in time; killing it", p.pid)
                p.kill()
            p.join(timeout=5)
            if p.pid is not None:
                multiprocess.mark_process_dead(p.pid)

    # ---- policy -------------------------------------------------------------------------------

    def _launch_specs(self) -> list[tuple[str, str, Any]]:
        return [(name, b.url, b.launch) for name, b in self.policy.backends.items() if b.launch is not None]

    def _sockets(self) -> list[Path]:
        return [worker_socket(self.control_dir, i) for i in sorted(self.procs)]

    async def reload_all(self, trigger: str, progress: _Progress | None = None) -> dict[str, Any]:
        """Reload every worker, then here: the launched models follow the new policy only when
        no worker rejected it (a worker checks more than parsing: its API key variables, weights
        files, store URL, open mode), so they never move to where the workers do not route.
        A policy one worker rejects is rolled back in the others (_roll_back): all serve one
        policy, the one in force. `progress` follows it (answer_reload)."""
        progress = progress if progress is not None else _Progress(self._sockets())
        async with self._lock:
            progress.stage = "reading the policy"
            try:
                policy, data = await asyncio.to_thread(read_policy, self.path)
            except (PolicyError, ValueError) as exc:
                log.error("supervisor: policy reload (%s) rejected: %s", trigger, exc)
                return {"ok": False, "supervisor": {"pid": os.getpid(), "ok": False, "error": str(exc)}, "workers": []}
            # The workers reload these bytes (the snapshot), not the file as it is when each reads it.
            await asyncio.to_thread(_write_snapshot, self.snapshot, data)
            indexes = sorted(self.procs)
            sockets = [worker_socket(self.control_dir, i) for i in indexes]
            progress.stage = "reloading the workers"
            progress.expect(sockets)
            results = await control.ask_all(sockets, "POST", control.why("/reload", f"{trigger}, through the supervisor"),
                                            _FANOUT_TIMEOUT_S, on_answer=progress.answered)
            rejected = control.rejections(results)
            own: dict[str, Any] = {"ok": True}
            if rejected:
                await asyncio.to_thread(_write_snapshot, self.snapshot, self.data)  # a worker started later: the one in force
                why = next((str(r["error"]) for r in rejected if r.get("error")), "a worker rejected it")
                log.error("supervisor: policy reload (%s) rejected by %s; launched models stay as they are: %s",
                          trigger, _who(rejected), why)
                own = {"ok": False, "error": why}
                progress.stage = "rolling back the workers that took it"
                await self._roll_back(trigger, indexes, results)
            else:
                self.data, self.digest = data, hashlib.sha256(data).hexdigest()
                progress.stage = "applying it to the launched models"
                await self._apply(policy)
        ok = bool(own["ok"]) and all(r.get("ok") for r in results)
        return {"ok": ok, "supervisor": {"pid": os.getpid(), **own}, "workers": results}

    async def _roll_back(self, trigger: str, indexes: list[int], results: list[dict[str, Any]]) -> None:
        """A worker rejected the policy (a failure of its own: a weights file it cannot read...)
        that others may have taken: every worker that did not reject it reloads the policy in
        force (the snapshot, already written back), so that none serves a policy the reload
        reports rejected. One that took it and cannot go back (it rejects the policy in force now,
        or no longer answers) is restarted, on that snapshot; one that had not answered either
        (starting: its socket was not up) takes the snapshot as it catches up. `results` are
        annotated in place."""
        back = [(i, r) for i, r in zip(indexes, results) if r.get("ok") or r.get("unreachable")]
        if not back:
            return
        why = f"rollback to the policy in force: {_who(control.rejections(results))} rejected the one of {trigger}"
        answers = await control.ask_all([worker_socket(self.control_dir, i) for i, _ in back], "POST",
                                        control.why("/reload", f"{why}, through the supervisor"), _FANOUT_TIMEOUT_S)
        for (index, result), answer in zip(back, answers):
            took = bool(result.get("ok"))
            if answer.get("ok"):
                if took:  # say that it is not in force there
                    result.update(ok=False, rolled_back=True, policy_generation=answer.get("policy_generation"),
                                  error="took the policy, then went back to the one in force: another worker rejected it")
            elif answer.get("unreachable") and not took:
                log.warning("supervisor: worker %d answered neither the reload nor its rollback (%s); one starting takes "
                            "the policy in force once up", index, answer.get("error"))
            elif not self.stopping.is_set() and index in self.procs:
                log.error("supervisor: worker %d could not go back to the policy in force (%s); restarting it on that policy",
                          index, answer.get("error"))
                result.update(ok=False, restarted=True)
                proc = self.procs[index][0]
                if proc.pid is not None and proc.is_alive():
                    os.kill(proc.pid, signal.SIGTERM)  # it drains; _monitor starts it again on the snapshot

    async def _apply(self, policy: Policy) -> None:
        self.policy = policy
        self.generation += 1
        if self.admin is not None:
            self.admin.resize(policy.request_log.size, policy.request_log.memory_max_bytes)
        await self.children.reconcile(self._launch_specs())

    async def reload_everywhere(self, trigger: str, progress: _Progress | None = None) -> dict[str, Any]:
        """reload_all, then the other replicas on the same Redis (their answers included)."""
        progress = progress if progress is not None else _Progress(self._sockets())
        out = await self.reload_all(trigger, progress)
        progress.stage = "announcing it to the other replicas"
        out["replicas"] = await self.peers.announce()
        return out

    async def answer_reload(self) -> dict[str, Any]:
        """POST /admin/reload through a worker: reload_everywhere, answered within the time the
        worker waits for it (_answer_within_s). A reload that takes longer (queued behind another,
        a slow worker, replicas slow to answer) goes on; the answer says what is known (the
        workers that took it, those still reloading, a rejection already seen: `_Progress.answer`)
        and the supervisor logs how it ends. Without this, the worker's wait ran out and a reload
        that succeeded was answered 500."""
        progress = _Progress(self._sockets(), announces=self.peers.enabled)
        task = self._background(self.reload_everywhere(ADMIN_TRIGGER, progress), "reload-admin")
        budget = _answer_within_s()
        done, _ = await asyncio.wait({task}, timeout=budget)  # the reload is never cancelled by this
        if task in done:
            out: dict[str, Any] = task.result()
            return out
        log.warning("supervisor: policy reload (%s) still %s after %.0f s: answered before it ended; it goes on",
                    ADMIN_TRIGGER, progress.stage, budget)
        task.add_done_callback(_log_late_end)
        return progress.answer(budget)

    async def launched(self) -> dict[str, Any]:
        """Each launched model's state (ready, or why not and when it is retried), for the workers."""
        return {name: state.to_json() for name, state in self.children.states().items()}

    async def views(self) -> dict[str, Any]:
        sockets = [worker_socket(self.control_dir, i) for i in sorted(self.procs)]
        return {"workers": await control.ask_all(sockets, "GET", "/backends", _FANOUT_TIMEOUT_S)}

    async def _reload_noted(self, trigger: str) -> None:
        """reload_all for a trigger nobody answers (the file watcher, SIGHUP): a worker it did not
        reach is said in a warning (a rejection is logged by reload_all). A worker that was starting
        catches up on its own once its control socket is up (app._worker_side)."""
        out = await self.reload_all(trigger)
        missed = [str(r.get("socket")) for r in out["workers"] if r.get("unreachable")]
        if missed:
            log.warning("supervisor: policy reload (%s) did not reach %d of %d workers (%s): one starting "
                        "reloads once up; else send SIGHUP or POST /admin/reload again", trigger, len(missed),
                        len(out["workers"]), ", ".join(missed))

    async def _watch_file(self) -> None:
        """Follow the policy file: a change reloads every worker, then the launched models
        (reload_all; the workers do not watch the file themselves). A change is bytes other than
        those of the policy in force (`self.digest`), whichever reload put it in force: the file
        written back to what it said before a /admin/reload or SIGHUP is a change too."""
        last = _stat(self.path)
        while True:
            await asyncio.sleep(self.policy.reload.interval_ms / 1000)
            if not self.policy.reload.watch:
                continue
            now = _stat(self.path)
            if now == last:
                continue
            last = now
            if now is not None and (digest_now := _digest(self.path)) is not None and digest_now != self.digest:
                await self._reload_noted("file change")


def _answer_within_s() -> float:
    """How long the supervisor may take to answer /admin/reload: a margin under the time the
    worker asking waits for it (read when asked: one constant, web/api.py's)."""
    return max(1.0, web_api.CONTROL_TIMEOUT_S - _ANSWER_MARGIN_S)


def _who(results: list[dict[str, Any]]) -> str:
    """The workers of `results`, for a message ("worker 1", "worker-1.sock")."""
    return ", ".join(f"worker {r['worker']}" if r.get("worker") is not None else str(r.get("socket", "a worker"))
                     for r in results) or "no worker"


class _Progress:
    """How far a reload has come: its stage and each worker's answer so far (None: not yet). The
    answer to /admin/reload when the reload outlasts the time to answer (answer_reload)."""

    __slots__ = ("stage", "workers", "announces")

    def __init__(self, sockets: list[Path], announces: bool = False) -> None:
        self.stage = "waiting for another reload to end"
        self.workers: dict[str, dict[str, Any] | None] = {}
        self.announces = announces  # the other replicas are told once the workers are done (peers.py)
        self.expect(sockets)

    def expect(self, sockets: list[Path]) -> None:
        self.workers = {p.name: None for p in sockets}

    def answered(self, path: Path, result: dict[str, Any]) -> None:
        self.workers[path.name] = result

    def answer(self, waited_s: float) -> dict[str, Any]:
        """The answer for a reload still going on, in the shape of a finished one's (web/api.py
        reads it): a rejection already seen is a failed reload (400 invalid_policy: it is being
        rolled back); every worker done and none refusing: ok (200), the replicas' answers
        pending; else the workers still reloading are named, as ones that did not answer
        (503 reload_incomplete), with `pending` and why in their `error`."""
        note = (f"still {self.stage} {waited_s:.0f} s after it was asked: the reload goes on without this answer "
                "and the supervisor logs how it ends (GET /admin/backends shows each worker's policy_generation)")
        workers = [r if r is not None else {"ok": False, "socket": name, "pending": True, "unreachable": True, "error": note}
                   for name, r in self.workers.items()]
        sup: dict[str, Any] = {"pid": os.getpid(), "pending": self.stage}
        replicas = [{"ok": False, "pending": True, "error": note}] if self.announces else []
        if refused := control.rejections([r for r in self.workers.values() if r is not None]):
            why = next((str(r["error"]) for r in refused if r.get("error")), "a worker rejected it")
            sup.update(ok=False, error=f"{why} (rejected by {_who(refused)}; the workers that took it go back to the policy in force)")
            return {"ok": False, "supervisor": sup, "workers": workers, "replicas": []}
        if all(r is not None for r in self.workers.values()):
            sup["ok"] = True
            return {"ok": all(r.get("ok") for r in workers), "supervisor": sup, "workers": workers, "replicas": replicas}
        return {"ok": False, "supervisor": sup, "workers": workers, "replicas": replicas}


def _log_late_end(task: asyncio.Task[Any]) -> None:
    """How a reload answered before it ended did end (its failures: _Supervisor._ended)."""
    if task.cancelled() or task.exception() is not None:
        return
    out = task.result()
    workers = out.get("workers", [])
    if out.get("ok"):
        log.info("supervisor: policy reload (%s), answered before it ended, is in force in all %d workers",
                 ADMIN_TRIGGER, len(workers))
    else:
        missed = [str(r.get("socket", r.get("worker"))) for r in workers if r.get("unreachable")]
        log.warning("supervisor: policy reload (%s), answered before it ended, did not succeed everywhere: %s",
                    ADMIN_TRIGGER, out.get("supervisor", {}).get("error") or f"{', '.join(missed)} did not answer")


def _write_snapshot(path: Path, data: bytes) -> None:
    """Replace the policy copy the workers read, at once (a worker starting never reads half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
