"""Integer quantisation against compressed-tensors' own qparams/quantize/dequantize."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from quantkit.quant import QuantArgs, fake_quantize, quantize_weight
from quantkit.quant.integer import dequantize_weight, dequantize_weight_args, weight_qparams
from quantkit.quant.schemes import get_scheme
from quantkit.errors import InputError


def _ct_args(a: QuantArgs) -> QuantizationArgs:
    return QuantizationArgs(num_bits=a.num_bits, type="int", symmetric=a.symmetric, strategy=a.strategy,
                            group_size=a.group_size if a.strategy == "group" else None)


CASES = [
    QuantArgs(4, True, "group", 32),
    QuantArgs(4, False, "group", 64),
    QuantArgs(8, True, "channel", None),
    QuantArgs(4, False, "channel", None),
    QuantArgs(3, True, "group", 16),
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: f"{a.num_bits}b-{'sym' if a.symmetric else 'asym'}-{a.strategy}")
def test_qparams_and_roundtrip_match_compressed_tensors(args):
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.rand(48, 1) * 3
    w[0, :16] = 0.5  # an all-positive group: zero must still be representable
    scale, zp = weight_qparams(w, args)
    grouped = w.reshape(48, -1, args.group_size) if args.strategy == "group" else w.reshape(48, 1, -1)
    ct_scale, ct_zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), _ct_args(args))
    assert torch.allclose(scale, ct_scale, rtol=0, atol=0)
    if not args.symmetric:
        assert torch.equal(zp.to(torch.int32), ct_zp.to(torch.int32))
    q, s, z = quantize_weight(w, args, scale_dtype=torch.float32)
    ct_q = ct_quantize(w, s, None if args.symmetric else z, _ct_args(args), dtype=torch.int8)
    assert torch.equal(q, ct_q)
    ours = dequantize_weight(q, s, z, args, torch.float32)
    theirs = ct_dequantize(q, s, None if args.symmetric else z, _ct_args(args))
    assert torch.allclose(ours, theirs.float(), atol=0, rtol=0)


def test_fake_quantize_error_bound():
    """Round-to-nearest error is at most half a step per element."""
    torch.manual_seed(1)
    w = torch.randn(32, 256)
    args = QuantArgs(4, True, "group", 64)
    scale, _ = weight_qparams(w, args)
    err = (fake_quantize(w, args) - w).abs().reshape(32, 4, 64)
    assert (err <= scale.unsqueeze(-1) / 2 + 1e-6).all()


def test_g_idx_dequantisation_uses_each_columns_group():
    torch.manual_seed(2)
    args = QuantArgs(4, False, "group", 8)
    q = torch.randint(-8, 8, (4, 32), dtype=torch.int8)
    scale = torch.rand(4, 4) + 0.1
    zp = torch.randint(-8, 8, (4, 4), dtype=torch.int8)
    g_idx = torch.randperm(32) % 4
    out = dequantize_weight_args(q, scale, zp, args, g_idx)
    for j in range(32):
        g = int(g_idx[j])
        assert torch.allclose(out[:, j], (q[:, j].float() - zp[:, g].float()) * scale[:, g])


def test_scheme_errors():
    with pytest.raises(InputError, match="valid schemes"):
        get_scheme("W3A3")
    with pytest.raises(InputError, match="invalid group size"):
        get_scheme("W4A16", 0)
    assert get_scheme("w4a16", -1).weights.strategy == "channel"


def test_fake_quantize_in_a_checkpoint_dtype_matches_the_stored_values():
    # What AWQ's search scores must be what the checkpoint holds: scale and dequantised value rounded to bf16.
    from quantkit.quant.weights import dequantize_any, quantize_any

    w = torch.randn(16, 64)
    for args in (QuantArgs(4, True, "group", 32), QuantArgs(4, False, "group", 32), QuantArgs(8, True, "channel", None)):
        q, scale, zp, _ = quantize_any(w, args, torch.bfloat16)
        ref = dequantize_any(q, scale, zp, args).to(torch.bfloat16).float()
        torch.testing.assert_close(fake_quantize(w, args, torch.bfloat16), ref, rtol=0, atol=0)
