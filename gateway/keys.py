"""Typed keys of the app's shared state (aiohttp AppKeys): the only mutable wiring there is."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .admission import Admission
    from .metrics import Metrics
    from .relay import RelayContext
    from .reload import Live, Reloader

__all__ = ["ADMISSION", "LIVE", "METRICS", "RELAY", "RELOADER"]

LIVE: web.AppKey["Live"] = web.AppKey("live")
METRICS: web.AppKey["Metrics"] = web.AppKey("metrics")
RELAY: web.AppKey["RelayContext"] = web.AppKey("relay")
RELOADER: web.AppKey["Reloader"] = web.AppKey("reloader")
ADMISSION: web.AppKey["Admission"] = web.AppKey("admission")
