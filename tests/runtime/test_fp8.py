"""fp8 numerics (quantkit.quant.fp8) against plain loops and known bounds."""

import torch

from quantkit.quant.fp8 import block_absmax, dequantize_fp8, expand_block_scale, quantize_fp8_weight


def test_block_absmax_handles_ragged_blocks():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0))
    got = block_absmax(w, (128, 128))
    assert got.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert got[i, j] == w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].abs().max()
    full = expand_block_scale(got, (200, 300))
    assert full.shape == (200, 300) and full[199, 299] == got[1, 2] and full[127, 128] == got[0, 1]


def test_fp8_weight_round_trip_is_within_half_an_fp8_step():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    for strategy in ("tensor", "channel", "block"):
        q, scale = quantize_fp8_weight(w, strategy, block=(32, 64), scale_dtype=torch.float32)
        assert q.dtype == torch.float8_e4m3fn
        full = expand_block_scale(scale, tuple(w.shape), (32, 64)) if strategy == "block" else scale
        back = dequantize_fp8(q, full.reshape(full.shape if strategy != "tensor" else (1, 1)))
        # e4m3 has 3 mantissa bits: relative rounding error at most 2^-4 for normal values.
        rel = ((back - w).abs() / w.abs().clamp_min(1e-3 * float(full.max()) * 448)).max()
        assert rel <= 2**-4 + 1e-6, (strategy, rel)
        assert (q.float().abs().amax() <= 448)
