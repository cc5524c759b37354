"""Choose the weight format and activation dtype for a device, and build the lean model with it.

Modes:

- ``none``: dense weights, fp32 on CPU, bf16 on CUDA.
- ``w8a16`` (CPU with AVX-512 VNNI and a C compiler): int8 weights, one scale per output
  channel, times fp32 activations that our kernel (``llama/q8kernel.c``) carries as two int8
  digits per value, each row with its own scale (~15 bits); prefill through the same kernel.
- ``w8a8``: the same weights times one int8 digit per activation (per row), two for the MLP's
  down projection and the LM head. On the VNNI kernel where it runs (fp32 in and out), else
  oneDNN's int8 matmul (bf16 activations, dense bf16 prefill).
- ``int8``: weight-only, torch's ``_weight_int8pack_mm`` (bf16 activations).
- ``int4``: weight-only, groups of 32 input features with a scale and zero each; the tied
  embedding/LM head stays int8.

torch's weight-only modes compute in bf16 on CPU (the packed kernels' fast path) and prefill
through dense bf16 copies of the same (dequantized) weights, because at 50 rows dense GEMMs run
~3x faster than those kernels. The VNNI modes need no copy: their int8 products beat dense bf16
at every prompt length measured (12 to 500 tokens).

``auto`` is the fastest mode whose greedy answers on the check set (``local_backend/checkset.py``)
stay at least as right as fp32's; measured with bench/local_model.py, figures in
local_backend/README.md:

- CPU: ``w8a16``: ~6x fp32's one-stream decode (memory-bound: 135 MB of weights per token
  streamed at ~20 GB/s by one core), as many check-set answers right as fp32 and as many of
  fp32's tokens kept as torch's int8. ``w8a8`` batches 8 streams better (8 rows of one digit
  cost about one row's memory pass, two digits double the products) but keeps fewer of fp32's
  tokens and lost acceptance answers fp32 gets, so it is an option. Where the kernel cannot
  run (no AVX-512 VNNI, no compiler), ``auto`` falls back to ``int8`` and says why.
- CUDA: ``none`` (bf16). For a 135M model a GPU is bound by kernel launches, not weight bytes;
  ``int8``/``int4`` use torch's CUDA weight-only kernels for larger models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INT4_GROUP_SIZE", "QUANTIZE_CHOICES", "QuantPlan", "build_lean", "plan_quantization"]

QUANTIZE_CHOICES = ("auto", "none", "int8", "w8a16", "w8a8", "int4")
_AUTO = {"cpu": "w8a16", "cuda": "none"}  # w8a16 falls back to int8 where its kernel cannot run
INT4_GROUP_SIZE = 32  # SmolLM2's GGUF is Q4_1 in groups of 32: int4 in the same groups keeps its grid


@dataclass(frozen=True)
class QuantPlan:
    """The resolved choice: weight format, activation dtype, and whether prefill uses dense copies."""

    mode: str  # none|int8|w8a16|w8a8|int4
    act_dtype: torch.dtype
    device: str  # cpu|cuda
    dense_prefill: bool
    note: str = ""  # why auto chose what it chose, when that is not the first choice

    def describe(self) -> str:
        prefill = ", dense bf16 prefill" if self.dense_prefill else ""
        note = f"; {self.note}" if self.note else ""
        return f"{self.mode} ({str(self.act_dtype).removeprefix('torch.')} activations on {self.device}{prefill}){note}"


def plan_quantization(quantize: str, device: str) -> QuantPlan:
    """Resolve ``auto`` and pick dtypes for ``device`` (cpu|cuda)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {QUANTIZE_CHOICES}, not {quantize!r}")
    if device not in _AUTO:
        raise ValueError(f"device must be cpu or cuda, not {device!r}")
    mode, note = _AUTO[device] if quantize == "auto" else quantize, ""
    if mode in ("w8a8", "w8a16") and device != "cpu":
        # x86 int8 kernels (ours, oneDNN's); a GPU has no use for int8 activations at 135M parameters.
        raise ValueError(f"--quantize {mode} runs on CPU only")
    if device == "cuda":
        return QuantPlan(mode, torch.bfloat16, device, dense_prefill=False)
    if mode == "none":
        return QuantPlan(mode, torch.float32, device, dense_prefill=False)
    if mode in ("w8a8", "w8a16"):
        from .llama.native import kernel, unavailable_reason

        if kernel() is not None:
            # fp32 in and out: the kernel quantizes each row itself, prefill included (at 50 rows its
            # int8 products run faster than dense bf16 GEMMs, and no dense copy is kept).
            return QuantPlan(mode, torch.float32, device, dense_prefill=False)
        if mode == "w8a16" and quantize != "auto":
            raise ValueError(f"--quantize w8a16: {unavailable_reason()}")
        if mode == "w8a16":
            mode, note = "int8", f"not w8a16: {unavailable_reason()}"
        else:
            note = f"oneDNN's int8 matmul, not the VNNI kernel: {unavailable_reason()}"
    return QuantPlan(mode, torch.bfloat16, device, dense_prefill=True, note=note)


def build_lean(hf_model: Any, plan: QuantPlan) -> Any:
    """The LeanLlama for ``plan`` from a loaded transformers Llama (which the caller may then drop)."""
    from .llama import LeanLlama

    return LeanLlama.from_hf(
        hf_model, mode=plan.mode, act_dtype=plan.act_dtype, group_size=INT4_GROUP_SIZE, dense_prefill=plan.dense_prefill
    )
