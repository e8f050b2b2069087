"""Checkpoint formats: the planned safetensors writer, compressed-tensors layout and config, the manifest."""
