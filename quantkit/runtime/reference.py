"""The exact torch reference for every quantised op, matching what compressed-tensors computes.

Weights: the dense weight is (q - zp) * scale evaluated in the scale's dtype, with one scale per group
(column j uses group j // group_size, or g_idx[j] for act-order), per row, per tensor or per 128x128 block.
Activations (W8A8 and FP8): fake-quantised in the activation dtype (`quantkit.quant.activations`). The matmul
runs in the activation dtype (fp32 accumulation inside the BLAS).

This is the oracle the kernels are tested against and the fallback where no kernel serves a format. It keeps
no dense copy: each call dequantises the weight, uses it and lets it go, in blocks of output rows when the
layer is large, so a fallback layer holds its packed size and one call at most one block of dense weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.quant.activations import _dynamic_scale, quantize_activation  # noqa: F401  (re-exported)
from quantkit.quant.fp4 import dequantize_fp4
from quantkit.quant.fp8 import expand_block_scale
from quantkit.quant.integer import dequantize
from quantkit.quant.args import QuantArgs

# Dense weight elements one reference call materialises at most (64 MB in fp32). Below it the whole weight is
# dequantised at once, so the product is bit-identical to a consumer multiplying by the dense weight.
TILE_ELEMENTS = 1 << 24

Rows = tuple[int, int] | None


def _rows(layer, rows: Rows) -> tuple[int, int]:
    return (0, layer.out_features) if rows is None else rows


def _column_index(layer, args: QuantArgs) -> torch.Tensor:
    g_idx = getattr(layer, "weight_g_idx", None)
    if g_idx is not None:
        return g_idx.long()
    cols = torch.arange(layer.in_features, device=layer.weight_scale.device)
    return cols // args.group_size


def _expand(params: torch.Tensor, layer, args: QuantArgs, rows: Rows = None) -> torch.Tensor:
    """Per-group / per-block parameters of output rows [r0, r1) -> broadcastable against their [r1-r0, in] weight."""
    r0, r1 = _rows(layer, rows)
    if args.strategy == "group":
        return params[r0:r1, _column_index(layer, args)]
    if args.strategy == "block":
        bh = args.block[0]
        b0, b1 = r0 // bh, -(-r1 // bh)
        full = expand_block_scale(params[b0:b1], ((b1 - b0) * bh, layer.in_features), args.block)
        return full[r0 - b0 * bh : r1 - b0 * bh]
    if args.strategy == "tensor":
        return params.reshape(1, 1)
    return params.reshape(-1, 1)[r0:r1]  # channel: [out, 1]


def _stored(layer) -> dict[str, torch.Tensor]:
    return {name: t for name, t in layer.named_buffers(recurse=False) if t is not None}


def integer_weight(layer, rows: Rows = None) -> torch.Tensor:
    """The stored integer (or fp8) weight values [out, in] (output rows [r0, r1)), unpacked by the format."""
    return layer.fmt.compressor.values(_stored(layer), layer.fmt.weights, layer.in_features, rows)


def zero_point(layer) -> torch.Tensor | None:
    """Zero points in the scale's layout (int8), or None when symmetric."""
    return layer.fmt.compressor.zero_point(_stored(layer), layer.fmt.weights, layer.out_features)


def dequantize_weight(layer, dtype: torch.dtype | None = None, rows: Rows = None) -> torch.Tensor:
    """Dense [out, in] weight (or output rows [r0, r1) of it) in the scale's dtype, bit-identical to
    compressed-tensors' decompression.

    With a wider compute `dtype` (fp32 over a bf16 checkpoint) the product is formed in that dtype instead,
    so it is not rounded to the narrower one first."""
    args = layer.fmt.weights
    q = integer_weight(layer, rows)
    if args.is_fp4:
        scale = layer.fmt.compressor.scale_values(_stored(layer), rows)
        return dequantize_fp4(q, scale, args.group_size, getattr(layer, "weight_global_scale", None),
                              dtype or torch.float32)
    scale = layer.weight_scale
    if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(scale.dtype).bits:
        scale = scale.to(dtype)
    scale = _expand(scale, layer, args, rows)
    zp = zero_point(layer)
    if zp is not None:
        zp = _expand(zp, layer, args, rows)
    if args.type == "float":
        return q.to(scale.dtype) * scale
    return dequantize(q, scale, zp)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Reference quantised linear: activation fake-quant where the scheme has it, then x @ W^T with W
    dequantised for this call only."""
    if layer.fmt.input is not None:
        x = quantize_activation(x, layer.fmt.input, getattr(layer, "input_scale", None),
                                getattr(layer, "input_zero_point", None), getattr(layer, "input_global_scale", None))
    n = layer.out_features
    step = max(1, TILE_ELEMENTS // max(layer.in_features, 1))
    if step >= n:
        return F.linear(x, dequantize_weight(layer, x.dtype).to(device=x.device, dtype=x.dtype), layer.bias)
    parts = []
    for r0 in range(0, n, step):
        rows = (r0, min(n, r0 + step))
        w = dequantize_weight(layer, x.dtype, rows).to(device=x.device, dtype=x.dtype)
        parts.append(F.linear(x, w, None if layer.bias is None else layer.bias[rows[0]:rows[1]]))
        del w
    return torch.cat(parts, dim=-1)
