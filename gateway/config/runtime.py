"""A Runtime: everything built from one policy, swapped atomically on reload.

Each request reads the current Runtime once and keeps it to the end, so a reload never mixes the
old and the new policy within one request. Building one changes nothing live: its limits on the
backends it shares with the running one (health thresholds, slots) apply once, at the swap
(`Runtime.activate`), so a policy that fails to build leaves everything as it was.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..admission.gate import reserve_slots
from ..cache.core import Cache, cache_key, cacheable_request, key_owner
from ..classify.cascade import LEXICAL_ONLY, Cascade, EncoderWorker, band_for
from ..classify.classifier import DEFAULT_WEIGHTS, Classifier, Rules, Verdict
from ..classify.encoder_meta import meta_of
from ..errors import BadRequest, ModelNotFound, shown
from ..pipeline.call import CacheResult, Call
from ..responses.affinity import Affinity, owner_of
from ..routing.affinity import PrefixMap
from ..routing.backends import Backend, BackendState, Slots
from ..routing.health import Health
from ..routing.hedge_budget import HedgeBudget
from ..routing.latency import Tracker
from ..routing.selector import Candidate, Selector
from ..store.core import FairMemoryStore, MemoryStore, Store
from ..store.redis_store import RedisStore
from ..tenants.auth import Tenant, Tenants
from ..tenants.breaker import Breaker
from ..tenants.quota import Quota, reported
from ..wire.codec import Endpoint
from ..wire.endpoints import ENDPOINTS
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

__all__ = ["Runtime", "Route", "Pool", "HedgeBudget", "CachePlan", "build_runtime", "cascade_for", "open_store"]


log = logging.getLogger("gateway.runtime")

_UNCLASSIFIED = Verdict("complex", 0.0, 1.0, None, {}, ["not classified: this model does not route by class"])


# Budgets a route keeps across reloads, in the state of its first backend (app-owned, carried by
# name): at most this many per state, the oldest dropped (a reload storm of changing routes).
_MAX_BUDGETS = 64


def _hedge_budget(model: str, pct: float, backends: tuple[Backend, ...]) -> HedgeBudget:
    """The route's hedge budget: the one the same route (model, max_extra_pct, backends in order)
    had before this build, else a new one. Nothing in it is a limit the new policy changes (a
    changed `max_extra_pct` or backend list makes a new one), so sharing it from the build on
    changes nothing live."""
    if not backends:
        return HedgeBudget(pct)
    kept = backends[0].state.hedge_budgets
    key = (model, pct, tuple(b.name for b in backends))
    budget = kept.get(key)
    if budget is None:
        if len(kept) >= _MAX_BUDGETS:
            del kept[next(iter(kept))]
        budget = kept[key] = HedgeBudget(pct)
    return budget


@dataclass(frozen=True, slots=True)
class Pool:
    """The candidates of one (model, class) and the selector that ranks them."""

    backends: tuple[Backend, ...]
    candidates: tuple[Candidate, ...]
    selector: Selector
    affinity: bool = False  # prefix affinity ranks it (routing.prefix_affinity)
    mixed: bool = False  # it has local models and others: the simple class's local_first applies
    kinds: frozenset[str] = frozenset({"openai"})  # the APIs its backends speak (BackendPolicy.kind)
    # endpoint -> the translating legs its backends would be reached by (checked at intake)
    translating: dict[str, tuple[Endpoint, ...]] = field(default_factory=dict)
    # the endpoints whose streams may be continued on another backend: every backend's leg can
    continues: frozenset[str] = frozenset()
    # the endpoints whose streams some backend's leg does not store (Endpoint.stores_streams)
    unstored_streams: frozenset[str] = frozenset()


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
    # The process's learned prefix -> backend map, when a pool of this route uses prefix affinity
    # or its conversations keep their class (routing.prefix_affinity.sticky_class); else None.
    prefixes: PrefixMap | None = None
    # endpoint -> (simple, complex) pools of the backends that continue a final assistant turn
    # (BackendPolicy.prefill), for the endpoints whose requests may end in one (Messages)
    prefilling: dict[str, tuple[Pool | None, Pool | None]] = field(default_factory=dict)

    def pool(self, cls: str, endpoint: str = "chat") -> Pool:
        """The candidates for a request class on an endpoint; BadRequest when no backend of this
        route serves the endpoint (decided from the policy, before any upstream call)."""
        pair = self.by_endpoint.get(endpoint)
        if pair is None:
            return self.simple if cls == "simple" else self.complex
        p = pair[0] if cls == "simple" else pair[1]
        if p is None:
            raise BadRequest(
                f"the model {shown(self.model)} is not served on /v1{ENDPOINTS[endpoint].path}: "
                f"no backend of its route lists {endpoint!r} in its `endpoints`",
                param="model",
                code="unsupported_endpoint",
            )
        return p

    def candidates(self, cls: str) -> tuple[Backend, ...]:
        return self.pool(cls).backends

    def prefilled(self, cls: str, endpoint: str) -> Route:
        """The route for a request that ends in an assistant turn its answer continues (Anthropic's
        prefill): only the backends that continue one, context fallbacks included. A chat backend
        that starts a new turn would answer after it instead (the request was a 400 on every chat
        backend, `prefill: true` or not). BadRequest when the class has none."""
        pair = self.prefilling.get(endpoint)
        if pair is None:
            return self
        if (pair[0] if cls == "simple" else pair[1]) is None:
            self.pool(cls, endpoint)  # not served at all: that 400 first
            raise BadRequest(
                f"a final assistant turn (a prefill) is continued only by a backend that continues one (`prefill: true`, "
                f"or `kind: anthropic`): none of the backends of model {shown(self.model)} for this request does",
                param="messages", code="unsupported_prefill",
            )
        return dataclasses.replace(self, by_endpoint={**self.by_endpoint, endpoint: pair},
                                   context_fallbacks=tuple(b for b in self.context_fallbacks if b.prefill))


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
        stores: dict[StorePolicy, Store] | None = None,
        slot_limits: dict[str, int] | None = None,
        prefixes: PrefixMap | None = None,
        cascade: Cascade | None = None,
    ) -> None:
        self.policy = policy
        self.prefixes = prefixes if prefixes is not None else PrefixMap()
        self.generation = generation
        self.created = time.time()
        self.backends = backends
        self.tenants = Tenants(policy)
        self.server = policy.server
        self.routing = policy.routing
        # Applied by `activate`, at the swap: nothing above touched the live backends.
        self.stores = stores if stores is not None else {}  # the stores it uses, by settings
        self.priced = any(b.policy.price is not None for b in backends.values())  # else spend_usd is 0 at once
        self.slot_limits = slot_limits if slot_limits is not None else {n: b.policy.max_concurrency for n, b in backends.items()}
        self._new_models: dict[str, dict[str, Health]] = {}  # backend -> upstream model -> its health, made here
        self._new_trackers: dict[str, dict[str, Tracker]] = {}  # backend -> upstream model -> its tracker, made here
        self._active = False
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
        self.cascade = cascade if cascade is not None else LEXICAL_ONLY
        self.rules = Rules(**cp.rules.model_dump())
        self.cache = cache
        self.quota = quota  # None: no tenant has limits
        # Which backend holds each Responses API id (responses/affinity.py); in memory unless given a store.
        self.affinity = affinity if affinity is not None else _affinity(policy, FairMemoryStore(owner_of), None)

    def activate(self, states: dict[str, BackendState], stores: dict[StorePolicy, Store]) -> None:
        """Put this runtime's limits in force on the live backends: once, at its swap, right after
        its build (no await between: a model health first made between them would be made twice).

        Until now the build only read the live state, so a policy that failed to build changed
        nothing. Applies the health thresholds (each backend's and its models'), the slot limits
        (`slot_limits`: a worker's share), reserves and queue settings, and lets waiters in under a
        raised limit; records the backend states in `states` (measurements carry over by name)
        and registers the stores it opened in `stores` (reused while their settings stay the same;
        one no longer used stays registered, for requests in flight, and closes with the app)."""
        if self._active:
            raise RuntimeError(f"policy generation {self.generation} was activated twice")
        self._active = True
        hp, ap = self.policy.health, self.policy.admission
        for name, backend in self.backends.items():
            state = backend.state
            for upstream, h in self._new_models.get(name, {}).items():
                state.models.setdefault(upstream, h)
            for upstream, t in self._new_trackers.get(name, {}).items():
                state.trackers.setdefault(upstream, t)
            for h in (state.health, *state.models.values()):
                h.failures_to_eject = hp.failures_to_eject
                h.eject_s = hp.eject_ms / 1000
                h.max_eject_s = hp.max_eject_ms / 1000
                # The probes decide; with one tenant (or none) there is nobody else to protect.
                h.corroborate = hp.corroborate and hp.recovery_probe_interval_ms > 0 and self.policy.shared
            # One tenant's slow first tokens move its predicted TTFT only so far (latency.py).
            for t in (state.tracker, *state.trackers.values()):
                t.corroborate = hp.corroborate and self.policy.shared
            slots = backend.slots
            slots.limit = self.slot_limits[name]
            slots.reserve = reserve_slots(slots.limit, ap.priority_reserve_pct)
            slots.queue.starvation_share = ap.starvation_share
            slots.standing_target_s, slots.standing_interval_s = ap.standing()
            slots.dispatch()  # a raised max_concurrency lets its waiters in now
            states[name] = state
        for sp, store in self.stores.items():
            stores.setdefault(sp, store)
        pa = self.routing.prefix_affinity
        self.prefixes.configure(pa.max_entries, pa.prefix_ttl_s)

    def spend_usd(self, call: Call, estimate: tuple[int, int] | None = None) -> float:
        """What the request cost at its backends' `price`s (0 without one, and for a cache hit).

        The answer at its backend's price: its usage's prompt and completion tokens (a usage
        with a figure that is not a whole number from 0 to 2**40 is none: tenants/quota.py
        `reported`), else `estimate`, the (input, output) tokens a quota charged in their place
        (none: 0). Plus the prompt estimate of each read beyond the answer's (failed over after a
        timeout or a cut, a hedge's loser, a continued stream's earlier legs: `out.read_prompts`)
        at the input price of the backends attempted besides the answer's (`out.attempts`),
        dearest first since which of them read it is not recorded, the rest at the dearest one
        attempted: a usage report counts only its own backend's read, and three reads of a
        10,000-token prompt were charged 30,000 tokens but one read's spend (review helper's repro)."""
        if call.cache.result is CacheResult.HIT or not self.priced:
            return 0.0
        input_price = self._input_price
        usd = 0.0
        backend = self.backends.get(call.out.backend or "")
        if backend is not None and backend.policy.price is not None:
            tokens = reported(call.out.usage) or estimate
            if tokens is not None:
                usd = backend.policy.price.usd(*tokens)
        extra = call.out.read_prompts - 1
        if extra > 0 and call.prompt_tokens > 0:
            others = list(call.out.attempts)
            if call.out.backend in others:
                others.remove(call.out.backend)  # one attempt is the answer's: priced above
            dearest = sorted((p for name in others if (p := input_price(name)) is not None), reverse=True)[:extra]
            rest = max((p for name in call.out.attempts if (p := input_price(name)) is not None), default=0.0)
            usd += (sum(dearest) + (extra - len(dearest)) * rest) * call.prompt_tokens / 1e6
        return usd

    def _input_price(self, name: str | None) -> float | None:
        backend = self.backends.get(name or "")
        price = None if backend is None else backend.policy.price
        return None if price is None else price.input_per_mtok

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
        if call.asked.no_cache:
            return CachePlan(None, "cache-control: no-cache")
        # The backends' default temperatures count only for a request that sets none (not built otherwise).
        defaults = _defaults(call, route) if call.body.get("temperature") is None else None
        why = cacheable_request(call.body, require_deterministic=not include_sampled, default_temperatures=defaults)
        if why is None:
            why = call.endpoint.cache_reason(call.body)
        if why is not None:
            return CachePlan(None, why)
        key = cache_key(tenant.cache_namespace, call.endpoint.name, call.model, call.body, call.endpoint.echoed, call.asked.betas)
        return CachePlan(key, None, ttl, not call.asked.no_store)

    def _pool(self, model: str, names: tuple[str, ...], strategy: str) -> Pool:
        rp = self.routing
        picked = tuple(self.backends[b] for b in names)
        cands = tuple(
            Candidate(b.name, self._tracker_for(b, model), self._health_for(b, model), b.policy.weight, _cost(b.policy),
                      b.state.load, b.local)
            for b in picked
        )
        selector = Selector(strategy, tie_pct=rp.tie_pct / 100, cost_weight_s=rp.cost_weight_s,
                            load_stale_s=rp.load_signals.stale_ms / 1000)
        enabled = rp.prefix_affinity.enabled
        affinity = len(picked) >= 2 and (enabled if enabled is not None else True) and strategy == "latency"
        mixed = any(b.local for b in picked) and not all(b.local for b in picked)
        translating, continues, unstored = {}, set(), set()
        for ep, codec in ENDPOINTS.items():
            legs = {leg for b in picked if (leg := codec.toward(b.kind, b.policy.endpoints)) is not None}
            if legs - {codec}:
                translating[ep] = tuple(legs - {codec})
            if legs and all(leg.continues for leg in legs):
                continues.add(ep)
            if not all(leg.stores_streams for leg in legs):
                unstored.add(ep)
        return Pool(picked, cands, selector, affinity, mixed, frozenset(b.kind for b in picked), translating, frozenset(continues),
                    frozenset(unstored))

    def _health_for(self, b: Backend, model: str) -> Health:
        """`b.health_for(model)`, but while building without touching the live state: a model
        health the backend has not had yet is made here and joins its state at `activate`."""
        if self._active:
            return b.health_for(model)
        return _staged(b.state.models, self._new_models, b, model, b.health.for_model)  # as BackendState.model_health

    def _tracker_for(self, b: Backend, model: str) -> Tracker:
        """`b.tracker_for(model)`, made as `_health_for` makes a model's health."""
        if self._active or b.one_model:
            return b.tracker_for(model)
        return _staged(b.state.trackers, self._new_trackers, b, model, b.tracker.for_model)  # as BackendState.model_tracker

    def single_pool(self, model: str, backend: str) -> Pool:
        """A pool of one backend (a follow-up pinned to the backend that holds its state)."""
        return self._pool(model, (backend,), "ordered")

    def _narrowed(self, model: str, pool: Pool | None, keep: Callable[[Backend], bool], strategy: str) -> Pool | None:
        """`pool` when `keep` keeps each of its backends, else a pool of those it keeps (None: none)."""
        if pool is None:
            return None
        names = tuple(b.name for b in pool.backends if keep(b))
        return pool if len(names) == len(pool.backends) else (self._pool(model, names, strategy) if names else None)

    def _prefilling(self, model: str, pool: Pool | None, strategy: str) -> Pool | None:
        """The backends of `pool` that continue a final assistant turn."""
        return self._narrowed(model, pool, lambda b: b.prefill, strategy)

    def _by_endpoint(self, model: str, pool: Pool, strategy: str) -> dict[str, Pool | None]:
        """Per endpoint: the pool itself when every backend serves it, else the ones that do."""
        return {ep: self._narrowed(model, pool, functools.partial(_serves, codec=codec), strategy) for ep, codec in ENDPOINTS.items()}

    def _route(self, model: str, r: ModelRoute) -> Route:
        strategy = r.strategy or self.routing.strategy
        if r.backends is not None:
            simple = complex_ = self._pool(model, r.backends, strategy)
        else:
            simple, complex_ = self._pool(model, r.simple or (), strategy), self._pool(model, r.complex or (), strategy)
        budget = _hedge_budget(model, r.hedge.max_extra_pct, simple.backends + complex_.backends) if r.hedge else None
        s_eps = self._by_endpoint(model, simple, strategy)
        c_eps = s_eps if complex_ is simple else self._by_endpoint(model, complex_, strategy)
        prefilling = {ep: (self._prefilling(model, s_eps[ep], strategy), self._prefilling(model, c_eps[ep], strategy))
                      for ep, codec in ENDPOINTS.items() if codec.client_prefill}
        sticky = r.backends is None and self.routing.prefix_affinity.sticky_class
        learns = sticky or any(p is not None and p.affinity for eps in (s_eps, c_eps) for p in eps.values())
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
            prefixes=self.prefixes if learns else None,
            prefilling=prefilling,
        )

    def classify(self, view: Mapping[str, Any], route: Route) -> Verdict:
        """simple|complex, by the lexical scorer and the rules, of a request's classify view, for
        routes that split by class (or every route with `classify_all`)."""
        if not (route.split or self.classify_all):
            return _UNCLASSIFIED
        threshold = route.threshold if route.threshold is not None else self.threshold
        return self.classifier.classify(view, threshold=threshold, rules=self.rules)

    def uncertain(self, v: Verdict, route: Route) -> bool:
        """Whether the cascade's encoder decides `v`: a lexical score in the uncertain band, on a
        route without a threshold of its own (an explicit threshold is the lexical scorer's)."""
        return route.threshold is None and self.cascade.uncertain(v)

    def route(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise ModelNotFound(f"the model {shown(model)} does not exist", param="model")
        return route


def cascade_for(policy: Policy, lexical: Classifier, encoder: EncoderWorker | None) -> Cascade:
    """The cascade for `policy`: the band encoder.json gives for its recall target, when the
    encoder is on and some route classifies. None (the lexical scorer alone) under an explicit
    `classifier.threshold`, or lexical weights other than those the band was calibrated on.
    Raises ValueError naming `classifier.encoder.weights_dir` for an encoder folder whose
    encoder.json is missing, unreadable or malformed (`gateway check` asks this too)."""
    cp = policy.classifier
    ep = cp.encoder
    classifies = cp.classify_all or any(r.backends is None for r in policy.models.values())
    if ep.enabled is False or not classifies or cp.threshold is not None:
        return LEXICAL_ONLY
    folder = Path(ep.weights_dir) if ep.weights_dir else None
    try:
        meta = meta_of(folder)
        band = band_for(meta, cp.complex_recall_target)
    except ValueError as exc:
        raise ValueError(f"classifier.encoder.weights_dir: {exc}") from None
    if meta.get("lexical_sha256") != lexical.sha256:
        log.warning("classifier: the encoder's band was calibrated on other lexical weights than %s: "
                    "the lexical scorer decides alone", cp.weights_file or DEFAULT_WEIGHTS)
        return LEXICAL_ONLY
    # With two tenants or more, one tenant's requests may hold at most its share of the queue.
    share = ep.max_waiting_per_tenant or max(1, ep.max_batch // 2) if policy.shared else None
    return Cascade(encoder, band, ep.deadline_ms / 1000, share)


def _serves(b: Backend, codec: Endpoint) -> bool:
    """Whether `b` answers `codec`'s requests: natively, or through a translating leg to an
    endpoint of its own API that it serves."""
    return codec.toward(b.kind, b.policy.endpoints) is not None


def _answerers(call: Call, route: Route) -> tuple[Backend, ...]:
    """Every backend that may answer `call`: its class's pool on this endpoint (failover, retries,
    hedges and rescues stay in it) and the route's context fallbacks."""
    return (*route.pool(call.cls, call.endpoint.name).backends, *route.context_fallbacks)


def answer_cost_usd(call: Call, route: Route, prompt_tokens: int, completion_tokens: int) -> float:
    """What an answer of these sizes costs at the dearest `price` among the backends that may
    answer `call`: a spend limit reserves it (0: none has a price)."""
    return max((b.policy.price.usd(prompt_tokens, completion_tokens) for b in _answerers(call, route) if b.policy.price is not None),
               default=0.0)


def answer_ceiling(call: Call, route: Route) -> int | None:
    """The largest answer limit every backend that may answer `call` accepts (_answerers): each
    one's `max_output_tokens`, else the limit its translating leg sends when the request sets none
    (a chat request to an Anthropic backend: 4096); None when one of them cannot say."""
    tops = []
    for b in _answerers(call, route):
        top = b.policy.max_output_tokens
        if top is None and (leg := call.endpoint.toward(b.kind, b.policy.endpoints)) is not None:
            top = leg.default_limit
        if top is None:
            return None
        tops.append(top)
    return min(tops) if tops else None


def _defaults(call: Call, route: Route) -> dict[str, float]:
    """The default temperature of every backend that may answer `call` (_answerers)."""
    return {b.name: b.policy.sampling_default_temperature for b in _answerers(call, route)}


_T = TypeVar("_T")


def _staged(live: Mapping[str, _T], made: dict[str, dict[str, _T]], b: Backend, model: str, make: Callable[[], _T]) -> _T:
    """The live state's object (a health, a tracker) for `model`'s upstream model on `b`, else one
    made while building (`made`, by backend: it joins the state at `activate`), made by `make`."""
    upstream = b.upstream_model(model)
    found = live.get(upstream)
    if found is None:
        new = made.setdefault(b.name, {})
        found = new.get(upstream)
        if found is None:
            found = new[upstream] = make()
    return found


def _cost(bp: BackendPolicy) -> float:
    """What routing.cost_weight_s trades against latency: `cost`, else the backend's price
    (input + output USD per million tokens)."""
    if bp.cost or bp.price is None:
        return bp.cost
    return bp.price.input_per_mtok + bp.price.output_per_mtok


def build_runtime(
    policy: Policy,
    states: Mapping[str, BackendState],
    generation: int,
    stores: Mapping[StorePolicy, Store] | None = None,
    on_cache_error: Callable[[str], None] | None = None,
    on_quota_degraded: Callable[[], None] | None = None,
    on_affinity: Callable[[str, str], None] | None = None,
    slot_share: Callable[[int], int] | None = None,
    prefixes: PrefixMap | None = None,
    encoder: EncoderWorker | None = None,
) -> Runtime:
    """Build a complete Runtime from `policy`, changing nothing live: backend measurements carry
    over from `states` (by name) and stores from `stores` (a store is reused while its settings
    stay the same), both only read here. `Runtime.activate`, at the swap, puts the new limits in
    force and records the states and the stores it opened. `slot_share`: the part of each
    backend's max_concurrency that this process holds (a worker's share; default all of it).

    Raises ValueError (e.g. a missing API key variable) leaving the running one and every live
    limit as they were.
    """
    backends: dict[str, Backend] = {}
    for name, bp in policy.backends.items():
        state = states.get(name)
        if state is None:
            tracker = Tracker()
            state = BackendState(tracker, Health(), Slots(bp.max_concurrency, tracker, name))
        backends[name] = Backend(name, bp, state)
    # Loaded on every build (~5 ms), so an edited weights file takes effect on reload.
    classifier = Classifier.load(policy.classifier.weights_file)
    cascade = cascade_for(policy, classifier, encoder)
    registry: Mapping[StorePolicy, Store] = stores if stores is not None else {}
    used: dict[StorePolicy, Store] = {}

    def store_of(sp: StorePolicy, role: str = "store") -> Store:
        store = used.get(sp)
        if store is None:
            store = registry.get(sp)
            used[sp] = store = store if store is not None else open_store(sp, role)
        return store

    cache = None
    if policy.cache.enabled or any(r.cache and r.cache.enabled for r in policy.models.values()) or any(
        t.cache and t.cache.enabled for t in policy.tenants.values()
    ):
        # In memory, shared fairly among namespaces (a shared store is itself: Redis's own LRU).
        cache_sp = policy.store if policy.cache.store is None else policy.cache.store
        cache_store = store_of(cache_sp) if policy.cache.store is None else store_of(cache_sp, "cache")
        # On Redis, skipped for a moment after a few timeouts in a row (a stall): a failure that
        # took nearly the whole timeout counts, a refused connection (which fails at once) does not.
        breaker = Breaker() if cache_sp.url is not None else None
        cache = Cache(cache_store.own("cache", key_owner), ttl_s=policy.cache.ttl_s,
                      max_entry_bytes=policy.cache.max_entry_bytes, on_error=on_cache_error,
                      breaker=breaker, slow_s=0.9 * cache_sp.timeout_ms / 1000)
    quota = None
    if any(t.quota is not None and t.quota.any() for t in policy.tenants.values()):
        # The fallback is this process's in-memory store: its counters live across reloads.
        quota = Quota(policy, store_of(policy.store), store_of(StorePolicy()), on_degraded=on_quota_degraded)
    # Its own connections with the record's timeout (a Redis store): the cache's few milliseconds
    # would drop records under load, and an answer without its record is not released.
    sp = policy.store
    record_sp = sp if sp.url is None else sp.model_copy(update={"timeout_ms": max(sp.timeout_ms, policy.responses.record_timeout_ms)})
    affinity = _affinity(policy, store_of(record_sp, "records").own("records", owner_of), on_affinity)
    share = slot_share if slot_share is not None else (lambda n: n)
    slot_limits = {name: share(bp.max_concurrency) for name, bp in policy.backends.items()}
    return Runtime(policy, backends, classifier, generation, cache, quota, affinity, used, slot_limits, prefixes, cascade)


def _affinity(policy: Policy, store: Store, on_event: Callable[[str, str], None] | None) -> Affinity:
    rp = policy.responses
    return Affinity(store, rp.affinity_ttl_s, on_event, timeout_s=rp.record_timeout_ms / 1000,
                    attempts=rp.record_attempts, adopt_unknown=rp.adopt_unknown_ids, replicas=rp.record_replicas)


def open_store(sp: StorePolicy, role: str = "store") -> Store:
    """The store a policy names (no connection is made until it is used); `role` names its
    connections on a Redis (CLIENT LIST: gw-<role>-<pid>)."""
    if sp.url is None:
        return MemoryStore(max_bytes=sp.memory_max_bytes)
    return RedisStore(sp.url, timeout_ms=sp.timeout_ms, max_connections=sp.max_connections, quota_timeout_ms=sp.quota_timeout_ms,
                      tls=sp.tls, role=role, quotas=role not in ("records", "cache"))
