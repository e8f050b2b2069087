"""quantkit's own runtime: quantised modules on the transformers skeleton, one dispatch point, generation."""

from quantkit.runtime.generate import GenerationResult, generate
from quantkit.runtime.model import RuntimeModel, load_model
from quantkit.runtime.moe import Routing, RuntimeMoE, moe_blocks, observe_routing, override_routing

__all__ = ["GenerationResult", "Routing", "RuntimeMoE", "RuntimeModel", "generate", "load_model", "moe_blocks",
           "observe_routing", "override_routing"]
