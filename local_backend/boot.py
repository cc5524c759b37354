"""From command-line settings to a running Engine: device, threads, load, quantize, warm up."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["EngineSettings", "build_engine", "default_threads", "resolve_device"]

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


def default_threads() -> int:
    """Torch threads: every usable core but one, which stays free for the gateway's event loop.

    With 2 shared cores, 2 torch threads slowed decoding 4x as soon as anything else ran
    (OpenMP threads spin-wait for each other), while 1 thread lost ~25% on an idle machine.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


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
    # Optional CUDA kernels torchao cannot load on CPU, and torch's pytree deprecation notes.
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # \r-redrawn bars make one huge log line


def build_engine(settings: EngineSettings, progress: Progress) -> Engine:
    """Load, quantize and warm the model; return a started Engine."""
    _quiet_libraries()
    import torch

    from .engine import Engine
    from .models import load_model
    from .quantize import apply_quantization, plan_quantization

    device = resolve_device(settings.device)
    threads = settings.threads or default_threads()
    if device == "cpu":
        torch.set_num_threads(threads)
    plan = plan_quantization(settings.quantize, device)
    progress(f"device {device}, {threads} torch threads, quantization {plan.describe()}")
    loaded = load_model(settings.model, device=device, dtype=plan.dtype, progress=progress)
    if plan.mode != "none":
        started = time.perf_counter()
        apply_quantization(loaded.model, plan)
        progress(f"quantized to {plan.mode} in {time.perf_counter() - started:.1f} s")
    engine = Engine(loaded, max_batch=settings.max_batch, max_queue=settings.max_queue, quantization=plan.mode)
    started = time.perf_counter()
    engine.warm_up(loaded.tokenizer("Hello, how are you?").input_ids)
    progress(f"warmed up in {time.perf_counter() - started:.2f} s")
    engine.start()
    return engine
