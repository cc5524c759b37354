"""The int8 VNNI kernel (q8kernel.c): its arithmetic against a reference, batch and thread invariance,
the fused prologues and epilogue, decode attention, the build, and what happens where it cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from local_backend.llama import native
from local_backend.llama.weights import VnniLinear, quantize_int8
from local_backend.quantize import plan_quantization

ROOT = Path(__file__).resolve().parents[2]

needs_kernel = pytest.mark.skipif(native.kernel() is None, reason=native.unavailable_reason() or "kernel available")


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, digits: int) -> torch.Tensor:
    """The kernel's arithmetic in float64: each row in int8 digits with its own scale, exact sums."""
    x = x.double()
    s = (x.abs().amax(dim=1, keepdim=True) / 127.0).float().double()
    v = (x.float() * (1.0 / s.float())).double()  # the kernel multiplies by 1/s in fp32
    hi = torch.round(v.float()).double()
    out = hi @ q.double().T
    if digits == 2:
        lo = torch.round(((v.float() - hi.float()) * 254.0)).double()
        out = out + (lo @ q.double().T) / 254.0
    return out * scales.double() * s


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(96, 80, generator=torch.Generator().manual_seed(3)) * 0.05


@needs_kernel
@pytest.mark.parametrize("digits", [1, 2])
def test_linear_matches_the_digit_arithmetic(weight: torch.Tensor, digits: int) -> None:
    lin = VnniLinear(weight, digits=digits)
    q, scales = quantize_int8(weight)
    x = torch.randn(11, 80, generator=torch.Generator().manual_seed(4))
    x[:, 7] *= 40.0  # an outlier channel, as LLM activations have
    out = lin(x).double()
    ref = _reference(x, q, scales, digits)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernel
def test_two_digits_are_close_to_the_weight_only_product(weight: torch.Tensor) -> None:
    # ~15 bits per activation: what is left is the weights' own rounding.
    q, scales = quantize_int8(weight)
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    one, two = VnniLinear(weight, digits=1)(x).double(), VnniLinear(weight, digits=2)(x).double()
    err_one, err_two = (one - exact).abs().max(), (two - exact).abs().max()
    assert err_two < 1e-3 * exact.abs().max() and err_two < err_one / 50


@needs_kernel
@pytest.mark.parametrize(("n", "k"), [(96, 80), (50, 30), (33, 4), (7, 1)])
def test_odd_shapes_are_padded_not_truncated(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q, scales = quantize_int8(w)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    out = VnniLinear(w, digits=2)(x)
    assert out.shape == (3, n)
    assert torch.allclose(out.double(), _reference(x, q, scales, 2), rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("digits", [1, 2])
def test_each_row_gets_the_same_bits_whatever_the_batch_and_the_threads(weight: torch.Tensor, digits: int) -> None:
    lin = VnniLinear(weight, digits=digits)
    g = torch.Generator().manual_seed(6)
    row = torch.randn(1, 80, generator=g)
    alone = lin(row)
    before = torch.get_num_threads()
    try:
        for m in (2, 5, 8, 9, 17):  # across the 8/4/2/1-row tiles
            batch = torch.randn(m, 80, generator=g) * 30.0  # louder batch-mates
            batch[m // 2] = row[0]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(lin(batch)[m // 2], alone[0]), (m, threads)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_fused_norm_glu_and_residual_add(weight: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(7)
    lin = VnniLinear(weight, digits=2)
    x = torch.randn(4, 80, generator=g) * 3.0
    norm_w = torch.rand(80, generator=g) + 0.5
    fused = lin.norm_linear(x, norm_w, 1e-5)
    plain = lin(F.rms_norm(x, (80,), norm_w, 1e-5))
    assert torch.allclose(fused, plain, rtol=1e-4, atol=1e-4)

    gu = torch.randn(4, 160, generator=g) * 4.0
    h = torch.randn(4, 96, generator=g)
    expected = h + lin(F.silu(gu[:, :80]) * gu[:, 80:])
    out = lin.add_into(h.clone(), gu, glu=True)
    assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)

    h2 = h.clone()
    assert lin.add_into(h2, x) is h2 and torch.allclose(h2, h + lin(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="glu input"):
        lin.add_into(h.clone(), x, glu=True)
    with pytest.raises(ValueError, match="fp32"):
        lin.add_into(h.double(), x)


@needs_kernel
def test_decode_attention_matches_torch() -> None:
    g = torch.Generator().manual_seed(8)
    b, nh, nkv, hd, cap = 3, 6, 2, 32, 40
    positions = torch.tensor([5, 17, 0])  # each row's write position: its own length
    keys, values = torch.randn(4, nkv, cap, hd, generator=g), torch.randn(4, nkv, cap, hd, generator=g)
    qkv = torch.randn(b, (nh + 2 * nkv) * hd, generator=g)
    angles = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    angles = torch.cat([angles, angles], dim=-1)
    cos = angles.cos().contiguous()
    sin = (angles.sin() * torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])).contiguous()
    k_ref, v_ref = keys.clone(), values.clone()

    out = torch.empty(b, nh * hd)
    lib = native.kernel()
    rc = lib.attend(qkv.data_ptr(), qkv.stride(0), b, nh, nkv, hd, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    keys.data_ptr(), values.data_ptr(), cap, out.data_ptr(), out.stride(0), 1)
    assert rc == 0

    def rope(x: torch.Tensor, p: int) -> torch.Tensor:
        return x * cos[p] + x.roll(hd // 2, dims=-1) * sin[p]

    for r in range(b):
        p = int(positions[r])
        heads = qkv[r].view(nh + 2 * nkv, hd)
        q = rope(heads[:nh], p)
        k_ref[r, :, p] = rope(heads[nh : nh + nkv], p)
        v_ref[r, :, p] = heads[nh + nkv :]
        for h in range(nh):
            kv = h // (nh // nkv)
            att = torch.softmax(q[h] @ k_ref[r, kv, : p + 1].T, dim=-1) @ v_ref[r, kv, : p + 1]
            assert torch.allclose(out[r, h * hd : (h + 1) * hd], att, rtol=1e-4, atol=1e-5)
    assert torch.allclose(keys, k_ref, atol=1e-6) and torch.equal(values, v_ref)


@needs_kernel
def test_auto_picks_w8a16_on_cpu_and_w8a8_runs_on_the_kernel() -> None:
    plan = plan_quantization("auto", "cpu")
    assert plan.mode == "w8a16" and plan.act_dtype == torch.float32 and not plan.dense_prefill
    w8a8 = plan_quantization("w8a8", "cpu")
    assert w8a8.act_dtype == torch.float32 and not w8a8.dense_prefill
    with pytest.raises(ValueError, match="CPU only"):
        plan_quantization("w8a16", "cuda")


def test_without_the_kernel_auto_falls_back_to_int8_and_w8a16_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_load", lambda: (None, "this CPU lacks avx512_vnni"))
    plan = plan_quantization("auto", "cpu")
    assert plan.mode == "int8" and plan.act_dtype == torch.bfloat16 and "avx512_vnni" in plan.describe()
    with pytest.raises(ValueError, match="avx512_vnni"):
        plan_quantization("w8a16", "cpu")
    w8a8 = plan_quantization("w8a8", "cpu")  # oneDNN's int8 matmul instead
    assert w8a8.mode == "w8a8" and w8a8.act_dtype == torch.bfloat16 and w8a8.dense_prefill
    with pytest.raises(RuntimeError, match="avx512_vnni"):
        VnniLinear(torch.ones(32, 32))


def _load_in_subprocess(env: dict[str, str]) -> str:
    code = "from local_backend.llama import native; k = native.kernel(); print(k.path if k else 'NONE: ' + native.unavailable_reason())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@needs_kernel
def test_the_kernel_builds_once_into_the_model_cache(tmp_path: Path) -> None:
    first = _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path)})
    assert first.startswith(str(tmp_path / "kernels" / "q8kernel-")) and first.endswith(".so")
    built = Path(first).stat().st_mtime_ns
    assert _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path)}) == first
    assert Path(first).stat().st_mtime_ns == built  # reused, not rebuilt
    assert not list((tmp_path / "kernels").glob("*.tmp"))


@needs_kernel
def test_a_missing_compiler_is_reported_not_raised(tmp_path: Path) -> None:
    out = _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path), "CC": "no-such-compiler-here"})
    assert out.startswith("NONE:") and "compiler" in out


@needs_kernel
@torch.inference_mode()
def test_decode_with_the_kernels_attention_matches_torchs(tiny) -> None:
    # The same w8a16 linears, attention by the kernel or (for head sizes it does not vectorize) by torch.
    from local_backend.llama import LeanLlama

    from .conftest import chat_ids

    lean = LeanLlama.from_hf(tiny.model, mode="w8a16", act_dtype=torch.float32)
    assert lean.native is not None
    prompts = [chat_ids(tiny, q) for q in ("What is the capital of France?", "Hi", "List three prime numbers, please.")]
    runs = []
    for attention in (lean.native, None):
        lean.native = attention
        cache = lean.new_cache(4, capacity=16)  # grows while decoding: the kernel reads the new capacity
        rows = [cache.add_row(len(p)) for p in prompts]
        logits = [lean.prefill(torch.tensor(p), cache, r) for p, r in zip(prompts, rows, strict=True)]
        tokens = torch.tensor([int(x.argmax()) for x in logits])
        steps = []
        for _ in range(24):
            step = lean.decode(tokens, cache)
            steps.append(step)
            tokens = step.argmax(dim=-1)
        runs.append(torch.stack(steps))
    assert (runs[0] - runs[1]).abs().max() < 1e-2 * runs[1].abs().max()  # fp32 rounding, grown over 24 steps
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))
