"""Active health probes, two kinds:

- a *request probe*: a one-token request to the model itself (text completions, else chat, else
  embeddings, as the backend serves them), sent with the backend's key to each ejected
  (backend, model) every `health.recovery_probe_interval_ms`, one at a time each. A good
  one ends the ejection (health.Health.report_probe), so a recovery is seen within about a second
  whatever the back-off says, while a backend that is still down costs one cheap request a second
  and no user request. It goes nowhere near tenants: no quota, no tokens counted, no latency sample.
- a *model-list probe*: a cheap `GET /models` to ejected, half-open and idle backends every
  `health.probe_interval_ms`. Passive checks see only the traffic a backend gets; an idle backend
  gets none, so this is how a dead idle one is ejected before a user finds out.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..config.reload import Live
from ..observe.metrics import Metrics
from .backends import Backend
from .health import LIVE_DEADLINE

__all__ = ["run_probes", "probe", "probe_request", "ProbeResult", "read_capped", "recovery_targets"]

log = logging.getLogger("gateway.probes")

# Request probe bodies, in the order tried: the first endpoint the backend serves that gives a
# conclusive answer decides (and is tried first next time). One token, a four-letter prompt: cheap
# wherever it is billed. Text completions first: the least the model can do (no chat template),
# served by self-hosted engines (vLLM, TGI, llama.cpp, our local server); a provider whose chat
# models refuse it (404) is asked on chat instead.
_PING = "ping"
_BODIES: dict[str, dict[str, Any]] = {
    "completions": {"prompt": _PING, "max_tokens": 1, "stream": False},
    "chat": {"messages": [{"role": "user", "content": _PING}], "max_tokens": 1, "stream": False},
    "embeddings": {"input": _PING},
    "messages": {"messages": [{"role": "user", "content": _PING}], "max_tokens": 1},  # a `kind: anthropic` backend
}
# What a good answer holds: an answer, not just a 200 (a proxy's HTML page is no answer).
_ANSWER_KEY = {"chat": "choices", "completions": "choices", "embeddings": "data", "messages": "content"}
_MAX_BODY_BYTES = 1 << 20  # a one-token answer is well under this
# Statuses that count against the backend (health.OUTCOMES); other 4xx say the request's shape
# is not served there (unknown parameter, model or path), so the next endpoint is tried.
_FAILED_4XX = frozenset({401, 403, 408})


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A request probe's verdict. `ok`: True answered, False failed, None inconclusive (busy, or
    no endpoint took the request's shape). `whole_backend`: the connection itself failed, which
    is about the backend, not the model (as in relay/report.py)."""

    ok: bool | None
    whole_backend: bool = False
    why: str = ""
    endpoint: str | None = None  # the endpoint whose answer decided (None: none did)


async def probe(http: aiohttp.ClientSession, backend: Backend, timeout_s: float) -> bool:
    """True when the backend answers its model list (any status below 500 but 429)."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(backend.base_url + "/models", headers=backend.headers) as resp:
                await read_capped(resp.content, _MAX_BODY_BYTES)  # the status decides; the body is bounded, then dropped
                return resp.status < 500 and resp.status != 429
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False


async def probe_request(
    http: aiohttp.ClientSession, backend: Backend, model: str, timeout_s: float, first: str | None = None
) -> ProbeResult:
    """Send `model` (its upstream name) a minimal real request on `backend`, within `timeout_s`
    in all; the first conclusive answer among the endpoints it serves decides (`first`: the one
    that decided last time, tried first)."""
    headers = {**backend.headers, "x-gateway-probe": "recovery"}
    served = sorted((ep for ep in _BODIES if ep in backend.policy.endpoints), key=lambda ep: ep != first)
    try:
        async with asyncio.timeout(timeout_s):
            for ep in served:
                body = orjson.dumps({"model": model, **_BODIES[ep]})
                async with http.post(backend.urls[ep], data=body, headers=headers) as resp:
                    raw = await read_capped(resp.content, _MAX_BODY_BYTES)
                    status = resp.status
                why = f"{ep}: HTTP {status}"
                if 200 <= status < 300:
                    return ProbeResult(_is_answer(raw, _ANSWER_KEY[ep]), why=why, endpoint=ep)
                if status >= 500 or status in _FAILED_4XX:
                    return ProbeResult(False, why=why, endpoint=ep)
                if status == 429:
                    return ProbeResult(None, why=why, endpoint=ep)  # busy, not broken: says nothing
    except TimeoutError:
        return ProbeResult(False, why="timeout")
    except aiohttp.ClientConnectorError as exc:
        return ProbeResult(False, whole_backend=True, why=f"connect: {type(exc).__name__}")
    except (aiohttp.ClientError, OSError) as exc:
        return ProbeResult(False, why=type(exc).__name__)
    return ProbeResult(None, why="no endpoint took a minimal request")


async def read_capped(stream: aiohttp.StreamReader, cap: int) -> bytes | None:
    """The body, or None once it passes `cap` bytes."""
    buf = bytearray()
    async for chunk in stream.iter_any():
        buf += chunk
        if len(buf) > cap:
            return None
    return bytes(buf)


def _is_answer(raw: bytes | None, key: str) -> bool:
    if raw is None:
        return False
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get(key), list)


def recovery_targets(backend: Backend) -> list[tuple[str, float]]:
    """The upstream models of `backend` that a request probe should try now, each with when its
    ejection began: each one ejected itself, or (when only the backend as a whole is out, e.g.
    refused connections) one model it serves. An ejection that only one tenant's requests caused
    (health.Health.verifying) is due at once (-inf): the probe confirms or undoes it. Not a
    half-open one: its next request is the trial (probing it would cost a request a second for as
    long as it stays idle). None while a launched backend starts: its launcher watches it."""
    h = backend.health
    if not h.ready:
        return []
    now = h.clock()
    models = [(m, -math.inf if mh.verifying else mh.ejected_at) for m, mh in backend.state.models.items()
              if now < mh.ejected_until or mh.verifying]
    if not models and (now < h.ejected_until or h.verifying):
        models = [(next(iter(backend.state.models), backend.default_model), -math.inf if h.verifying else h.ejected_at)]
    return models


def _report_request(backend: Backend, model: str, result: ProbeResult, metrics: Metrics) -> None:
    """Report a request probe to the health it is about (health decides what it means)."""
    if result.ok is None:
        return
    mh = backend.state.model_health(model)
    whole = backend.health  # its own ejection waits for this probe when a call naming no model caused it
    verifying, suspect = mh.verifying or whole.verifying, mh.suspect or whole.suspect
    if result.ok:  # the model answered: the backend as a whole did too
        backend.health.report_probe(True, request=True)
        mh.report_probe(True, request=True)
    elif result.whole_backend:
        backend.health.report_probe(False)
        if mh.verifying:
            mh.report_probe(False)  # the one-tenant run waiting for this probe is corroborated
    else:
        mh.report_probe(False)
        if whole.verifying:
            whole.report_probe(False)  # its ejection stands (it is out: nothing more is counted)
    if verifying:
        metrics.health_verifications.labels(backend.name, "cleared" if result.ok else "confirmed").inc()
        how = ("was answered: the ejection is undone, and such failures do not count for a while" if result.ok
               else f"failed too ({result.why}): the ejection stands")
        who = "timeouts at first-token deadlines set from live data" if suspect == LIVE_DEADLINE else \
            f"failures that only tenant {suspect!r}'s requests met"
        log.warning("backend %s model %r was ejected after %s; the gateway's own request probe %s", backend.name, model, who, how)


async def _recover(
    http: aiohttp.ClientSession, backend: Backend, model: str, timeout_s: float, metrics: Metrics,
    inflight: set[tuple[str, str]], shapes: dict[tuple[str, str], str],
) -> None:
    """One request probe, reported; never raises (one probe's bug must not end the prober)."""
    key = (backend.name, model)
    try:
        before = backend.headline_health().state()
        result = await probe_request(http, backend, model, timeout_s, shapes.get(key))
        if result.endpoint is not None:
            shapes[key] = result.endpoint
        _report_request(backend, model, result, metrics)
        label = {True: "ok", False: "failed", None: "inconclusive"}[result.ok]
        metrics.probes.labels(backend.name, label).inc()
        after = backend.headline_health().state()
        if before != after:
            log.info("backend %s model %r: %s -> %s after a request probe (%s)", backend.name, model, before, after, result.why)
    except Exception:
        log.exception("request probe of backend %s model %r failed", backend.name, model)
    finally:
        inflight.discard(key)


async def _recovery_probes(live: Live, metrics: Metrics, http: aiohttp.ClientSession, tg: asyncio.TaskGroup) -> None:
    """A request probe to each ejected (backend, model) every `health.recovery_probe_interval_ms`,
    the first one interval after its ejection began (a backend that has just failed is not asked
    again at once), one at a time each."""
    inflight: set[tuple[str, str]] = set()
    last: dict[tuple[str, str], float] = {}  # when each target's last probe started
    shapes: dict[tuple[str, str], str] = {}  # the endpoint that last gave each target a conclusive answer
    while True:
        every = live.runtime.policy.health.recovery_probe_interval_ms / 1000
        # A quarter interval between looks (at most 0.1 s: an ejection waiting for a probe's word,
        # Health.corroborate, is probed at once): each target is probed within ~1.25 intervals.
        await asyncio.sleep(max(0.05, min(0.1, every / 4)) if every > 0 else 1.0)  # off: look again later (a reload may turn it on)
        rt = live.runtime  # follows reloads
        hp = rt.policy.health
        every = hp.recovery_probe_interval_ms / 1000
        if every <= 0:
            continue
        for backend in rt.backends.values():
            now = backend.health.clock()
            for model, since in recovery_targets(backend):
                key = (backend.name, model)
                if key in inflight or now < max(since, last.get(key, 0.0)) + every:
                    continue  # one at a time each: a hanging backend is not piled on
                last[key] = now
                inflight.add(key)
                tg.create_task(_recover(http, backend, model, hp.probe_timeout_ms / 1000, metrics, inflight, shapes))


def _due(backend: Backend, interval_s: float) -> bool:
    h = backend.health
    if not h.ready:
        return False  # a launched backend still starting: its launcher watches it
    healths = (h, *backend.state.models.values())
    return any(x.state() in ("ejected", "probing") for x in healths) or backend.tracker.idle_s() > interval_s


async def _list_probes(live: Live, metrics: Metrics, http: aiohttp.ClientSession) -> None:
    """Model-list probes to due backends every `health.probe_interval_ms`."""
    while True:
        rt = live.runtime  # follows reloads
        hp = rt.policy.health
        interval = hp.probe_interval_ms / 1000
        await asyncio.sleep(interval)
        due = [b for b in rt.backends.values() if _due(b, interval)]
        if not due:
            continue
        results = await asyncio.gather(*(probe(http, b, hp.probe_timeout_ms / 1000) for b in due))
        for backend, ok in zip(due, results, strict=True):
            before = backend.headline_health().state()
            backend.health.report_probe(ok)  # a failed probe counts against the backend as a whole
            if ok:  # a good one may end a first ejection early, the backend's or a model's (half-open)
                for h in backend.state.models.values():
                    h.report_probe(True)
            metrics.probes.labels(backend.name, "ok" if ok else "failed").inc()
            after = backend.headline_health().state()
            if before != after:
                log.info("backend %s: %s -> %s after a %s probe", backend.name, before, after, "good" if ok else "failed")


async def run_probes(live: Live, metrics: Metrics) -> None:
    """Run both kinds of probe until cancelled (cancelling this cancels every probe in flight)."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_list_probes(live, metrics, http))
            tg.create_task(_recovery_probes(live, metrics, http, tg))
