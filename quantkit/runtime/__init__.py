"""quantkit's own runtime: quantised modules on the transformers skeleton, one dispatch point, explicit steps."""

from quantkit.runtime.generate import GenerationResult, generate
from quantkit.runtime.model import RuntimeModel, load_model
from quantkit.runtime.moe import Routing, RuntimeMoE, moe_blocks, observe_routing, override_routing
from quantkit.runtime.step import KVCache, prefill, step, tree_mask, tree_positions

__all__ = ["GenerationResult", "KVCache", "Routing", "RuntimeMoE", "RuntimeModel", "generate", "load_model",
           "moe_blocks", "observe_routing", "override_routing", "prefill", "step", "tree_mask", "tree_positions"]
