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

from quantkit.errors import InputError
from quantkit.models.loader import ModelHandle


class _Stop(Exception):
    pass


class _PassThrough(nn.Module):
    def __init__(self, index: int, record: list, last: bool, attention_type=None):
        super().__init__()
        self.index, self.record, self.last = index, record, last
        self.as_tuple = False  # some models (BLOOM) read a layer's output as outputs[0]
        if attention_type is not None:
            self.attention_type = attention_type

    def forward(self, hidden_states, *args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache", "past_key_value")}
        kwargs["use_cache"] = False
        self.record.append((self.index, hidden_states, args, kwargs))
        if self.last:
            raise _Stop
        return (hidden_states,) if self.as_tuple else hidden_states


def _between_layers(record: list) -> str | None:
    """What the model did to a layer's output before the next layer read it, pass-through layers standing in:
    None (nothing: the layer-by-layer pipeline computes what the model computes), "tuple" (it read outputs[0]),
    "looped" (a layer ran twice) or "changed" (it computed something between them, as Dory's loops do)."""
    calls = [r[0] for r in record]
    if len(set(calls)) != len(calls):
        return "looped"
    for (_, a, _, _), (_, b, _, _) in zip(record, record[1:]):
        if b is a or b.shape == a.shape and torch.equal(a, b):
            continue
        return "tuple" if b.shape == a.shape[1:] and torch.equal(a[0], b) else "changed"
    return None


def _probe(base: nn.Module, layers: nn.ModuleList, ids: torch.Tensor) -> None:
    """One whole forward of a few tokens with the pass-through layers, none stopping it: finds whether the model reads
    a layer's output as outputs[0] (then every pass-through returns a tuple) and refuses, in one line, a model whose
    layers' inputs are not simply the previous layers' outputs."""
    record: list = []
    for p in layers:
        p.record, p.last = record, False
    try:
        for _ in range(2):  # a second time only where the model turns out to read outputs[0]
            record.clear()
            with torch.no_grad():
                base(input_ids=ids, use_cache=False)
            found = _between_layers(record)
            if found != "tuple" or layers[0].as_tuple:
                break
            for p in layers:
                p.as_tuple = True
    finally:
        for p in layers:
            p.last = p.index == len(layers) - 1
    if found == "looped":
        raise InputError("the model runs some decoder layers more than once per forward (a looped model): "
                         "quantkit's layer-by-layer pipeline runs each layer once, so it cannot calibrate it")
    if found is not None:
        raise InputError("the model computes between its decoder layers (a layer's input is not the previous "
                         "layer's output): quantkit's layer-by-layer pipeline cannot calibrate it")


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
    # small next to a layer, is read for the capture and released after it, in the embedding's dtype: what runs
    # before the first layer sees the embedding's output (BLOOM's LayerNorm on it cannot mix dtypes under autocast).
    others = [path for path in handle.around_layers() if path != emb_path]
    for path in others:
        handle.materialize_module(path, dtype=None if device == "cpu" else dtype, device=device)
    hidden: list[torch.Tensor] = []
    per_batch: list[list[tuple]] = []
    try:
        for i in range(len(originals)):
            layers[i] = _PassThrough(i, [], i == len(originals) - 1, getattr(originals[i], "attention_type", None))
        _probe(base, layers, input_ids[:1, :8].to(device))
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
