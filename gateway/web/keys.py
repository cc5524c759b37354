"""Typed keys of the app's shared state (aiohttp AppKeys): the only mutable wiring there is."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncio

from aiohttp import web

if TYPE_CHECKING:
    from ..admin.keys import KeyBook
    from ..admin.overview import Overviews
    from ..admin.request_log import RequestLog
    from ..admission.gate import Admission
    from ..classify.cascade import EncoderWorker
    from ..config.reload import Live, Reloader
    from ..observe.metrics import Metrics
    from ..observe.observer import Observer
    from ..pipeline.core import Pipeline
    from ..process.peers import Peers
    from ..process.workers import WorkerInfo
    from ..relay.context import RelayContext
    from .body import BodyBudget
    from .drain import Drain

__all__ = ["ADMISSION", "BODY_BUDGET", "DRAIN", "ENCODER", "EXPORTS", "KEYBOOK", "LIVE", "LOOPBACK", "METRICS", "OBSERVER", "OVERVIEWS", "PEERS", "PIPELINE", "POLICY_CHECK",
           "RELAY", "RELOADER", "REQUEST_LOG", "WORKER"]

LIVE: web.AppKey["Live"] = web.AppKey("live")
METRICS: web.AppKey["Metrics"] = web.AppKey("metrics")
RELAY: web.AppKey["RelayContext"] = web.AppKey("relay")
PIPELINE: web.AppKey["Pipeline"] = web.AppKey("pipeline")
RELOADER: web.AppKey["Reloader"] = web.AppKey("reloader")
ADMISSION: web.AppKey["Admission"] = web.AppKey("admission")
DRAIN: web.AppKey["Drain"] = web.AppKey("drain")
OBSERVER: web.AppKey["Observer"] = web.AppKey("observer")
# Set in one process only (a single gateway); None in the workers of a supervisor, which has it.
PEERS: web.AppKey["Peers | None"] = web.AppKey("peers")
WORKER: web.AppKey["WorkerInfo | None"] = web.AppKey("worker")
# Whether the app is bound to a loopback address only (set by create_app from its `host`).
LOOPBACK: web.AppKey[bool] = web.AppKey("loopback", bool)
# The admin plane's: virtual keys (admin/keys.py) and the request log (admin/request_log.py).
KEYBOOK: web.AppKey["KeyBook"] = web.AppKey("keybook")
REQUEST_LOG: web.AppKey["RequestLog"] = web.AppKey("request_log")
# The console's overview of the log, computed once at a time and reused for a moment (admin/overview.py).
OVERVIEWS: web.AppKey["Overviews"] = web.AppKey("overviews")
# The classifier cascade's encoder (classify/cascade.py): one per process, loaded in the background.
ENCODER: web.AppKey["EncoderWorker"] = web.AppKey("encoder")
# Bytes of request bodies still arriving, per tenant (web/body.py): one per process.
BODY_BUDGET: web.AppKey["BodyBudget"] = web.AppKey("body_budget")
# Held while a pasted policy is checked (POST /admin/policy/check, in a thread): one at a time.
POLICY_CHECK: web.AppKey[asyncio.Lock] = web.AppKey("policy_check", asyncio.Lock)
# Held by each request log export (GET /admin/requests/export): a few at a time.
EXPORTS: web.AppKey[asyncio.Semaphore] = web.AppKey("exports", asyncio.Semaphore)
