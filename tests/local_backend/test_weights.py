"""Weight-only quantized linears and the tied embedding table (no model needed)."""

from __future__ import annotations

import pytest
import torch

from local_backend.llama.weights import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    _onednn_int8,
    dequantized,
    make_embedding,
    quantize_int4,
    quantize_int8,
    quantize_rows,
)
from local_backend.quantize import plan_quantization


def _linear(weight: torch.Tensor, mode: str) -> Int8Linear | Int4Linear | W8A8Linear:
    if mode == "int8":
        return Int8Linear(weight, torch.bfloat16)
    if mode == "w8a8":
        return W8A8Linear(weight)
    return Int4Linear(weight, torch.bfloat16, 32)


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(96, 128, generator=torch.Generator().manual_seed(0))


def test_int8_is_per_output_channel(weight: torch.Tensor) -> None:
    weight[3] *= 100.0  # one loud channel must not coarsen the others
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and scales.shape == (96,)
    assert q.abs().amax(dim=1).eq(127).all()
    err = (q.float() * scales[:, None] - weight).abs()
    assert (err <= scales[:, None] / 2 + 1e-6).all()


def test_int4_groups_reproduce_a_4bit_grid_exactly() -> None:
    # Q4_1-style weights (scale * q + min per group of 32, both levels 0 and 15 used), as in SmolLM2's GGUF.
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d, m = torch.rand(64, 4, 1, generator=g) * 0.01, -torch.rand(64, 4, 1, generator=g) * 0.1
    w = (q * d + m).reshape(64, 128)
    qq, scales, zeros = quantize_int4(w, 32)
    back = (qq.reshape(64, 4, 32).float() - 8) * scales[..., None] + zeros[..., None]
    assert torch.allclose(back.reshape(64, 128), w, atol=1e-7)


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4"])
def test_kernel_matches_its_dequantized_weight(weight: torch.Tensor, mode: str) -> None:
    linear = _linear(weight, mode)
    dense = dequantized(weight, mode, torch.bfloat16, 32)
    x = torch.randn(5, 128).bfloat16()
    got, want, exact = linear(x).float(), dense(x).float(), torch.nn.functional.linear(x.float(), weight)
    if mode == "w8a8":  # the activations are rounded to 8 bits too: close in norm, not element by element
        assert (got - want).norm() / want.norm() < 0.02
    else:
        assert torch.allclose(got, want, atol=0.1, rtol=0.02)
    tolerance = 0.05 if mode == "int8" else 0.3  # relative to the output's size
    assert (got - exact).norm() / exact.norm() < tolerance


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4"])
def test_each_row_gets_the_same_bits_whatever_the_batch(weight: torch.Tensor, mode: str) -> None:
    # No activation scale is shared by a batch: row 0 alone and among 7 or 49 others is bit-identical.
    linear = _linear(weight, mode)
    x = torch.randn(50, 128).bfloat16()
    x[1:] *= 30.0  # louder batch-mates must not change row 0's scale (w8a8 quantizes each row alone)
    alone = linear(x[:1])
    assert torch.equal(linear(x[:8])[:1], alone)
    assert torch.equal(linear(x)[:1], alone)


def test_activations_are_quantized_per_row() -> None:
    x = torch.randn(4, 128)
    x[2] *= 1000.0  # one loud row must not coarsen the others
    q, scales = quantize_rows(x)
    assert q.dtype == torch.int8 and scales.shape == (4, 1)
    assert q.abs().amax(dim=1).eq(127).all()
    assert ((q.float() * scales - x).abs() <= scales / 2 + 1e-6).all()
    u, same = quantize_rows(x, offset=True)  # oneDNN's unsigned form: the same values + 128
    assert u.dtype == torch.uint8 and torch.equal(same, scales) and torch.equal(u.int() - 128, q.int())
    zeros, _ = quantize_rows(torch.zeros(2, 128))  # an all-zero row stays zero (no 0/0)
    assert zeros.eq(0).all()


@pytest.mark.parametrize("residual_pass", [False, True])
def test_w8a8_kernels_give_the_same_bits(weight: torch.Tensor, residual_pass: bool) -> None:
    # oneDNN's packed int8 matmul and torch._int_mm both sum int32 exactly: the same fp32 out.
    x = torch.randn(9, 128).bfloat16()
    fallback = W8A8Linear(weight, residual_pass=residual_pass, onednn=False)(x)
    if _onednn_int8():  # the CPUs oneDNN's int8 kernel is used on (exact: VNNI or AMX)
        assert torch.equal(W8A8Linear(weight, residual_pass=residual_pass, onednn=True)(x), fallback)
    assert fallback.dtype == torch.float32 and fallback.shape == (9, 96)


def test_onednn_int8_only_where_it_sums_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without VNNI (or AMX) oneDNN's u8 x s8 kernel saturates pairs of products at 16 bits (AVX2's
    # vpmaddubsw): W8A8Linear then takes torch._int_mm, whatever the CPU it runs on.
    import local_backend.llama.weights as w

    monkeypatch.setattr(w, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not w._onednn_int8() and W8A8Linear(torch.randn(8, 64)).qweight_t is not None
    monkeypatch.setattr(w, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    assert w._onednn_int8() == (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise"))


def test_w8a8_residual_pass_is_close_to_the_weight_only_result(weight: torch.Tensor) -> None:
    # Two int8 passes per row (~15 bits) leave only the weights' rounding: the head keeps int8's picks.
    x = torch.randn(6, 128)
    q, scales = quantize_int8(weight)
    want = torch.nn.functional.linear(x, q.float() * scales[:, None])
    one, two = W8A8Linear(weight)(x), W8A8Linear(weight, residual_pass=True)(x)
    err_one, err_two = (one - want).norm() / want.norm(), (two - want).norm() / want.norm()
    assert err_two < 1e-3 and err_two < err_one / 20


def test_w8a8_is_cpu_only() -> None:
    assert plan_quantization("w8a8", "cpu").mode == "w8a8"
    with pytest.raises(ValueError, match="CPU only"):
        plan_quantization("w8a8", "cuda")


@pytest.mark.parametrize("mode", ["none", "int8", "w8a8", "int4"])
def test_embedding_rows_match_the_head_weights(weight: torch.Tensor, mode: str) -> None:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    table = make_embedding(weight, mode, dtype)
    assert table.mode == {"none": "none", "w8a8": "w8a8"}.get(mode, "int8")  # int4 keeps the head at int8
    ids = torch.tensor([0, 5, 95, 5])
    rows = table.lookup(ids).float()
    assert rows.shape == (4, 128)
    # The head computes x @ W.T: one-hot inputs pick out the rows it multiplies with.
    eye = torch.eye(128, dtype=dtype)
    head_rows = table.head(eye).float().t()[ids]
    tolerance = 0.0 if mode == "none" else 0.01 * float(weight.abs().max())
    assert (rows - head_rows).abs().max() <= tolerance
    if mode != "none":
        assert table.nbytes() < weight.numel() * 2  # smaller than bf16


def test_dense_linear_is_plain_matmul(weight: torch.Tensor) -> None:
    x = torch.randn(3, 128)
    assert torch.equal(DenseLinear(weight)(x), torch.nn.functional.linear(x, weight))
