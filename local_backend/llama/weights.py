"""Linear layers and the tied embedding table, dense or weight-only quantized.

Weight-only means the activations stay in floating point and every row of a batch is computed
on its own: there is no activation scale shared by a batch, so a request's output never depends
on its batch-mates (torch's packed int8/int4 kernels give each row the same bits whatever M is;
tests/local_backend/test_weights.py checks it).

- int8: symmetric, one scale per output channel, ``torch.ops.aten._weight_int8pack_mm``.
- w8a8: the same int8 weights, and each activation row quantized to int8 on the fly with its
  own scale (per token, never per batch), multiplied int8 x int8 with exact int32 sums (oneDNN's
  packed int8 matmul, or ``torch._int_mm``): a row's result is bit-identical whatever its
  batch-mates, and the kernel's cost grows far less with the rows than the weight-only one's.
- w8a16 / w8a8 on our own int8 kernel (``Q8Linear``, ``q8kernel.c`` built by ``native.py`` for
  AVX-512 VNNI or AVX2, the same bits on both): the same int8 weights times activations
  quantized per row to ~16 bits (w8a16) or 8 (w8a8; its MLP down projection and LM head keep 16);
  exact integer sums, so a row's bits never depend on its batch-mates.
- int4: asymmetric, one scale and zero per group of ``group_size`` input features,
  ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (CPU) or ``_weight_int4pack_mm`` (CUDA).
  SmolLM2's GGUF stores its layers as Q4_1 (groups of 32, scale and minimum), which int4 with
  groups of 32 represents almost exactly.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .native import cpu_flags

__all__ = [
    "DenseLinear",
    "EmbeddingTable",
    "Int4Linear",
    "Int8Linear",
    "Linear",
    "Q8Linear",
        "W8A8Linear",
    "dequantized",
    "make_embedding",
    "make_linear",
    "quantize_int4",
    "quantize_int8",
    "quantize_rows",
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


def quantize_rows(x: torch.Tensor, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of activations x [M, K]: (q [M, K], scales fp32 [M, 1]).

    Each row's scale is its own absolute maximum / 127, so a row's bits never depend on the
    other rows of the batch. With ``offset`` the values come as uint8 q + 128 (zero point 128):
    oneDNN's fast int8 kernels take unsigned activations (signed ones fall back to a path
    ~300x slower here).
    """
    scales = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-10).div_(127.0)
    q = torch.div(x, scales).round_()
    return (q.add_(_ZERO_POINT).to(torch.uint8) if offset else q.to(torch.int8)), scales


_ZERO_POINT = 128


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
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)  # torch.ops: typed Any
        return out

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()


class W8A8Linear:
    """int8 weights (one scale per output channel) times int8 activations (one scale per row).

    The output is fp32: ``(xq @ q.T) * channel_scale * row_scale``. The int32 sums are exact
    and both scales belong to one row or one column, so any row's bits are the same whatever
    M and whichever kernel torch picks for it. The kernel is oneDNN's int8 matmul over a weight
    packed once (``onednn.qlinear_pointwise``, what torch's x86 int8 inference uses): its time
    barely grows from 1 to 8 rows because it streams the packed weight once for all rows;
    ``torch._int_mm`` (which repacks the weight every call and is 1.3x slower at 8 rows here)
    gives the same bits and serves where torch lacks oneDNN.

    ``residual_pass`` quantizes each row twice, its int8 value and then its rounding error in
    a second int8 row at 1/254 of the scale (~15 bits per activation), in one call of 2M rows:
    for the LM head, whose near-tied top tokens one 8-bit pass flipped ("Paris" lost).
    """

    def __init__(self, weight: torch.Tensor | None = None, *, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                 residual_pass: bool = False, onednn: bool | None = None) -> None:
        if quantized is None:
            if weight is None:
                raise ValueError("W8A8Linear needs a weight or its quantized (q, scales)")
            quantized = quantize_int8(weight)
        q, scales = quantized
        self.out_features = int(q.shape[0])
        self.residual_pass = residual_pass
        self.scales = scales.float().contiguous()
        self.onednn = _onednn_int8() if onednn is None else onednn
        if self.onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), None)
            self._zeros = torch.zeros(self.out_features, dtype=torch.long)
            self.qweight_t = None
        else:
            self.qweight_t = q.t().contiguous()  # [K, N]: _int_mm's layout
        self._bytes = q.numel() + self.scales.numel() * 4

    def _matmul(self, xq: torch.Tensor) -> torch.Tensor:
        """fp32 [M, N] = (xq @ q.T) * channel_scale for xq [M, K] from ``quantize_rows(offset=self.onednn)``."""
        if self.qweight_t is None:
            out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(  # torch.ops: typed Any
                xq, 1.0, _ZERO_POINT, self.packed, self.scales, self._zeros, None, 1.0, 0, torch.float32, "none", [], ""
            )
            return out
        return torch.mul(torch._int_mm(xq, self.qweight_t), self.scales)  # int32 * fp32 -> fp32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.residual_pass:
            xq, row_scales = quantize_rows(x, offset=self.onednn)
            return self._matmul(xq).mul_(row_scales)
        m = x.shape[0]
        row_scales = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-10).div_(127.0)
        scaled = torch.div(x, row_scales)
        hi = scaled.round()
        lo = scaled.sub_(hi).mul_(_RESIDUAL_STEP).round_()  # |error| <= 1/2, so lo stays within +-127
        both = torch.cat([hi, lo])
        out = self._matmul(both.add_(_ZERO_POINT).to(torch.uint8) if self.onednn else both.to(torch.int8))
        return out[m:].div_(_RESIDUAL_STEP).add_(out[:m]).mul_(row_scales)

    def nbytes(self) -> int:
        return self._bytes


_RESIDUAL_STEP = 254.0  # the second pass's step is 1/254 of the first's


# CPU features with which oneDNN's int8 matmul sums u8 x s8 products exactly (VNNI's vpdpbusd, AMX).
# Without them it multiplies with vpmaddubsw, which saturates a pair of products at 16 bits: with
# activations offset to 0..255 one pair reaches 2 x 255 x 127, and the outputs come out wrong
# (measured on an AVX2-only EPYC: 4-5 % off in norm). torch._int_mm is exact there.
_EXACT_INT8_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def _onednn_int8() -> bool:
    """Whether this torch has oneDNN's int8 linear (x86 CPU builds do) and this CPU runs it exactly."""
    exact = not cpu_flags().isdisjoint(_EXACT_INT8_FLAGS)
    return exact and bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.onednn, "qlinear_pointwise")


class Q8Linear:
    """int8 weights (one scale per output channel) times fp32 activations quantized per row, on our kernel.

    ``q8kernel.c`` (built by ``native.py`` for AVX-512 VNNI or AVX2; the same bits on both). Each
    activation row is quantized on its own inside the kernel: a = round(x / s) with s = max|x| / 127
    (``digits=1``) or max|x| / 32639 (``digits=2``, ~16 bits); y = (q . a) * channel_scale * s with
    exact integer sums, so a row's output is bit-identical whatever the batch. A tile streams the
    packed weight once for several rows. The RMSNorm or gated SiLU before a linear and the residual
    add after it run inside the same call (``norm_linear``, ``add_into``): fewer tensor ops per step.
    ``isa`` picks a build (default: the best this CPU runs).
    """

    def __init__(self, weight: torch.Tensor | None = None, *, quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                 digits: int = 2, isa: str | None = None) -> None:
        from .native import kernel, unavailable_reason

        lib = kernel(isa)
        if lib is None:
            raise RuntimeError(unavailable_reason(isa))
        if digits not in (1, 2):
            raise ValueError(f"digits must be 1 or 2, not {digits}")
        if quantized is None:
            if weight is None:
                raise ValueError("Q8Linear needs a weight or its quantized (q, scales)")
            quantized = quantize_int8(weight)
        q, scales = quantized
        n, k = (int(d) for d in q.shape)
        self.kernel = lib
        self.out_features, self.in_features, self.digits = n, k, digits
        self._np, self._kp = -(-n // lib.block) * lib.block, -(-k // 4) * 4
        q = q.contiguous()
        self.packed = torch.empty(self._np * self._kp, dtype=torch.uint8)
        lib.pack(q.data_ptr(), n, k, self._np, self._kp, self.packed.data_ptr())
        self.scales = scales.float().contiguous()
        self._linear = lib.linear
        self._wp, self._sp = self.packed.data_ptr(), self.scales.data_ptr()

    def _run(self, x: torch.Tensor, y: torch.Tensor, norm: torch.Tensor | None, eps: float, glu: bool, accumulate: bool) -> torch.Tensor:
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        m = int(x.shape[0])
        if m == 0:
            return y
        rc = self._linear(x.data_ptr(), x.stride(0), m, self.in_features, self._kp, self.out_features, self._np, self._wp, self._sp,
                          None if norm is None else norm.data_ptr(), eps, int(glu), self.digits, y.data_ptr(), y.stride(0), int(accumulate),
                          torch.get_num_threads())
        if rc != 0:
            raise MemoryError(f"the {self.kernel.isa} int8 kernel could not allocate its buffers for {m} rows x {self.in_features}")
        return y

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        return torch.empty((x.shape[0], self.out_features), dtype=torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self._out(x), None, 0.0, False, False)

    def norm_linear(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``self(rms_norm(x) * weight)`` in one call (``weight`` fp32 [in_features])."""
        return self._run(x, self._out(x), weight, eps, False, False)

    def add_into(self, h: torch.Tensor, x: torch.Tensor, *, glu: bool = False) -> torch.Tensor:
        """``h += self(x)`` in place, or ``h += self(silu(gate) * up)`` for x = [gate | up] with ``glu``;
        ``h`` fp32 [M, out_features] with contiguous rows. Returns ``h``."""
        if h.dtype != torch.float32 or h.stride(-1) != 1:
            raise ValueError("add_into needs an fp32 output with contiguous rows")
        if glu and x.shape[-1] != 2 * self.in_features:
            raise ValueError(f"glu input has {x.shape[-1]} features, expected 2 x {self.in_features}")
        return self._run(x, h, None, 0.0, glu, True)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() * 4


class Int4Linear:
    """int4 weights in groups along the input features, each with a scale and a zero point."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group_size: int) -> None:
        q, scales, zeros = quantize_int4(weight, group_size)
        self.group_size = group_size
        self.out_features = int(weight.shape[0])
        self.in_features = int(weight.shape[1])
        self.cuda = weight.device.type == "cuda"
        self.packed: torch.Tensor  # torch.ops: typed Any
        if self.cuda:
            packed = (q[:, ::2] << 4 | q[:, 1::2]).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed, _INT4_INNER_K_TILES)
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), _INT4_INNER_K_TILES)
        # [groups, N, 2]: (scale, zero) per group and output channel, the layout both kernels take.
        self.scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor  # torch.ops: typed Any
        if self.cuda:
            out = torch.ops.aten._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)
        return out

    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


# w8a8 on our kernel keeps two activation digits where one lost answers fp32 gets: the MLP's
# down projection, whose input (silu(gate) * up) carries the outlier channels, and the LM head
# (the tied one is built by EmbeddingTable; an untied one comes here as "head").
W8A8_TWO_DIGITS = frozenset({"down", "head"})


def make_linear(weight: torch.Tensor, mode: str, dtype: torch.dtype, group_size: int, role: str = "", isa: str | None = None) -> Linear:
    """A linear layer for ``mode`` (none|int8|w8a8|w8a16|int4) with activations in ``dtype``.

    ``role`` names the layer's place (qkv, o, gate_up, down, head) where a mode treats them differently;
    ``isa`` the kernel build of the w8a16/w8a8 modes (default: the best this CPU runs).
    """
    if mode == "w8a16":
        return Q8Linear(weight, digits=2, isa=isa)
    if mode == "w8a8" and dtype == torch.float32:  # fp32 activations: the kernel's plan (quantize.py)
        return Q8Linear(weight, digits=2 if role in W8A8_TWO_DIGITS else 1, isa=isa)
    if mode == "w8a8":
        return W8A8Linear(weight)
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
    if mode in ("int8", "w8a8", "w8a16"):
        q, scales = quantize_int8(weight)
        # int8's kernel keeps its scales in the activation dtype; w8a8 and w8a16 keep them in fp32.
        w = q.float() * (scales.to(dtype).float() if mode == "int8" else scales)[:, None]
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
    ``w8a8``: the same int8 table, the head a residual-pass W8A8Linear (oneDNN keeps its own
    packed copy, 28 MB for SmolLM2). (No int4 table: on SmolLM2, whose GGUF keeps the embedding at 8 bits, a 4-bit head lost
    answers fp32 gets right.)
    """

    def __init__(self, weight: torch.Tensor, mode: str, dtype: torch.dtype, isa: str | None = None) -> None:
        if mode not in ("none", "int8", "w8a8", "w8a16"):
            raise ValueError(f"the embedding table is dense, int8, w8a8 or w8a16, not {mode!r}")
        self.mode, self.dtype = mode, dtype
        self.head: Int8Linear | W8A8Linear | Q8Linear | DenseLinear
        if mode == "int8":
            self.head = Int8Linear(weight, dtype)
            self._rows, self._scales = self.head.qweight, self.head.scales
        elif mode in ("w8a8", "w8a16") and dtype == torch.float32:
            # Two digits for the head in both: one 8-bit pass flipped near-tied top tokens ("Paris").
            q, scales = quantize_int8(weight)
            self.head = Q8Linear(quantized=(q, scales), digits=2, isa=isa)
            self._rows, self._scales = q, scales
        elif mode == "w8a8":
            q, scales = quantize_int8(weight)
            self.head = W8A8Linear(quantized=(q, scales), residual_pass=True)
            self._rows, self._scales = q, scales
        else:
            self.head = DenseLinear(weight.to(dtype))
            self._rows = self.head.weight

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows for token ids [T] -> [T, hidden] in the activation dtype."""
        if self.mode != "none":
            return (self._rows[ids].to(self.dtype) * self._scales[ids, None]).to(self.dtype)
        return self._rows[ids]

    def nbytes(self) -> int:
        return self.head.nbytes()


def make_embedding(weight: torch.Tensor, mode: str, dtype: torch.dtype, isa: str | None = None) -> EmbeddingTable:
    """The tied embedding / LM head table: dense for ``none``, its own kind for ``w8a8``/``w8a16``, else int8 (int4's too)."""
    return EmbeddingTable(weight, mode if mode in ("none", "w8a8", "w8a16") else "int8", dtype, isa)
