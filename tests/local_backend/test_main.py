"""`python -m local_backend serve` as a user runs it: a real process on a real port."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

from local_backend.models import LoadedModel

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


def _sampling_line(*args: str) -> str:
    """Start the server, return its start-up line about sampling defaults, stop it."""
    cmd = [sys.executable, "-m", "local_backend", "serve", "--device", "cpu", "--quantize", "none", "--threads", "1", *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "a request without temperature / top_p is decoded with" in line:
                return line.split(" is decoded with ", 1)[1].strip()
        raise AssertionError(f"no sampling line; exit code {proc.wait()}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_the_models_generation_config_sets_the_defaults_when_it_samples(tiny: LoadedModel, tmp_path: Path) -> None:
    folder = tmp_path / "tiny-sampling"
    tiny.model.save_pretrained(str(folder))
    tiny.tokenizer.save_pretrained(str(folder))
    config = folder / "generation_config.json"
    config.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 0.9, "eos_token_id": 2}))
    from_config = "the model's generation config (do_sample: true)"
    port = str(_free_port())
    assert _sampling_line("--model", str(folder), "--port", port) == f"temperature 0.7 from {from_config}, top_p 0.9 from {from_config}"
    assert _sampling_line("--model", str(folder), "--port", port, "--default-temperature", "0") == (
        f"temperature 0 (greedy) from --default-temperature, top_p 0.9 from {from_config}"
    )
    config.write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))  # no do_sample: greedy, as transformers reads it
    assert _sampling_line("--model", str(folder), "--port", port) == (
        "temperature 0 (greedy) from the built-in default, top_p 1 from the built-in default"
    )
    assert _sampling_line("--model", "tiny-random", "--port", port) == (
        "temperature 0 (greedy) from the built-in default, top_p 1 from the built-in default"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
