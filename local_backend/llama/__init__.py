"""Our own Llama forward for serving: quantized weights, a preallocated KV cache, a lean decode step.

transformers loads the checkpoint; ``LeanLlama.from_hf`` takes its weights (fusing QKV and
gate/up, quantizing per the plan) and the engine runs prefill and decode through this package.
"""

from .cache import KVCache
from .model import LeanLlama
from .weights import DenseLinear, Int4Linear, Int8Linear

__all__ = ["DenseLinear", "Int4Linear", "Int8Linear", "KVCache", "LeanLlama"]
