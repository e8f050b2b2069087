"""Reference numerics against independent implementations: compressed-tensors' own unpacker and
fake-quantiser, and plain per-column / per-row loops."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

from quantkit.quant import QuantArgs, pack_int32, quantize_weight
from quantkit.runtime import dispatch, reference
from quantkit.quant.args import QuantArgs
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.linear import QuantLinear


def _packed_layer(w, bits, symmetric, group, g_idx=None, dtype=torch.bfloat16):
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy="group" if group else "channel", group_size=group)
    q, scale, zp = quantize_weight(w, args, scale_dtype=dtype)
    tensors = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.reshape(w.shape[0], -1),
               "weight_shape": torch.tensor(w.shape)}
    if not symmetric:
        tensors["weight_zero_point"] = pack_int32(zp.reshape(w.shape[0], -1).to(torch.int8), bits, packed_dim=0)
    if g_idx is not None:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    fmt = LinearFormat("pack-quantized", QuantArgs(num_bits=bits, symmetric=symmetric,
                                                   strategy="group" if group else "channel", group_size=group))
    return QuantLinear(fmt, tensors, w.shape[1], w.shape[0]), q, scale.reshape(w.shape[0], -1), zp.reshape(w.shape[0], -1)


@pytest.mark.parametrize("bits,symmetric,group", [(4, True, 32), (4, False, 32), (8, True, None), (4, True, None), (8, False, 16)])
def test_pack_quantized_dequant_matches_compressed_tensors_unpacker(bits, symmetric, group):
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer, _, scale, _ = _packed_layer(w, bits, symmetric, group)
    q = unpack_from_int32(layer.weight_packed, bits, torch.Size(w.shape))
    if symmetric:
        zp = torch.zeros_like(scale)
    else:
        zp = unpack_from_int32(layer.weight_zero_point, bits, torch.Size(scale.shape), packed_dim=0)
    reps = group or w.shape[1]
    expected = (q.to(scale.dtype) - zp.to(scale.dtype).repeat_interleave(reps, 1)) * scale.repeat_interleave(reps, 1)
    assert torch.equal(reference.dequantize_weight(layer), expected)


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_g_idx_uses_the_indexed_group_per_column(symmetric):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=gen).to(torch.bfloat16)
    # Columns are assigned to groups in a permuted order (act-order): column j belongs to group g_idx[j].
    g_idx = (torch.randperm(64, generator=gen) // 16).to(torch.int32)
    layer, q, scale, zp = _packed_layer(w, 4, symmetric, 16, g_idx=g_idx)
    got = reference.dequantize_weight(layer)
    for j in range(64):
        g = int(g_idx[j])
        col = q[:, j].to(torch.bfloat16)
        if not symmetric:
            col = col - zp[:, g].to(torch.bfloat16)
        assert torch.equal(got[:, j], col * scale[:, g]), f"column {j}"


def _ct_args(**kw):
    return QuantizationArgs(symmetric=True, **kw)


@pytest.mark.parametrize("kind,strategy,group", [("int", "token", None), ("float", "token", None),
                                                 ("float", "group", 128), ("int", "tensor", None)])
def test_dynamic_activation_quant_matches_compressed_tensors(kind, strategy, group):
    x = (torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    x[0, 0, 7], x[1, 2, :] = 40.0, 0.0  # an outlier, and an all-zero token (eps scale)
    ct = _ct_args(num_bits=8, type=kind, strategy=strategy, group_size=group, dynamic=True)
    scale, zp = compute_dynamic_scales_and_zp(x, ct, module=None)
    expected = fake_quantize(x, scale, zp, ct)
    mine = QuantArgs(num_bits=8, strategy=strategy, group_size=group, type=kind, dynamic=True)
    assert torch.equal(reference.quantize_activation(x, mine), expected)


def test_ragged_activation_group_is_quantised_on_its_own():
    # K = 576 with 1x128 groups (SmolLM2's hidden size): four full groups and a last one of 64 columns.
    x = (torch.randn(2, 3, 576, generator=torch.Generator().manual_seed(6)) * 3).to(torch.bfloat16)
    x[0, 1, 550] = 60.0  # an outlier in the ragged group must not leak into the full groups
    got = reference.quantize_activation(x, QuantArgs(num_bits=8, type="float", dynamic=True))
    assert got.shape == x.shape
    ct = _ct_args(num_bits=8, type="float", strategy="token", dynamic=True)
    for start in range(0, 576, 128):
        part = x[..., start:start + 128].contiguous()
        scale, zp = compute_dynamic_scales_and_zp(part, ct, module=None)
        assert torch.equal(got[..., start:start + 128], fake_quantize(part, scale, zp, ct)), f"group at {start}"


@pytest.mark.parametrize("kind", ["int", "float"])
def test_static_activation_quant_matches_compressed_tensors(kind):
    x = (torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    input_scale = torch.tensor([0.0123], dtype=torch.bfloat16)
    ct = _ct_args(num_bits=8, type=kind, strategy="tensor", dynamic=False)
    expected = fake_quantize(x, input_scale, torch.zeros(1, dtype=torch.int8 if kind == "int" else torch.bfloat16), ct)
    got = reference.quantize_activation(x, QuantArgs(num_bits=8, strategy="tensor", type=kind), input_scale)
    assert torch.equal(got, expected)


def test_int8_activation_quant_against_a_plain_loop():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = reference.quantize_activation(x, QuantArgs(num_bits=8, strategy="token", dynamic=True))
    for r in range(4):
        s = x[r].abs().max() / 127.5  # bf16 arithmetic, as the consumer computes
        for c in range(32):
            q = torch.round(torch.clamp(x[r, c] / s, -128, 127))
            assert got[r, c] == q * s


class _PlusOne:
    """A test kernel: the reference product plus one, so its output is recognisable."""

    name = "plus-one"

    def supports(self, fmt, device, shape, dtype):
        return fmt.kind == "w4a16"

    def prepare(self, layer):
        from quantkit.runtime.kernels.base import Prepared

        p = Prepared(layer.in_features, layer.out_features, None)
        p.weight = reference.dequantize_weight(layer)  # a test kernel may hold what it likes
        return p

    def run(self, x, p):
        return torch.nn.functional.linear(x, p.weight) + 1


class _Refuses(_PlusOne):
    name = "refuses"

    def prepare(self, layer):
        from quantkit.runtime.kernels.base import NotSupported

        raise NotSupported("never")


def test_dispatch_routes_to_the_first_kernel_that_prepares_and_reference_can_be_forced(monkeypatch):
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x = torch.randn(2, 32).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x, reference.dequantize_weight(_packed_layer(w, 4, True, 16)[0]))
    dispatch.register_kernel(_Refuses(), "cpu", priority=-2)  # tried first, refuses at prepare
    dispatch.register_kernel(_PlusOne(), "cpu", priority=-1)
    try:
        layer = _packed_layer(w, 4, True, 16)[0]
        assert dispatch.prepare_layer(layer) == ("plus-one", None)
        assert layer.weight_packed is None and layer.weight_scale is None  # checkpoint tensors released
        assert torch.equal(layer(x), expected + 1)
        forced = _packed_layer(w, 4, True, 16)[0]
        monkeypatch.setenv("QUANTKIT_REFERENCE", "1")
        assert dispatch.prepare_layer(forced) == ("reference", None)
        assert torch.equal(forced(x), expected) and forced.weight_packed is not None
    finally:
        dispatch.unregister_kernel("plus-one", "cpu")
        dispatch.unregister_kernel("refuses", "cpu")
    assert torch.equal(_packed_layer(w, 4, True, 16)[0](x), expected)  # unprepared: the reference


def test_reference_in_row_blocks_matches_one_dense_product(monkeypatch):
    # Large layers are dequantised a block of output rows at a time; every output still sums the same terms.
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(48, 64, generator=gen)
    g_idx = (torch.randperm(64, generator=gen) // 16).to(torch.int32)
    layer = _packed_layer(w, 4, False, 16, g_idx=g_idx, dtype=torch.float32)[0]
    layer.bias = torch.nn.Parameter(torch.randn(48, generator=gen), requires_grad=False)
    x = torch.randn(3, 5, 64, generator=gen)
    whole = reference.linear(x, layer)
    monkeypatch.setattr(reference, "TILE_ELEMENTS", 64 * 7)  # 7 rows a block: ragged last block
    blocks = reference.linear(x, layer)
    # fp32: only the BLAS blocking may differ (sums of 64 terms of size ~1: a few 1e-6 at most); a wrong row
    # block or bias slice moves outputs by ~1.
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=2e-5)
    assert torch.equal(whole, torch.nn.functional.linear(x, reference.dequantize_weight(layer), layer.bias))
