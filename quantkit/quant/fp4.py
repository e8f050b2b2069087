"""4-bit floating point (e2m1) numerics: NVFP4 and MXFP4, as compressed-tensors and vLLM define them.

An e2m1 value is one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 with a sign; a code is its index in that list with the sign
in bit 3, and two codes share a byte (the even column in the low nibble).

- NVFP4: groups of 16 along the input dimension. A tensor-wide fp32 global scale g = 448 * 6 / absmax(tensor)
  spreads the group scales over e4m3's range; each group's stored scale is e4m3(absmax(group) / 6 * g) and a
  value is code * (stored / g).
- MXFP4: groups of 32, each scale a power of two stored as a biased e8m0 exponent (2^(e - 127)), chosen from
  the group's absmax rounded to a power of two, less 2 (6's exponent), so the largest values may clip to 6.

Rounding to e2m1 is to the nearest value, ties to the even mantissa (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4),
after clamping to [-6, 6]; the sign of a non-zero value that rounds to zero is kept in its code.
"""

from __future__ import annotations

import torch

from quantkit.quant.args import FP4_MAX, FP8_MAX, QuantArgs

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E4M3_EPS = 0.125  # a zero e4m3 group scale becomes this (compressed-tensors' convention), never a 0 division
MX_BIAS = 127
MX_OFFSET = 2  # floor(log2(6)): the group absmax's exponent less this lands the group's top near 6


def _magnitude_index(a: torch.Tensor) -> torch.Tensor:
    """Index of |x| (already non-negative) on the e2m1 grid, ties to even: the midpoints 0.25, 1.25, 2.5 and
    5 round down and 0.75, 1.75, 3.5 round up."""
    return ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0))


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest signed e2m1 value (clamped to +-6), in x's dtype."""
    grid = torch.tensor(E2M1_VALUES, dtype=x.dtype, device=x.device)
    # Times sign(x): a negative value that rounds to zero keeps its sign (-0), a zero of either sign gives +0.
    return grid[_magnitude_index(x.abs()).long()] * torch.sign(x)


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """uint8 codes (sign in bit 3) of tensors holding e2m1 values."""
    return _magnitude_index(values.abs()) | (torch.signbit(values).to(torch.uint8) << 3)


def codes_to_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=codes.device)
    return grid[codes.long()]


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] e2m1 values -> uint8 [rows, cols / 2]; column 2j in the low nibble of byte j."""
    if values.shape[-1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got {values.shape[-1]}")
    codes = e2m1_codes(values)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [rows, cols / 2] -> e2m1 values [rows, cols] in `dtype`."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return codes_to_values(codes, dtype)


def nvfp4_global_scale(absmax: torch.Tensor) -> torch.Tensor:
    """fp32 [1]: 448 * 6 / absmax of the whole tensor; 1 where that is not finite (an all-zero tensor)."""
    a = absmax.float().reshape(1).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(FP8_MAX * FP4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)


def nvfp4_group_scales(group_absmax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Stored e4m3 group scales (as fp32 values) of per-group absmax values. absmax / 6 is formed in absmax's own
    dtype (bf16 activations: in bf16), then scaled in fp32, as compressed-tensors computes it."""
    scaled = global_scale.float() * (group_absmax / FP4_MAX).float()
    stored = scaled.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(stored == 0, torch.full_like(stored, E4M3_EPS), stored)


def _round_to_power_of_two(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to a power of two: up where x's mantissa fraction is at least 0.75 (e2m1's one mantissa
    bit: values that would round past the grid's top take the next exponent), down otherwise."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + (1 << 21)) & 0x7F800000).view(torch.float32)


def mx_exponents(group_absmax: torch.Tensor) -> torch.Tensor:
    """uint8 biased e8m0 exponents of per-group absmax values (an all-zero group gets exponent 0)."""
    e = MX_BIAS + torch.floor(torch.log2(_round_to_power_of_two(group_absmax))) - MX_OFFSET
    return torch.round(torch.clamp(e, 0, 255)).to(torch.uint8)


def mx_scale_values(exponents: torch.Tensor) -> torch.Tensor:
    """fp32 scales 2^(e - 127) of uint8 exponents."""
    return torch.exp2(exponents.to(torch.int32).float() - MX_BIAS)


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    if x.shape[-1] % group_size:
        raise ValueError(f"fp4 groups of {group_size} do not divide {x.shape[-1]} columns")
    return x.unflatten(-1, (-1, group_size))


def fp4_group_scales(values: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Stored per-row scale [rows, 1] of one group's columns [rows, group] (fp32: e4m3 values for NVFP4, 2^k for
    MXFP4); `global_scale` [1] or per row [rows, 1]."""
    return fp4_group_scales_of(values.abs().amax(dim=-1, keepdim=True), args, global_scale)


def effective_scale(scale: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """What a stored fp32 scale multiplies a value by: scale / global for NVFP4, the scale itself for MXFP4."""
    return scale if global_scale is None else scale / global_scale.float()


def quantize_fp4_weight(weight: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest fp4 quantisation of an [out, in] weight: (e2m1 values in fp32, stored scales fp32
    [out, in / group], global scale fp32 [1] or None). NVFP4's global scale is the weight's own unless given
    (linears an engine fuses, q/k/v or gate/up, must share one)."""
    w = weight.float()
    global_scale = fp4_global_scale(w, args, global_scale)
    scale = fp4_group_scales_of(group_view(w, args.group_size).abs().amax(dim=-1), args, global_scale)
    return quantize_fp4(w, scale, args.group_size, global_scale), scale, global_scale


def fp4_global_scale(weight: torch.Tensor, args: QuantArgs, given: torch.Tensor | None = None) -> torch.Tensor | None:
    """NVFP4's global scale: `given` (shared by fused linears) or the weight's own; None for MXFP4."""
    if not args.fp4_global:
        return None
    return nvfp4_global_scale(weight.abs().amax()) if given is None else given.to(weight.device)


def quantize_fp4(x: torch.Tensor, scale: torch.Tensor, group_size: int,
                 global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """e2m1 values of x [..., in] under per-group stored scales [..., in / group] (computed in x's dtype)."""
    s = effective_scale(scale.to(x.dtype), global_scale)
    scaled = group_view(x, group_size) / s.unsqueeze(-1)
    return round_to_e2m1(scaled.clamp(-FP4_MAX, FP4_MAX)).flatten(-2)


def dequantize_fp4(q: torch.Tensor, scale: torch.Tensor, group_size: int,
                   global_scale: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense values q * (scale [/ global]) per group, formed in fp32 (exact: 3 significant bits times e4m3 or a
    power of two, over one fp32 division), then cast to `dtype`."""
    s = effective_scale(scale.float(), global_scale)
    return (group_view(q.float(), group_size) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def fake_quantize_fp4_activation(x: torch.Tensor, args: QuantArgs,
                                 global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Activation fp4 fake-quantisation with dynamic per-group scales (MXFP4: e8m0; NVFP4: e4m3 under the static
    `input_global_scale`), in x's dtype as consumers simulate it."""
    grouped = group_view(x, args.group_size)
    scale = fp4_group_scales_of(grouped.abs().amax(dim=-1), args, global_scale).to(x.dtype)
    s = effective_scale(scale, global_scale)
    q = round_to_e2m1((grouped / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return (q * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def search_fp4_scales(weight: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None,
                      importance: torch.Tensor | None = None) -> torch.Tensor:
    """Stored fp4 group scales [out, in / group] of an [out, in] weight chosen per group to minimise its squared
    rounding error (each column's weighted by `importance` [in] when given), among the plain absmax scale and its
    neighbours on the format's own scale grid: for NVFP4 the e4m3 value one above and three below (about 0.75x to
    1.1x: the integer search's 0.8-1.0 shrink range, which e4m3's three mantissa bits cut into a handful of distinct
    scales), for MXFP4 the power of two above and below (the format's rule lets a group's top clip to 6; one up
    does not). The plain scale is the first candidate and is kept on ties."""
    w = weight.float()
    grouped = group_view(w, args.group_size)
    plain = fp4_group_scales_of(grouped.abs().amax(dim=-1), args, global_scale)
    imp = None if importance is None else group_view(importance.float().reshape(1, -1), args.group_size)
    best_err = best = None
    for step in ((0, 1, -1, -2, -3) if args.fp4_global else (0, 1, -1)):
        scale = _scale_neighbour(plain, step, args)
        s = effective_scale(scale, global_scale).unsqueeze(-1)
        err = (round_to_e2m1((grouped / s).clamp(-FP4_MAX, FP4_MAX)) * s - grouped).pow(2)
        err = (err if imp is None else err * imp).sum(dim=-1)
        if best is None:
            best_err, best = err, scale
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, scale, best)
    return best


def _scale_neighbour(scale: torch.Tensor, step: int, args: QuantArgs) -> torch.Tensor:
    """The stored scale `step` places up (+) or down (-) the format's scale grid: e4m3 bit patterns are ordered
    like their values, so a neighbour is the pattern plus `step` (kept within the positive finite ones); MXFP4's
    neighbours are the powers of two."""
    if step == 0:
        return scale
    if not args.fp4_global:
        return scale * 2.0 ** step
    codes = scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16) + step
    return codes.clamp(1, 0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()


def fp4_group_scales_of(group_absmax: torch.Tensor, args: QuantArgs, global_scale: torch.Tensor | None) -> torch.Tensor:
    """Stored scales (fp32) of given per-group absmax values under the format's rule."""
    if args.fp4_global:
        return nvfp4_group_scales(group_absmax, global_scale)
    return mx_scale_values(mx_exponents(group_absmax))
