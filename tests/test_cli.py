"""The CLI as a user runs it: `gateway check` and `gateway serve --workers N` in real processes."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import resource
import signal
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import yaml

from tests.conftest import simple_policy

ROOT = Path(__file__).resolve().parents[1]


def _gateway(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", 60)
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_check_prints_every_error_with_its_path_and_exits_1(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "backends:\n  a: {url: 'ftp://x', models: [m], extra: 1, max_concurency: 4}\n"
        "models:\n  auto: {simple: [a], complex: [zz]}\n"
    )
    r = _gateway("check", str(bad))
    assert r.returncode == 1
    assert "backends.a.url: must be an http:// or https:// URL" in r.stderr
    assert "backends.a.extra: unknown field (line 2)" in r.stderr
    assert "backends.a.max_concurency: unknown field; did you mean `max_concurrency`? (line 2)" in r.stderr
    # Cross-references in the same pass as the schema errors, not only once the structure is valid.
    assert "models.auto.complex[0]: unknown backend 'zz' (line 4)" in r.stderr
    assert "4 error(s)" in r.stderr


def test_check_warns_about_placeholder_and_guessable_keys(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(
        "backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\n"
        f"tenants: {{t: {{key_sha256: ['{'0' * 63}1']}}}}\n"
        f"admin: {{key_sha256: ['{hashlib.sha256(b'password').hexdigest()}']}}\n"
    )
    r = _gateway("check", str(p))
    assert r.returncode == 0, r.stderr
    assert "tenants.t.key_sha256[0]: a placeholder no key matches" in r.stderr
    assert "admin.key_sha256[0]: the digest of the guessable key 'password'" in r.stderr


def test_check_accepts_the_default_policy():
    r = _gateway("check", "policies/default.yaml")
    assert r.returncode == 0, r.stderr
    assert "ok (1 backends" in r.stdout


def test_hash_key_prints_the_digest():
    r = _gateway("hash-key", "sk-1")
    assert r.stdout.strip() == hashlib.sha256(b"sk-1").hexdigest()


def test_hash_key_reads_the_key_from_stdin():
    """A key on argv shows up in `ps`; piped in (with its newline, as `echo` sends it) it does not."""
    r = _gateway("hash-key", input="sk-secret\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == hashlib.sha256(b"sk-secret").hexdigest()
    assert _gateway("hash-key", input="").returncode == 1  # an empty key is refused, not hashed


def test_hash_key_new_makes_a_key_and_its_digest():
    r = _gateway("hash-key", "--new")
    lines = dict(line.split()[:2] for line in r.stdout.splitlines())
    key, digest = lines["key:"], lines["key_sha256:"]
    assert key.startswith("sk-") and len(key) > 40
    assert digest == hashlib.sha256(key.encode()).hexdigest()


def test_serve_refuses_an_open_policy_on_a_public_address(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\n")
    r = _gateway("serve", "--policy", str(p), "--host", "0.0.0.0", "--port", str(_free_port()), timeout=15)
    assert r.returncode != 0
    assert "gateway hash-key" in r.stderr and "tenants:" in r.stderr and "open_access: true" in r.stderr
    assert "serving on" not in r.stderr


async def test_serve_on_a_public_address_with_open_access_or_tenants_starts(tmp_path):
    """`server.open_access: true` states openness on purpose; a policy with tenants is never open."""
    for extra in ("server: {open_access: true}\n", f"tenants: {{t: {{key_sha256: ['{'0' * 64}']}}}}\n"):
        p = tmp_path / "p.yaml"
        p.write_text("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\nreload: {watch: false}\n" + extra)
        port = _free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(p), "--host", "0.0.0.0", "--port", str(port),
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )
        try:
            async with asyncio.timeout(30):
                while "serving on" not in (line := (await proc.stderr.readline()).decode()):  # type: ignore[union-attr]
                    assert line, "the gateway exited"
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.communicate(), 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_serve_with_two_workers_shares_the_port_and_aggregates_metrics(upstream, tmp_path):
    up = await upstream("a", tokens=2)
    policy = tmp_path / "p.yaml"
    policy.write_text(yaml.safe_dump(simple_policy(up)))
    port = _free_port()
    env = {**os.environ, "GATEWAY_POLICY": str(policy)}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway", "serve", "--port", str(port), "--workers", "2",
        cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    seen: list[str] = []
    try:
        # Both workers up before any request: each logs when it serves.
        async with asyncio.timeout(60):
            while sum("serving on" in line for line in seen) < 2:
                line = (await proc.stderr.readline()).decode()  # type: ignore[union-attr]
                assert line, "the gateway exited: " + "".join(seen)
                seen.append(line)
        async with aiohttp.ClientSession() as http:
            client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
            n = 20
            # separate connections, so SO_REUSEPORT spreads them over both workers
            for _ in range(n):
                async with aiohttp.ClientSession() as one:
                    async with one.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                        json={"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}) as r:
                        assert r.status == 200
            r2 = await client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}])
            assert r2.choices[0].message.content == "w0 w1 "
            await client.close()
            async with http.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
        line = next(l for l in text.splitlines() if l.startswith("gateway_requests_total{"))
        assert line.endswith(f" {float(n + 1)}"), line  # every worker's requests, whichever answered
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0, err.decode()[-2000:]
    pids = {w.split("pid ")[1].split(")")[0] for w in seen if "serving on" in w}
    assert len(pids) == 2, seen


def test_serve_refuses_a_bad_policy_before_binding(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: {}\n")
    r = _gateway("serve", "--policy", str(bad), "--port", str(_free_port()))
    assert r.returncode == 1 and "backends" in r.stderr


def test_serve_and_check_refuse_a_missing_weights_file(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text(
        "backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\nclassifier: {weights_file: /nonexistent.json}\n"
    )
    r = _gateway("check", str(bad))
    assert r.returncode == 1 and "weights_file" in r.stderr
    r = _gateway("serve", "--policy", str(bad), "--port", str(_free_port()))
    assert r.returncode == 1 and "/nonexistent.json" in r.stderr


def test_serve_refuses_a_missing_api_key_variable(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], api_key_env: NO_SUCH_KEY_VAR}}\n")
    env = {k: v for k, v in os.environ.items() if k != "NO_SUCH_KEY_VAR"}
    r = _gateway("serve", "--policy", str(p), "--port", str(_free_port()), env=env)
    assert r.returncode == 1 and "NO_SUCH_KEY_VAR is not set" in r.stderr


def test_the_fake_upstream_runs_as_a_process_and_explains_every_knob():
    """Benchmarks start it as `python -m tests.fake_upstream`: every Behaviour field has an option."""
    import dataclasses

    from tests.fake_upstream import Behaviour

    out = subprocess.run([sys.executable, "-m", "tests.fake_upstream", "--help"], capture_output=True, text=True, timeout=60,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr
    for f in dataclasses.fields(Behaviour):
        assert "--" + f.name.replace("_", "-") in out.stdout, f.name


def _unreachable_policy(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\nreload: {watch: false}\n")
    return p


@contextlib.contextmanager
def _held_port(*, reuse_port: bool = False):
    """A loopback port another socket listens on, for as long as the block runs."""
    with socket.socket() as holder:
        if reuse_port:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_serve_on_a_port_in_use_says_so_in_one_line(tmp_path):
    """One line and exit 1, before anything starts, with one process or a supervisor over workers."""
    p = _unreachable_policy(tmp_path)
    with _held_port() as port:
        for workers in ("1", "2"):
            r = _gateway("serve", "--policy", str(p), "--port", str(port), "--workers", workers, timeout=30)
            assert r.returncode == 1, r.stderr
            assert r.stderr.splitlines() == [f"gateway: cannot listen on 127.0.0.1:{port}: address already in use"], r.stderr


def test_serve_with_workers_beside_another_reuse_port_listener_refuses(tmp_path):
    """SO_REUSEPORT would let the workers bind beside another process that set it too (another
    gateway with --workers) and split its connections: refused like any taken port."""
    p = _unreachable_policy(tmp_path)
    with _held_port(reuse_port=True) as port:
        r = _gateway("serve", "--policy", str(p), "--port", str(port), "--workers", "2", timeout=30)
    assert r.returncode == 1, r.stderr
    assert r.stderr.splitlines() == [
        f"gateway: cannot listen on 127.0.0.1:{port}: address already in use (another process listens there)"
    ], r.stderr


def test_a_port_taken_after_the_check_still_ends_in_one_line(tmp_path):
    """The race `serve` cannot check for (taken between its look and the bind): the worker ends
    with the same line and exit code 1, not a traceback."""
    p = _unreachable_policy(tmp_path)
    with _held_port() as port:
        code = f"import sys; from gateway.process.serve import run_worker; sys.exit(run_worker({str(p)!r}, '127.0.0.1', {port}, False, False))"
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1] == f"gateway: cannot listen on 127.0.0.1:{port}: address already in use", r.stderr


def test_a_worker_lifts_its_open_file_limit_to_the_hard_limit():
    """Each stream holds two connections: the usual soft limit (1024) would refuse clients first."""
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "from gateway.process.serve import raise_fd_limit\n"
        "raise_fd_limit()\n"
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    soft, hard = (int(x) for x in out.split())
    assert soft == (1 << 20 if hard == resource.RLIM_INFINITY else hard)


def test_check_refuses_what_serve_refuses_naming_the_field(tmp_path):
    """A port out of range (a backend's, the store's) and a missing encoder folder: `check` said
    ok where `serve` refused with a line that named no field."""
    cases = {
        "backends: {a: {url: 'http://127.0.0.1:99999/v1', models: [m]}}\n": "backends.a.url: the port must be a number from 1 to 65535",
        "backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\nstore: {url: 'redis://127.0.0.1:70000/0'}\n":
            "store.url: the port must be a number from 1 to 65535",
        "backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\nmodels: {auto: {simple: [a], complex: [a]}}\n"
        f"classifier: {{encoder: {{weights_dir: '{tmp_path / 'missing'}'}}}}\n": "classifier.encoder.weights_dir: encoder weights",
    }
    for i, (text, says) in enumerate(cases.items()):
        p = tmp_path / f"p{i}.yaml"
        p.write_text(text + "reload: {watch: false}\n")
        r = _gateway("check", str(p))
        assert r.returncode == 1 and f"{p}: {says}" in r.stderr, r.stderr
        r = _gateway("serve", "--policy", str(p), "--port", str(_free_port()), timeout=30)
        assert r.returncode == 1 and says in r.stderr, r.stderr


def test_serve_refuses_a_port_or_worker_count_out_of_range(tmp_path):
    """argparse's `int` bound `--port 70000` as 70000 mod 65536 and made `--workers -3` one worker."""
    p = _unreachable_policy(tmp_path)
    for args, says in ((["--port", "70000"], "argument --port: 70000 is not from 1 to 65535"),
                       (["--port", "0"], "argument --port: 0 is not from 1 to 65535"),
                       (["--workers", "-3"], "argument --workers: -3 is below 1"),
                       (["--workers", "0"], "argument --workers: 0 is below 1"),
                       (["--workers", "two"], "argument --workers: 'two' is not a whole number")):
        r = _gateway("serve", "--policy", str(p), *args, timeout=30)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        assert "serving on" not in r.stderr
