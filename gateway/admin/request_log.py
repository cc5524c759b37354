"""The request log: every API request's metadata, written off the request path.

A request that ends costs a dict and a deque append (`RequestLog.add`); a writer task sends what
came to the store (admin/log_store.py) every `request_log.flush_ms`. Bounded when the store is
slow or down: at most `request_log.queue` entries wait, more are dropped and counted
(`gateway_request_log_dropped_total{reason="queue_full"}`), and a batch the store does not take
within `write_timeout_ms` is dropped and counted (`reason="store"`): never a blocked request,
never a queue that grows without bound.

Prompts and answers are kept only for tenants with `log_payloads: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from ..config.policy import RequestLogPolicy
from ..pipeline.call import Call
from .log_store import LogStore

if TYPE_CHECKING:
    from ..config.runtime import Runtime

__all__ = ["RequestLog", "entry_of"]

log = logging.getLogger("gateway.admin.request_log")


class RequestLog:
    """One per process: a bounded queue in front of the store, and its writer."""

    def __init__(self, store: LogStore, policy: RequestLogPolicy, on_drop: Callable[[str, int], None]) -> None:
        self.store = store
        self.policy = policy
        self._q: deque[tuple[int, str, bytes]] = deque()
        self._on_drop = on_drop
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._failing = False

    def add(self, call: Call, rt: Runtime, end: float, spend_usd: float) -> None:
        """Queue one finished request (dropped and counted when the queue is full)."""
        if len(self._q) >= self.policy.queue:  # checked first: a full queue costs no entry
            self._on_drop("queue_full", 1)
            return
        e = entry_of(call, rt, end, spend_usd)
        self.put((int(e["time"] * 1e6), e["tenant"] or "", orjson.dumps(e, default=str)))

    def put(self, item: tuple[int, str, bytes]) -> bool:
        """Queue one entry (its score, tenant, JSON); False when the queue is full (dropped, counted)."""
        if len(self._q) >= self.policy.queue:
            self._on_drop("queue_full", 1)
            return False
        self._q.append(item)
        return True

    def configure(self, policy: RequestLogPolicy) -> None:
        """A reloaded policy's settings (the store stays the one named at start)."""
        self.policy = policy
        self.store.size = policy.size

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="request-log-writer")

    async def close(self) -> None:
        """Write what is queued (within one write timeout), then stop."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._flush()
        await self.store.close()

    async def flush(self) -> None:
        """Write what is queued now (the admin API reads its own writes)."""
        await self._flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.flush_ms / 1000)
            await self._flush()

    async def _flush(self) -> None:
        while self._q:
            batch = [self._q.popleft() for _ in range(min(len(self._q), 1000))]
            try:
                async with asyncio.timeout(self.policy.write_timeout_ms / 1000):
                    await self.store.append(batch)
                if self._failing:
                    log.warning("request log: the store takes entries again")
                self._failing = False
            except Exception as exc:  # slow or down: this batch is lost, counted, and the next one tries again
                self._on_drop("store", len(batch))
                if not self._failing:
                    log.warning("request log: cannot write to the store, entries are dropped and counted: %s", exc)
                self._failing = True
                return


def entry_of(call: Call, rt: Runtime, end: float, spend_usd: float) -> dict[str, Any]:
    """What the log keeps of one request: its metadata, and the route's reasons; the prompt and
    the answer only for a tenant with `log_payloads`."""
    usage = call.out.usage or {}
    t = call.tenant
    v = call.verdict
    e: dict[str, Any] = {
        "id": call.request_id,
        "time": round(time.time(), 6),
        "tenant": None if t is None else t.name,
        "key_id": None if t is None else t.key_id,
        "endpoint": call.endpoint.name,
        "model": call.model[:200],
        "backend": call.out.backend,
        "class": call.cls,
        "cache": call.cache.result.value,
        "status": call.out.status,
        "stream": call.stream,
        "ttft_ms": None if call.timing.ttft_s is None else round(call.timing.ttft_s * 1000, 2),
        "duration_ms": round((end - call.timing.t0) * 1000, 2),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cost_usd": round(spend_usd, 8),
        "attempts": list(call.out.attempts),
        "finish": None if call.out.finish is None else call.out.finish.value,
        "rule": None if v is None else v.rule,
        "reasons": call.reasons,
        "error": None if not call.out.error else call.out.error[:300],
    }
    if call.out.affinity is not None:
        e["affinity"] = call.out.affinity.view()
    if t is not None and t.log_payloads:
        body = call.body
        limit = rt.policy.request_log.max_payload_chars
        _payload(e, "prompt", body.get("messages", body.get("prompt", body.get("input"))), limit)
        _payload(e, "answer", None if call.cache.entry is None else _text(call.cache.entry.answer()), limit)
    return e


def _payload(e: dict[str, Any], name: str, value: Any, limit: int) -> None:
    """`value` under `name`, or its JSON text cut to `limit` characters (and `{name}_truncated`)."""
    if value is None or (isinstance(value, str) and len(value) <= limit):
        e[name] = value
        return
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    if len(text) <= limit:
        e[name] = value
    else:
        e[name], e[f"{name}_truncated"] = text[:limit], True


def _text(obj: dict[str, Any]) -> str | None:
    """An answer's text, in any of the shapes the gateway speaks (chat, completions, a Response,
    a Message)."""
    if isinstance(obj.get("output_text"), str):
        return str(obj["output_text"])
    parts: list[str] = []
    for c in obj.get("choices") or ():
        if isinstance(c, dict):
            m = c.get("message")
            text = m.get("content") if isinstance(m, dict) else c.get("text")
            if isinstance(text, str):
                parts.append(text)
    for block in obj.get("content") or ():
        if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
    for item in obj.get("output") or ():
        for block in (item.get("content") or ()) if isinstance(item, dict) else ():
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
    return "".join(parts) if parts else None
