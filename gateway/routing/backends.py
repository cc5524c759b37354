"""Backends: an OpenAI-compatible HTTP endpoint and the state the gateway keeps about it.

The local model server is just another one of these: one backend kind, one way to measure TTFT.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from yarl import URL

from ..admission.gate import Gate
from ..config.policy import BackendPolicy, secret_problem
from ..wire.endpoints import ENDPOINTS
from .health import Health
from .hedge_budget import HedgeBudget
from .latency import Tracker
from .load import Load

__all__ = ["ANTHROPIC_VERSION", "BETA_HEADERS", "FORWARDED", "Backend", "BackendState", "Slots"]

# The client's headers that turn on a provider's beta features, passed on to the backends whose
# API reads them (Claude Code and the SDKs send `anthropic-beta` for 1M context, interleaved
# thinking, ...). Nothing else of the client's headers goes upstream: not OpenAI-Organization or
# -Project, which would pick what the gateway's own key is billed to.
FORWARDED: dict[str, tuple[str, ...]] = {"anthropic": ("anthropic-beta",), "openai": ("openai-beta",)}
BETA_HEADERS = tuple(name for names in FORWARDED.values() for name in names)

ANTHROPIC_VERSION = "2023-06-01"  # the Messages API version a `kind: anthropic` backend is called with


class Slots(Gate):
    """At most `limit` requests in flight on a backend; waiters queue by band and tenant
    (admission.FairQueue).

    The count lives in the backend's tracker (`tracker.inflight`): one number that the limit, the
    selector and /admin all read. Whoever acquires a slot releases it in the same `try/finally`
    (see relay_base.RelayBase.attempt), so a task cancelled at any await point gives its slot back."""

    def __init__(self, limit: int, tracker: Tracker | None = None, backend: str = "") -> None:
        # Named in the queue's log lines: which backend's slots a miscounted waiter was in.
        name = f"backend {backend!r}'s slots" if backend else "a backend's slots"
        super().__init__(limit, tracker if tracker is not None else Tracker(), name=name)


@dataclass
class BackendState:
    """What the gateway measured about a backend; kept across policy reloads by name."""

    tracker: Tracker = field(default_factory=Tracker)  # the backend as a whole: in-flight, /admin, /metrics
    health: Health = field(default_factory=Health)  # the backend as a whole: readiness, probes, connections
    # In-flight slots live here, not on Backend, so a reload mid-request keeps counting right.
    slots: Slots | None = None
    models: dict[str, Health] = field(default_factory=dict)  # upstream model -> its own health
    load: Load = field(default_factory=Load)  # the model server's own load gauges (metrics_url)
    # upstream model -> its own latency tracker (routing, deadlines, hedging), `tracker` its parent
    trackers: dict[str, Tracker] = field(default_factory=dict)
    # (model, max_extra_pct, backend names) -> the hedge budget of a route that starts with this
    # backend: an unchanged route keeps its budget across reloads (config/runtime.py _hedge_budget)
    hedge_budgets: dict[tuple[str, float, tuple[str, ...]], HedgeBudget] = field(default_factory=dict)

    def model_health(self, upstream: str) -> Health:
        """The health of one upstream model on this backend (created on first use)."""
        h = self.models.get(upstream)
        if h is None:
            h = self.models[upstream] = self.health.for_model()
        return h

    def model_tracker(self, upstream: str) -> Tracker:
        """The latency tracker of one upstream model on this backend (created on first use)."""
        t = self.trackers.get(upstream)
        if t is None:
            t = self.trackers[upstream] = self.tracker.for_model()
        return t

    def __post_init__(self) -> None:
        if self.slots is None:
            self.slots = Slots(64, self.tracker)


class Backend:
    """One configured backend, as built from the current policy."""

    def __init__(self, name: str, policy: BackendPolicy, state: BackendState) -> None:
        self.name = name
        self.policy = policy
        self.base_url = policy.url
        self.model_map = policy.model_map
        self.default_model = next(iter(self.model_map.values()))
        # One upstream model: its figures are the backend's, kept in the backend's own tracker (a
        # model's tracker beside it would double every sample's cost for nothing).
        self.one_model = len(set(self.model_map.values())) == 1
        self.state = state
        self.tracker = state.tracker
        self.health = state.health
        assert state.slots is not None
        self.slots: Slots = state.slots
        self.timeouts = policy.timeouts
        # Built once: URL parsing and timeout objects are measurable costs per request.
        self.urls = {name: URL(self.base_url + ep.path) for name, ep in ENDPOINTS.items()}
        # identity: the relay reads every event, and passes bytes on without re-encoding them.
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        self.kind = policy.kind
        if policy.kind == "anthropic":
            headers["anthropic-version"] = ANTHROPIC_VERSION
        if policy.api_key_env:
            key = _secret(f"backends.{name}.api_key_env", policy.api_key_env)
            if policy.kind == "anthropic":
                headers["x-api-key"] = key
            else:
                headers["Authorization"] = f"Bearer {key}"
        secret = {h: _secret(f"backends.{name}.headers_env.{h}", env) for h, env in policy.headers_env.items()}
        self.headers = {**policy.headers, **secret, **headers}
        # The client's beta headers this backend's API reads (FORWARDED): passed on, after its own.
        self.forwards = FORWARDED[policy.kind]
        self.metrics_url = policy.metrics_url or (_sibling_metrics(self.base_url) if policy.launch else None)
        self.local = policy.local if policy.local is not None else policy.launch is not None
        self.salts = policy.cache_salt if policy.cache_salt is not None else policy.launch is not None

    def upstream_model(self, public: str) -> str:
        """The name this backend knows a public model by (its default model for `auto`-style routes)."""
        return self.model_map.get(public, self.default_model)

    def tracker_for(self, public: str | None) -> Tracker:
        """The latency tracker that routing, deadlines and hedging read for a request for
        `public`: its upstream model's (one model's first tokens say nothing about another's);
        the backend's own for a request that names no model (a by-id call), and for every request
        where the backend serves one model."""
        return self.tracker if self.one_model or not public else self.state.model_tracker(self.upstream_model(public))

    def health_for(self, public: str) -> Health:
        """The health that decides whether a request for `public` may go here: its upstream
        model's, which also reflects the backend's own."""
        return self.state.model_health(self.upstream_model(public))

    def headline_health(self) -> Health:
        """The health to report for the backend as a whole: its one model's (which includes the
        backend's own), or with several models the backend's own (each model's is listed apart)."""
        models = self.state.models
        if len(models) == 1:
            return next(iter(models.values()))
        return self.health

    def takes_traffic(self) -> bool:
        """Ready, not ejected, and at least one of its models not ejected."""
        models = self.state.models
        return self.health.healthy and (not models or any(h.healthy for h in models.values()))

    @property
    def prefill(self) -> bool:
        """Whether it continues a trailing assistant message (see BackendPolicy.prefill)."""
        p = self.policy.prefill
        # Anthropic's Messages API continues a trailing assistant turn (its "prefill"), as our local model does.
        return p if p is not None else (self.policy.launch is not None or self.policy.kind == "anthropic")

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.base_url!r})"


def _secret(where: str, env: str) -> str:
    """A backend's secret from the environment variable `env` (its key, a header's value): a
    ValueError naming `where` when it is unset or cannot be sent in a header (secret_problem):
    refused at start and on reload, not a 500 on every request to the backend."""
    value = os.environ.get(env)
    if not value:
        raise ValueError(f"{where}: environment variable {env} is not set")
    if (problem := secret_problem(env, value)) is not None:
        raise ValueError(f"{where}: {problem}")
    return value


def _sibling_metrics(base_url: str) -> str:
    """A launched local backend's /metrics: next to its /v1."""
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    return root + "/metrics"
