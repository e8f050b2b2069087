"""One entry point per direction for a weight under any scheme (integer or fp8; tensor, channel, group, block).

Stored layouts follow compressed-tensors: integer scales [out, n_groups] (tensor: [1]); fp8 scales [1],
[out, 1] or [ceil(out/bh), ceil(in/bw)] for blocks.
"""

from __future__ import annotations

import torch

from quantkit.quant.fp8 import dequantize_fp8, expand_block_scale, quantize_fp8_weight
from quantkit.quant.args import QuantArgs
from quantkit.quant.integer import dequantize_weight_args, quantize_weight


def quantize_any(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantisation: (q int8 or float8, scale in fp32 holding `scale_dtype` values, zp or None)."""
    if args.type == "float":
        q, scale = quantize_fp8_weight(weight, args.strategy, args.block or (128, 128), scale_dtype=scale_dtype)
        return q, scale.float(), None
    q, scale, zp = quantize_weight(weight, args, scale_dtype=scale_dtype)
    return q, scale.float(), None if args.symmetric else zp


def dequantize_any(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense weight from stored values, computed in fp32 (exact for 8-bit values times bf16/fp16 scales)."""
    if args.type == "float":
        full = scale.float()
        if args.strategy == "block":
            full = expand_block_scale(full, tuple(q.shape), args.block)
        return dequantize_fp8(q, full).to(dtype)
    return dequantize_weight_args(q, scale.float(), zero_point, args, g_idx, dtype)
