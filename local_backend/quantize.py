"""Choose the weight format and activation dtype for a device, and build the lean model with it.

Modes: ``none`` (dense weights: fp32 on CPU, bf16 on CUDA), ``int8`` (weight-only, one scale
per output channel), ``w8a8`` (CPU only: the same int8 weights times int8 activations, each row
quantized with its own scale; the LM head quantizes each row in two int8 passes), ``int4`` (weight-only, groups of 32 input features with a scale and zero
each; the tied embedding/LM head stays int8). Quantized modes compute in bf16 on CPU (the
packed kernels' fast path); prefill there reads dense bf16 copies of the same (dequantized)
weights, because at 50 rows dense GEMMs run ~3x faster than the weight-only kernels.

``auto`` is the fastest mode whose greedy answers on the check set (``local_backend/checkset.py``)
stay at least as right as fp32's; measured with bench/local_model.py, figures in
local_backend/README.md:

- CPU: ``int8``. It decodes faster than fp32 and gets as many check-set answers right;
  ``int4`` decodes faster still at one stream but answers fewer right. ``w8a8`` serves 8
  streams ~45% faster than ``int8`` (its int8 x int8 kernel costs about the same at 8 rows as
  at 1) for ~8% less at one stream and as many of the 36 checks right, but it keeps fewer of
  fp32's answers word for word and lost one of the acceptance's ten questions that fp32 and
  ``int8`` answer ("the sky is ... indigo"), so it is an option, not the default.
- CUDA: ``none`` (bf16). For a 135M model a GPU is bound by kernel launches, not weight bytes;
  ``int8``/``int4`` use torch's CUDA weight-only kernels for larger models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INT4_GROUP_SIZE", "QUANTIZE_CHOICES", "QuantPlan", "build_lean", "plan_quantization"]

QUANTIZE_CHOICES = ("auto", "none", "int8", "w8a8", "int4")
_AUTO = {"cpu": "int8", "cuda": "none"}
INT4_GROUP_SIZE = 32  # SmolLM2's GGUF is Q4_1 in groups of 32: int4 in the same groups keeps its grid


@dataclass(frozen=True)
class QuantPlan:
    """The resolved choice: weight format, activation dtype, and whether prefill uses dense copies."""

    mode: str  # none|int8|int4
    act_dtype: torch.dtype
    device: str  # cpu|cuda
    dense_prefill: bool

    def describe(self) -> str:
        prefill = ", dense bf16 prefill" if self.dense_prefill else ""
        return f"{self.mode} ({str(self.act_dtype).removeprefix('torch.')} activations on {self.device}{prefill})"


def plan_quantization(quantize: str, device: str) -> QuantPlan:
    """Resolve ``auto`` and pick dtypes for ``device`` (cpu|cuda)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {QUANTIZE_CHOICES}, not {quantize!r}")
    if device not in _AUTO:
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    mode = _AUTO[device] if quantize == "auto" else quantize
    if mode == "w8a8" and device != "cpu":
        # torch._int_mm on CUDA wants more than 16 rows, and a GPU has no use for it at 135M parameters.
        raise ValueError("--quantize w8a8 runs on CPU only")
    if device == "cuda":
        return QuantPlan(mode, torch.bfloat16, device, dense_prefill=False)
    if mode == "none":
        return QuantPlan(mode, torch.float32, device, dense_prefill=False)
    return QuantPlan(mode, torch.bfloat16, device, dense_prefill=True)


def build_lean(hf_model: Any, plan: QuantPlan) -> Any:
    """The LeanLlama for ``plan`` from a loaded transformers Llama (which the caller may then drop)."""
    from .llama import LeanLlama

    return LeanLlama.from_hf(
        hf_model, mode=plan.mode, act_dtype=plan.act_dtype, group_size=INT4_GROUP_SIZE, dense_prefill=plan.dense_prefill
    )
