"""The fused per-token activation fake quantisation (csrc/cpu/act_quant.cpp) against the eager ATen ops it replaces:
the same values bit for bit, in every dtype, shape and magnitude the runtime and the pipeline feed it."""

from __future__ import annotations

import zlib

import pytest
import torch

from quantkit.quant import QuantArgs
from quantkit.quant.activations import eager_quantize_activation, fused_extension, quantize_activation

pytestmark = pytest.mark.skipif(fused_extension() is None, reason="the fused kernel cannot be built here")

INT8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
FP8 = QuantArgs(num_bits=8, strategy="token", type="float", dynamic=True)


def _x(kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    if kind == "outliers":  # LLM activations: a few channels 100x the rest
        x[..., :: 97] *= 100
    elif kind == "zero rows":
        x.view(-1, shape[-1])[::2] = 0
    elif kind == "tiny":  # scales and codes near the bottom of the dtype (e4m3 subnormals, scale underflow)
        x = x * 1e-30
    elif kind == "wide":  # every binade from 2^-20 to 2^20 in one row: both grids' rounding at every exponent
        x = x * torch.exp2(torch.randint(-20, 21, shape, generator=gen).float())
    return x.to(dtype)


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "zero rows", "tiny", "wide"])
@pytest.mark.parametrize("shape", [(1, 2048), (3, 576), (2, 5, 1536), (128, 320)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("args", [INT8, FP8], ids=["int8", "fp8"])
def test_fused_activation_quantisation_is_the_eager_ops_bit_for_bit(args, dtype, shape, kind):
    x = _x(kind, shape, dtype, torch.Generator().manual_seed(zlib.crc32(f"{kind}{shape}".encode())))
    expected = eager_quantize_activation(x, args)
    got = quantize_activation(x, args)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} of {x.numel()} values differ"


def test_every_e4m3_rounding_boundary_rounds_as_torch_casts():
    """Each value halfway between two e4m3 neighbours (and one fp32 ulp either side), over the whole positive
    and negative range: ties to even and subnormals exactly as torch's float8_e4m3fn cast. A row holding 448
    keeps the scale at 1, so the values reach the rounding step unscaled."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, every code
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid * 2), grid])
    row = torch.cat([torch.tensor([448.0]), vals, -vals])
    got = quantize_activation(row[None], FP8)
    expected = row.to(torch.float8_e4m3fn).float()[None]
    assert torch.equal(got, expected)


def test_autograd_inputs_keep_the_eager_ops():
    x = torch.randn(2, 64, requires_grad=True)
    y = quantize_activation(x, INT8)
    assert y.requires_grad  # the fused kernel is no autograd op: eager ran


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "zero rows", "tiny", "wide"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_int8_codes_are_the_eager_codes_and_scales(dtype, kind):
    """token_codes (the int8 x int8 GEMM's inputs) against activation_codes, the eager quantisation's q and scale."""
    from quantkit.quant.activations import activation_codes, token_codes

    x = _x(kind, (37, 576), dtype, torch.Generator().manual_seed(zlib.crc32(kind.encode())))
    codes, scales = token_codes(x, INT8)
    q, scale, _ = activation_codes(x, INT8)
    assert codes.dtype == torch.int8 and torch.equal(codes, q.to(torch.int8))
    assert torch.equal(scales, scale.float().reshape(-1))


@pytest.mark.parametrize("vectorised", [True, False], ids=["vectorised", "scalar"])
@pytest.mark.parametrize("args", [INT8, FP8], ids=["int8", "fp8"])
def test_every_bf16_mantissa_over_every_scale_mantissa_is_the_eager_ops(args, vectorised):
    """The AVX-512 rows multiply by 1 / scale where the eager op divides (exact after the rounding to bf16, argued in
    act_quant.cpp): every pair of bf16 mantissas, x's and the scale's, both signs, over four binades, on both paths
    of the kernel. The rows' absmax values take every bf16 mantissa, so their scales are every scale a bf16 row can
    have."""
    absmax = torch.cat([torch.arange(128, 256) * 2.0 ** e for e in range(-1, 3)])  # every bf16 value in [64, 1024)
    mantissas = torch.arange(128, 256, dtype=torch.float32)  # x = m * 2^e: every bf16 mantissa
    body = torch.cat([mantissas * 2.0 ** e for e in (-9, -7, -4, -2)])  # below every row's absmax
    x = torch.cat([absmax[:, None], body.expand(len(absmax), -1), -body.expand(len(absmax), -1)], 1).to(torch.bfloat16)
    from quantkit.quant.activations import activation_codes

    q, scale, _ = activation_codes(x, args)
    ext = fused_extension()
    got = ext.fake_quant_token(x, args.type == "float", float(args.qmin), float(args.qmax), float(args.half_range),
                               torch.finfo(x.dtype).eps, vectorised=vectorised)
    assert torch.equal(got, eager_quantize_activation(x, args))
    if args.type == "int":
        codes, scales = ext.token_codes(x, float(args.qmin), float(args.qmax), float(args.half_range),
                                        torch.finfo(x.dtype).eps, vectorised=vectorised)
        assert torch.equal(codes, q.to(torch.int8)) and torch.equal(scales, scale.float().reshape(-1))
