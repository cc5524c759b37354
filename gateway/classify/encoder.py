"""The classifier's second stage: a small sentence encoder fine-tuned to score simple/complex.

A MiniLM (all-MiniLM-L6-v2's architecture: BERT, 384 wide, 12 heads; the shipped one keeps
its first 2 layers, encoder.json says how many) with a linear head over its mean-pooled output,
fine-tuned offline by `training.encoder_train`. It reads a bounded window of the final user
message (its first and last tokens), so a 2,000-token prompt costs what a 32-token one does.

The weights ship beside this file (`encoder/`): int8 per row for every matrix (a quarter of the
fp32 size), dequantized to fp32 once at load, so the arithmetic is fp32 on every CPU (AVX2 or
AVX-512: no int8 kernels whose results differ between instruction sets) and on a GPU.

Needs torch, tokenizers and safetensors (the `local` extra). `gateway.classify.cascade` imports
this module only when they are installed; without them the lexical scorer decides alone.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
import torch.nn.functional as F
from safetensors.torch import load as load_weights
from safetensors.torch import save as dump_weights
from tokenizers import Tokenizer
from torch import nn

from .encoder_meta import ENCODER_DIR, ENCODER_FORMAT, meta_of

__all__ = ["EncoderConfig", "MiniLM", "Encoder", "window_ids", "quantize_state", "dequantize_state", "save"]

log = logging.getLogger("gateway.classify")

META_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "encoder.json", "model.safetensors", "tokenizer.json"
_SCALE = ".scale"  # the suffix of a quantized matrix's per-row scales in the weights file


@dataclass(frozen=True, slots=True)
class EncoderConfig:
    """The network's shape and what of a prompt it reads."""

    vocab: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    positions: int = 512
    eps: float = 1e-12
    window_tokens: int = 64   # tokens read, [CLS] and [SEP] included
    head_share: float = 0.75  # of them from the start of the message, the rest from its end
    head_chars: int = 2000    # characters tokenized at each end: bounds a long prompt's cost
    tail_chars: int = 600

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EncoderConfig:
        """From the `config` object of encoder.json (unknown keys refused)."""
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(d) - known)
        if extra:
            raise ValueError(f"unknown encoder config keys: {', '.join(extra)}")
        return cls(**d)


class _Layer(nn.Module):
    """One post-LayerNorm BERT layer."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.attn_out = nn.Linear(c.hidden, c.hidden)
        self.ln1 = nn.LayerNorm(c.hidden, eps=c.eps)
        self.fc1 = nn.Linear(c.hidden, c.intermediate)
        self.fc2 = nn.Linear(c.intermediate, c.hidden)
        self.ln2 = nn.LayerNorm(c.hidden, eps=c.eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.attn_out(a.transpose(1, 2).reshape(b, t, h)))
        out: torch.Tensor = self.ln2(x + self.fc2(F.gelu(self.fc1(x))))
        return out


class MiniLM(nn.Module):
    """BERT encoder + mean pooling + a linear head: the logit that a request is complex."""

    def __init__(self, c: EncoderConfig) -> None:
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab, c.hidden)
        self.position = nn.Embedding(c.positions, c.hidden)
        self.token_type = nn.Embedding(2, c.hidden)
        self.ln = nn.LayerNorm(c.hidden, eps=c.eps)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.layers))
        self.head = nn.Linear(c.hidden, 1)

    def forward(self, ids: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """ids, attend: (batch, tokens); attend is 1 on real tokens, 0 on padding."""
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        x = self.ln(self.word(ids) + self.position(pos)[None] + self.token_type.weight[0])
        mask = attend[:, None, None, :].bool()  # padding is never attended to
        for layer in self.layers:
            x = layer(x, mask)
        w = attend[..., None].to(x.dtype)
        pooled = (x * w).sum(1) / w.sum(1).clamp(min=1.0)
        logit: torch.Tensor = self.head(pooled).squeeze(-1)
        return logit


def window_ids(tokenizer: Tokenizer, text: str, c: EncoderConfig) -> list[int]:
    """The token ids the encoder reads for `text`: [CLS], the message's first tokens, its last
    ones, [SEP]. Only `head_chars` + `tail_chars` characters are tokenized, which holds every
    token of the window (a token is a few characters), so the ids equal those of the whole text's
    head and tail."""
    return _window(tokenizer.encode(_bounded(text, c)).ids, c)


def _bounded(text: str, c: EncoderConfig) -> str:
    if len(text) > c.head_chars + c.tail_chars:
        return text[:c.head_chars] + " " + text[-c.tail_chars:]
    return text


def _window(ids: list[int], c: EncoderConfig) -> list[int]:
    w = c.window_tokens
    if len(ids) > w:
        head = int(w * c.head_share)
        return ids[:head] + ids[len(ids) - (w - head):]
    return ids


def quantize_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 per row (symmetric) for every matrix, fp32 for the rest (biases, norms, the head)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        t = t.detach().float().cpu()
        if t.dim() == 2 and not name.startswith("head."):
            scale = t.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            out[name] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + _SCALE] = scale.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def dequantize_state(q: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 state of a quantize_state() result."""
    out: dict[str, torch.Tensor] = {}
    for name, t in q.items():
        if name.endswith(_SCALE):
            continue
        scale = q.get(name + _SCALE)
        out[name] = t.float() * scale[:, None] if scale is not None else t.float()
    return out


def save(model: MiniLM, tokenizer_json: Path, out: Path, meta: Mapping[str, Any]) -> None:
    """Write a weights folder: int8 weights, the tokenizer, encoder.json (with the weights' digest)."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dump_weights(quantize_state(model.state_dict()))
    (out / WEIGHTS_FILE).write_bytes(weights)
    (out / TOKENIZER_FILE).write_bytes(tokenizer_json.read_bytes())
    doc = {"format": ENCODER_FORMAT, **meta,
           "config": {k: getattr(model.config, k) for k in EncoderConfig.__dataclass_fields__},
           "weights_sha256": hashlib.sha256(weights).hexdigest()}
    (out / META_FILE).write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n")


_Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _one_graph(model: MiniLM, device: torch.device) -> _Forward:
    """The forward pass as one TorchScript graph, which runs without the GIL from end to end.

    An eager pass gives the GIL back and takes it again around each of its ~50 operations; next
    to a busy event loop each retake waits up to the interpreter's switch interval, so a 4.5 ms
    pass took 263 ms (the graph: 9.9 ms, one retake). TorchScript is deprecated in torch 2.x and
    its successors (torch.compile, torch.export) run from Python, op by op: where tracing fails
    or is gone, the eager model (and a warning)."""
    shapes = [(1, model.config.window_tokens), (2, model.config.window_tokens), (3, 5)]
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the deprecation notice and the tracer's notes on shapes
            ids = torch.zeros(*shapes[0], dtype=torch.long, device=device)
            graph: _Forward = torch.jit.trace(model, (ids, torch.ones_like(ids)), check_trace=False)
            for shape in shapes * 2:  # the graph executor optimizes over its first runs: not on a request
                ids = torch.zeros(*shape, dtype=torch.long, device=device)
                graph(ids, torch.ones_like(ids))
    except Exception as e:  # an older or newer torch: slower next to a busy loop, still correct
        log.warning("classifier encoder: cannot trace the model (%s); running it op by op", e)
        return model
    return graph


class Encoder:
    """A loaded encoder. `score` is synchronous and CPU-bound: call it off the event loop, from
    one thread at a time (the cascade's worker does)."""

    def __init__(self, model: MiniLM, tokenizer: Tokenizer, meta: Mapping[str, Any],
                 device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.meta = dict(meta)
        self.config = model.config
        self._forward = _one_graph(model, device)

    @classmethod
    def load(cls, folder: str | os.PathLike[str] | None = None, device: str = "auto") -> Encoder:
        """Load a weights folder (None: the shipped one) onto `device` ("auto": the GPU when
        torch sees one, else the CPU). Raises ValueError naming what is wrong."""
        d = Path(folder) if folder is not None else ENCODER_DIR
        meta = meta_of(d)
        config = EncoderConfig.from_dict(meta.get("config", {}))
        try:
            weights = (d / WEIGHTS_FILE).read_bytes()  # read once: checked, then loaded
            if hashlib.sha256(weights).hexdigest() != meta.get("weights_sha256"):
                raise ValueError(f"encoder weights {d / WEIGHTS_FILE}: its digest is not the one "
                                 f"{META_FILE} records (a partial copy?)")
            tokenizer = Tokenizer.from_file(str(d / TOKENIZER_FILE))
            state = dequantize_state(load_weights(weights))
        except OSError as e:
            raise ValueError(f"encoder weights {d}: cannot read: {e.strerror or e}") from e
        tokenizer.no_padding()
        tokenizer.no_truncation()
        model = MiniLM(config)
        try:
            model.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(f"encoder weights {d / WEIGHTS_FILE}: do not fit the config: {e}") from e
        dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                           ("cpu" if device == "auto" else device))
        model.to(dev).eval()
        return cls(model, tokenizer, meta, dev)

    @property
    def window_tokens(self) -> int:
        """The most tokens this encoder reads from a text."""
        return self.config.window_tokens

    def ids(self, text: str) -> list[int]:
        """The window of `text` this encoder reads."""
        return window_ids(self.tokenizer, text, self.config)

    def score(self, texts: Sequence[str]) -> list[float]:
        """P(complex) for each text, in one padded batch."""
        if not texts:
            return []
        # encode_batch releases the GIL while it tokenizes (encode does not): the event loop, in
        # another thread, is not held up by a batch of long prompts. One text (at most ~1 ms of
        # tokenizing) keeps the GIL instead: taking it back from a busy loop costs a switch interval.
        c = self.config
        if len(texts) == 1:
            rows = [_window(self.tokenizer.encode(_bounded(texts[0], c)).ids, c)]
        else:
            rows = [_window(e.ids, c) for e in self.tokenizer.encode_batch([_bounded(t, c) for t in texts])]
        # Few torch calls, each of which may give the GIL away: the tensors built from lists at once.
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)
        attend = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long,
                              device=self.device)
        with torch.inference_mode():
            logits = self._forward(ids, attend)
        return [1.0 / (1.0 + math.exp(-v)) if v > -700 else 0.0 for v in logits.float().tolist()]
