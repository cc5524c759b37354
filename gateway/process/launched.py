"""In a worker: follow the readiness of the local backends another process (the supervisor) launched."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from urllib.parse import urlsplit

import aiohttp

from .launch_proof import check, health_url, other_answers
from .launcher import NOT_ANSWERING, LaunchState

__all__ = ["LaunchStates", "watch_launched"]

log = logging.getLogger("gateway.launcher")

_WATCH_READY_S = 1.0  # between polls of a ready launched backend
_WATCH_STARTING_S = 0.2  # between polls while it starts: traffic waits for this
_WATCH_FAILURES = 3  # failed polls in a row before a ready backend counts as gone
_WATCH_REASON_S = 1.0  # between questions to the launching process while one is not ready

# What the launching process says about its children (the supervisor, through the control socket).
LaunchStates = Callable[[], Awaitable[Mapping[str, LaunchState]]]


async def watch_launched(
    backends: Callable[[], Iterable[tuple[str, str, Callable[[LaunchState], None]]]],
    launch_states: LaunchStates,
) -> None:
    """In a worker: follow the readiness of the backends another process launched, by polling
    their /healthz (`backends()` yields name, base URL and a setter, read anew each round so it
    follows reloads). While one is not ready, `launch_states()` (the launching process's
    `Children.states()`, at most once a second; empty when it cannot answer) says why, e.g. a
    failed start and its retry, or a model that stopped answering and is being restarted; and
    gives its launch's health token: only an answer with the proof of it counts, so a worker takes
    no other process on the port for the model (and, until the launcher has said, none at all).
    Runs until cancelled."""
    failures: dict[str, int] = {}
    ready: dict[str, bool] = {}
    was_up: set[str] = set()  # ready at some point: failing now is not "starting"
    known: Mapping[str, LaunchState] = {}
    tokens: dict[str, str] = {}  # the launcher's latest word on each one's health token
    others: set[str] = set()  # something else answers its port (logged once in a row)
    asked_at = -math.inf
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout, cookie_jar=aiohttp.DummyCookieJar()) as http:
        while True:
            current = list(backends())
            checked_at = time.monotonic()
            used = [tokens.get(name) for name, _, _ in current]
            results = await asyncio.gather(
                *(check(http, health_url(url), token) for (_, url, _), token in zip(current, used, strict=True))
            )
            down = [name for (name, _, _), found in zip(current, results, strict=True) if found != "ok"]
            if down and time.monotonic() - asked_at >= _WATCH_REASON_S:
                asked_at = time.monotonic()
                known = await launch_states()
                tokens.update({name: st.health_token for name, st in known.items() if st.health_token is not None})
            for (name, url, set_state), found, token in zip(current, results, used, strict=True):
                ok = found == "ok"
                # A 200 without the proof, checked with the token the launcher gives now (after a
                # restart the new child's proof fails the old token until the launcher was asked).
                other = found == "other" and token is not None and asked_at >= checked_at and tokens.get(name) == token
                if other and name not in others:
                    log.warning("backend %s: %s", name, other_answers(urlsplit(url).netloc))
                if other:
                    others.add(name)
                elif found != "other":
                    others.discard(name)
                failures[name] = 0 if ok else failures.get(name, 0) + 1
                now = ok or (ready.get(name, False) and failures[name] < _WATCH_FAILURES)
                if now != ready.get(name):
                    log.info("backend %s: launched model %s", name, "ready" if now else "not ready")
                ready[name] = now
                theirs = known.get(name)
                if now:
                    was_up.add(name)
                    set_state(LaunchState(True))
                elif theirs is not None and not theirs.ready:
                    set_state(theirs)  # the launcher's word: starting, a failed start, a restart
                elif name in was_up:
                    # The launcher still counts it as up (its own checks are more lenient, as it
                    # kills on them) or cannot say: this worker's polls fail, so say that.
                    set_state(LaunchState(False, other_answers(urlsplit(url).netloc) if name in others else NOT_ANSWERING))
                else:
                    set_state(LaunchState(False))
            starting = any(not ready.get(name, False) for name, _, _ in current)
            await asyncio.sleep(_WATCH_STARTING_S if starting else _WATCH_READY_S)
