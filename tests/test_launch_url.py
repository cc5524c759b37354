"""A launched backend's URL: the child listens on its host, so it must be plainly a loopback
host:port (parsed as the launcher parses it), and two launched backends never share a port,
however the URLs spell it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.config.policy import PolicyError, parse_policy
from gateway.process.launcher import ChildBackend

NEEDS_LOOPBACK = "a launched backend needs an explicit loopback host:port URL"


def _policy(*urls: str) -> str:
    backends = {f"b{i}": {"url": url, "launch": {"model": "tiny-random"}, "models": [f"m{i}"]} for i, url in enumerate(urls)}
    return yaml.safe_dump({"version": 1, "backends": backends, "models": {}})


def _problems(*urls: str) -> list[str]:
    try:
        parse_policy(_policy(*urls))
    except PolicyError as exc:
        return [str(p) for p in exc.problems]
    return []


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8001@0.0.0.0:18777/v1",  # userinfo: the host is 0.0.0.0
        "http://user@127.0.0.1:8001/v1",
        "http://127.0.0.1:8001.evil.example/v1",  # the old pattern matched a prefix
        "http://127.0.0.1:8001?x=1",
        "http://127.0.0.1:8001/v1#frag",
        "http://127.0.0.1/v1",  # no port
        "http://127.0.0.1:0/v1",
        "http://127.0.0.1:70000/v1",
        "http://10.0.0.5:8001/v1",
        "https://127.0.0.1:8001/v1",
    ],
)
def test_a_url_that_is_not_plainly_loopback_host_and_port_is_refused(url: str) -> None:
    problems = _problems(url)
    assert any("backends.b0.url" in p and NEEDS_LOOPBACK in p for p in problems), problems


@pytest.mark.parametrize("url", ["http://127.0.0.1:8001/v1", "http://localhost:8001", "http://[::1]:8001/v1/", "http://LOCALHOST:8001/v1"])
def test_a_loopback_host_and_port_passes(url: str) -> None:
    assert _problems(url) == []


@pytest.mark.parametrize(
    "first, second",
    [
        ("http://127.0.0.1:8001/v1", "http://127.0.0.1:8001/v1/"),
        ("http://localhost:8001/v1", "http://127.0.0.1:8001/v1"),
        ("http://[::1]:8001", "http://localhost:8001/v1"),
    ],
)
def test_two_launched_backends_on_one_port_are_refused_however_spelled(first: str, second: str) -> None:
    problems = _problems(first, second)
    assert any("backends.b1.url" in p and "same port (8001) as launched backend 'b0'" in p for p in problems), problems
    assert _problems(first, second.replace("8001", "8002")) == []


def test_the_child_listens_on_the_urls_host() -> None:
    """Why userinfo matters: the launcher starts the child with --host from urlsplit."""
    command = ChildBackend("b", "http://127.0.0.1:8001@0.0.0.0:18777/v1", "tiny-random").command
    assert command[command.index("--host") + 1] == "0.0.0.0"


def test_gateway_check_refuses_the_reviewed_policy(tmp_path: Path) -> None:
    """The policy that passed the check before: a child on every interface, and two on one port."""
    path = tmp_path / "policy.yaml"
    path.write_text(_policy("http://127.0.0.1:8001@0.0.0.0:18777/v1", "http://localhost:18778/v1", "http://127.0.0.1:18778"))
    out = subprocess.run([sys.executable, "-m", "gateway", "check", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"backends.b0.url: {NEEDS_LOOPBACK}" in out.stderr
    assert "backends.b2.url: same port (18778) as launched backend 'b1'" in out.stderr
