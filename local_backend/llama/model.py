"""A Llama forward for serving: prefill one sequence into a cache row, decode one token for every row.

Per layer a decode step is about twenty tensor ops in the torch modes: RMSNorm, one fused QKV
matmul, RoPE on Q and K together, two in-place K/V writes, attention over the cache slice (two
small matmuls, the mask added, softmax), the output projection, RMSNorm, one fused gate/up matmul,
SiLU-and-multiply, the down projection. In the kernel modes (w8a16/w8a8 on CPU) it is three kernel
calls and attention: the norms, SiLU and residual adds run inside the linears, and RoPE, the K/V
write and attention are one more call, for prefill as for decode (one query row at a time, so a
token's K/V and output are the same bits whichever pass computed them). The residual stream, RoPE,
attention and the KV cache stay fp32; torch's quantized modes cast matmul inputs to bf16 on CPU
(their kernels' fast path). The attention scale 1/sqrt(head_dim) is folded into the Q weights
(exact for head_dim 64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from .cache import KVCache
from .native import Kernel
from .weights import EmbeddingTable, Linear, Q8Linear, dequantized, make_embedding, make_linear

if TYPE_CHECKING:
    from .graphs import CudaGraphs

__all__ = ["LeanLlama"]


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    # Prefill's copies (dense bf16 when that is faster than the quantized kernels at many rows).
    qkv_p: Linear
    o_p: Linear
    gate_up_p: Linear
    down_p: Linear


def _check_config(config: Any) -> None:
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"the lean engine runs Llama models, not {getattr(config, 'model_type', None)!r}")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"the lean engine does not support {flag}=True")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"the lean engine supports hidden_act 'silu', not {config.hidden_act!r}")


class LeanLlama:
    """Weights, rotary tables and the two forward passes; build it with ``from_hf``."""

    def __init__(
        self,
        *,
        config: Any,
        embed: EmbeddingTable,
        head: Linear,
        layers: list[_Layer],
        final_norm: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        act_dtype: torch.dtype,
        mode: str,
    ) -> None:
        self.config = config
        self.embed, self.head, self.layers, self.final_norm = embed, head, layers, final_norm
        self.cos, self.sin = rope  # [positions, head_dim]; sin carries rotate_half's sign
        self.act_dtype, self.mode = act_dtype, mode
        self.device = final_norm.device
        # fp32 attention on CPU: bf16 scores lose ~0.4%, and small bf16 matmuls run slower than fp32 there.
        self.kv_dtype = torch.float32 if self.device.type == "cpu" else act_dtype
        self.graphs: CudaGraphs | None = None  # set by use_cuda_graphs()
        self.hidden = int(config.hidden_size)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or self.hidden // self.heads)
        self.eps = float(config.rms_norm_eps)
        self.intermediate = int(config.intermediate_size)
        self.context_length = int(self.cos.shape[0])
        self._qk = (self.heads + self.kv_heads) * self.head_dim
        # The kernel modes run attention in the kernel too (RoPE, K/V write, attention per row in one
        # call, prefill and decode alike), for head sizes it vectorizes (multiples of 16 up to 256:
        # every Llama we know of).
        fits = self.head_dim % 16 == 0 and self.head_dim <= 256
        self.native: Kernel | None = head.kernel if isinstance(head, Q8Linear) and fits else None

    @property
    def row_invariant(self) -> bool:
        """Whether every token's K/V and logits are the same bits whichever pass computed them (a prefill
        of any length from any start, or a decode step of any batch): the kernel modes, where each row
        is computed on its own in a fixed order. Then a cached prefix may end at any position."""
        return self.native is not None

    @classmethod
    def from_hf(cls, hf: Any, *, mode: str, act_dtype: torch.dtype, group_size: int = 32, dense_prefill: bool = False,
                isa: str | None = None) -> LeanLlama:
        """Take a transformers LlamaForCausalLM's weights: fuse, quantize (``mode`` none|int8|w8a16|w8a8|int4), build.

        ``isa`` picks the kernel build of the w8a16/w8a8 modes (default: the best this CPU runs)."""
        config = hf.config
        _check_config(config)
        device = next(hf.parameters()).device

        def linear(w: torch.Tensor, role: str = "") -> Linear:
            return make_linear(w, mode, act_dtype, group_size, role, isa)

        def prefill_copy(w: torch.Tensor, decode: Linear) -> Linear:
            return dequantized(w, mode, act_dtype, group_size) if dense_prefill and mode != "none" else decode

        layers = []
        with torch.no_grad():
            for block in hf.model.layers:
                a, m = block.self_attn, block.mlp
                q_scaled = a.q_proj.weight.float() * (float(a.head_dim) ** -0.5)
                ws = {
                    "qkv": torch.cat([q_scaled, a.k_proj.weight.float(), a.v_proj.weight.float()]),
                    "o": a.o_proj.weight.float(),
                    "gate_up": torch.cat([m.gate_proj.weight, m.up_proj.weight]).float(),
                    "down": m.down_proj.weight.float(),
                }
                dec = {k: linear(w, k) for k, w in ws.items()}
                pre = {f"{k}_p": prefill_copy(w, dec[k]) for k, w in ws.items()}
                layers.append(
                    _Layer(
                        attn_norm=block.input_layernorm.weight.float().clone(),
                        mlp_norm=block.post_attention_layernorm.weight.float().clone(),
                        **dec,
                        **pre,
                    )
                )
            embed_w = hf.model.embed_tokens.weight.float()
            # SmolLM2's GGUF keeps its embedding at 8 bits; 4-bit groups on it lost answers ("the capital
            # of France is L'Etoile"), so the int4 mode keeps the tied embedding/LM head at int8.
            embed = make_embedding(embed_w, mode, act_dtype, isa)
            tied = hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
            head = embed.head if tied else linear(hf.lm_head.weight.float(), "head")
            rope = _rope_tables(hf, int(getattr(config, "max_position_embeddings", 2048)), act_dtype, device)
            final_norm = hf.model.norm.weight.float().clone()
        return cls(config=config, embed=embed, head=head, layers=layers, final_norm=final_norm, rope=rope, act_dtype=act_dtype, mode=mode)

    def use_cuda_graphs(self, cache: KVCache) -> None:
        """Replay decode steps as CUDA graphs over ``cache`` (allocated at full capacity): one per batch size."""
        from .graphs import CudaGraphs

        self.graphs = CudaGraphs(self, cache)

    def nbytes(self) -> int:
        """Bytes of weights a decode step reads (quantized), excluding prefill's dense copies."""
        per_layer = sum(x.nbytes() for lay in self.layers for x in (lay.qkv, lay.o, lay.gate_up, lay.down))
        head = 0 if self.head is self.embed.head else self.head.nbytes()
        return per_layer + self.embed.nbytes() + head

    def new_cache(self, slots: int, capacity: int = 256, *, max_bytes: int | None = None, static: bool = False) -> KVCache:
        """An empty cache for up to ``slots`` rows; ``max_bytes`` bounds its allocation, ``static``
        allocates every row at full context once (CUDA graphs need fixed addresses)."""
        return KVCache(
            layers=len(self.layers),
            slots=slots,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.kv_dtype,
            device=self.device,
            capacity=capacity,
            max_capacity=self.context_length,
            max_bytes=max_bytes,
            static=static,
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token holds over every layer."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.tensor([], dtype=self.kv_dtype).element_size()

    # ---- building blocks ---------------------------------------------------------------

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(h, (self.hidden,), weight, self.eps).to(self.act_dtype)

    def _norm_linear(self, h: torch.Tensor, weight: torch.Tensor, linear: Linear) -> torch.Tensor:
        """linear(RMSNorm(h) * weight), in one kernel call where the linear fuses the norm (VNNI kernel)."""
        fused = getattr(linear, "norm_linear", None)
        return fused(h, weight, self.eps) if fused is not None else linear(self._norm(h, weight))

    def _add_linear(self, h: torch.Tensor, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """h + linear(x): in place where the linear fuses the residual add (VNNI kernel; h is the pass's own)."""
        fused = getattr(linear, "add_into", None)
        return fused(h, x) if fused is not None else h + linear(x.to(self.act_dtype))

    def _add_mlp_down(self, h: torch.Tensor, gu: torch.Tensor, linear: Linear) -> torch.Tensor:
        """h + linear(silu(gate) * up) for gu = [gate | up]: SiLU, product and add inside the call where fused."""
        fused = getattr(linear, "add_into", None)
        if fused is not None:
            out: torch.Tensor = fused(h, gu, glu=True)
            return out
        return h + linear(F.silu(gu[:, : self.intermediate]) * gu[:, self.intermediate :])

    def _rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x * cos + rotate_half(x) * sin, with rotate_half(x) = roll(x) * (-1 for the first half).
        return torch.addcmul(qk * cos, qk.roll(self.head_dim // 2, dims=-1), sin)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self._norm_linear(h, self.final_norm, self.head).float()

    # ---- forward passes ----------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, cache: KVCache, row: int, start: int = 0) -> torch.Tensor:
        """Run prompt ``ids`` [T] alone, write its K/V into ``row``; return the last position's logits [vocab].

        With ``start`` > 0 the row already holds K/V for the first ``start`` tokens (a cached
        prefix) and only the rest is computed.
        """
        t = int(ids.shape[0])
        n = t - start
        hd, nh, nkv = self.head_dim, self.heads, self.kv_heads
        if self.native is not None:
            slots = torch.full((n,), row, dtype=torch.long)
            positions = torch.arange(start, t, dtype=torch.long)
        else:
            cos, sin = self.cos[start:t, None, :], self.sin[start:t, None, :]
            # New tokens see every earlier position: a plain causal mask when there is no prefix.
            mask = None if start == 0 else torch.arange(t, device=ids.device)[None, :] <= torch.arange(start, t, device=ids.device)[:, None]
        h = self.embed.lookup(ids[start:]).float()
        for i, lay in enumerate(self.layers):
            qkv = self._norm_linear(h, lay.attn_norm, lay.qkv_p).float()
            if self.native is not None:
                attn = self._native_attention(qkv, cache, i, slots, positions)
            else:
                qk = self._rope(qkv[:, : self._qk].view(n, nh + nkv, hd), cos, sin)
                q = qk[:, :nh].transpose(0, 1)
                keys, values = cache.keys[i], cache.values[i]
                keys[row, :, start:t] = qk[:, nh:].transpose(0, 1)
                values[row, :, start:t] = qkv[:, self._qk :].view(n, nkv, hd).transpose(0, 1)
                k, v = keys[row : row + 1, :, :t], values[row : row + 1, :, :t]
                sdpa = F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, is_causal=mask is None, scale=1.0, enable_gqa=True)
                attn = sdpa[0].transpose(0, 1).reshape(n, nh * hd)
            h = self._add_linear(h, attn, lay.o_p)
            h = self._add_mlp_down(h, self._norm_linear(h, lay.mlp_norm, lay.gate_up_p), lay.down_p)
        return self._logits(h[-1:])[0]

    def _native_attention(self, qkv: torch.Tensor, cache: KVCache, layer: int, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """RoPE, the K/V write at ``pos`` of cache row ``slots`` and attention over each query row's own
        length, in one kernel call (kernel modes; decode: one row per slot, prefill: rows of one slot)."""
        assert self.native is not None
        b = int(qkv.shape[0])
        keys, values = cache.keys[layer], cache.values[layer]
        out = torch.empty((b, self.heads * self.head_dim), dtype=torch.float32)
        rc = self.native.attend(qkv.data_ptr(), qkv.stride(0), b, self.heads, self.kv_heads, self.head_dim, slots.data_ptr(), pos.data_ptr(),
                                self.cos.data_ptr(), self.sin.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2],
                                out.data_ptr(), out.stride(0), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"the {self.native.isa} attention kernel failed for {b} rows (head_dim {self.head_dim}, out of memory?)")
        return out

    def decode(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One token for each of the cache's first B rows (``tokens`` [B]: every row but a prompt
        still being prefilled, which is the last); return logits [B, vocab]."""
        if self.graphs is not None:
            return self.graphs.replay(tokens, cache)
        b = int(tokens.shape[0])
        rows, pos, width = cache.begin_step(b)
        logits = self.decode_tensors(tokens, cache, rows, pos, width)
        cache.end_step(b)
        return logits

    def decode_tensors(self, tokens: torch.Tensor, cache: KVCache, rows: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
        """The decode step's tensor work, free of host-side decisions (so a CUDA graph can capture it)."""
        b = int(tokens.shape[0])
        hd, nh, nkv = self.head_dim, self.heads, self.kv_heads
        group = nh // nkv
        cache.bias[rows, pos] = 0.0  # each row attends to the token it writes now
        if self.native is None:
            cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
            bias = cache.bias[:b, None, None, :width]  # 0 where a row holds a token, -inf elsewhere
        h = self.embed.lookup(tokens).float()
        for i, lay in enumerate(self.layers):
            qkv = self._norm_linear(h, lay.attn_norm, lay.qkv).float()
            if self.native is not None:
                attn = self._native_attention(qkv, cache, i, rows, pos)
            else:
                qk = self._rope(qkv[:, : self._qk].view(b, nh + nkv, hd), cos, sin)
                keys, values = cache.keys[i], cache.values[i]
                keys[rows, :, pos] = qk[:, nh:]
                values[rows, :, pos] = qkv[:, self._qk :].view(b, nkv, hd)
                # Grouped-query attention as [B, kv_heads, group, ...] matmuls: no K/V repeat, no copy.
                q = qk[:, :nh].reshape(b, nkv, group, hd)
                scores = torch.matmul(q, keys[:b, :, :width].transpose(-1, -2)) + bias
                attn = torch.matmul(torch.softmax(scores, dim=-1), values[:b, :, :width])
            h = self._add_linear(h, attn.reshape(b, nh * hd), lay.o)
            h = self._add_mlp_down(h, self._norm_linear(h, lay.mlp_norm, lay.gate_up), lay.down)
        pos += 1  # in place: these are the cache's positions
        return self._logits(h)


def _rope_tables(hf: Any, positions: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [positions, head_dim] from the model's own rotary embedding (any RoPE variant)."""
    rotary = hf.model.rotary_emb
    inv_freq = rotary.inv_freq.float().to(device)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    freqs = torch.outer(torch.arange(positions, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    half = inv_freq.shape[0]
    sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale * sign).to(dtype)
