"""create_app(): the routes, the typed shared state, and start-up/shutdown in cleanup_ctx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from .api import LOOPBACK, routes
from .auth import is_loopback, open_mode_problem
from .backends import BackendState
from .admission import Admission
from .keys import ADMISSION, LIVE, METRICS, RELAY, RELOADER
from .metrics import Metrics
from .policy import LaunchPolicy, Policy, StorePolicy, load_policy
from .relay import RelayContext
from .probes import run_probes
from .reload import Live, Reloader
from .runtime import Runtime, build_runtime
from .store import Store
from .upstream_http import UpstreamPool

__all__ = ["create_app"]

log = logging.getLogger("gateway.app")


def create_app(policy: Policy | str | Path, host: str | None = None) -> web.Application:
    """Build the gateway app from a policy object or a policy file (the file is then watched).

    `host` is the address it will be bound to (None: loopback). A policy without tenants is
    refused (ValueError) on any other address unless it sets `server.open_access`, at start and
    on every reload."""
    path = None if isinstance(policy, Policy) else Path(policy)
    loaded = load_policy(path) if path is not None else policy
    assert isinstance(loaded, Policy)
    app = web.Application(client_max_size=1 << 30)  # the policy's own limit is enforced per request
    metrics = Metrics()
    # What outlives a reload: backend measurements (by name) and cache stores (by settings).
    states: dict[str, BackendState] = {}
    stores: dict[StorePolicy, Store] = {}

    # One admission gate for the app's life: a reload changes its limits, never drops its queue.
    admission = Admission(loaded.admission.max_inflight, loaded.admission.max_queue)

    def build(p: Policy, generation: int) -> Runtime:
        problem = open_mode_problem(p, host)
        if problem is not None:  # e.g. a reload that drops every tenant must not open the doors
            raise ValueError(problem)
        rt = build_runtime(
            p, states, generation, stores,
            on_cache_error=lambda op: metrics.cache_errors.labels(op).inc(),
            on_quota_degraded=metrics.quota_degraded.inc,
            on_affinity=metrics.affinity_event,
        )
        a = p.admission
        admission.configure(a.max_inflight, a.max_queue, a.starvation_share, a.enabled, a.priority_reserve_pct, a.standing())
        return rt

    live = Live(build(loaded, 1))
    children = _Children()
    app[METRICS] = metrics
    app[ADMISSION] = admission
    app[LOOPBACK] = is_loopback(host)
    app[LIVE] = live
    app[RELOADER] = Reloader(path, live, build, metrics, on_swap=children.reconcile)
    app.add_routes(routes())
    app.cleanup_ctx.append(_upstream_pool)
    app.cleanup_ctx.append(lambda _app: _close_stores(stores, live))
    app.cleanup_ctx.append(children.context)
    app.cleanup_ctx.append(_reload_watch)
    app.cleanup_ctx.append(_probes)
    return app


async def _close_stores(stores: dict[StorePolicy, Store], live: Live) -> AsyncIterator[None]:
    yield
    quota = live.runtime.quota
    if quota is not None:
        await quota.drain()  # the last requests' settles, before their store closes
    for store in stores.values():
        await store.close()


async def _probes(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(run_probes(app[LIVE], app[METRICS]))
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _upstream_pool(app: web.Application) -> AsyncIterator[None]:
    """One keep-alive connection pool for every upstream call."""
    pool = UpstreamPool()
    app[RELAY] = RelayContext(pool, app[METRICS], admission=app[ADMISSION])
    yield
    await pool.close()


async def _reload_watch(app: web.Application) -> AsyncIterator[None]:
    reloader = app[RELOADER]
    watcher = None
    if reloader.path is not None and app[LIVE].runtime.policy.reload.watch:
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


class _Children:
    """Backends with a `launch:` section: started, supervised and stopped with the app."""

    def __init__(self) -> None:
        self._tasks: dict[str, tuple[tuple[str, LaunchPolicy], asyncio.Task[None]]] = {}
        self._runtime: Runtime | None = None

    async def context(self, app: web.Application) -> AsyncIterator[None]:
        await self.reconcile(app[LIVE].runtime)
        yield
        await self._stop(list(self._tasks))

    async def reconcile(self, runtime: Runtime) -> None:
        """Start children new to this policy; stop those that left it or changed."""
        wanted = {
            name: (b.base_url, b.policy.launch) for name, b in runtime.backends.items() if b.policy.launch is not None
        }
        stale = [n for n, (spec, _) in self._tasks.items() if wanted.get(n) != spec]
        await self._stop(stale)
        for name, spec in wanted.items():
            if name not in self._tasks:
                backend = runtime.backends[name]
                task = asyncio.create_task(_run_child(name, spec[0], spec[1], backend.state))
                self._tasks[name] = (spec, task)  # type: ignore[assignment]

    async def _stop(self, names: list[str]) -> None:
        tasks = [self._tasks.pop(n)[1] for n in names if n in self._tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _run_child(name: str, url: str, launch: LaunchPolicy, state: BackendState) -> None:
    from .launcher import ChildBackend, LaunchError

    child = ChildBackend(
        name,
        url,
        launch.model,
        quantize=launch.quantize,
        device=launch.device,
        threads=launch.threads,
        startup_timeout_s=launch.startup_timeout_s,
        extra_args=launch.extra_args,
    )
    state.health.ready = False
    try:
        await child.start()
        state.health.ready = True
        log.info("backend %s: local model %s is ready at %s", name, launch.model, url)
        await child.supervise()
    except LaunchError as exc:
        log.error("backend %s could not be launched: %s", name, exc)
    finally:
        state.health.ready = False
        await asyncio.shield(child.stop())
