"""Layer-by-layer forward of a whole model (one layer in memory at a time) up to the logits.

Used to prove the streaming engine computes what the full model computes, and by evaluation to run
models larger than memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
from torch import nn

from quantkit.models.loader import ModelHandle
from quantkit.pipeline.capture import capture_layer_inputs, run_layer


class _Inject(nn.Module):
    """In a decoder layer's place: returns `value` (the last layer's output) where one is set, else its input."""

    def __init__(self, value: torch.Tensor | None, attention_type=None, as_tuple: bool = False):
        super().__init__()
        self.value, self.as_tuple = value, as_tuple
        if attention_type is not None:  # read by some models' mask building (Gemma 2's sliding layers)
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        out = hidden_states if self.value is None else self.value
        return (out,) if self.as_tuple else out


@contextmanager
def output_logits(handle: ModelHandle, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Yields hidden [N, L, H] (the last decoder layer's output) -> logits [N, L, V] computed by the model's own
    forward with its layers stood in for, so whatever the architecture does after them (final norm, output
    projection, Cohere's logit scale, Gemma's soft-capping) is what transformers does. Differentiable in hidden.
    The modules outside the layers are read for it (the input embedding left memory-mapped) and released after."""
    layers = handle.layers()
    originals = list(layers)
    emb = handle.embedding_path()
    # What runs around the layers: the base model's other modules and the head (not a vision tower).
    head = handle.skeleton.get_output_embeddings()
    owners = [p for p in handle.around_layers() if p != emb]
    owners.append(next(n for n, m in handle.skeleton.named_modules() if m is head))
    handle.materialize_module(emb, dtype=None if device == "cpu" else dtype, device=device, mapped=True)
    for name in owners:
        handle.materialize_module(name, dtype, device)

    # Most models take a decoder layer's output as it is; some (BLOOM) read it as outputs[0]. The first call finds
    # out on two tokens: a tensor read as outputs[0] loses its batch dimension, which fails or shows in the shape.
    as_tuple: list[bool] = []

    def run(hidden: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(originals):
            layers[i] = _Inject(hidden if i == 0 else None, getattr(layer, "attention_type", None), as_tuple[-1])
        ids = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        try:
            return handle.skeleton(input_ids=ids, use_cache=False).logits.float()
        finally:
            for i, layer in enumerate(originals):
                layers[i] = layer

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        if not as_tuple:
            as_tuple.append(False)
            probe = hidden[:1, :2]
            try:
                plain = run(probe).shape[:2] == probe.shape[:2]
            except (IndexError, RuntimeError, ValueError):
                plain = False
            as_tuple[0] = not plain
        return run(hidden)

    try:
        yield logits
    finally:
        for name in owners:
            handle.release_module(name)
        handle.release_module(emb)


@torch.no_grad()
def layerwise_logits(
    handle: ModelHandle,
    input_ids: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    batch_size: int = 8,
    layer_transform: Callable[[int, nn.Module], None] | None = None,
) -> torch.Tensor:
    """Logits [N, L, V] computed one decoder layer at a time; `layer_transform(i, layer)` may edit a layer."""
    hidden, calls = capture_layer_inputs(handle, input_ids, batch_size, device, dtype)
    for i in range(handle.num_layers):
        layer = handle.materialize_layer(i, dtype, device)
        if layer_transform is not None:
            layer_transform(i, layer)
        hidden = [run_layer(layer, h, calls[j][i]) for j, h in enumerate(hidden)]
        del layer
    with output_logits(handle, dtype, device) as logits:
        return torch.cat([logits(h) for h in hidden])
