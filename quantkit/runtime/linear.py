"""QuantLinear: a linear layer stored as compressed-tensors tensors, computed through `dispatch.linear`."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.runtime import dispatch, reference
from quantkit.runtime.formats import INPUT_TENSORS, WEIGHT_TENSORS, LinearFormat


class QuantLinear(nn.Module):
    def __init__(self, fmt: LinearFormat, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                 bias: torch.Tensor | None = None):
        super().__init__()
        self.fmt = fmt
        self.kind = fmt.kind
        self.in_features, self.out_features = in_features, out_features
        for name in (*WEIGHT_TENSORS, *INPUT_TENSORS):
            self.register_buffer(name, tensors.get(name))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._dense: dict[tuple, torch.Tensor] = {}

    def dense_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The dequantised weight, computed once per (dtype, device) and kept (the reference path's speed)."""
        key = (dtype, str(device))
        w = self._dense.get(key)
        if w is None:
            w = self._dense[key] = reference.dequantize_weight(self, dtype).to(device=device, dtype=dtype)
        return w

    def _apply(self, fn, recurse=True):
        self._dense.clear()  # moved or cast: the cache would hold stale copies
        return super()._apply(fn, recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.linear(x, self)

    def extra_repr(self) -> str:
        w = self.fmt.weights
        detail = f"{w.strategy}" + (f" g{w.group_size}" if w.strategy == "group" else "")
        return f"in={self.in_features}, out={self.out_features}, {self.fmt.format} {self.kind} {detail}"
