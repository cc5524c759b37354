"""Linear layers and the tied embedding table, dense or weight-only quantized.

Weight-only means the activations stay in floating point and every row of a batch is computed
on its own: there is no activation scale shared by a batch, so a request's output never depends
on its batch-mates (torch's packed int8/int4 kernels give each row the same bits whatever M is;
tests/local_backend/test_weights.py checks it).

- int8: symmetric, one scale per output channel, ``torch.ops.aten._weight_int8pack_mm``.
- int4: asymmetric, one scale and zero per group of ``group_size`` input features,
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) or ``_weight_int4pack_mm`` (CUDA).
  SmolLM2's GGUF stores its layers as Q4_1 (groups of 32, scale and minimum), which int4 with
  groups of 32 represents almost exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = [
    "DenseLinear",
    "EmbeddingTable",
    "Int4Linear",
    "Int8Linear",
    "Linear",
    "dequantized",
    "make_embedding",
    "make_linear",
    "quantize_int4",
    "quantize_int8",
]

_INT4_INNER_K_TILES = 8  # the CUDA packing's tile parameter (2, 4 or 8); the CPU kernel ignores it


class Linear(Protocol):
    """``y = x @ W.T`` for x [M, in_features] in the activation dtype."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    def nbytes(self) -> int: ...


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scales fp32 [N]) with w ~= q * scale."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise int4: (q uint8 [N, K] in 0..15, scales [N, G], zeros [N, G]), fp32.

    Dequantized as ``(q - 8) * scale + zero`` (tinygemm's convention), so zero = min + 8 * scale.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the int4 group size {group_size}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scales, lo + 8.0 * scales


class DenseLinear:
    """A plain floating-point weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.contiguous()
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8Linear:
    """int8 weights with one scale per output channel; activations in ``dtype`` (bf16 on CPU: its fast path)."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        q, scales = quantize_int8(weight)
        self.qweight = q.contiguous()
        self.scales = scales.to(dtype)
        self.out_features = int(weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class Int4Linear:
    """int4 weights in groups along the input features, each with a scale and a zero point."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group_size: int) -> None:
        q, scales, zeros = quantize_int4(weight, group_size)
        self.group_size = group_size
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.cuda = weight.device.type == "cuda"
        if self.cuda:
            packed = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed, _INT4_INNER_K_TILES)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INT4_INNER_K_TILES)
        # [groups, N, 2]: (scale, zero) per group and output channel, the layout both kernels take.
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            return torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


def make_linear(weight: torch.Tensor, mode: str, dtype: torch.dtype, group_size: int) -> Linear:
    """A linear layer for ``mode`` (none|int8|int4) with activations in ``dtype``."""
    if mode == "int8":
        return Int8Linear(weight, dtype)
    if mode == "int4":
        return Int4Linear(weight, dtype, group_size)
    return DenseLinear(weight.to(dtype))


def dequantized(weight: torch.Tensor, mode: str, dtype: torch.dtype, group_size: int) -> DenseLinear:
    """A dense ``dtype`` copy of the weight as ``mode`` stores it (scales rounded as the kernel keeps them).

    Prefill is compute-bound, and dense bf16 GEMMs run 3x faster than the weight-only kernels at
    50 rows here, so prefill can use this copy while decode reads the smaller quantized weights.
    """
    if mode == "int8":
        q, scales = quantize_int8(weight)
        w = q.float() * scales.to(dtype).float()[:, None]
    elif mode == "int4":
        q, scales, zeros = quantize_int4(weight, group_size)
        g = q.reshape(q.shape[0], -1, group_size).float()
        w = ((g - 8) * scales.to(dtype).float()[..., None] + zeros.to(dtype).float()[..., None]).reshape(q.shape)
    else:
        w = weight
    return DenseLinear(w.to(dtype))


class EmbeddingTable:
    """The tied token embedding: looked up by token id on the way in, the LM head on the way out.

    Dense, or int8 with one scale per token (a scale per output channel of the head): the head
    and the lookups read the same int8 table, and lookups dequantize only the rows they need.
    (No int4 table: on SmolLM2, whose GGUF keeps the embedding at 8 bits, a 4-bit head lost
    answers fp32 gets right.)
    """

    def __init__(self, weight: torch.Tensor, mode: str, dtype: torch.dtype) -> None:
        if mode not in ("none", "int8"):
            raise ValueError(f"the embedding table is dense or int8, not {mode!r}")
        self.mode, self.dtype = mode, dtype
        self.head: Int8Linear | DenseLinear
        if mode == "int8":
            self.head = Int8Linear(weight, dtype)
            self._rows, self._scales = self.head.qweight, self.head.scales
        else:
            self.head = DenseLinear(weight.to(dtype))
            self._rows = self.head.weight

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for token ids [T] -> [T, hidden] in the activation dtype."""
        if self.mode == "int8":
            return self._rows[ids].to(self.dtype) * self._scales[ids, None]
        return self._rows[ids]

    def nbytes(self) -> int:
        return self.head.nbytes()


def make_embedding(weight: torch.Tensor, mode: str, dtype: torch.dtype) -> EmbeddingTable:
    """The tied embedding / LM head table: int8 for any quantized mode, else dense."""
    return EmbeddingTable(weight, "none" if mode == "none" else "int8", dtype)
