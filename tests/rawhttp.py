"""Blocking raw-socket HTTP for edge tests: bytes exactly as given (no client normalises anything),
the first answer read back, and a process's memory read from /proc."""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer", "Watch", "exchange", "get", "json_error", "rss_kb"]


@dataclass
class Answer:
    """What one connection got: the first final answer (None: none), whether the server closed."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    closed: bool = False  # EOF or reset
    reset: bool = False
    seconds: float = 0.0  # until the answer was complete (or the connection closed, or the timeout)
    sent: int = 0
    raw: bytes = b""

    @property
    def ctype(self) -> str:
        return self.headers.get("content-type", "")


def _dechunk(b: bytes) -> bytes | None:
    """The body of a complete chunked message, None while incomplete."""
    out = b""
    while True:
        line, sep, rest = b.partition(b"\r\n")
        if not sep:
            return None
        try:
            n = int(line.split(b";")[0], 16)
        except ValueError:
            return out
        if n == 0:
            return out  # trailers, if any, are not looked at
        if len(rest) < n + 2:
            return None
        out, b = out + rest[:n], rest[n + 2 :]


def _parse(buf: bytes, ans: Answer) -> bool:
    """Fill `ans` from `buf` when it holds a complete final answer; 1xx answers are skipped."""
    while True:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return False
        lines = buf[:end].decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise AssertionError(f"not an HTTP answer: {buf[:200]!r}") from None
        headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        rest = buf[end + 4 :]
        if 100 <= status < 200:
            buf = rest
            continue
        ans.status, ans.headers = status, headers
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body = _dechunk(rest)
            if body is None:
                return False
            ans.body = body
            return True
        need = int(headers["content-length"]) if headers.get("content-length", "").isdigit() else None
        if need is None:
            ans.body = rest
            return False  # until the server closes
        if len(rest) < need:
            return False
        ans.body = rest[:need]
        return True


def exchange(
    port: int,
    head: bytes,
    pieces: Iterable[bytes] = (),
    *,
    timeout: float = 10.0,
    source: str | None = None,
    pause_s: float = 0.0,
    wait_close: bool = False,
) -> Answer:
    """Send `head`, then each of `pieces` (`pause_s` apart, the first too) until the server answers; read the
    first final answer. Sending stops at the answer, as a client that sees an early 413 does.
    `wait_close`: then wait for the server to close (`seconds` is then when it did)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if source is not None:
        s.bind((source, 0))
    s.settimeout(5)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    ans = Answer()
    t0 = time.monotonic()
    todo = iter(pieces)
    pending = memoryview(head)
    sending, buf, next_at, done = True, b"", t0 + pause_s, False  # pieces come `pause_s` after the head, and apart
    try:
        while time.monotonic() - t0 < timeout:
            if sending and not len(pending) and time.monotonic() >= next_at:
                nxt = next(todo, None)
                if nxt is None:
                    sending = False
                else:
                    pending, next_at = memoryview(nxt), time.monotonic() + pause_s
            want_write = sending and len(pending) > 0
            r, w, _ = select.select([s], [s] if want_write else [], [], 0.02)
            if r:
                try:
                    d = s.recv(1 << 16)
                except ConnectionResetError:
                    ans.closed = ans.reset = True
                    break
                if not d:
                    ans.closed = True
                    break
                buf += d
                if not done and _parse(buf, ans):
                    done, sending = True, False
                    if not wait_close:
                        break
                if ans.status is not None:
                    sending = False  # the answer began: the rest of the body is not wanted
            if w and want_write:
                try:
                    k = s.send(pending[: 1 << 18])
                    pending = pending[k:]
                    ans.sent += k
                except BlockingIOError:
                    pass
                except OSError:
                    sending = False  # the server closed its side; read what it said
    finally:
        s.close()
    ans.seconds = time.monotonic() - t0
    ans.raw = buf
    if not done and buf:
        _parse(buf, ans)
    return ans


def json_error(body: bytes) -> dict[str, Any] | None:
    """The `error` object of an OpenAI-shaped error body, None if it is not one."""
    try:
        js = json.loads(body)
    except ValueError:
        return None
    if not isinstance(js, dict) or set(js) != {"error"} or not isinstance(js["error"], dict):
        return None
    err = js["error"]
    if set(err) != {"message", "type", "param", "code"} or not isinstance(err["message"], str) or not err["message"]:
        return None
    return err


def get(port: int, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """One GET on a fresh connection: (status, body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def rss_kb(pid: int, key: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class Watch:
    """While it runs: a process's RSS every 10 ms and, given a port, /healthz every 50 ms (each
    answer's latency; a failure counts as infinitely slow). `growth_mb` and `slowest_s` after."""

    def __init__(self, pid: int, port: int | None = None) -> None:
        self.pid, self.port = pid, port
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.base = rss_kb(pid)
        self.hwm0 = rss_kb(pid, "VmHWM")
        self.peak = self.base
        self.growth_mb = 0.0
        self.threads = [threading.Thread(target=self._rss, daemon=True)]
        if port is not None:
            self.threads.append(threading.Thread(target=self._poll, daemon=True))

    def _rss(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_kb(self.pid))
            time.sleep(0.01)

    def _poll(self) -> None:
        assert self.port is not None
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                ok = get(self.port, "/healthz", timeout=15)[0] == 200
            except OSError:
                ok = False
            self.latencies.append(time.monotonic() - t if ok else float("inf"))
            time.sleep(0.05)

    @property
    def slowest_s(self) -> float:
        return max(self.latencies) if self.latencies else float("inf")

    def __enter__(self) -> "Watch":
        for t in self.threads:
            t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self.stop.set()
        for t in self.threads:
            t.join(20)
        hwm = rss_kb(self.pid, "VmHWM")
        if hwm > self.hwm0:  # a peak between two samples still counts
            self.peak = max(self.peak, hwm)
        self.growth_mb = (self.peak - self.base) / 1024
