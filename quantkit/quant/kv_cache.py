"""An fp8 (e4m3) KV cache with calibrated static scales, as compressed-tensors' `kv_cache_scheme` describes it
and vLLM serves it.

Keys (after RoPE, as the engines store them) and values are divided by a stored scale, clamped to +-448 and cast
to e4m3 on their way into the cache, and multiplied back on their way out. The scale is absmax / 448 over the
calibration tokens, one per attention layer ("tensor") or one per KV head ("attn_head").
"""

from __future__ import annotations

import torch

from quantkit.errors import InputError
from quantkit.quant.args import FP8_MAX

# --kv-cache value -> compressed-tensors strategy
KV_CACHE_MODES = {"fp8": "tensor", "fp8-head": "attn_head"}


def kv_strategy(mode: str) -> str:
    try:
        return KV_CACHE_MODES[mode]
    except KeyError:
        raise InputError(f"unknown --kv-cache {mode!r}; valid: {', '.join(KV_CACHE_MODES)}") from None


def kv_cache_scheme(mode: str) -> dict:
    """config.json's `kv_cache_scheme`, field for field what compressed-tensors' QuantizationArgs dumps."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": kv_strategy(mode),
            "dynamic": False, "observer": "minmax"}


def head_absmax(states: torch.Tensor) -> torch.Tensor:
    """fp32 [H]: absmax per head of [B, H, L, D] key or value states."""
    return states.detach().abs().amax(dim=(0, 2, 3)).float()


def kv_scale(absmax: torch.Tensor, strategy: str, dtype: torch.dtype) -> torch.Tensor:
    """The stored scale from per-head absmax [H]: [1] (tensor) or [H, 1, 1] (attn_head, compressed-tensors' and
    vLLM's layout), absmax / 448 rounded to the checkpoint dtype; a zero becomes the dtype's eps."""
    a = absmax.float().amax().reshape(1) if strategy == "tensor" else absmax.float().reshape(-1, 1, 1)
    scale = a / FP8_MAX
    scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)
    return scale.to(dtype)


def fake_quantize_kv(states: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, H, L, D] states through an e4m3 cache under a [1] or [H, 1, 1] scale, returned in the states' dtype.
    Divided and multiplied back in fp32, as vLLM's cache kernels convert each element."""
    s = scale.to(device=states.device, dtype=torch.float32)
    s = s.reshape(1) if s.numel() == 1 else s.reshape(1, -1, 1, 1)
    q = torch.clamp(states.float() / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(states.dtype)
