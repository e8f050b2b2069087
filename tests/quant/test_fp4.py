"""fp4 (e2m1) numerics against compressed-tensors' own functions: rounding, packing, NVFP4 global and group
scales, MXFP4 e8m0 exponents, the compressors' stored tensors and activation fake-quantisation."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import (
    pack_fp4_to_uint8,
    quantize_and_pack_fp4,
    unpack_fp4_from_uint8,
)
from compressed_tensors.quantization import QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp, generate_gparam
from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

from quantkit.formats.compressors import compressor_for
from quantkit.quant.fp4 import (
    fake_quantize_fp4_activation,
    pack_e2m1,
    quantize_fp4_weight,
    round_to_e2m1,
    unpack_e2m1,
)
from quantkit.quant.schemes import get_scheme


def _adversarial(n: int = 4096, seed: int = 0) -> torch.Tensor:
    """Every rounding midpoint and grid value with both signs, signed zeros, values beyond +-6, plus noise."""
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 100.0])
    edges = torch.cat([grid, -grid, torch.tensor([-0.0, 1e-30, -1e-30, 0.2499, 0.2501, 4.999, 5.001])])
    noise = torch.randn(n - edges.numel(), generator=torch.Generator().manual_seed(seed)) * 3
    return torch.cat([edges, noise])


def _weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :40] = 0.0  # an all-zero group (and more)
    w[1, 3] = 2.5  # an outlier that sets the tensor's absmax
    w[2] *= 1e-6  # a row of tiny values
    return w


def test_rounding_to_e2m1_is_compressed_tensors_cast():
    x = _adversarial()
    ours, theirs = round_to_e2m1(x.clamp(-6, 6)), cast_to_fp4(x.clamp(-6, 6).clone())
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))  # negative zeros included


def test_packing_matches_compressed_tensors_both_ways():
    values = round_to_e2m1(_adversarial().clamp(-6, 6)).reshape(64, 64)
    packed = pack_e2m1(values)
    assert torch.equal(packed, pack_fp4_to_uint8(values))
    assert torch.equal(unpack_e2m1(packed), unpack_fp4_from_uint8(packed, 64, 64, dtype=torch.float32))


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_weight_scales_and_codes_are_compressed_tensors(scheme):
    w = _weight(48, 256, seed=1)
    args = get_scheme(scheme).weights
    theirs_args = preset_name_to_scheme(scheme, ["Linear"]).weights
    q, scale, global_scale = quantize_fp4_weight(w, args)
    grouped = w.unflatten(-1, (-1, args.group_size))
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    if args.fp4_global:
        g_theirs = generate_gparam(w.min(), w.max())
        assert torch.equal(global_scale, g_theirs)
    else:
        g_theirs = None
        assert global_scale is None
    s_theirs, _ = calculate_qparams(lo, hi, theirs_args, global_scale=g_theirs)
    assert torch.equal(scale, s_theirs.float())
    packed = quantize_and_pack_fp4(w, s_theirs, global_scale=g_theirs, group_size=args.group_size)
    assert torch.equal(pack_e2m1(q), packed)


@pytest.mark.parametrize("scheme,theirs", [("NVFP4A16", NVFP4PackedCompressor), ("MXFP4A16", MXFP4PackedCompressor)])
def test_stored_tensors_are_what_compressed_tensors_compresses_and_decompress_alike(scheme, theirs):
    w = _weight(32, 128, seed=2)
    ours_scheme = get_scheme(scheme)
    q, scale, global_scale = quantize_fp4_weight(w, ours_scheme.weights)
    stored = compressor_for(ours_scheme.format).compress(ours_scheme.weights, q, scale, torch.bfloat16,
                                                         global_scale=global_scale)
    ct_scheme = QuantizationScheme(targets=["Linear"], **preset_name_to_scheme(scheme, ["Linear"]).model_dump(
        exclude={"targets"}))
    state = {"weight": w, "weight_scale": scale}
    if global_scale is not None:
        state["weight_global_scale"] = global_scale
    expected = theirs.compress(state, ct_scheme)
    assert set(stored) == set(expected)
    for name, t in expected.items():
        assert stored[name].dtype == t.dtype and torch.equal(stored[name], t), name
    # And back: compressed-tensors' decompression of our tensors equals our dequantisation.
    from quantkit.quant.weights import dequantize_any

    dense = theirs.decompress(dict(stored), ct_scheme)["weight"]  # in bf16, the dtype the values unpack into
    ours = dequantize_any(q, scale, None, ours_scheme.weights, global_scale=global_scale, dtype=dense.dtype)
    assert torch.equal(dense, ours)


@pytest.mark.parametrize("scheme", ["NVFP4", "MXFP4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_fake_quantisation_is_compressed_tensors(scheme, dtype):
    x = (torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    x[0, 0, :16] = 0  # a zero group
    args = get_scheme(scheme).input_activations
    theirs_args = preset_name_to_scheme(scheme, ["Linear"]).input_activations
    global_scale = generate_gparam(x.float().min(), x.float().max()) if args.fp4_global else None
    module = torch.nn.Linear(64, 4)
    scale, zp = compute_dynamic_scales_and_zp(x, theirs_args, module, global_scale=global_scale)
    theirs = fake_quantize(x, scale, None, theirs_args, global_scale=global_scale)
    ours = fake_quantize_fp4_activation(x, args, global_scale)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("scheme", ["NVFP4A16", "MXFP4A16"])
def test_scale_search_never_loses_to_the_plain_scale_and_follows_the_importance(scheme):
    from quantkit.quant.fp4 import dequantize_fp4, fp4_global_scale, quantize_fp4, search_fp4_scales

    args = get_scheme(scheme).weights
    g = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=g) * 0.05
    w[:, 7] *= 12  # an outlier column
    importance = torch.rand(256, generator=g) + 0.01
    gs = fp4_global_scale(w, args)

    def error(scale, imp):
        deq = dequantize_fp4(quantize_fp4(w, scale, args.group_size, gs), scale, args.group_size, gs)
        return float(((deq - w) ** 2 * imp).sum())

    plain = quantize_fp4_weight(w, args)[1]
    for imp in (None, importance):
        searched = search_fp4_scales(w, args, gs, imp)
        weights = torch.ones(256) if imp is None else imp
        assert error(searched, weights) < error(plain, weights)
    # Weighting by importance lowers the weighted error below the unweighted search's choice.
    assert error(search_fp4_scales(w, args, gs, importance), importance) <= \
        error(search_fp4_scales(w, args, gs), importance)
