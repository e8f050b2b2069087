"""Capture what each decoder layer receives, without computing any layer.

The model's own forward runs with every decoder layer replaced by a pass-through that records its
keyword arguments (attention mask, rotary position embeddings, ... exactly as this architecture builds
them, including per-layer differences such as sliding-window masks) and returns its input unchanged.
Only what the model holds outside its layers is materialised (the embedding memory-mapped); the pass stops
before the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.loader import ModelHandle


class _Stop(Exception):
    pass


class _PassThrough(nn.Module):
    def __init__(self, index: int, record: list, last: bool, attention_type=None):
        super().__init__()
        self.index, self.record, self.last = index, record, last
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "past_key_value")}
        kwargs["use_cache"] = False
        self.record.append((self.index, hidden_states, args, kwargs))
        if self.last:
            raise _Stop
        return hidden_states


def capture_layer_inputs(
    handle: ModelHandle, input_ids: torch.Tensor, batch_size: int, device: str = "cpu",
    dtype: torch.dtype = torch.float32, hidden_device: str | torch.device | None = None,
) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """Returns (hidden states entering layer 0, one per batch; per batch, per layer: (args, kwargs)).
    `hidden_device`: where the hidden states are kept (default `device`); a GPU run whose activations do not
    fit on the device moves each batch to the host as soon as it is captured."""
    layers = handle.layers()
    originals = list(layers)
    emb_path = handle.embedding_path()
    # The embedding table stays memory-mapped in its stored dtype: only the rows looked up are read.
    handle.materialize_module(emb_path, dtype=None if device == "cpu" else dtype, device=device, mapped=True)
    base = handle.base_model()
    # Whatever else the base model holds outside its layers (OPT's learned positions, a norm after the embedding),
    # small next to a layer, is read for the capture and released after it.
    others = [path for path in handle.around_layers() if path != emb_path]
    for path in others:
        handle.materialize_module(path, dtype=dtype, device=device)
    hidden: list[torch.Tensor] = []
    per_batch: list[list[tuple]] = []
    try:
        for i in range(len(originals)):
            layers[i] = _PassThrough(i, [], i == len(originals) - 1, getattr(originals[i], "attention_type", None))
        for start in range(0, input_ids.shape[0], batch_size):
            record: list = []
            for p in layers:
                p.record = record
            ids = input_ids[start : start + batch_size].to(device)
            try:
                with torch.no_grad():
                    base(input_ids=ids, use_cache=False)
            except _Stop:
                pass
            h = record[0][1].detach().to(dtype)
            hidden.append(h if hidden_device is None else h.to(hidden_device))
            per_batch.append([(args, kwargs) for _, _, args, kwargs in sorted(record, key=lambda r: r[0])])
    finally:
        for i, layer in enumerate(originals):
            layers[i] = layer
        handle.release_module(emb_path)
        for path in others:
            handle.release_module(path)
    return hidden, per_batch


def run_layer(layer: nn.Module, hidden: torch.Tensor, call: tuple) -> torch.Tensor:
    args, kwargs = call
    out = layer(hidden, *args, **kwargs)
    return out[0] if isinstance(out, tuple) else out
