"""The fp8 KV cache: its rounding against a plain nearest-value implementation, its config against
compressed-tensors' own model."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs

from quantkit.errors import InputError
from quantkit.quant.kv_cache import fake_quantize_kv, kv_cache_scheme, kv_scale


def _e4m3_table() -> tuple[torch.Tensor, torch.Tensor]:
    """Every finite non-negative e4m3 value (float64) and whether its bit pattern is even (mantissa LSB 0)."""
    codes = torch.arange(127, dtype=torch.int32)  # 0x7f is NaN
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).double()
    return values, codes % 2 == 0


def _plain(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|x| / scale to the nearest e4m3 value by distance to every one, a tie to the even bit pattern (IEEE
    round-to-nearest-even), saturating at 448; sign put back, times the scale, in float64, cast to x's dtype."""
    values, even = _e4m3_table()
    s = scale.double().reshape(1, -1, 1, 1) if scale.numel() > 1 else scale.double().reshape(1)
    y = (x.double() / s).clamp(-448, 448)
    dist = (y.abs().reshape(-1, 1) - values.reshape(1, -1)).abs()
    best = dist.min(dim=1, keepdim=True).values
    # among the nearest (one, or two at a tie) prefer an even pattern
    score = (dist == best).double() * 2 + even.double().reshape(1, -1)
    nearest = values[score.argmax(dim=1)].reshape(y.shape)
    return (torch.copysign(nearest, y) * s).to(x.dtype)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_fake_quantised_cache_is_the_nearest_e4m3_value_times_the_scale(strategy):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 4, 9, 16, generator=g) * torch.tensor([0.5, 2.0, 8.0, 30.0]).reshape(1, 4, 1, 1)
    scale = kv_scale(k.abs().amax(dim=(0, 2, 3)), strategy, torch.float32)
    assert scale.shape == ((1,) if strategy == "tensor" else (4, 1, 1))
    got = fake_quantize_kv(k, scale)
    assert torch.allclose(got, _plain(k, scale), rtol=0, atol=0)
    # the largest value of each head (or of the tensor) lands on 448 * scale: nothing clips
    assert (got.abs().amax() - k.abs().amax()).abs() <= 1e-6 * k.abs().amax()


def test_scale_is_rounded_to_the_checkpoint_dtype_and_never_zero():
    s = kv_scale(torch.tensor([0.0, 3.0]), "attn_head", torch.bfloat16)
    assert s.dtype == torch.bfloat16 and bool((s > 0).all())
    assert s[1].item() == torch.tensor(3.0 / 448).to(torch.bfloat16).item()


@pytest.mark.parametrize("mode", ["fp8", "fp8-head"])
def test_kv_cache_scheme_is_what_compressed_tensors_validates_and_dumps(mode):
    ours = kv_cache_scheme(mode)
    assert QuantizationArgs.model_validate(ours).model_dump() == ours


def test_unknown_mode_is_one_clear_line():
    with pytest.raises(InputError, match="valid: fp8, fp8-head"):
        kv_cache_scheme("int8")
