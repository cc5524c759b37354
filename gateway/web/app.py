"""create_app(): the routes, the typed shared state, and start-up/shutdown in cleanup_ctx."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from ..admin.api import EXPORTS_AT_ONCE
from ..admin.key_store import KeyStore, MemoryKeyStore, RedisKeyStore
from ..admin.keys import KeyBook
from ..admin.relayed import RelayedKeyStore, RelayedLogStore
from ..admin.log_store import LogStore, MemoryLogStore, RedisLogStore
from ..admin.overview import Overviews
from ..admin.request_log import RequestLog
from ..admission.gate import Admission
from ..classify.cascade import EncoderWorker
from ..config.policy import LaunchPolicy, Policy, StorePolicy, VirtualKeysPolicy, read_policy
from ..config.reload import Live, Reloader
from ..config.runtime import Runtime, build_runtime
from ..observe.metrics import Metrics, refresh_gauges
from ..observe.observer import Observer
from ..pipeline.core import Pipeline
from ..process import control
from ..process.launched import watch_launched
from ..process.launcher import Children, LaunchState
from ..process.peers import Peers
from ..process.workers import WorkerInfo, share
from ..relay.context import RelayContext
from ..routing.affinity import PrefixMap
from ..routing.backends import BackendState
from ..routing.health import Health
from ..routing.probes import run_probes
from ..routing.scrape import run_scrapes
from ..store.connect import warn_over_budget
from ..store.core import Store
from ..tenants.auth import is_loopback, open_mode_problem
from ..tenants.quota import Quota
from ..upstream.client import UpstreamPool
from .api import backends_view, routes
from .body import BodyBudget
from .drain import Drain
from .edge import handler_args
from .keys import ADMISSION, BODY_BUDGET, DRAIN, ENCODER, EXPORTS, KEYBOOK, LIVE, LOOPBACK, METRICS, OBSERVER, OVERVIEWS, PEERS, PIPELINE, POLICY_CHECK, RELAY, RELOADER, REQUEST_LOG, WORKER

__all__ = ["create_app"]

log = logging.getLogger("gateway.app")

_GAUGES_EVERY_S = 1.0  # a worker's per-backend gauges, for scrapes served by any worker
_LAUNCHED_TIMEOUT_S = 2.0  # the supervisor answers from memory
_ADMIN_PREFIX = "gateway:admin:"  # the admin plane's keys in a shared Redis


def create_app(
    policy: Policy | str | Path, host: str | None = None, *, worker: WorkerInfo | None = None, access_log: bool = False
) -> web.Application:
    """Build the gateway app from a policy object or a policy file (the file is then watched).

    `host` is the address it will be bound to (None: loopback). A policy without tenants is
    refused (ValueError) on any other address unless it sets `server.open_access`, at start and
    on every reload. `worker`: this app is one worker of `gateway serve --workers N` (it takes
    its share of each backend's max_concurrency, and leaves launching to the supervisor).
    `access_log`: write the JSON access log even when the policy's `log.access` is off."""
    path = None if isinstance(policy, Policy) else Path(policy)
    source = worker.policy_source or None if worker is not None else None
    loaded, data = read_policy(path, source) if path is not None else (policy, None)
    assert isinstance(loaded, Policy)
    # Bodies are read by body.read_body (bounded, inflated under the limit, after authentication);
    # client_max_size only backs that up for a stray request.read(). The parser never inflates.
    app = web.Application(client_max_size=loaded.server.max_body_bytes, handler_args=handler_args(loaded.server))
    metrics = Metrics()
    # One admission gate for the app's life: a reload changes its limits, never drops its queue.
    admission = Admission(loaded.admission.max_inflight, loaded.admission.max_queue)
    # The admin plane's state lives in the store named at start (a new `store.url` takes a restart).
    keybook = KeyBook(_key_store(loaded, worker), loaded.admin.keys if loaded.admin else VirtualKeysPolicy())
    request_log = RequestLog(_log_store(loaded, worker), loaded.request_log,
                             on_drop=lambda reason, n: metrics.request_log_dropped.labels(reason).inc(n))
    # The classifier's encoder: loaded once per process, in its own thread, when a policy first
    # needs it (a route that classifies); its settings are read at start.
    encoder = EncoderWorker(loaded.classifier.encoder, observe=metrics.classifier_encoder_seconds.observe)
    bodies = BodyBudget(loaded.server.body_read_budget_bytes)  # one for the app's life: a reload sets its limit
    snapshots = _Snapshots(metrics, admission, host, worker, keybook, request_log, encoder, bodies)
    live = Live(snapshots.build(loaded, 1 if worker is None else worker.generation), snapshots.activate)  # loads the encoder here, if needed
    snapshots.started = True

    def set_state(name: str, state: LaunchState) -> None:
        b = live.runtime.backends.get(name)
        if b is not None:
            _apply(b.health, state)

    children = Children(set_state)

    async def on_swap(rt: Runtime) -> None:
        if worker is None:  # a worker's supervisor launches the models
            await children.reconcile(_launch_specs(rt))

    app[METRICS] = metrics
    app[ADMISSION] = admission
    app[LOOPBACK] = is_loopback(host)
    app[LIVE] = live
    app[WORKER] = worker
    app[DRAIN] = Drain()
    app[OBSERVER] = Observer(metrics, force_access_log=access_log)
    app[KEYBOOK] = keybook
    app[REQUEST_LOG] = request_log
    app[OVERVIEWS] = Overviews()
    app[BODY_BUDGET] = bodies
    app[ENCODER] = encoder
    app[POLICY_CHECK] = asyncio.Lock()
    app[EXPORTS] = asyncio.Semaphore(EXPORTS_AT_ONCE)
    app[RELOADER] = Reloader(path, live, snapshots.build, metrics, on_swap=on_swap, source=source, loaded=data)
    app.add_routes(routes())
    _lifecycle(app, children, live, snapshots, worker)
    return app


class _Snapshots:
    """Builds runtimes and puts them in force. What outlives a reload lives here: backend
    measurements (by name) and stores (by settings), recorded by each runtime when it is put in
    force (Runtime.activate), never while it is built."""

    def __init__(self, metrics: Metrics, admission: Admission, host: str | None, worker: WorkerInfo | None,
                 keys: KeyBook, request_log: RequestLog, encoder: EncoderWorker,
                 bodies: BodyBudget) -> None:
        self.metrics, self.admission, self.host, self.worker = metrics, admission, host, worker
        self.keys, self.request_log, self.encoder, self.bodies = keys, request_log, encoder, bodies
        self.started = False  # the first runtime is in force (later ones come from reloads)
        self.states: dict[str, BackendState] = {}
        self.stores: dict[StorePolicy, Store] = {}
        self.prefixes = PrefixMap()  # learned prefix -> backend, kept across reloads like the states
        # Every quota put in force that still exists (a runtime's requests, or its settles, hold it):
        # shutdown drains each one's settles.
        self.quotas: weakref.WeakSet[Quota] = weakref.WeakSet()

    def build(self, p: Policy, generation: int) -> Runtime:
        """A complete runtime for `p`; nothing live changes until `activate`, at its swap."""
        problem = open_mode_problem(p, self.host)
        if problem is not None:  # e.g. a reload that drops every tenant must not open the doors
            raise ValueError(problem)
        metrics, worker = self.metrics, self.worker
        rt = build_runtime(
            p, self.states, generation, self.stores,
            on_cache_error=lambda op: metrics.cache_errors.labels(op).inc(),
            on_quota_degraded=metrics.quota_degraded.inc,
            on_affinity=metrics.affinity_event,
            # max_concurrency holds across the workers: each its share
            slot_share=lambda limit: share(limit, worker),
            prefixes=self.prefixes,
            encoder=self.encoder,
        )
        rt.tenants.keys = self.keys  # virtual keys authenticate too (one book for the app's life)
        return rt

    def activate(self, rt: Runtime) -> None:
        """A built runtime's limits in force, once, at its swap: the backends', the admission
        gate's, and the series of its tenants."""
        rt.activate(self.states, self.stores)
        if rt.quota is not None:
            self.quotas.add(rt.quota)
        a = rt.policy.admission
        self.admission.configure(a.max_inflight, a.max_queue, a.starvation_share, a.enabled, a.priority_reserve_pct, a.standing())
        self.bodies.limit = rt.policy.server.body_read_budget_bytes
        self.metrics.zero_series(sorted({rt.tenants.metric_label(t) for t in rt.policy.tenants}))
        self.keys.policy = rt.policy.admin.keys if rt.policy.admin else VirtualKeysPolicy()
        self.request_log.configure(rt.policy.request_log)
        if rt.cascade.band is not None:  # the first policy that needs it (idempotent): at start,
            self.encoder.start(block=not self.started)  # before the port opens; on a reload, in its thread


def _key_store(policy: Policy, worker: WorkerInfo | None) -> KeyStore:
    """Redis when the policy names one; else this process's memory, or, for a worker of
    `serve --workers N`, the supervisor's (shared by the workers: admin/relayed.py)."""
    url = policy.store.url
    if url is not None:
        return RedisKeyStore(url, prefix=_ADMIN_PREFIX, tls=policy.store.tls)
    return MemoryKeyStore() if worker is None else RelayedKeyStore(worker.supervisor_socket)


def _log_store(policy: Policy, worker: WorkerInfo | None) -> LogStore:
    url, rp = policy.store.url, policy.request_log
    if url is not None:
        return RedisLogStore(url, rp.size, prefix=_ADMIN_PREFIX, tls=policy.store.tls)
    return MemoryLogStore(rp.size, rp.memory_max_bytes) if worker is None else RelayedLogStore(worker.supervisor_socket, rp.size)


def _lifecycle(app: web.Application, children: Children, live: Live, snapshots: _Snapshots,
               worker: WorkerInfo | None) -> None:
    """What starts with the app and stops with it, in order."""
    app.cleanup_ctx.append(_upstream_pool)
    app.cleanup_ctx.append(lambda _app: _close_stores(snapshots))
    if worker is None:
        app.cleanup_ctx.append(lambda _app: _launched(children, live))
        app.cleanup_ctx.append(_peers)
    else:
        for b in live.runtime.backends.values():
            if b.policy.launch is not None:
                b.health.ready = False  # until this worker sees its /healthz answer
        app.cleanup_ctx.append(_worker_side)
    app.cleanup_ctx.append(_reload_watch)
    app.cleanup_ctx.append(_probes)
    app.cleanup_ctx.append(_observer)
    app.cleanup_ctx.append(_admin_plane)
    app.cleanup_ctx.append(_encoder)


def _apply(health: Health, state: LaunchState) -> None:
    """A launched backend's state as its routing health: ready or not, and why not."""
    health.ready = state.ready
    health.start_failure = "" if state.ready or state.failure is None else state.failure
    health.start_retry_at = health.clock() + state.retry_in_s()


def _launch_specs(rt: Runtime) -> list[tuple[str, str, LaunchPolicy]]:
    return [(name, b.base_url, b.policy.launch) for name, b in rt.backends.items() if b.policy.launch is not None]


async def _launched(children: Children, live: Live) -> AsyncIterator[None]:
    """Backends with a `launch:` section: started, supervised and stopped with the app."""
    await children.reconcile(_launch_specs(live.runtime))
    yield
    await children.stop()


async def _peers(app: web.Application) -> AsyncIterator[None]:
    """Reloads announced by other replicas on the same Redis reach this process."""

    async def on_reload(trigger: str) -> dict[str, object]:
        ok, detail = await app[RELOADER].reload(trigger)
        return _reload_result(app, ok, detail)

    policy = app[LIVE].runtime.policy
    peers = Peers(policy, on_reload)
    await peers.start()
    app[PEERS] = peers
    budget = asyncio.create_task(warn_over_budget(policy.store, 1), name="store-budget")
    yield
    budget.cancel()
    await peers.close()


def _reload_result(app: web.Application, ok: bool, detail: str) -> dict[str, object]:
    """One process's answer to a reload, as /admin/reload lists it."""
    worker = app[WORKER]
    return {
        "ok": ok, "pid": os.getpid(), "worker": None if worker is None else worker.index,
        "policy_generation": app[LIVE].runtime.generation, **({} if ok else {"error": detail}),
    }  # fmt: skip


async def _worker_side(app: web.Application) -> AsyncIterator[None]:
    """In a worker: the control socket (reload, admin view), readiness of the launched models,
    and the per-backend gauges refreshed here too (every worker's view reaches /metrics)."""
    worker = app[WORKER]
    assert worker is not None
    live = app[LIVE]

    async def reload() -> dict[str, object]:
        ok, detail = await app[RELOADER].reload("admin, through the supervisor")
        return _reload_result(app, ok, detail)

    async def view() -> dict[str, object]:
        return {"pid": os.getpid(), "worker": worker.index, **backends_view(app)}

    app[PEERS] = None
    server = await control.serve_unix(worker.socket, {("POST", "/reload"): reload, ("GET", "/backends"): view})
    # A reload fanned out while this worker started (before its socket was up) did not reach it:
    # from here on one does; until here, the supervisor's snapshot says what it missed.
    await app[RELOADER].reload("policy changed while this worker started", if_changed=True)

    def launched() -> list[tuple[str, str, Callable[[LaunchState], None]]]:
        out: list[tuple[str, str, Callable[[LaunchState], None]]] = []
        for name, b in live.runtime.backends.items():
            if b.policy.launch is not None:
                out.append((name, b.base_url, functools.partial(_apply, b.health)))
        return out

    async def launch_states() -> dict[str, LaunchState]:
        """The supervisor's word on why a launched model is not ready (none when it cannot say)."""
        try:
            answer = await control.ask(worker.supervisor_socket, "GET", "/launched", _LAUNCHED_TIMEOUT_S)
        except control.ControlError as exc:
            log.debug("worker %d: the supervisor did not say how its launched models are: %s", worker.index, exc)
            return {}
        return {name: LaunchState.from_json(st) for name, st in answer.items() if isinstance(st, dict)}

    async def gauges() -> None:
        while True:
            refresh_gauges(app[METRICS], live.runtime, app[ADMISSION])
            await asyncio.sleep(_GAUGES_EVERY_S)

    tasks = [asyncio.create_task(watch_launched(launched, launch_states)), asyncio.create_task(gauges())]
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.cleanup()


async def _observer(app: web.Application) -> AsyncIterator[None]:
    app[OBSERVER].start(app[LIVE].runtime.policy)
    yield
    app[OBSERVER].close()


async def _encoder(app: web.Application) -> AsyncIterator[None]:
    yield
    await asyncio.to_thread(app[ENCODER].close)  # ends after its batch in progress


async def _admin_plane(app: web.Application) -> AsyncIterator[None]:
    """Virtual keys kept in step with the store, and the request log's writer."""
    keys, request_log = app[KEYBOOK], app[REQUEST_LOG]
    await keys.start()
    request_log.start()
    app[OBSERVER].request_log = request_log
    yield
    app[OBSERVER].request_log = None
    await request_log.close()
    await keys.close()


async def _close_stores(snapshots: _Snapshots) -> AsyncIterator[None]:
    stores = snapshots.stores
    await asyncio.gather(*(s.warm() for s in stores.values() if hasattr(s, "warm")))
    yield
    # The last requests' settles, before their store closes: through the quota of the runtime
    # each started on (only the newest was drained: a request begun before a reload left its
    # concurrency lease and its reservation in Redis until the lease expired).
    await asyncio.gather(*(q.drain() for q in list(snapshots.quotas)))
    for store in stores.values():
        await store.close()


async def _probes(app: web.Application) -> AsyncIterator[None]:
    """Health probes and the backends' load scrapes (each worker its own: routing reads them in
    process), running as long as the app."""
    tasks = [asyncio.create_task(run_probes(app[LIVE], app[METRICS])), asyncio.create_task(run_scrapes(app[LIVE]))]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _upstream_pool(app: web.Application) -> AsyncIterator[None]:
    """One keep-alive connection pool for every upstream call."""
    pool = UpstreamPool()
    app[RELAY] = RelayContext(pool, app[METRICS], admission=app[ADMISSION])
    app[PIPELINE] = Pipeline(app[RELAY], app[OBSERVER])
    yield
    # Relays still going on for single-flight followers after their leader's client left: no
    # handler tracks them, so whoever runs the app (serve, a test, an embedding program) has them
    # ended here, before the pool they use closes.
    await app[RELAY].cancel_carried()
    await pool.close()


async def _reload_watch(app: web.Application) -> AsyncIterator[None]:
    reloader = app[RELOADER]
    watcher = None
    # A worker of `serve --workers N` does not watch the file: its supervisor does, and reloads
    # every worker, then its launched models, only where no worker rejects the policy.
    if reloader.path is not None and app[LIVE].runtime.policy.reload.watch and app[WORKER] is None:
        watcher = asyncio.create_task(reloader.watch(app[LIVE].runtime.policy.reload.interval_ms / 1000))
    hup = reloader.install_sighup() if reloader.path is not None else False
    yield
    if hup:
        reloader.remove_sighup()
    if watcher is not None:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    await reloader.close()
