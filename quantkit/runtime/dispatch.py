"""The single dispatch point for quantised ops.

`linear(x, layer)` runs a registered kernel for (the layer's op kind, x's device type) if there is one,
else the exact torch reference. CUDA kernels from csrc/ register here; QUANTKIT_REFERENCE=1 forces the
reference everywhere (for kernel-vs-reference tests).
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from quantkit.runtime import reference

Kernel = Callable[[torch.Tensor, "torch.nn.Module"], torch.Tensor]
_KERNELS: dict[tuple[str, str], Kernel] = {}


def register_kernel(kind: str, device_type: str, fn: Kernel) -> None:
    """Route `kind` ops (w4a16, w8a16, int8, fp8) on `device_type` (cpu, cuda) to `fn(x, layer)`."""
    _KERNELS[(kind, device_type)] = fn


def unregister_kernel(kind: str, device_type: str) -> None:
    _KERNELS.pop((kind, device_type), None)


def kernel_for(kind: str, device_type: str) -> Kernel:
    if os.environ.get("QUANTKIT_REFERENCE"):
        return reference.linear
    return _KERNELS.get((kind, device_type), reference.linear)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    return kernel_for(layer.kind, x.device.type)(x, layer)
