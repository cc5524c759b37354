"""Helpers for benchmarks: start our own processes on free loopback ports and read their CPU/RSS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def worktree(rev: str, path: Path) -> Iterator[Path]:
    """This repository at git revision `rev`, checked out at `path` (a temporary worktree: another
    version's `gateway` to run beside this tree's, with this tree's virtual environment); removed
    on the way out."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False)


def start(args: list[str], env: dict[str, str] | None = None, cpus: str | None = None, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """Start a Python module as a child process (optionally pinned to CPUs with taskset), in `cwd`
    (`python -m` imports the packages found there first: another checkout's `gateway`)."""
    cmd = [sys.executable, *args]
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    return subprocess.Popen(
        cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def need(*tools: str) -> None:
    """Exit saying how to install them when command-line tools the benchmark drives are missing."""
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        sys.exit(f"{' and '.join(missing)} not found: apt-get install {' '.join(missing)}")


def fake_upstream(*flags: str, cpus: str | None = None) -> tuple[subprocess.Popen[bytes], int]:
    """The fake OpenAI upstream (tests/fake_upstream.py) on a free port, with `flags` (e.g.
    "--tokens", "16"): the process and its port."""
    port = free_port()
    return start(["-m", "tests.fake_upstream", "--port", str(port), *flags], cpus=cpus), port


def redis_server(port: int, cpus: str | None = None) -> subprocess.Popen[bytes]:
    """A redis-server of the benchmark's own on 127.0.0.1:`port`, keeping nothing on disk
    (optionally pinned to CPUs with taskset); stop it with `stop()` or terminate()."""
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    return subprocess.Popen(["taskset", "-c", cpus, *cmd] if cpus else cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_http(
    url: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None, on_exit: Callable[[], str] | None = None
) -> None:
    """Wait until `url` answers 200; with `proc`, fail at once if it exits (`on_exit()` says why)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            time.sleep(0.2)  # let a reader thread catch the last lines
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n" + (on_exit() if on_exit else ""))
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a process we started, by its PID."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children that were waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of a process and every live descendant (a supervisor and its workers)."""
    total = 0.0
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            total += cpu_seconds(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")
