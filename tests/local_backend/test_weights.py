"""Weight-only quantized linears and the tied embedding table (no model needed)."""

from __future__ import annotations

import pytest
import torch

from local_backend.llama.weights import (
    DenseLinear,
    Int4Linear,
    Int8Linear,
    dequantized,
    make_embedding,
    quantize_int4,
    quantize_int8,
)


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


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_matches_its_dequantized_weight(weight: torch.Tensor, mode: str) -> None:
    linear = Int8Linear(weight, torch.bfloat16) if mode == "int8" else Int4Linear(weight, torch.bfloat16, 32)
    dense = dequantized(weight, mode, torch.bfloat16, 32)
    x = torch.randn(5, 128).bfloat16()
    got, want, exact = linear(x).float(), dense(x).float(), torch.nn.functional.linear(x.float(), weight)
    assert torch.allclose(got, want, atol=0.1, rtol=0.02)
    tolerance = 0.05 if mode == "int8" else 0.3  # relative to the output's size
    assert (got - exact).norm() / exact.norm() < tolerance


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_each_row_gets_the_same_bits_whatever_the_batch(weight: torch.Tensor, mode: str) -> None:
    # No activation scale is shared by a batch: row 0 alone and among 7 or 49 others is bit-identical.
    linear = Int8Linear(weight, torch.bfloat16) if mode == "int8" else Int4Linear(weight, torch.bfloat16, 32)
    x = torch.randn(50, 128).bfloat16()
    alone = linear(x[:1])
    assert torch.equal(linear(x[:8])[:1], alone)
    assert torch.equal(linear(x)[:1], alone)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_embedding_rows_match_the_head_weights(weight: torch.Tensor, mode: str) -> None:
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    table = make_embedding(weight, mode, dtype)
    assert table.mode == ("none" if mode == "none" else "int8")  # int4 keeps the head at int8
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
