"""quantkit's own runtime: quantised modules on the transformers skeleton, one dispatch point, generation."""

from quantkit.runtime.generate import GenerationResult, generate
from quantkit.runtime.model import RuntimeModel, load_model
from quantkit.runtime.step import KVCache, prefill, step, tree_mask, tree_positions

__all__ = ["GenerationResult", "KVCache", "RuntimeModel", "generate", "load_model", "prefill", "step", "tree_mask",
           "tree_positions"]
