"""Floating-point 8-bit numerics (compressed-tensors / vLLM conventions), as pure functions.

Scale = absmax / fp8_max (e4m3: 448, e5m2: 57344), a zero scale becomes the dtype's eps; quantise is
clamp(x / scale, -max, max) cast to the fp8 dtype (round to nearest even); dequantise is q * scale in the
scale's dtype. Scales come per tensor, per row (channel / token), per group of the last dimension, or per
2-D block, where a ragged last group or block simply covers fewer elements.
"""

from __future__ import annotations

import torch

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_max(dtype: torch.dtype = torch.float8_e4m3fn) -> float:
    return float(torch.finfo(dtype).max)


def scale_from_absmax(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    """absmax / qmax in absmax's dtype; zero scales (all-zero rows) become eps so division stays finite."""
    scale = absmax / qmax
    eps = torch.finfo(scale.dtype).eps
    return torch.where(scale == 0, torch.full_like(scale, eps), scale)


def token_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax: reduce the last dimension, keep it (shape [..., 1])."""
    return x.abs().amax(dim=-1, keepdim=True)


def group_absmax(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """Absmax per group of `group_size` along the last dimension: [..., n_groups, 1] over the unflattened view."""
    if x.shape[-1] % group_size:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of group size {group_size}")
    return x.unflatten(-1, (-1, group_size)).abs().amax(dim=-1, keepdim=True)


def block_absmax(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Absmax per [bh, bw] block of a 2-D weight: [ceil(R/bh), ceil(C/bw)]; ragged edge blocks are smaller."""
    rows, cols = weight.shape
    bh, bw = block
    pr, pc = -rows % bh, -cols % bw
    padded = torch.nn.functional.pad(weight.abs(), (0, pc, 0, pr))  # zeros never raise an absmax
    return padded.reshape((rows + pr) // bh, bh, (cols + pc) // bw, bw).amax(dim=(1, 3))


def expand_block_scale(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """[ceil(R/bh), ceil(C/bw)] block scales -> one scale per element of an [R, C] weight."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:rows, :cols]


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """x / scale clamped to the fp8 range and rounded to the fp8 grid (computed in x's dtype, as consumers do)."""
    m = fp8_max(dtype)
    return torch.clamp(x / scale, -m, m).to(dtype)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """q * scale in the scale's dtype (fp8 -> bf16/fp32 is exact), then cast to `dtype` if given."""
    out = q.to(scale.dtype) * scale
    return out if dtype is None else out.to(dtype)


def quantize_fp8_weight(
    weight: torch.Tensor, strategy: str = "channel", block: tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.float8_e4m3fn, scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise an [out, in] weight to fp8 with a tensor / channel / block scale. Returns (q, scale).

    Scale shapes follow compressed-tensors: tensor [1], channel [out, 1], block [ceil(out/bh), ceil(in/bw)].
    The scale is rounded to `scale_dtype` (default the weight's) before the weight is divided by it.
    """
    scale_dtype = scale_dtype or weight.dtype
    w = weight.float()
    if strategy == "tensor":
        absmax = w.abs().amax().reshape(1)
    elif strategy == "channel":
        absmax = token_absmax(w)
    elif strategy == "block":
        absmax = block_absmax(w, block)
    else:
        raise ValueError(f"unknown fp8 weight strategy {strategy!r}")
    scale = scale_from_absmax(absmax, fp8_max(dtype)).to(scale_dtype)
    full = expand_block_scale(scale, tuple(w.shape), block) if strategy == "block" else scale
    return quantize_fp8(w, full.float(), dtype), scale
