"""quantkit's own runtime: quantised modules on the transformers skeleton, one dispatch point, generation."""

from quantkit.runtime.generate import GenerationResult, generate
from quantkit.runtime.model import RuntimeModel, load_model

__all__ = ["GenerationResult", "RuntimeModel", "generate", "load_model"]
