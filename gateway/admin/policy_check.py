"""`python -m gateway.admin.policy_check [--environment]`: a pasted policy's check, in a process of
its own (POST /admin/policy/check runs it): the text on stdin, check_text's answer as JSON on
stdout.

Why a process: parsing and validating a large policy holds the interpreter's lock (LibYAML's
compose is one C call: ~220 ms for 700 KB), so a check in a thread of the gateway still paused
every request for that long, once per check a viewer sent.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import orjson

from ..errors import Unavailable

__all__ = ["check_apart", "main"]

_ROOT = str(Path(__file__).resolve().parents[2])  # where the `gateway` package is imported from


async def check_apart(text: str, *, environment: bool, timeout_s: float) -> dict[str, Any]:
    """check_text's answer for `text`, computed by a child process within `timeout_s` (else
    Unavailable, and the child is killed)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)}
    args = [sys.executable, "-m", "gateway.admin.policy_check", *(["--environment"] if environment else [])]
    proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, env=env)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate(text.encode())
    except BaseException:  # the time ran out, or the caller left: the child goes too
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0:
        raise Unavailable(f"the policy check failed to run (exit status {proc.returncode}); try again", retry_after_s=1)
    answer = orjson.loads(out)
    assert isinstance(answer, dict)
    return answer


def main() -> None:
    from .policy_view import check_text  # the child's work: imported there only

    text = sys.stdin.buffer.read().decode("utf-8")
    sys.stdout.buffer.write(orjson.dumps(check_text(text, environment="--environment" in sys.argv[1:])))


if __name__ == "__main__":
    main()
