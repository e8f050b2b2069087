"""Random quantised linears of every format the CUDA kernels cover, built directly on a device.

Used by the kernel tests (CPU emulator) and benchmarks/gpu_check.py: parity against the reference and
speed depend on the format and shape, not on trained values.
"""

from __future__ import annotations

import torch

from quantkit.quant.packing import pack_int32
from quantkit.quant.args import QuantArgs
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.linear import QuantLinear


def make_layer(kind: str, n: int, k: int, dev, *, sym=True, strategy="group", group=128, actorder=False,
               scale_dtype=torch.bfloat16, seed=0) -> QuantLinear:
    # Generated on the target device: the 8B model's random layers would take minutes on the host.
    g = torch.Generator(device=dev).manual_seed(seed)
    r = dict(generator=g, device=dev)
    if kind in ("w4a16", "w8a16"):
        bits = 4 if kind == "w4a16" else 8
        lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
        q = torch.randint(lo, hi, (n, k), **r).to(torch.int8)
        ng = -(-k // group) if strategy == "group" else 1
        t = {"weight_packed": pack_int32(q, bits),
             "weight_scale": (torch.rand(n, ng, **r) * 0.02 + 0.001).to(scale_dtype),
             "weight_shape": torch.tensor([n, k], device=dev)}
        if not sym:
            t["weight_zero_point"] = pack_int32(torch.randint(lo, hi, (n, ng), **r).to(torch.int8), bits, packed_dim=0)
        if actorder:
            t["weight_g_idx"] = (torch.randperm(k, **r) // group).to(torch.int32)
        fmt = LinearFormat("pack-quantized", QuantArgs(num_bits=bits, symmetric=sym, strategy=strategy, group_size=group,
                                                        actorder="group" if actorder else None))
    elif kind == "int8":
        t = {"weight": torch.randint(-128, 128, (n, k), **r).to(torch.int8),
             "weight_scale": (torch.rand(n, 1, **r) * 0.002 + 1e-4).to(scale_dtype)}
        fmt = LinearFormat("int-quantized", QuantArgs(num_bits=8, strategy="channel"),
                           QuantArgs(num_bits=8, strategy="token", dynamic=True))
    elif kind == "fp8":
        t = {"weight": (torch.randn(n, k, **r) * 100).clamp(-448, 448).to(torch.float8_e4m3fn),
             "weight_scale": (torch.rand(-(-n // 128), -(-k // 128), **r) * 1e-3 + 1e-5).to(scale_dtype)}
        fmt = LinearFormat("float-quantized", QuantArgs(num_bits=8, strategy="block", type="float", block=(128, 128)),
                           QuantArgs(num_bits=8, type="float", dynamic=True))
    else:
        raise ValueError(kind)
    layer = QuantLinear(fmt, {key: v.to(dev) for key, v in t.items()}, k, n)
    return layer
