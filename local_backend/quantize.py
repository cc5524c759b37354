"""Pick the compute dtype and apply weight quantization for a device.

``auto`` resolves to the fastest mode whose greedy answers on a fixed question set stay as
correct as fp32's (bench/local_model.py; numbers in local_backend/README.md):

- CPU: ``none`` (fp32). ``int8`` (torch's dynamic int8 linears, per-channel weights) decoded
  1.25-1.8x faster and halved TTFT, but lost answers fp32 gets right and garbled one; its
  activation scale is also shared by a batch's rows, so batch-mates change a request's output.
  ``int4`` (torchao weight-only, groups of 128, bf16 activations) kept every right answer but
  was not reliably faster (0.85-1.3x decode over three runs) and doubled TTFT (bf16 prefill).
  fp32 is also the exact path: batched greedy output equals one-at-a-time output.
- CUDA: ``none`` in bf16: for a 135M model, weight-only int8/int4 saves little memory
  bandwidth and adds dequantization work; torchao's kernels are offered for larger models.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["QUANTIZE_CHOICES", "QuantPlan", "apply_quantization", "plan_quantization"]

QUANTIZE_CHOICES = ("auto", "none", "int8", "int4")
_CPU_AUTO = "none"
_CUDA_AUTO = "none"
_INT4_GROUP_SIZE = 128  # groups of 32 garbled an answer; 64 was no faster

log = logging.getLogger("local_backend.quantize")


@dataclass(frozen=True)
class QuantPlan:
    """The resolved choice: quantization mode and the dtype the model is loaded in."""

    mode: str  # none|int8|int4
    dtype: torch.dtype
    device: str  # cpu|cuda

    def describe(self) -> str:
        return f"{self.mode} ({str(self.dtype).removeprefix('torch.')} activations on {self.device})"


def plan_quantization(quantize: str, device: str) -> QuantPlan:
    """Resolve ``auto`` and choose the load dtype for ``device`` (cpu|cuda)."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"--quantize must be one of {QUANTIZE_CHOICES}, not {quantize!r}")
    if device == "cuda":
        mode = _CUDA_AUTO if quantize == "auto" else quantize
        return QuantPlan(mode, torch.bfloat16, device)
    mode = _CPU_AUTO if quantize == "auto" else quantize
    # int4 on CPU packs weights for bf16 matmuls (AVX-512 BF16/AMX); int8 dynamic and none stay fp32.
    dtype = torch.bfloat16 if mode == "int4" else torch.float32
    return QuantPlan(mode, dtype, device)


def _linear(module: torch.nn.Module, fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear)


def _cpu_int8(model: Any) -> Any:
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch.ao's eager quantization is deprecated in favour of torchao, whose CPU int8 path
        # measured 2-3x slower than this one here; the deprecation notice is noise for users.
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def _torchao() -> Any:
    try:
        import torchao.quantization as tq
    except ImportError as exc:
        raise RuntimeError("this quantization needs torchao: pip install torchao==0.18.0") from exc
    logging.getLogger("torchao").setLevel(logging.ERROR)  # it logs optional CUDA kernels it cannot load
    return tq


def apply_quantization(model: Any, plan: QuantPlan) -> Any:
    """Quantize ``model`` in place per ``plan``; returns the model to use."""
    if plan.mode == "none":
        return model
    if plan.device == "cpu" and plan.mode == "int8":
        return _cpu_int8(model)
    tq = _torchao()
    if plan.device == "cpu":  # int4
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        tq.quantize_(model, PrototypeInt4WeightOnlyConfig(group_size=_INT4_GROUP_SIZE), filter_fn=_linear)
    elif plan.mode == "int8":
        tq.quantize_(model, tq.Int8WeightOnlyConfig(), filter_fn=_linear)
    else:
        tq.quantize_(model, tq.Int4WeightOnlyConfig(group_size=_INT4_GROUP_SIZE), filter_fn=_linear)
    return model
