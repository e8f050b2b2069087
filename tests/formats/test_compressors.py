"""The format registry (quantkit/formats/compressors.py): what the writer plans is what it writes, what it writes
unpacks to the quantised values, and compressed-tensors' own compressors agree with both directions."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationScheme

from quantkit.formats.compressed_tensors import build_quantization_config
from quantkit.formats.compressors import COMPRESSORS, compressor_for
from quantkit.quant.schemes import SCHEMES, get_scheme
from quantkit.quant.weights import dequantize_any, quantize_any

N, K = 44, 256  # 44 rows: 4-bit zero points packed along the output dimension fill 5.5 int32 words
CASES = [(name, 64, False) for name in sorted(SCHEMES)] + [("W4A16", -1, False), ("W4A16_ASYM", -1, False),
                                                            ("W4A16", 64, True), ("W4A16_ASYM", 32, True)]


def _quantised(name: str, group: int, act_order: bool, dtype=torch.bfloat16):
    scheme = get_scheme(name, group)
    gen = torch.Generator().manual_seed(len(name) + group)
    w = torch.randn(N, K, generator=gen) * torch.logspace(-1, 0.5, K)
    q, scale, zp, global_scale = quantize_any(w, scheme.weights, dtype)
    g_idx = None
    if act_order:  # a column permutation's group of each column, as GPTQ's act-order stores it
        g_idx = (torch.randperm(K, generator=gen) // scheme.weights.group_size).to(torch.int32)
    input_scale = torch.tensor([0.02]) if scheme.static_activations else None
    return scheme, q, scale, zp, g_idx, input_scale, global_scale


@pytest.mark.parametrize("name,group,act_order", CASES)
def test_what_is_planned_is_what_is_written_and_unpacks_to_the_values(name, group, act_order):
    scheme, q, scale, zp, g_idx, input_scale, global_scale = _quantised(name, group, act_order)
    c = compressor_for(scheme.format)
    tensors = c.compress(scheme.weights, q, scale, torch.bfloat16, zero_point=zp, g_idx=g_idx, input_scale=input_scale,
                         global_scale=global_scale)
    planned = c.specs(scheme.weights, N, K, torch.bfloat16, scheme.input_activations, g_idx=act_order)
    assert {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()} == planned
    if scheme.weights.is_fp4:  # e2m1 values come back as numbers
        assert torch.equal(c.values(tensors, scheme.weights, K), q)
    else:
        assert torch.equal(c.values(tensors, scheme.weights, K).view(torch.int8), q.view(torch.int8))
    assert torch.equal(c.values(tensors, scheme.weights, K, rows=(8, 20)).view(torch.int8), q[8:20].view(torch.int8))
    if scheme.weights.is_fp4:
        assert torch.equal(c.scale_values(tensors), scale)  # e4m3 values or powers of two, stored exactly
    got_zp = c.zero_point(tensors, scheme.weights, N)
    if scheme.weights.symmetric:
        assert got_zp is None
    else:
        assert torch.equal(got_zp, zp.reshape(N, -1).to(torch.int8))


def _theirs(name: str, group: int) -> tuple[BaseCompressor, QuantizationScheme]:
    group_cfg = build_quantization_config(get_scheme(name, group), [])["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate({k: v for k, v in group_cfg.items() if k != "format"})
    return BaseCompressor.load_from_registry(group_cfg["format"]), scheme


@pytest.mark.parametrize("name,group", [(n, g) for n, g, a in CASES if not a])
def test_compressed_tensors_decompresses_ours_and_compresses_to_ours(name, group):
    scheme, q, scale, zp, _, input_scale, global_scale = _quantised(name, group, False)
    ours = compressor_for(scheme.format).compress(scheme.weights, q, scale, torch.bfloat16, zero_point=zp,
                                                   input_scale=input_scale, global_scale=global_scale)
    compressor, their_scheme = _theirs(name, group)
    dense = dequantize_any(q, scale, zp, scheme.weights, dtype=torch.bfloat16, global_scale=global_scale)
    out = compressor.decompress(dict(ours), their_scheme)
    assert torch.equal(out["weight"].to(torch.bfloat16), dense)
    # And from the dense weight plus our scales and zero points, theirs packs exactly what ours wrote.
    state = {"weight": dense.float(), "weight_scale": ours["weight_scale"]}
    if scheme.weights.is_fp4:  # their fp4 compressors take scales as numbers and the global scale beside them
        state = {"weight": dense.float(), "weight_scale": scale}
        if global_scale is not None:
            state["weight_global_scale"] = global_scale
    if zp is not None:
        state["weight_zero_point"] = zp.reshape(ours["weight_scale"].shape).to(torch.int8)
    theirs = compressor.compress(state, their_scheme)
    key = compressor_for(scheme.format).values_tensor
    if scheme.weights.is_fp4:  # the same numbers; a -0 that rounded from a tiny negative re-quantises to +0
        c = compressor_for(scheme.format)
        assert torch.equal(c.values(theirs, scheme.weights, K), c.values(ours, scheme.weights, K))
    else:
        assert torch.equal(theirs[key].view(torch.int8), ours[key].view(torch.int8))
    if "weight_zero_point" in ours:
        assert torch.equal(theirs["weight_zero_point"], ours["weight_zero_point"])
    if scheme.weights.is_fp4:
        assert torch.equal(theirs["weight_scale"].view(torch.uint8), ours["weight_scale"].view(torch.uint8))


def test_every_runtime_format_is_registered_and_an_unknown_one_names_the_known():
    assert {"pack-quantized", "int-quantized", "naive-quantized", "float-quantized"} <= set(COMPRESSORS)
    with pytest.raises(KeyError, match="known: pack-quantized"):
        compressor_for("marlin-24")
