"""A Runtime: everything built from one policy, swapped atomically on reload.

Each request reads the current Runtime once and keeps it to the end, so a reload never mixes the
old and the new policy within one request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .auth import Tenants
from .backends import Backend, BackendState, Slots
from .call import Call
from .classify import Classifier, Rules, Verdict
from .errors import ModelNotFound
from .health import Health
from .latency import Tracker
from .policy import Policy

__all__ = ["Runtime", "Route", "build_runtime"]


_UNCLASSIFIED = Verdict("complex", 0.0, 1.0, None, {}, ["not classified: this model does not route by class"])


@dataclass(frozen=True, slots=True)
class Route:
    """Candidate backends for one public model, in policy order, per request class."""

    model: str
    simple: tuple[Backend, ...]
    complex: tuple[Backend, ...]
    split: bool  # True when simple and complex prompts go to different lists (the `auto` style)
    threshold: float | None = None

    def candidates(self, cls: str) -> tuple[Backend, ...]:
        return self.simple if cls == "simple" else self.complex


class Runtime:
    def __init__(self, policy: Policy, backends: dict[str, Backend], classifier: Classifier, generation: int) -> None:
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
                    threshold=r.threshold,
                )
        self.routes = routes
        self.public_models = policy.public_models()
        cp = policy.classifier
        self.classifier = classifier
        self.threshold = cp.threshold
        self.classify_all = cp.classify_all
        self.rules = Rules(**cp.rules.model_dump())

    def classify(self, call: Call, route: Route) -> Verdict:
        """simple|complex for routes that split by class (or every route with `classify_all`)."""
        if not (route.split or self.classify_all):
            return _UNCLASSIFIED
        threshold = route.threshold if route.threshold is not None else self.threshold
        return self.classifier.classify(call.body, threshold=threshold, rules=self.rules)

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
    # Loaded on every build (~5 ms), so an edited weights file takes effect on reload.
    classifier = Classifier.load(policy.classifier.weights_file)
    return Runtime(policy, backends, classifier, generation)
