"""A Runtime: everything built from one policy, swapped atomically on reload.

Each request reads the current Runtime once and keeps it to the end, so a reload never mixes the
old and the new policy within one request.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .admission import reserve_slots
from .affinity import Affinity
from .auth import Tenants
from .backends import Backend, BackendState, Slots
from .call import Call
from .endpoints import ENDPOINTS
from .classify import Classifier, Rules, Verdict
from .errors import BadRequest, ModelNotFound
from .health import Health
from .latency import Tracker
from .auth import Tenant
from .cache import Cache, cache_key, cacheable_request
from .policy import (
    BackendPolicy,
    CacheOverride,
    HedgePolicy,
    ModelRoute,
    Policy,
    RetryPolicy,
    RoutingPolicy,
    ServerPolicy,
    StorePolicy,
)
from .quota import Quota
from .store import MemoryStore, Store
from .store_redis import RedisStore
from .routing import Candidate, Selector

__all__ = ["Runtime", "Route", "Pool", "HedgeBudget", "CachePlan", "build_runtime", "open_store"]


_UNCLASSIFIED = Verdict("complex", 0.0, 1.0, None, {}, ["not classified: this model does not route by class"])


@dataclass
class HedgeBudget:
    """Hedges may add at most `pct` % extra upstream calls, measured over a decaying window."""

    pct: float
    half_life_s: float = 60.0
    clock: object = time.monotonic
    _requests: float = 0.0
    _hedges: float = 0.0
    _at: float = field(default_factory=time.monotonic)

    def _decay(self) -> None:
        now = self.clock()  # type: ignore[operator]
        k = 0.5 ** ((now - self._at) / self.half_life_s)
        self._requests *= k
        self._hedges *= k
        self._at = now

    def note_request(self) -> None:
        self._decay()
        self._requests += 1

    def try_spend(self) -> bool:
        """True (and counted) when one more hedge stays within the budget."""
        self._decay()
        if self._hedges + 1 > self.pct / 100 * self._requests + 1:  # +1: one hedge allowed from the start
            return False
        self._hedges += 1
        return True


@dataclass(frozen=True, slots=True)
class Pool:
    """The candidates of one (model, class) and the selector that ranks them."""

    backends: tuple[Backend, ...]
    candidates: tuple[Candidate, ...]
    selector: Selector


@dataclass(frozen=True, slots=True)
class Route:
    """Candidate backends for one public model, per request class."""

    model: str
    simple: Pool
    complex: Pool
    split: bool  # True when simple and complex prompts go to different lists (the `auto` style)
    threshold: float | None = None
    hedge: HedgePolicy | None = None
    budget: HedgeBudget | None = None
    cache: CacheOverride | None = None
    # The settings of the policy this route came from: a request keeps them to its end.
    server: ServerPolicy = field(default_factory=ServerPolicy)
    routing: RoutingPolicy = field(default_factory=RoutingPolicy)
    # endpoint -> (simple, complex) pools of only the backends that serve it (None: none does)
    by_endpoint: dict[str, tuple[Pool | None, Pool | None]] = field(default_factory=dict)
    retry: RetryPolicy | None = None
    context_fallbacks: tuple[Backend, ...] = ()  # for a 400 context_length_exceeded

    def pool(self, cls: str, endpoint: str = "chat") -> Pool:
        """The candidates for a request class on an endpoint; BadRequest when no backend of this
        route serves the endpoint (decided from the policy, before any upstream call)."""
        pair = self.by_endpoint.get(endpoint)
        if pair is None:
            return self.simple if cls == "simple" else self.complex
        p = pair[0] if cls == "simple" else pair[1]
        if p is None:
            raise BadRequest(
                f"the model {self.model!r} is not served on /v1{ENDPOINTS[endpoint].path}: "
                f"no backend of its route lists {endpoint!r} in its `endpoints`",
                param="model",
                code="unsupported_endpoint",
            )
        return p

    def candidates(self, cls: str) -> tuple[Backend, ...]:
        return self.pool(cls).backends


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What the cache does for one call: `key` None means bypass, for `reason`."""

    key: str | None
    reason: str | None
    ttl_s: float = 0.0
    store: bool = True  # False: `cache-control: no-store`


_NO_CACHE = CachePlan(None, "caching is off for this model")


class Runtime:
    def __init__(
        self,
        policy: Policy,
        backends: dict[str, Backend],
        classifier: Classifier,
        generation: int,
        cache: Cache | None = None,
        quota: Quota | None = None,
        affinity: Affinity | None = None,
    ) -> None:
        self.policy = policy
        self.generation = generation
        self.created = time.time()
        self.backends = backends
        self.tenants = Tenants(policy)
        self.server = policy.server
        self.routing = policy.routing
        routes: dict[str, Route] = {}
        for model, names in policy.served_models().items():
            routes[model] = self._route(model, ModelRoute(backends=names))
        for model, r in policy.models.items():
            routes[model] = self._route(model, r)
        self.routes = routes
        self.public_models = policy.public_models()
        cp = policy.classifier
        self.classifier = classifier
        self.threshold = cp.threshold if cp.threshold is not None \
            else classifier.threshold_for_recall(cp.complex_recall_target)
        self.classify_all = cp.classify_all
        self.rules = Rules(**cp.rules.model_dump())
        self.cache = cache
        self.quota = quota  # None: no tenant has limits
        # Which backend holds each Responses API id (affinity.py); in memory unless given a store.
        self.affinity = affinity if affinity is not None else _affinity(policy, MemoryStore(), None)

    def cache_plan(self, call: Call, route: Route, tenant: Tenant) -> CachePlan:
        """Whether and under which key this call's answer is looked up and stored.

        Settings resolve tenant over model over the policy's `cache` section."""
        if self.cache is None or not call.endpoint.cacheable:
            return _NO_CACHE
        cp = self.policy.cache
        enabled, include_sampled, ttl = cp.enabled, cp.include_sampled, cp.ttl_s
        for o in (route.cache, tenant.cache):
            if o is not None:
                enabled = enabled if o.enabled is None else o.enabled
                include_sampled = include_sampled if o.include_sampled is None else o.include_sampled
                ttl = ttl if o.ttl_s is None else o.ttl_s
        if not enabled:
            return _NO_CACHE
        if call.no_cache:
            return CachePlan(None, "cache-control: no-cache")
        why = cacheable_request(call.body, require_deterministic=not include_sampled, default_temperatures=_defaults(call, route))
        if why is None:
            why = call.endpoint.cache_reason(call.body)
        if why is not None:
            return CachePlan(None, why)
        key = cache_key(tenant.cache_namespace, call.endpoint.name, call.model, call.body)
        return CachePlan(key, None, ttl, not call.no_store)

    def _pool(self, model: str, names: tuple[str, ...], strategy: str) -> Pool:
        rp = self.routing
        picked = tuple(self.backends[b] for b in names)
        cands = tuple(Candidate(b.name, b.tracker, b.health_for(model), b.policy.weight, _cost(b.policy)) for b in picked)
        selector = Selector(strategy, tie_pct=rp.tie_pct / 100, cost_weight_s=rp.cost_weight_s)
        return Pool(picked, cands, selector)

    def single_pool(self, model: str, backend: str) -> Pool:
        """A pool of one backend (a follow-up pinned to the backend that holds its state)."""
        return self._pool(model, (backend,), "ordered")

    def _by_endpoint(self, model: str, pool: Pool, strategy: str) -> dict[str, Pool | None]:
        """Per endpoint: the pool itself when every backend serves it, else the ones that do."""
        out: dict[str, Pool | None] = {}
        for ep in ENDPOINTS:
            names = tuple(b.name for b in pool.backends if ep in b.policy.endpoints)
            out[ep] = pool if len(names) == len(pool.backends) else (self._pool(model, names, strategy) if names else None)
        return out

    def _route(self, model: str, r: ModelRoute) -> Route:
        strategy = r.strategy or self.routing.strategy
        budget = HedgeBudget(r.hedge.max_extra_pct) if r.hedge else None
        if r.backends is not None:
            simple = complex_ = self._pool(model, r.backends, strategy)
        else:
            simple, complex_ = self._pool(model, r.simple or (), strategy), self._pool(model, r.complex or (), strategy)
        s_eps = self._by_endpoint(model, simple, strategy)
        c_eps = s_eps if complex_ is simple else self._by_endpoint(model, complex_, strategy)
        return Route(
            model,
            simple,
            complex_,
            split=r.backends is None,
            threshold=r.threshold,
            hedge=r.hedge,
            budget=budget,
            cache=r.cache,
            server=self.server,
            routing=self.routing,
            by_endpoint={ep: (s_eps[ep], c_eps[ep]) for ep in ENDPOINTS},
            retry=r.retry,
            context_fallbacks=tuple(self.backends[b] for b in r.context_fallbacks),
        )

    def classify(self, call: Call, route: Route) -> Verdict:
        """simple|complex for routes that split by class (or every route with `classify_all`)."""
        if not (route.split or self.classify_all):
            return _UNCLASSIFIED
        threshold = route.threshold if route.threshold is not None else self.threshold
        return self.classifier.classify(call.endpoint.classify_view(call.body), threshold=threshold, rules=self.rules)

    def route(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")
        return route


def _defaults(call: Call, route: Route) -> dict[str, float]:
    """The default temperature of every backend that may answer `call`: its class's pool on this
    endpoint (failover, retries, hedges and rescues stay in it) and the route's context fallbacks."""
    backends = (*route.pool(call.cls, call.endpoint.name).backends, *route.context_fallbacks)
    return {b.name: b.policy.sampling_default_temperature for b in backends}


def _cost(bp: BackendPolicy) -> float:
    """What routing.cost_weight_s trades against latency: `cost`, else the backend's price
    (input + output USD per million tokens)."""
    if bp.cost or bp.price is None:
        return bp.cost
    return bp.price.input_per_mtok + bp.price.output_per_mtok


def build_runtime(
    policy: Policy,
    states: dict[str, BackendState],
    generation: int,
    stores: dict[StorePolicy, Store] | None = None,
    on_cache_error: Callable[[str], None] | None = None,
    on_quota_degraded: Callable[[], None] | None = None,
    on_affinity: Callable[[str, str], None] | None = None,
) -> Runtime:
    """Build a Runtime; backend measurements carry over from `states`, and cache stores from
    `stores` (both updated in place; a store is reused while its settings stay the same).

    Raises ValueError (e.g. a missing API key variable) without touching the running one.
    """
    backends: dict[str, Backend] = {}
    hp = policy.health
    for name, bp in policy.backends.items():
        if name in states:
            state = states[name]
        else:
            tracker = Tracker()
            state = BackendState(tracker, Health(), Slots(bp.max_concurrency, tracker))
        backends[name] = Backend(name, bp, state)
    # Loaded on every build (~5 ms), so an edited weights file takes effect on reload.
    classifier = Classifier.load(policy.classifier.weights_file)
    # Only now that everything built: apply the new limits to the live state.
    for name, backend in backends.items():
        for h in (backend.state.health, *backend.state.models.values()):
            h.failures_to_eject = hp.failures_to_eject
            h.eject_s = hp.eject_ms / 1000
            h.max_eject_s = hp.max_eject_ms / 1000
        backend.slots.limit = backend.policy.max_concurrency
        backend.slots.reserve = reserve_slots(backend.slots.limit, policy.admission.priority_reserve_pct)
        backend.slots.queue.starvation_share = policy.admission.starvation_share
        backend.slots.standing_target_s, backend.slots.standing_interval_s = policy.admission.standing()
        backend.slots.dispatch()  # a raised max_concurrency lets its waiters in now
        states[name] = backend.state
    registry = stores if stores is not None else {}

    def store_of(sp: StorePolicy) -> Store:
        store = registry.get(sp)
        if store is None:
            store = registry[sp] = open_store(sp)
        return store

    cache = None
    if policy.cache.enabled or any(r.cache and r.cache.enabled for r in policy.models.values()) or any(
        t.cache and t.cache.enabled for t in policy.tenants.values()
    ):
        cache = Cache(store_of(policy.store), ttl_s=policy.cache.ttl_s, max_entry_bytes=policy.cache.max_entry_bytes, on_error=on_cache_error)
    quota = None
    if any(t.quota is not None and t.quota.any() for t in policy.tenants.values()):
        # The fallback is this process's in-memory store: its counters live across reloads.
        quota = Quota(policy, store_of(policy.store), store_of(StorePolicy()), on_degraded=on_quota_degraded)
    # Its own connections with the record's timeout (a Redis store): the cache's few milliseconds
    # would drop records under load, and an answer without its record is not released.
    sp = policy.store
    record_sp = sp if sp.url is None else sp.model_copy(update={"timeout_ms": max(sp.timeout_ms, policy.responses.record_timeout_ms)})
    affinity = _affinity(policy, store_of(record_sp), on_affinity)
    return Runtime(policy, backends, classifier, generation, cache, quota, affinity)


def _affinity(policy: Policy, store: Store, on_event: Callable[[str, str], None] | None) -> Affinity:
    rp = policy.responses
    return Affinity(store, rp.affinity_ttl_s, on_event, timeout_s=rp.record_timeout_ms / 1000,
                    attempts=rp.record_attempts, adopt_unknown=rp.adopt_unknown_ids)


def open_store(sp: StorePolicy) -> Store:
    """The store a policy names (no connection is made until it is used)."""
    if sp.url is None:
        return MemoryStore(max_bytes=sp.memory_max_bytes)
    return RedisStore(sp.url, timeout_ms=sp.timeout_ms, max_connections=sp.max_connections, quota_timeout_ms=sp.quota_timeout_ms)
