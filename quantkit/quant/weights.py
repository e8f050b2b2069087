"""One entry point per direction for a weight under any scheme (integer, fp8 or fp4; tensor, channel, group,
block, tensor_group).

Stored layouts follow compressed-tensors: integer scales [out, n_groups] (tensor: [1]); fp8 scales [1],
[out, 1] or [ceil(out/bh), ceil(in/bw)] for blocks; fp4 scales [out, in / group] (e4m3 or power-of-two values,
held in fp32) plus NVFP4's fp32 global scale [1].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from quantkit.quant.args import QuantArgs
from quantkit.quant.fp4 import dequantize_fp4, quantize_fp4_weight
from quantkit.quant.fp8 import dequantize_fp8, expand_block_scale, quantize_fp8_weight
from quantkit.quant.integer import dequantize_weight_args, quantize_weight


class Quantized(NamedTuple):
    q: torch.Tensor  # int8 values, float8_e4m3fn, or fp4: e2m1 values in fp32
    scale: torch.Tensor  # fp32 holding `scale_dtype` values (fp4: the stored e4m3 / power-of-two values)
    zero_point: torch.Tensor | None  # int asymmetric only
    global_scale: torch.Tensor | None = None  # NVFP4 only: fp32 [1]


def quantize_any(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
                 global_scale: torch.Tensor | None = None) -> Quantized:
    """Round-to-nearest quantisation under any scheme's weight arguments (`global_scale`: NVFP4's shared one)."""
    if args.is_fp4:
        q, scale, global_scale = quantize_fp4_weight(weight, args, global_scale)
        return Quantized(q, scale, None, global_scale)
    if args.type == "float":
        q, scale = quantize_fp8_weight(weight, args.strategy, args.block or (128, 128), scale_dtype=scale_dtype)
        return Quantized(q, scale.float(), None)
    q, scale, zp = quantize_weight(weight, args, scale_dtype=scale_dtype)
    return Quantized(q, scale.float(), None if args.symmetric else zp)


def dequantize_any(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense weight from stored values, computed in fp32 (exact for 8-bit values times bf16/fp16 scales)."""
    if args.is_fp4:
        return dequantize_fp4(q, scale, args.group_size, global_scale, dtype)
    if args.type == "float":
        full = scale.float()
        if args.strategy == "block":
            full = expand_block_scale(full, tuple(q.shape), args.block)
        return dequantize_fp8(q, full).to(dtype)
    return dequantize_weight_args(q, scale.float(), zero_point, args, g_idx, dtype)


def as_stored(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs,
              scale_dtype: torch.dtype, g_idx: torch.Tensor | None = None,
              global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The weight a consumer computes from stored values: the scale in the checkpoint's dtype, the product rounded
    to it as it multiplies there (fp32 result holding `scale_dtype` values)."""
    deq = dequantize_any(q, scale.to(scale_dtype).float(), zero_point, args, g_idx, global_scale=global_scale)
    return deq.to(scale_dtype).float()


def round_trip(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
               global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`as_stored` of the weight's round-to-nearest quantisation."""
    q, scale, zp, gs = quantize_any(weight, args, scale_dtype, global_scale)
    return as_stored(q, scale, zp, args, scale_dtype, global_scale=gs)
