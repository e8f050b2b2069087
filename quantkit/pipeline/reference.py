"""Layer-by-layer forward of a whole model (one layer in memory at a time) up to the logits.

Used to prove the streaming engine computes what the full model computes, and by evaluation to run
models larger than memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from quantkit.models.loader import ModelHandle
from quantkit.pipeline.capture import capture_layer_inputs, run_layer


def output_head(handle: ModelHandle) -> str:
    head = handle.skeleton.get_output_embeddings()
    for name, module in handle.skeleton.named_modules():
        if module is head:
            return name
    raise RuntimeError("cannot locate the output head")


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
    norm_path = handle.adapter.layers_path.rpartition(".")[0] + ".norm"
    head_path = output_head(handle)
    norm = handle.materialize_module(norm_path, dtype, device)
    head = handle.materialize_module(head_path, dtype, device)
    try:
        logits = torch.cat([head(norm(h)) for h in hidden]).float()
        cap = getattr(handle.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
    finally:
        handle.release_module(norm_path)
        handle.release_module(head_path)
