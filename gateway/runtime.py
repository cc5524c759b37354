"""A Runtime: everything built from one policy, swapped atomically on reload.

Each request reads the current Runtime once and keeps it to the end, so a reload never mixes the
old and the new policy within one request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .auth import Tenants
from .call import Call
from .backends import Backend, BackendState, Slots
from .errors import ModelNotFound
from .health import Health
from .latency import Tracker
from .policy import Policy

__all__ = ["Runtime", "Route", "Verdict", "build_runtime"]


@dataclass(frozen=True, slots=True)
class Verdict:
    cls: str
    score: float | None
    reasons: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Route:
    """Candidate backends for one public model, in policy order, per request class."""

    model: str
    simple: tuple[Backend, ...]
    complex: tuple[Backend, ...]
    split: bool  # True when simple and complex prompts go to different lists (the `auto` style)

    def candidates(self, cls: str) -> tuple[Backend, ...]:
        return self.simple if cls == "simple" else self.complex


class Runtime:
    def __init__(self, policy: Policy, backends: dict[str, Backend], generation: int) -> None:
        self.policy = policy
        self.generation = generation
        self.created = time.time()
        self.backends = backends
        self.tenants = Tenants(policy)
        self.server = policy.server
        routes: dict[str, Route] = {}
        for model, candidates in policy.served_models().items():
            picked = tuple(backends[b] for b in candidates)
            routes[model] = Route(model, picked, picked, split=False)
        for model, r in policy.models.items():
            if r.backends is not None:
                picked = tuple(backends[b] for b in r.backends)
                routes[model] = Route(model, picked, picked, split=False)
            else:
                routes[model] = Route(
                    model,
                    tuple(backends[b] for b in r.simple or ()),
                    tuple(backends[b] for b in r.complex or ()),
                    split=True,
                )
        self.routes = routes
        self.public_models = policy.public_models()

    def classify(self, call: "Call", route: Route) -> "Verdict":
        """Until a classifier is configured every request counts as complex."""
        return Verdict("complex", None, ("no classifier configured: every request counts as complex",))

    def route(self, model: str) -> Route:
        route = self.routes.get(model)
        if route is None:
            raise ModelNotFound(f"the model {model!r} does not exist", param="model")
        return route


def build_runtime(policy: Policy, states: dict[str, BackendState], generation: int) -> Runtime:
    """Build a Runtime; backend measurements carry over from `states` (updated in place).

    Raises ValueError (e.g. a missing API key variable) without touching the running one.
    """
    backends: dict[str, Backend] = {}
    srv = policy.server
    for name, bp in policy.backends.items():
        state = states.get(name) or BackendState(
            Tracker(), Health(failures_to_eject=srv.failures_to_eject, eject_s=srv.eject_ms / 1000), Slots(bp.max_concurrency)
        )
        backends[name] = Backend(name, bp, state)
    # Only now that every backend built: apply the new limits to the live state.
    for name, backend in backends.items():
        backend.state.health.failures_to_eject = srv.failures_to_eject
        backend.state.health.eject_s = srv.eject_ms / 1000
        backend.slots.limit = backend.policy.max_concurrency
        states[name] = backend.state
    return Runtime(policy, backends, generation)
