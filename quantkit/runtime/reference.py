"""The exact torch reference for every quantised op, matching what compressed-tensors computes.

Weights: the dense weight is (q - zp) * scale evaluated in the scale's dtype, with one scale per group
(column j uses group j // group_size, or g_idx[j] for act-order), per row, per tensor or per 128x128 block.
Activations (W8A8 and FP8): fake-quantised in the activation dtype: scale = absmax / ((qmax - qmin) / 2)
(int8: 127.5, fp8: 448) per token, per group of the last dimension or per tensor, or the stored static
`input_scale`; q = round-half-even(clamp(x / scale)) for int, a cast to float8_e4m3fn for fp8; then
q * scale. The matmul runs in the activation dtype (fp32 accumulation inside the BLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.quant.fp8 import expand_block_scale, scale_from_absmax
from quantkit.quant.integer import dequantize
from quantkit.quant.packing import unpack_int32
from quantkit.runtime.formats import TensorArgs


def _column_index(layer, args: TensorArgs) -> torch.Tensor:
    g_idx = getattr(layer, "weight_g_idx", None)
    if g_idx is not None:
        return g_idx.long()
    cols = torch.arange(layer.in_features, device=layer.weight_scale.device)
    return cols // args.group_size


def _expand(params: torch.Tensor, layer, args: TensorArgs) -> torch.Tensor:
    """Per-group / per-block parameters -> broadcastable against the [out, in] weight."""
    if args.strategy == "group":
        return params[:, _column_index(layer, args)]
    if args.strategy == "block":
        return expand_block_scale(params, (layer.out_features, layer.in_features), args.block_structure)
    if args.strategy == "tensor":
        return params.reshape(1, 1)
    return params.reshape(-1, 1)  # channel: [out, 1]


def integer_weight(layer) -> torch.Tensor:
    """The stored integer (or fp8) weight values [out, in], unpacked."""
    args = layer.fmt.weights
    if layer.fmt.format == "pack-quantized":
        return unpack_int32(layer.weight_packed, args.num_bits, layer.in_features)
    return layer.weight


def zero_point(layer) -> torch.Tensor | None:
    zp = getattr(layer, "weight_zero_point", None)
    args = layer.fmt.weights
    if zp is None or args.symmetric:
        return None
    if layer.fmt.format == "pack-quantized":
        # Packed along the output dimension: [ceil(out*bits/32), n_groups] int32.
        zp = unpack_int32(zp.to(torch.int32), args.num_bits, layer.out_features, packed_dim=0)
    return zp


def dequantize_weight(layer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense [out, in] weight in the scale's dtype, bit-identical to compressed-tensors' decompression.

    With a wider compute `dtype` (fp32 over a bf16 checkpoint) the product is formed in that dtype instead,
    so it is not rounded to the narrower one first."""
    args = layer.fmt.weights
    q = integer_weight(layer)
    scale = layer.weight_scale
    if dtype is not None and dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(scale.dtype).bits:
        scale = scale.to(dtype)
    scale = _expand(scale, layer, args)
    zp = zero_point(layer)
    if zp is not None:
        zp = _expand(zp, layer, args)
    if args.type == "float":
        return q.to(scale.dtype) * scale
    return dequantize(q, scale, zp)


def _dynamic_scale(x: torch.Tensor, args: TensorArgs) -> torch.Tensor:
    if args.strategy == "token":
        absmax = x.abs().amax(dim=-1, keepdim=True)
    elif args.strategy == "group":
        absmax = x.abs().amax(dim=-1, keepdim=True)  # x is already viewed as [..., groups, group_size]
    elif args.strategy == "tensor":
        absmax = x.abs().amax().reshape(1)
    else:
        raise ValueError(f"dynamic activation strategy {args.strategy!r} is not supported")
    return scale_from_absmax(absmax, args.half_range)


def quantize_activation(x: torch.Tensor, args: TensorArgs, input_scale: torch.Tensor | None = None,
                        input_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantise activations (quantise then dequantise) in x's dtype."""
    shape = x.shape
    if args.strategy == "group":
        # A ragged last group (K not a multiple of the group) has its own scale over the columns it covers:
        # zero padding never raises an absmax and is cut off again below.
        x = F.pad(x, (0, -shape[-1] % args.group_size)).unflatten(-1, (-1, args.group_size))
    if args.dynamic:
        scale, zp = _dynamic_scale(x, args), None
    else:
        scale, zp = input_scale, (None if args.symmetric else input_zero_point)
    scaled = x / scale
    if zp is not None:
        scaled = scaled + zp.to(x.dtype)
    if args.type == "float":
        q = torch.clamp(scaled, args.qmin, args.qmax).to(torch.float8_e4m3fn).to(x.dtype)
    else:
        q = torch.round(torch.clamp(scaled, args.qmin, args.qmax))
    out = q.to(scale.dtype)
    if zp is not None:
        out = out - zp.to(scale.dtype)
    out = (out * scale).to(x.dtype)
    return out.flatten(-2)[..., :shape[-1]] if args.strategy == "group" else out.reshape(shape)


def linear(x: torch.Tensor, layer) -> torch.Tensor:
    """Reference quantised linear: cached dense weight, activation fake-quant where the scheme has it."""
    weight = layer.dense_weight(x.dtype, x.device)
    if layer.fmt.input is not None:
        x = quantize_activation(x, layer.fmt.input, getattr(layer, "input_scale", None),
                                getattr(layer, "input_zero_point", None))
    return F.linear(x, weight, layer.bias)
