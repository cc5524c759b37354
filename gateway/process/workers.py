"""What a worker of `gateway serve --workers N` knows about its place among the others.

A worker is one of N processes sharing the port. It never launches local models (the supervisor
does, once), it takes its share of each backend's `max_concurrency`, and it reaches its siblings
through the supervisor's control socket (control.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["WorkerInfo", "share"]


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Worker `index` (0-based) of `count`; `control_dir` holds the supervisor's and workers' sockets;
    `supervisor_pid`: the process that started it (a worker whose parent is another one is orphaned)."""

    index: int
    count: int
    control_dir: Path
    supervisor_pid: int = 0
    generation: int = 1  # the supervisor's policy generation when it started this worker
    policy_source: str = ""  # the policy file's path, for messages (the worker reads the supervisor's copy)

    @property
    def socket(self) -> Path:
        return worker_socket(self.control_dir, self.index)

    @property
    def supervisor_socket(self) -> Path:
        return self.control_dir / "supervisor.sock"


def worker_socket(control_dir: Path, index: int) -> Path:
    return control_dir / f"worker-{index}.sock"


def share(limit: int, worker: WorkerInfo | None) -> int:
    """This worker's part of a bound of `limit` held across all workers: `limit // N`, the
    remainder going to the lowest indexes, so the parts add up to `limit` exactly. A bound below
    N still gives each worker 1 (a worker with 0 could never reach the backend), so the effective
    bound is then N; `gateway serve` warns about it."""
    if worker is None or worker.count <= 1:
        return limit
    base, extra = divmod(limit, worker.count)
    return max(1, base + (1 if worker.index < extra else 0))
