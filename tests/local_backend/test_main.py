"""`python -m local_backend serve` as a user runs it: a real process on a real port."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "local_backend", "serve", "--model", "tiny-random", "--device", "cpu", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = _serve("--port", str(port))
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [f"local_backend: cannot listen on 127.0.0.1:{port}: address already in use"], r.stderr
