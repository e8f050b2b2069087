"""quantkit: offline compression of large language models to compressed-tensors checkpoints."""

__version__ = "0.1.0"
