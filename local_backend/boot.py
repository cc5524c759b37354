"""From command-line settings to a running Engine: device, threads, load, quantize, warm up."""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .threads import ThreadPicker

if TYPE_CHECKING:
    from .engine import Engine
    from .models import LoadedModel
    from .quantize import QuantPlan

__all__ = [
    "EngineSettings",
    "build_engine",
    "chat_template_prefix",
    "engine_from_loaded",
    "eos_token_ids",
    "resolve_device",
    "thread_picker",
    "usable_cores",
]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class EngineSettings:
    """Everything needed to build an engine."""

    model: str
    quantize: str = "auto"
    device: str = "auto"
    threads: int | None = None
    max_batch: int = 16
    max_queue: int = 64
    kernel: str | None = None  # the int8 kernel build (avx512_vnni|avx2); None: the best this CPU runs
    kv_cache_mb: int = 1024  # the running sequences' KV cache, at most
    prefix_cache_mb: int = 256  # the prefix cache's pool (0: off)
    prefix_block_tokens: int = 16


def usable_cores(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU limit (a container's
    `--cpus`, a Kubernetes `limits.cpu`, a systemd `CPUQuota=`), rounded up. More threads than the
    limit get throttled for whole scheduler periods (100 ms), far worse than fewer threads."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = _cgroup_cpu_limit(cgroup_root, proc_cgroup)
    return max(1, min(cores, math.ceil(limit))) if limit else cores


def _cgroup_cpu_limit(root: Path, proc_cgroup: Path) -> float | None:
    """The smallest CPU limit on this process's cgroup and its parents (cgroup v2 `cpu.max`, v1 CFS
    quota); None when there is none or nothing is readable."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2_path = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), "/")
    v1_path = next((line.split(":", 2)[2] for line in lines if "cpu" in line.split(":", 2)[1].split(",")), "/")
    limits = []
    for rel in _self_and_parents(v2_path):
        limits.append(_read_limit(root / rel / "cpu.max", None))
    for rel in _self_and_parents(v1_path):
        limits.append(_read_limit(root / "cpu" / rel / "cpu.cfs_quota_us", root / "cpu" / rel / "cpu.cfs_period_us"))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _self_and_parents(path: str) -> list[str]:
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _read_limit(quota_file: Path, period_file: Path | None) -> float | None:
    """CPUs one cgroup file allows: v2 `cpu.max` ("max 100000" or "200000 100000"), or v1 quota and period files."""
    try:
        if period_file is None:
            quota, period = quota_file.read_text().split()[:2]
            return None if quota == "max" or int(period) <= 0 else int(quota) / int(period)
        quota_us, period_us = int(quota_file.read_text()), int(period_file.read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


def thread_picker(threads: int | None = None, cores: int | None = None) -> ThreadPicker:
    """The thread counts the engine picks from on CPU: ``threads`` alone when given, else 1, 2, 4, ...
    below the core count, every core but one (the gateway's) and every core.

    A fixed count was wrong either way on 2 shared cores: 2 threads decode 10-50% faster while the
    other core is idle and 2-3x slower while something keeps it busy (OpenMP threads wait on each
    other), so the engine times its passes and keeps to whichever count is faster now.
    """
    if threads:
        return ThreadPicker((threads,))
    cores = cores or usable_cores()
    ladder = {1 << i for i in range(cores.bit_length()) if 1 << i < cores}
    return ThreadPicker(ladder | {max(1, cores - 1), cores})


def resolve_device(device: str) -> str:
    """``auto`` is CUDA when torch sees a GPU, else CPU."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda, not {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch sees no CUDA device")
    return device


def _quiet_libraries() -> None:
    """Keep stderr to our own progress lines: the launcher forwards it line by line to the gateway's log."""
    # torch's pytree deprecation notes.
    for name in ("torch.utils._pytree",):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # \r-redrawn bars make one huge log line


def eos_token_ids(hf_model: Any) -> list[int]:
    """The end-of-sequence ids the model's generation config names."""
    eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    return [int(t) for t in (eos if isinstance(eos, list) else [eos] if eos is not None else [])]


def chat_template_prefix(tokenizer: Any) -> list[int]:
    """The tokens every one-user-message chat starts with (SmolLM2: its default system prompt and the user tag)."""
    from .checkset import chat_prompt_ids

    if not getattr(tokenizer, "chat_template", None):
        return []
    a, b = chat_prompt_ids(tokenizer, "Hello"), chat_prompt_ids(tokenizer, "Why?")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def engine_from_loaded(
    loaded: LoadedModel,
    plan: QuantPlan,
    *,
    max_batch: int = 16,
    max_queue: int = 64,
    threads: ThreadPicker | None = None,
    kv_cache_mb: int = 1024,
    prefix_cache_mb: int = 256,
    prefix_block_tokens: int = 16,
) -> Engine:
    """An (unstarted) Engine over ``loaded``'s weights in ``plan``'s format; ``threads`` picks each CPU pass's thread count."""
    from .engine import Engine
    from .quantize import build_lean

    lean = build_lean(loaded.model, plan)
    engine = Engine(
        lean, loaded.tokenizer, eos_token_ids=eos_token_ids(loaded.model), max_batch=max_batch, max_queue=max_queue, threads=threads,
        kv_cache_bytes=kv_cache_mb << 20, prefix_cache_bytes=prefix_cache_mb << 20, prefix_block_tokens=prefix_block_tokens,
    )
    engine.plan = plan
    return engine


def _memory_line(engine: Engine, settings: EngineSettings, pinned: int) -> str:
    """What the two caches may hold, in the start-up line."""
    per_token = engine.model.kv_bytes_per_token()
    kv = f"KV cache up to {settings.kv_cache_mb} MB ({(settings.kv_cache_mb << 20) // per_token} tokens over all sequences, {per_token // 1024} KiB a token)"
    if engine.prefix is None:
        return f"{kv}; prefix cache off"
    p = engine.prefix
    return (f"{kv}; prefix cache {settings.prefix_cache_mb} MB ({p.capacity} blocks of {p.block_tokens} tokens, "
            f"the chat template's first {pinned} tokens pinned)")


def build_engine(settings: EngineSettings, progress: Progress) -> Engine:
    """Load, quantize and warm the model; return a started Engine."""
    _quiet_libraries()
    import torch

    from .models import load_model
    from .quantize import plan_quantization

    device = resolve_device(settings.device)
    picker = thread_picker(settings.threads) if device == "cpu" else None
    if picker is not None:
        # Loading and warming up run on this thread, and on one core: a second OpenMP pool left here
        # makes libgomp count more of its threads than cores, and then its workers on the engine
        # thread sleep between parallel regions instead of spinning (measured: 2-thread decode
        # steps 10 ms instead of 4).
        torch.set_num_threads(1)
    threads = picker.describe() if picker is not None else "torch's default threads"
    plan = plan_quantization(settings.quantize, device, settings.kernel)
    progress(f"device {device}, {threads}, quantization {plan.describe()}")
    loaded = load_model(settings.model, device=device, dtype=torch.float32, progress=progress)
    started = time.perf_counter()
    engine = engine_from_loaded(
        loaded, plan, max_batch=settings.max_batch, max_queue=settings.max_queue, threads=picker, kv_cache_mb=settings.kv_cache_mb,
        prefix_cache_mb=settings.prefix_cache_mb, prefix_block_tokens=settings.prefix_block_tokens,
    )
    del loaded  # transformers' copy of the weights: the engine holds its own (quantized) ones
    gc.collect()
    progress(f"weights ready ({plan.mode}, {engine.model.nbytes() / 1e6:.0f} MB read per decode step) in {time.perf_counter() - started:.1f} s")
    started = time.perf_counter()
    engine.warm_up(engine.tokenizer("Hello, how are you?").input_ids)
    pinned = engine.cache_prefix(chat_template_prefix(engine.tokenizer))
    progress(f"warmed up in {time.perf_counter() - started:.2f} s; {_memory_line(engine, settings, pinned)}")
    engine.start()
    return engine
