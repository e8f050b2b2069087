"""Activation quantisation as the consumers run it (W8A8 int8 and FP8), shared by the quantisation pipeline
(which simulates it so later layers calibrate on what deployment computes) and quantkit's runtime.

In the activation dtype: scale = absmax / ((qmax - qmin) / 2) (int8: 127.5, fp8 e4m3: 448) per token, per
group of the last dimension or per tensor, or the stored static `input_scale`; q = round-half-even(clamp(x /
scale [+ zp])) for int, a cast to float8_e4m3fn for fp8; dequantised as (q [- zp]) * scale. This matches
compressed-tensors' fake-quantisation bit for bit.

`args` is the input activations' `QuantArgs` (a scheme's, or one read from a checkpoint's config).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.quant.args import QuantArgs
from quantkit.quant.fp4 import fake_quantize_fp4_activation
from quantkit.quant.fp8 import scale_from_absmax


def _dynamic_scale(x: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    if args.strategy == "token":
        absmax = x.abs().amax(dim=-1, keepdim=True)
    elif args.strategy == "group":
        absmax = x.abs().amax(dim=-1, keepdim=True)  # x is already viewed as [..., groups, group_size]
    elif args.strategy == "tensor":
        absmax = x.abs().amax().reshape(1)
    else:
        raise ValueError(f"dynamic activation strategy {args.strategy!r} is not supported")
    return scale_from_absmax(absmax, args.half_range)


def activation_codes(x: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None,
                     input_zero_point: torch.Tensor | None = None):
    """The quantised activations before dequantisation: (q, scale, zp).

    q holds the integer (or fp8-grid) values in x's dtype, shaped like x except for group strategy, where x is
    viewed as [..., n_groups, group_size] (a ragged last group zero-padded); scale broadcasts against q; zp is
    None unless static asymmetric."""
    if args.strategy == "group":
        # A ragged last group (K not a multiple of the group) has its own scale over the columns it covers:
        # zero padding never raises an absmax and is cut off again by the caller.
        x = F.pad(x, (0, -x.shape[-1] % args.group_size)).unflatten(-1, (-1, args.group_size))
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
    return q, scale, zp


def quantize_activation(x: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None,
                        input_zero_point: torch.Tensor | None = None,
                        input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantise activations (quantise then dequantise) in x's dtype. fp4 (MXFP4, NVFP4) activations take
    dynamic group scales, NVFP4's under the static `input_global_scale`."""
    if args.is_fp4:
        return fake_quantize_fp4_activation(x, args, input_global_scale)
    shape = x.shape
    q, scale, zp = activation_codes(x, args, input_scale, input_zero_point)
    out = q.to(scale.dtype)
    if zp is not None:
        out = out - zp.to(scale.dtype)
    out = (out * scale).to(x.dtype)
    return out.flatten(-2)[..., :shape[-1]] if args.strategy == "group" else out.reshape(shape)
