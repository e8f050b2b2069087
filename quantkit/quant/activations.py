"""Activation quantisation as the consumers run it (W8A8 int8 and FP8), shared by the quantisation pipeline
(which simulates it so later layers calibrate on what deployment computes) and quantkit's runtime.

In the activation dtype: scale = absmax / ((qmax - qmin) / 2) (int8: 127.5, fp8 e4m3: 448) per token, per
group of the last dimension or per tensor, or the stored static `input_scale`; q = round-half-even(clamp(x /
scale [+ zp])) for int, a cast to float8_e4m3fn for fp8; dequantised as (q [- zp]) * scale. This matches
compressed-tensors' fake-quantisation bit for bit.

`args` is the input activations' `QuantArgs` (a scheme's, or one read from a checkpoint's config).
"""

from __future__ import annotations

import functools
import os

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


@functools.cache
def fused_extension():
    """The fused per-token fake quantisation (csrc/cpu/act_quant.cpp), or None after one warning where it cannot be
    built; QUANTKIT_EAGER_ACTIVATIONS=1 keeps the eager ops."""
    from quantkit.native import CSRC, EXACT_FP_CFLAGS, OPENMP_CFLAGS, load_cpu_extension
    from quantkit.progress import warn_once

    if os.environ.get("QUANTKIT_EAGER_ACTIVATIONS"):
        return None
    # Threaded like the ATen ops it replaces (a prefill block of rows splits over torch's threads; one decode row
    # runs inline).
    module, why = load_cpu_extension(CSRC / "cpu" / "act_quant.cpp", EXACT_FP_CFLAGS + OPENMP_CFLAGS)
    if module is None:
        warn_once(f"activation quantisation: {why}; the eager torch ops run instead (slower, same result)")
    return module


def _fused_ok(x: torch.Tensor, args: QuantArgs) -> bool:
    return (args.dynamic and args.strategy == "token" and args.num_bits == 8 and args.type in ("int", "float")
            and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.numel() > 0
            and not (x.requires_grad and torch.is_grad_enabled()))


def _fused(x: torch.Tensor, args: QuantArgs) -> torch.Tensor | None:
    """quantize_activation by the C++ kernel where it applies (dynamic per-token 8-bit, bf16 / fp32 on the CPU,
    no autograd), else None. Same values bit for bit (tests/quant/test_activations.py)."""
    if not _fused_ok(x, args):
        return None
    ext = fused_extension()
    if ext is None:
        return None
    eps = torch.finfo(x.dtype).eps
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = ext.fake_quant_token(x2, args.type == "float", float(args.qmin), float(args.qmax), float(args.half_range),
                               eps)
    return out.reshape(x.shape)


def token_codes(x: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token int8 activations as (int8 codes [M, K], fp32 scales [M]) for an int8 x int8 GEMM: x [M, K]
    quantised as quantize_activation does (its q and scale, the scale's values in x's dtype)."""
    if not (args.dynamic and args.strategy == "token" and args.type == "int" and args.num_bits == 8):
        raise ValueError(f"token_codes takes dynamic per-token int8 activations, not {args}")
    ext = fused_extension() if _fused_ok(x, args) else None
    if ext is not None:
        codes, scales = ext.token_codes(x.contiguous(), float(args.qmin), float(args.qmax), float(args.half_range),
                                        torch.finfo(x.dtype).eps)
        return codes, scales
    q, scale, _ = activation_codes(x, args)
    return q.to(torch.int8), scale.float().reshape(-1)


def quantize_activation(x: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None,
                        input_zero_point: torch.Tensor | None = None,
                        input_global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantise activations (quantise then dequantise) in x's dtype. fp4 (MXFP4, NVFP4) activations take
    dynamic group scales, NVFP4's under the static `input_global_scale`."""
    if args.is_fp4:
        return fake_quantize_fp4_activation(x, args, input_global_scale)
    fused = _fused(x, args)
    return fused if fused is not None else eager_quantize_activation(x, args, input_scale, input_zero_point)


def eager_quantize_activation(x: torch.Tensor, args: QuantArgs, input_scale: torch.Tensor | None = None,
                              input_zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_activation in ATen ops (the reference the fused kernel reproduces; every non-fp4 case)."""
    shape = x.shape
    q, scale, zp = activation_codes(x, args, input_scale, input_zero_point)
    out = q.to(scale.dtype)
    if zp is not None:
        out = out - zp.to(scale.dtype)
    out = (out * scale).to(x.dtype)
    return out.flatten(-2)[..., :shape[-1]] if args.strategy == "group" else out.reshape(shape)
