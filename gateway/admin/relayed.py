"""The admin plane's stores for `gateway serve --workers N` without a Redis store.

The supervisor keeps the virtual keys and the request log in its own memory (`SharedAdmin`),
and every worker reaches them over the supervisor's control socket (process/control.py):
`RelayedKeyStore` and `RelayedLogStore` are the worker's KeyStore and LogStore. So a key made
through one worker works on every other within a poll, a revoke reaches them all, and the
request log holds every worker's requests: what one process with the in-memory stores does,
across the workers. The state lives as long as the supervisor (a worker that restarts loses
nothing); several replicas still need Redis to share it.

A supervisor that does not answer is a store that is down: StoreError, as for Redis (known keys
keep working, mutations get 503, log batches are dropped and counted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import BadRequest, Conflict, GatewayError, NotFound
from ..process import control
from ..store.core import StoreError
from .key_ops import KeyOp, from_json, to_json
from .key_store import MemoryKeyStore
from .log_store import Cursor, Filter, MemoryLogStore, Page

__all__ = ["RelayedKeyStore", "RelayedLogStore", "SharedAdmin"]

_ERRORS: dict[int, type[GatewayError]] = {400: BadRequest, 404: NotFound, 409: Conflict}


class RelayedKeyStore:
    """A worker's view of the supervisor's keys (admin/key_store.KeyStore)."""

    def __init__(self, socket: Path, timeout_s: float = 2.0) -> None:
        self._socket, self._timeout_s = socket, timeout_s

    async def version(self) -> int:
        return int((await self._ask("GET", "/admin/keys/version"))["version"])

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        r = await self._ask("GET", "/admin/keys/records")
        return int(r["version"]), r["records"]

    async def change(self, op: KeyOp) -> Any:
        r = await self._ask("POST", "/admin/keys/change", to_json(op))
        if "error" in r:  # refused there, by the same key_ops.apply: the same error here
            err = r["error"]
            raise _ERRORS.get(err.get("status"), Conflict)(str(err.get("message")))
        return r.get("result")

    async def touch(self, used: dict[str, float]) -> None:
        if used:
            await self._ask("POST", "/admin/keys/touch", used)

    async def last_used(self) -> dict[str, float]:
        return {k: float(v) for k, v in (await self._ask("GET", "/admin/keys/used"))["used"].items()}

    async def close(self) -> None:
        return None

    async def _ask(self, method: str, route: str, data: Any = None) -> dict[str, Any]:
        return await _ask(self._socket, method, route, self._timeout_s, data)


class RelayedLogStore:
    """A worker's view of the supervisor's request log (admin/log_store.LogStore)."""

    def __init__(self, socket: Path, size: int, timeout_s: float = 1.0) -> None:
        self.size = size  # the supervisor's own bound applies; kept for RequestLog.configure
        self._socket, self._timeout_s = socket, timeout_s

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        if batch:
            rows = [[score, tenant, entry.decode()] for score, tenant, entry in batch]
            await _ask(self._socket, "POST", "/admin/log/append", self._timeout_s, rows)

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Page:
        q = {"tenant": f.tenant, "model": f.model, "status": f.status, "limit": limit, "at": None if at is None else str(at)}
        r = await _ask(self._socket, "POST", "/admin/log/page", self._timeout_s, q)
        return Page(r["entries"], r["next"])

    async def close(self) -> None:
        return None


class SharedAdmin:
    """The supervisor's keys and request log, and the control-socket handlers that serve them."""

    def __init__(self, log_size: int, log_max_bytes: int) -> None:
        self.keys = MemoryKeyStore()
        self.log = MemoryLogStore(log_size, log_max_bytes)

    def resize(self, log_size: int, log_max_bytes: int) -> None:
        """A reloaded policy's bounds for the log."""
        self.log.size, self.log.max_bytes = log_size, log_max_bytes

    def handlers(self) -> dict[tuple[str, str], control.Handler]:
        return {("GET", "/admin/keys/version"): self._version, ("GET", "/admin/keys/records"): self._records,
                ("GET", "/admin/keys/used"): self._used}

    def data_handlers(self) -> dict[tuple[str, str], control.DataHandler]:
        return {("POST", "/admin/keys/change"): self._change, ("POST", "/admin/keys/touch"): self._touch,
                ("POST", "/admin/log/append"): self._append, ("POST", "/admin/log/page"): self._page}

    async def _version(self) -> dict[str, Any]:
        return {"version": await self.keys.version()}

    async def _records(self) -> dict[str, Any]:
        version, records = await self.keys.records()
        return {"version": version, "records": records}

    async def _used(self) -> dict[str, Any]:
        return {"used": await self.keys.last_used()}

    async def _change(self, data: Any) -> dict[str, Any]:
        try:
            op = from_json(data if isinstance(data, dict) else {})
            return {"result": await self.keys.change(op)}
        except GatewayError as err:
            return {"error": {"status": err.status, "message": err.message}}

    async def _touch(self, data: Any) -> dict[str, Any]:
        if isinstance(data, dict):
            await self.keys.touch({str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))})
        return {"ok": True}

    async def _append(self, data: Any) -> dict[str, Any]:
        rows = [(int(r[0]), str(r[1]), str(r[2]).encode()) for r in data if isinstance(r, list) and len(r) == 3] \
            if isinstance(data, list) else []
        await self.log.append(rows)
        return {"ok": True, "count": len(rows)}

    async def _page(self, data: Any) -> dict[str, Any]:
        q = data if isinstance(data, dict) else {}
        status = q.get("status")
        f = Filter(q.get("tenant"), q.get("model"), status if isinstance(status, int) else None)
        limit = q.get("limit")
        at = q.get("at")
        try:
            cursor = Cursor.parse(at) if isinstance(at, str) else None
        except ValueError:
            cursor = None
        page = await self.log.page(f, limit if isinstance(limit, int) and limit > 0 else 50, cursor)
        return {"entries": page.entries, "next": page.next}


async def _ask(socket: Path, method: str, route: str, timeout_s: float, data: Any = None) -> dict[str, Any]:
    try:
        return await control.ask(socket, method, route, timeout_s, data)
    except control.ControlError as exc:
        raise StoreError(f"the supervisor's shared admin store: {exc}") from None
