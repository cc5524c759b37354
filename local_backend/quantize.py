"""Choose the weight format and activation dtype for a device, and build the lean model with it.

Modes:

- ``none``: dense weights, fp32 on CPU, bf16 on CUDA.
- ``w8a16`` (CPU with AVX-512 VNNI or AVX2, and a C compiler): int8 weights, one scale per output
  channel, times fp32 activations that our kernel (``llama/q8kernel.c``) quantizes per row to ~16
  bits; prefill and attention through the same kernel. The AVX-512 VNNI and AVX2 builds give the
  same bits, so the answers do not depend on the CPU.
- ``w8a8``: the same weights times 8-bit activations (per row), 16 for the MLP's down projection
  and the LM head. On our kernel where it runs (fp32 in and out), else oneDNN's int8 matmul (bf16
  activations, dense bf16 prefill).
- ``int8``: weight-only, torch's ``_weight_int8pack_mm`` (bf16 activations).
- ``int4``: weight-only, groups of 32 input features with a scale and zero each; the tied
  embedding/LM head stays int8.

torch's weight-only modes compute in bf16 on CPU (the packed kernels' fast path) and prefill
through dense bf16 copies of the same (dequantized) weights, because at 50 rows dense GEMMs run
~3x faster than those kernels. The kernel modes need no copy.

``auto`` is the fastest mode whose greedy answers on the check set (``local_backend/checkset.py``)
stay at least as right as fp32's; measured with bench/local_model.py, figures in
local_backend/README.md:

- CPU: ``w8a16`` on the best kernel build the CPU runs (``avx512_vnni``, else ``avx2``): decode
  streams 135 MB of int8 weights per token at memory speed, several times fp32's. Where no build
  runs (another CPU family, no compiler): ``int8`` on a CPU with native bf16 (its bf16 activations
  keep fp32's answers there), else ``none``: emulated bf16 on an AVX2-only CPU lost answers fp32
  gets ("Paris"), and the default must never answer worse than fp32. ``w8a8`` batches 8 streams
  better on AVX-512 (8 rows of one digit cost about one row's memory pass) but keeps fewer of
  fp32's tokens and lost acceptance answers fp32 gets, so it is an option.
- CUDA: ``none`` (bf16). For a 135M model a GPU is bound by kernel launches, not weight bytes;
  ``int8``/``int4`` use torch's CUDA weight-only kernels for larger models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["INT4_GROUP_SIZE", "QUANTIZE_CHOICES", "QuantPlan", "build_lean", "plan_quantization"]

QUANTIZE_CHOICES = ("auto", "none", "int8", "w8a16", "w8a8", "int4")
_AUTO = {"cpu": "w8a16", "cuda": "none"}  # w8a16 falls back where no kernel build runs (see plan_quantization)
_NATIVE_BF16 = ("avx512_bf16", "amx_bf16")  # CPU flags of a native bf16 dot product
INT4_GROUP_SIZE = 32  # SmolLM2's GGUF is Q4_1 in groups of 32: int4 in the same groups keeps its grid


@dataclass(frozen=True)
class QuantPlan:
    """The resolved choice: weight format, activation dtype, and whether prefill uses dense copies."""

    mode: str  # none|int8|w8a16|w8a8|int4
    act_dtype: torch.dtype
    device: str  # cpu|cuda
    dense_prefill: bool
    note: str = ""  # why auto chose what it chose, when that is not the first choice
    kernel: str | None = None  # the kernel build (avx512_vnni|avx2) of the w8a16/w8a8 modes, None for torch's

    def describe(self) -> str:
        prefill = ", dense bf16 prefill" if self.dense_prefill else ""
        kernel = f", {self.kernel} kernel" if self.kernel else ""
        note = f"; {self.note}" if self.note else ""
        return f"{self.mode} ({str(self.act_dtype).removeprefix('torch.')} activations on {self.device}{kernel}{prefill}){note}"

    @property
    def path(self) -> str:
        """The compute path in one word, for /metrics: the kernel build, else torch on the device."""
        return self.kernel or f"torch-{self.device}"


def plan_quantization(quantize: str, device: str, kernel_isa: str | None = None) -> QuantPlan:
    """Resolve ``auto`` and pick dtypes for ``device`` (cpu|cuda); ``kernel_isa`` names the kernel build
    of the w8a16/w8a8 modes (default: ``$LOCAL_BACKEND_KERNEL``, else the best this CPU runs)."""
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

        found = kernel(kernel_isa)
        if found is None and kernel_isa is not None:
            raise ValueError(f"--kernel {kernel_isa}: {unavailable_reason(kernel_isa)}")
        if found is not None:
            # fp32 in and out: the kernel quantizes each row itself, prefill and attention included.
            return QuantPlan(mode, torch.float32, device, dense_prefill=False, kernel=found.isa)
        if quantize != "auto":
            if mode == "w8a16":
                raise ValueError(f"--quantize w8a16: {unavailable_reason()}")
            note = f"oneDNN's int8 matmul, not our kernel: {unavailable_reason()}"
            return QuantPlan(mode, torch.bfloat16, device, dense_prefill=True, note=note)
        if _native_bf16():
            mode, note = "int8", f"not w8a16: {unavailable_reason()}"
        else:
            return QuantPlan("none", torch.float32, device, dense_prefill=False,
                             note=f"not w8a16: {unavailable_reason()}; not int8: this CPU has no native bf16")
    return QuantPlan(mode, torch.bfloat16, device, dense_prefill=True, note=note)


def _native_bf16() -> bool:
    from .llama.native import cpu_flags

    return any(flag in cpu_flags() for flag in _NATIVE_BF16)


def build_lean(hf_model: Any, plan: QuantPlan) -> Any:
    """The LeanLlama for ``plan`` from a loaded transformers Llama (which the caller may then drop)."""
    from .llama import LeanLlama

    return LeanLlama.from_hf(
        hf_model, mode=plan.mode, act_dtype=plan.act_dtype, group_size=INT4_GROUP_SIZE, dense_prefill=plan.dense_prefill, isa=plan.kernel
    )
