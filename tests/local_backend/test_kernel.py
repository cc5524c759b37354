"""Our int8 kernel (q8kernel.c), on each build this CPU runs (AVX-512 VNNI, AVX2): its arithmetic
against an exact reference, batch and thread invariance, the fused prologues and epilogue,
attention for decode and prefill rows, the same bits from both builds, the build itself, and what
happens where no build can run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from local_backend.llama import native
from local_backend.llama.weights import Q8Linear, quantize_int8
from local_backend.quantize import plan_quantization

ROOT = Path(__file__).resolve().parents[2]
QMAX = {1: 127, 2: 32639}


def _needs(isa: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(native.kernel(isa) is None, reason=native.unavailable_reason(isa) or "available")


# Every test parametrized by ISA runs on each build this machine can run; the others skip with the reason.
ISA_PARAMS = [pytest.param(isa, marks=_needs(isa), id=isa) for isa in native.ISAS]
both = pytest.mark.skipif(any(native.kernel(i) is None for i in native.ISAS),
                          reason="comparing the builds needs a CPU that runs both (AVX-512 VNNI runs AVX2 too): "
                          + "; ".join(r for r in (native.unavailable_reason(i) for i in native.ISAS) if r))


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, digits: int) -> torch.Tensor:
    """The kernel's arithmetic, op for op: each row's scale and rounding in fp32, the sum exact in
    int64, rounded to fp32 once, then times the channel scale and the row scale (fp32)."""
    s = (x.abs().amax(dim=1, keepdim=True) / float(QMAX[digits])).clamp(min=1e-30)
    a = torch.round(x * (1.0 / s)).clamp(-QMAX[digits], QMAX[digits]).long()
    exact = a @ q.long().T
    return exact.float() * scales.float() * s


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(96, 80, generator=torch.Generator().manual_seed(3)) * 0.05


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("digits", [1, 2])
def test_linear_is_the_exact_integer_arithmetic(weight: torch.Tensor, digits: int, isa: str) -> None:
    lin = Q8Linear(weight, digits=digits, isa=isa)
    q, scales = quantize_int8(weight)
    x = torch.randn(11, 80, generator=torch.Generator().manual_seed(4))
    x[:, 7] *= 40.0  # an outlier channel, as LLM activations have
    assert torch.equal(lin(x), _reference(x, q, scales, digits))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_long_rows_widen_before_they_overflow(isa: str) -> None:
    # 2,500 inputs at the extremes: the AVX2 build's int32 lanes must be widened on the way.
    k = 2500
    w = torch.full((16, k), 0.05)
    w[:, ::2] = -0.05
    x = torch.ones(2, k)
    x[:, ::2] = -1.0
    q, scales = quantize_int8(w)
    out = Q8Linear(w, digits=2, isa=isa)(x)
    assert torch.equal(out, _reference(x, q, scales, 2)) and bool((out > 0).all())


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_two_digits_are_close_to_the_weight_only_product(weight: torch.Tensor, isa: str) -> None:
    # ~16 bits per activation: what is left is the weights' own rounding.
    q, scales = quantize_int8(weight)
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ (q.double() * scales.double()[:, None]).T
    one, two = Q8Linear(weight, digits=1, isa=isa)(x).double(), Q8Linear(weight, digits=2, isa=isa)(x).double()
    err_one, err_two = (one - exact).abs().max(), (two - exact).abs().max()
    assert err_two < 1e-3 * exact.abs().max() and err_two < err_one / 50


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize(("n", "k"), [(96, 80), (50, 30), (33, 4), (7, 1)])
def test_odd_shapes_are_padded_not_truncated(n: int, k: int, isa: str) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    q, scales = quantize_int8(w)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    out = Q8Linear(w, digits=2, isa=isa)(x)
    assert out.shape == (3, n)
    assert torch.equal(out, _reference(x, q, scales, 2))


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("digits", [1, 2])
def test_each_row_gets_the_same_bits_whatever_the_batch_and_the_threads(weight: torch.Tensor, digits: int, isa: str) -> None:
    lin = Q8Linear(weight, digits=digits, isa=isa)
    g = torch.Generator().manual_seed(6)
    row = torch.randn(1, 80, generator=g)
    alone = lin(row)
    before = torch.get_num_threads()
    try:
        for m in (2, 3, 5, 8, 9, 17):  # across every tile size of both builds
            batch = torch.randn(m, 80, generator=g) * 30.0  # louder batch-mates
            batch[m // 2] = row[0]
            for threads in (1, 2):
                torch.set_num_threads(threads)
                assert torch.equal(lin(batch)[m // 2], alone[0]), (m, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_fused_norm_glu_and_residual_add(weight: torch.Tensor, isa: str) -> None:
    g = torch.Generator().manual_seed(7)
    lin = Q8Linear(weight, digits=2, isa=isa)
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


def _rope_tables(hd: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(torch.arange(positions).float(), 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().contiguous(), (angles.sin() * torch.cat([-torch.ones(hd // 2), torch.ones(hd // 2)])).contiguous()


def _attend(isa: str, qkv: torch.Tensor, slots: list[int], positions: list[int], keys: torch.Tensor, values: torch.Tensor,
            nh: int, nkv: int, hd: int, cos: torch.Tensor, sin: torch.Tensor, threads: int = 1) -> torch.Tensor:
    lib = native.kernel(isa)
    assert lib is not None
    b = qkv.shape[0]
    out = torch.empty(b, nh * hd)
    slot_t, pos_t = torch.tensor(slots, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
    rc = lib.attend(qkv.data_ptr(), qkv.stride(0), b, nh, nkv, hd, slot_t.data_ptr(), pos_t.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    keys.data_ptr(), values.data_ptr(), keys.shape[2], out.data_ptr(), out.stride(0), threads)
    assert rc == 0
    return out


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("hd", [32, 48, 64])
def test_attention_matches_torch_for_decode_and_prefill_rows(isa: str, hd: int) -> None:
    g = torch.Generator().manual_seed(8)
    nh, nkv, cap = 6, 2, 40
    cos, sin = _rope_tables(hd, 64)
    keys, values = torch.randn(4, nkv, cap, hd, generator=g), torch.randn(4, nkv, cap, hd, generator=g)
    k_ref, v_ref = keys.clone(), values.clone()
    # decode rows in slots 0, 1, 3 and a prefill of slot 2's positions 3..6: each row sees its own slot up to its position
    slots, positions = [0, 1, 3, 2, 2, 2, 2], [5, 17, 0, 3, 4, 5, 6]
    qkv = torch.randn(len(slots), (nh + 2 * nkv) * hd, generator=g)
    out = _attend(isa, qkv, slots, positions, keys, values, nh, nkv, hd, cos, sin)

    def rope(x: torch.Tensor, p: int) -> torch.Tensor:
        return x * cos[p] + x.roll(hd // 2, dims=-1) * sin[p]

    for r, (s, p) in enumerate(zip(slots, positions, strict=True)):  # every K/V first, as the kernel does
        heads = qkv[r].view(nh + 2 * nkv, hd)
        k_ref[s, :, p] = rope(heads[nh : nh + nkv], p)
        v_ref[s, :, p] = heads[nh + nkv :]
    for r, (s, p) in enumerate(zip(slots, positions, strict=True)):
        q = rope(qkv[r].view(nh + 2 * nkv, hd)[:nh], p)
        for h in range(nh):
            kv = h // (nh // nkv)
            att = torch.softmax(q[h] @ k_ref[s, kv, : p + 1].T, dim=-1) @ v_ref[s, kv, : p + 1]
            assert torch.allclose(out[r, h * hd : (h + 1) * hd], att, rtol=1e-4, atol=1e-5)
    assert torch.allclose(keys, k_ref, atol=1e-6) and torch.equal(values, v_ref)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_rows_attention_is_the_same_bits_in_a_prefill_and_in_a_decode_step(isa: str) -> None:
    # The prefix cache's premise: position 37 computed among a prefill of 0..39, or alone as a decode
    # step over a cache that holds 0..36, on 1 or 2 threads, gives the same K/V and output bits
    # (past 16 positions: scores are summed 16 keys at a time, the rest one by one).
    g = torch.Generator().manual_seed(9)
    nh, nkv, hd, cap, n, at = 6, 2, 64, 48, 40, 37
    cos, sin = _rope_tables(hd, 64)
    qkv = torch.randn(n, (nh + 2 * nkv) * hd, generator=g)
    keys, values = torch.zeros(2, nkv, cap, hd), torch.zeros(2, nkv, cap, hd)
    full = _attend(isa, qkv, [1] * n, list(range(n)), keys, values, nh, nkv, hd, cos, sin)
    k2, v2 = torch.zeros_like(keys), torch.zeros_like(values)
    _attend(isa, qkv[:at], [0] * at, list(range(at)), k2, v2, nh, nkv, hd, cos, sin, threads=2)
    step = _attend(isa, qkv[at : at + 1], [0], [at], k2, v2, nh, nkv, hd, cos, sin, threads=2)
    assert torch.equal(step[0], full[at])
    assert torch.equal(k2[0, :, : at + 1], keys[1, :, : at + 1]) and torch.equal(v2[0, :, : at + 1], values[1, :, : at + 1])


@both
@pytest.mark.parametrize("digits", [1, 2])
def test_both_builds_give_the_same_bits(weight: torch.Tensor, digits: int) -> None:
    g = torch.Generator().manual_seed(10)
    avx512, avx2 = (Q8Linear(weight, digits=digits, isa=isa) for isa in native.ISAS)
    x = torch.randn(9, 80, generator=g) * 5.0
    norm_w = torch.rand(80, generator=g) + 0.5
    gu = torch.randn(9, 160, generator=g) * 4.0
    h = torch.randn(9, 96, generator=g)
    assert torch.equal(avx512(x), avx2(x))
    assert torch.equal(avx512.norm_linear(x, norm_w, 1e-5), avx2.norm_linear(x, norm_w, 1e-5))
    assert torch.equal(avx512.add_into(h.clone(), gu, glu=True), avx2.add_into(h.clone(), gu, glu=True))

    nh, nkv, hd, cap = 6, 2, 64, 48
    cos, sin = _rope_tables(hd, 48)
    qkv = torch.randn(5, (nh + 2 * nkv) * hd, generator=g)
    kv = torch.randn(2, 3, nkv, cap, hd, generator=g)
    outs = []
    for isa in native.ISAS:
        keys, values = kv[0].clone(), kv[1].clone()
        outs.append((_attend(isa, qkv, [0, 1, 2, 2, 2], [7, 40, 0, 1, 2], keys, values, nh, nkv, hd, cos, sin), keys, values))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1], strict=True))


@both
@torch.inference_mode()
def test_both_builds_give_a_model_the_same_logits(tiny) -> None:
    from local_backend.llama import LeanLlama

    from .conftest import chat_ids

    prompts = [chat_ids(tiny, q) for q in ("What is the capital of France?", "Hi")]
    runs = []
    for isa in native.ISAS:
        lean = LeanLlama.from_hf(tiny.model, mode="w8a16", act_dtype=torch.float32, isa=isa)
        cache = lean.new_cache(2)
        logits = [lean.prefill(torch.tensor(p), cache, cache.add_row(len(p))) for p in prompts]
        tokens = torch.tensor([int(x.argmax()) for x in logits])
        for _ in range(8):
            logits.append(lean.decode(tokens, cache))
            tokens = logits[-1].argmax(dim=-1)
        runs.append(logits)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_auto_picks_w8a16_on_the_best_kernel_and_the_environment_can_name_one(monkeypatch: pytest.MonkeyPatch) -> None:
    best = native.kernel()
    if best is None:
        pytest.skip(native.unavailable_reason())
    plan = plan_quantization("auto", "cpu")
    assert plan.mode == "w8a16" and plan.kernel == best.isa and plan.act_dtype == torch.float32 and not plan.dense_prefill
    assert f"{best.isa} kernel" in plan.describe() and plan.path == best.isa
    w8a8 = plan_quantization("w8a8", "cpu")
    assert w8a8.act_dtype == torch.float32 and not w8a8.dense_prefill and w8a8.kernel == best.isa
    with pytest.raises(ValueError, match="CPU only"):
        plan_quantization("w8a16", "cuda")
    if native.kernel("avx2") is not None:
        monkeypatch.setenv(native.ENV_CHOICE, "avx2")
        assert plan_quantization("auto", "cpu").kernel == "avx2"
        assert Q8Linear(torch.ones(8, 8)).kernel.isa == "avx2"


@_needs("avx2")
def test_on_an_avx2_only_cpu_auto_picks_the_avx2_build(monkeypatch: pytest.MonkeyPatch) -> None:
    load = native._load
    monkeypatch.setattr(native, "_load", lambda isa: (None, "this CPU lacks avx512_vnni") if isa == "avx512_vnni" else load(isa))
    plan = plan_quantization("auto", "cpu")
    assert (plan.mode, plan.kernel, plan.act_dtype) == ("w8a16", "avx2", torch.float32) and "avx2 kernel" in plan.describe()
    with pytest.raises(ValueError, match="avx512_vnni"):
        plan_quantization("auto", "cpu", "avx512_vnni")  # named, it must run


@pytest.mark.parametrize(("bf16", "fallback"), [(True, "int8"), (False, "none")])
def test_without_a_kernel_auto_falls_back_to_what_keeps_fp32s_answers(monkeypatch: pytest.MonkeyPatch, bf16: bool, fallback: str) -> None:
    monkeypatch.setattr(native, "_load", lambda isa: (None, f"this CPU lacks what {isa} needs"))
    monkeypatch.setattr("local_backend.quantize._native_bf16", lambda: bf16)
    plan = plan_quantization("auto", "cpu")
    assert plan.mode == fallback and plan.kernel is None and "avx2 needs" in plan.describe()
    assert plan.act_dtype == (torch.bfloat16 if bf16 else torch.float32) and plan.path == "torch-cpu"
    with pytest.raises(ValueError, match="avx2 needs"):
        plan_quantization("w8a16", "cpu")
    w8a8 = plan_quantization("w8a8", "cpu")  # oneDNN's int8 matmul instead
    assert w8a8.mode == "w8a8" and w8a8.act_dtype == torch.bfloat16 and w8a8.dense_prefill
    with pytest.raises(RuntimeError, match="avx2 needs"):
        Q8Linear(torch.ones(32, 32))


def _load_in_subprocess(env: dict[str, str], isa: str) -> str:
    code = f"from local_backend.llama import native; k = native.kernel({isa!r}); print(k.path if k else 'NONE: ' + native.unavailable_reason({isa!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_the_kernel_builds_once_into_the_model_cache(tmp_path: Path, isa: str) -> None:
    first = _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path)}, isa)
    assert first.startswith(str(tmp_path / "kernels" / f"q8kernel-{isa}-")) and first.endswith(".so")
    built = Path(first).stat().st_mtime_ns
    assert _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path)}, isa) == first
    assert Path(first).stat().st_mtime_ns == built  # reused, not rebuilt
    assert not list((tmp_path / "kernels").glob("*.tmp"))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_missing_compiler_is_reported_not_raised(tmp_path: Path, isa: str) -> None:
    out = _load_in_subprocess({"LOCAL_BACKEND_CACHE": str(tmp_path), "CC": "no-such-compiler-here"}, isa)
    assert out.startswith("NONE:") and "compiler" in out


def test_an_unknown_kernel_name_is_refused() -> None:
    assert native.kernel("sse2") is None and "unknown kernel 'sse2'" in native.unavailable_reason("sse2")


@pytest.mark.parametrize("isa", ISA_PARAMS)
@torch.inference_mode()
def test_decode_with_the_kernels_attention_matches_torchs(tiny, isa: str) -> None:
    # The same w8a16 linears, attention by the kernel or (for head sizes it does not vectorize) by torch.
    from local_backend.llama import LeanLlama

    from .conftest import chat_ids

    lean = LeanLlama.from_hf(tiny.model, mode="w8a16", act_dtype=torch.float32, isa=isa)
    assert lean.native is not None and lean.row_invariant
    kernel_attention = lean.native
    prompts = [chat_ids(tiny, q) for q in ("What is the capital of France?", "Hi", "List three prime numbers, please.")]
    runs = []
    for attention in (kernel_attention, None):
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
