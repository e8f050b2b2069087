"""fp8 numerics against torch's own float8 dtypes, and block scales on ragged shapes."""

import pytest
import torch

from quantkit.formats.compressed_tensors import quantized_specs
from quantkit.quant.fp8 import (
    FP8_DTYPES,
    block_absmax,
    dequantize_fp8,
    expand_block_scale,
    fp8_max,
    quantize_fp8,
    quantize_fp8_weight,
)
from quantkit.quant.schemes import block_fallback, get_scheme
from quantkit.quant.weights import dequantize_any, quantize_any


@pytest.mark.parametrize("fmt,maxval", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_cast_matches_torch_round_trip(fmt, maxval):
    dtype = FP8_DTYPES[fmt]
    assert fp8_max(dtype) == maxval
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 100
    x = torch.cat([x, torch.tensor([maxval, -maxval, 1e6, -1e6, 0.0])])
    q = quantize_fp8(x, torch.tensor(1.0), dtype)
    assert q.dtype == dtype
    # Identical to torch's own cast of the clamped value (round to nearest even), saturating at +-max.
    expected = torch.clamp(x, -maxval, maxval).to(dtype)
    assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
    assert q.float().abs().max() == maxval
    # Values already on the grid survive quantise -> dequantise exactly.
    on_grid = expected.float()
    assert torch.equal(dequantize_fp8(quantize_fp8(on_grid, torch.tensor(1.0), dtype), torch.tensor(1.0)), on_grid)


@pytest.mark.parametrize("shape", [(576, 576), (200, 300), (128, 256), (1, 129), (1536, 576)])
def test_block_scale_shape_padding_and_ragged_edges(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_fp8_weight(w, "block", (128, 128), scale_dtype=torch.float32)
    rows, cols = -(-shape[0] // 128), -(-shape[1] // 128)
    assert scale.shape == (rows, cols) and q.shape == w.shape
    # Each block's scale is its own absmax / 448, the ragged last blocks included (no padding leaks in).
    for i in range(rows):
        for j in range(cols):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert torch.isclose(scale[i, j], blk.abs().max() / 448, rtol=1e-6)
    # The largest element of each block lands exactly on +-448.
    full = expand_block_scale(scale, shape)
    assert torch.allclose((q.float() * full).abs().amax(), w.abs().amax(), rtol=1e-6)
    back = dequantize_any(q, scale, None, get_scheme("FP8_BLOCK").weights)
    assert ((back - w).abs() <= full * 448 * 2**-4 + 1e-12).all()  # half an e4m3 step of the block's range
    # On disk the scale has the same ceil shape (what compressed-tensors and vLLM allocate).
    specs = quantized_specs("m", shape[0], shape[1], get_scheme("FP8_BLOCK"), torch.bfloat16)
    assert [s.shape for s in specs if s.name == "m.weight_scale"] == [(rows, cols)]


def test_block_absmax_matches_explicit_padding():
    w = torch.randn(130, 257, generator=torch.Generator().manual_seed(2))
    padded = torch.zeros(256, 384)
    padded[:130, :257] = w.abs()
    expected = padded.reshape(2, 128, 3, 128).amax(dim=(1, 3))
    assert torch.equal(block_absmax(w), expected)


@pytest.mark.parametrize("scheme", ["FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_quantize_any_scale_layouts(scheme):
    args = get_scheme(scheme).weights
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(3))
    q, scale, zp, global_scale = quantize_any(w, args, torch.bfloat16)
    assert zp is None and global_scale is None and q.dtype == torch.float8_e4m3fn
    assert scale.shape == {"tensor": (1,), "channel": (300, 1), "block": (3, 2)}[args.strategy]
    assert torch.equal(scale, scale.to(torch.bfloat16).float())  # rounded to the checkpoint dtype first


def test_block_fallback_only_for_ragged_k():
    block = get_scheme("FP8_BLOCK")
    assert block_fallback(block, 1536) is None
    assert block_fallback(block, 576).name == "FP8_DYNAMIC"
    assert block_fallback(get_scheme("FP8_DYNAMIC"), 576) is None
