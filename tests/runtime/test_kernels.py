"""CPU kernels against an independent oracle: the reference dequantisation of the same layer followed by a
float64 matmul; which kernel serves which format; the resident-memory bound; the reference fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quantkit.quant import QuantArgs, pack_int32, quantize_weight
from quantkit.quant.activations import quantize_activation
from quantkit.quant.fp8 import quantize_fp8_weight
from quantkit import progress
from quantkit.runtime import dispatch, load_model, reference
from quantkit.quant.args import QuantArgs
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.linear import QuantLinear
from quantkit.runtime.kernels import base
from quantkit.runtime.kernels.torch_cpu import int_mm_is_exact

TOKEN_INT8 = QuantArgs(num_bits=8, strategy="token", dynamic=True)
TENSOR_INT8 = QuantArgs(num_bits=8, strategy="tensor")
TENSOR_INT8_ASYM = QuantArgs(num_bits=8, symmetric=False, strategy="tensor")
GROUP_INT8 = QuantArgs(num_bits=8, group_size=32, dynamic=True)
TOKEN_FP8 = QuantArgs(num_bits=8, strategy="token", type="float", dynamic=True)
TENSOR_FP8 = QuantArgs(num_bits=8, strategy="tensor", type="float")
GROUP_FP8 = QuantArgs(num_bits=8, type="float", dynamic=True)


def _calibration(k: int, dtype) -> torch.Tensor:
    return (torch.randn(64, k, generator=torch.Generator().manual_seed(99)) * 2).to(dtype)


def _static_inputs(act: QuantArgs, k: int, dtype) -> dict:
    """input_scale (and zero point) from a calibration batch, as a static checkpoint stores them."""
    x = _calibration(k, torch.float32)
    if act.symmetric:
        scale = x.abs().max() / act.half_range
        return {"input_scale": scale.reshape(1).to(dtype)}
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / 255
    zp = torch.round(-128 - lo / scale).clamp(-128, 127).to(torch.int8)
    return {"input_scale": scale.reshape(1).to(dtype), "input_zero_point": zp.reshape(1)}


def int_layer(n, k, bits, symmetric, group=None, act_order=False, fmt="pack-quantized", act=None, *, dtype,
              seed=0) -> QuantLinear:
    """A compressed-tensors int linear: quantkit's quantiser and packer (tested against compressed-tensors'
    unpacker in test_reference.py). act_order: columns join groups in a random order, as GPTQ writes them."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.linspace(0.2, 2.0, k)  # unequal column ranges
    strategy = "group" if group else "channel"
    args = QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group)
    perm = torch.randperm(k, generator=gen) if act_order else torch.arange(k)
    inv = torch.argsort(perm)
    # Group g is the columns perm[g*group:(g+1)*group]: quantise the permuted weight, then undo the permutation.
    q, scale, zp = quantize_weight(w[:, perm].to(dtype), args, scale_dtype=dtype)
    q = q[:, inv].contiguous()
    scale, zp = scale.reshape(n, -1), zp.reshape(n, -1)
    t = {"weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if fmt == "pack-quantized":
        t["weight_packed"] = pack_int32(q, bits)
        if not symmetric:
            t["weight_zero_point"] = pack_int32(zp.to(torch.int8), bits, packed_dim=0)
    else:
        t["weight"] = q
        if not symmetric:
            t["weight_zero_point"] = zp.to(torch.int8)
    if act_order:
        t["weight_g_idx"] = (inv // group).to(torch.int32)
    if act is not None and not act.dynamic:
        t.update(_static_inputs(act, k, dtype))
    lf = LinearFormat(fmt, QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=group,
                                     actorder="group" if act_order else None), act)
    bias = torch.randn(n, generator=gen).to(dtype)
    return QuantLinear(lf, t, k, n, bias, dtype)


def fp8_layer(n, k, strategy, act, *, dtype, seed=0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    # Rows and columns over four decades, so some weights land on e4m3 subnormals.
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, k) * torch.logspace(0, -1, n)[:, None]
    q, scale = quantize_fp8_weight(w, strategy, (128, 128), scale_dtype=dtype)
    t = {"weight": q, "weight_scale": scale if strategy != "tensor" else scale.reshape(1)}
    if act is not None and not act.dynamic:
        t.update(_static_inputs(act, k, dtype))
    lf = LinearFormat("float-quantized", QuantArgs(num_bits=8, strategy=strategy, type="float", block=(128, 128)), act)
    return QuantLinear(lf, t, k, n, None, dtype)


# name -> (builder, {activation dtype: the kernel expected to serve it}). Shapes cover what torch's ops refuse:
# out not a multiple of 16, odd or ragged K, groups of 16, K=576-like widths that 128-blocks do not divide.
I4, I8, CPP, DOT = "torch-int4pack", "torch-int8pack", "cpu-dequant", "cpu-int4dot"
# torch._int_mm is exact only where oneDNN has more than AVX2 (see test_int_mm_probe_matches_an_exact_product)
MM = "torch-int-mm" if int_mm_is_exact() else CPP
W8, F8 = "cpu-int8dot", "cpu-fp8dot"


def _int8dot(otherwise):
    """cpu-int8dot where its AVX2 or AVX512-VNNI path runs (it is offered to bf16 / fp16 activations only), else
    `otherwise`."""
    from quantkit.runtime.kernels import cpp

    return W8 if cpp.extension() is not None and cpp.dot_isa() != cpp.ISA_SCALAR else otherwise


def _fp8dot():
    from quantkit.runtime.kernels import cpp

    return F8 if cpp.extension() is not None and cpp.fp8_isa() == cpp.ISA_BF16 else CPP


F8_BF = _fp8dot()
BF, FP = torch.bfloat16, torch.float32
CASES = {
    "w4_sym_g32": (lambda d: int_layer(64, 128, 4, True, 32, dtype=d), {BF: I4, FP: CPP}),
    "w4_asym_g32": (lambda d: int_layer(48, 128, 4, False, 32, dtype=d), {BF: I4, FP: CPP}),
    "w4_asym_g64_act_order": (lambda d: int_layer(32, 256, 4, False, 64, act_order=True, dtype=d), {BF: DOT, FP: DOT}),
    "w4_sym_channel_k576": (lambda d: int_layer(32, 576, 4, True, dtype=d), {BF: DOT, FP: DOT}),
    # 16-row tiles with padded rows; 64-column blocks; 128-column blocks with a 64-wide last one (320 = 2 x 128 + 64).
    "w4_sym_g64_k576_n40": (lambda d: int_layer(40, 576, 4, True, 64, dtype=d), {BF: DOT, FP: DOT}),
    "w4_asym_channel_k320": (lambda d: int_layer(72, 320, 4, False, dtype=d), {BF: DOT, FP: DOT}),
    "w4_asym_g128_n24": (lambda d: int_layer(24, 384, 4, False, 128, dtype=d), {BF: DOT, FP: DOT}),
    "w4_asym_g256_act_order": (lambda d: int_layer(16, 512, 4, False, 256, act_order=True, dtype=d), {BF: DOT, FP: DOT}),
    "w4_sym_channel_ragged": (lambda d: int_layer(40, 99, 4, True, dtype=d), {BF: CPP, FP: CPP}),
    "w4_asym_g16_act_order": (lambda d: int_layer(40, 96, 4, False, 16, act_order=True, dtype=d), {BF: CPP, FP: CPP}),
    "w8_sym_channel_ragged": (lambda d: int_layer(48, 100, 8, True, dtype=d), {BF: CPP, FP: CPP}),
    "w8_sym_channel": (lambda d: int_layer(40, 96, 8, True, dtype=d), {BF: I8, FP: CPP}),
    "w8_sym_channel_int": (lambda d: int_layer(64, 576, 8, True, fmt="int-quantized", dtype=d),
                           {BF: _int8dot(I8), FP: CPP}),
    # 8-bit tiles: 4 columns per step, padded rows, act-order, asymmetric groups, 128-column blocks with a 64 tail.
    "w8_asym_g64_act_order": (lambda d: int_layer(40, 256, 8, False, 64, act_order=True, dtype=d),
                              {BF: _int8dot(CPP), FP: CPP}),
    "w8_sym_g128_k384": (lambda d: int_layer(24, 384, 8, True, 128, dtype=d), {BF: _int8dot(CPP), FP: CPP}),
    "w8_asym_channel_k320": (lambda d: int_layer(72, 320, 8, False, dtype=d), {BF: _int8dot(CPP), FP: CPP}),
    "w8_asym_g32_act_order": (lambda d: int_layer(48, 128, 8, False, 32, act_order=True, dtype=d), {BF: CPP, FP: CPP}),
    "w8_asym_channel_int": (lambda d: int_layer(24, 72, 8, False, fmt="int-quantized", dtype=d), {BF: CPP, FP: CPP}),
    "w8a8_token": (lambda d: int_layer(48, 100, 8, True, fmt="int-quantized", act=TOKEN_INT8, dtype=d), {BF: MM, FP: MM}),
    "w8a8_static": (lambda d: int_layer(32, 64, 8, True, fmt="int-quantized", act=TENSOR_INT8, dtype=d),
                    {BF: _int8dot(MM), FP: MM}),
    "w8a8_static_asym": (lambda d: int_layer(32, 64, 8, True, fmt="int-quantized", act=TENSOR_INT8_ASYM, dtype=d),
                         {BF: _int8dot(MM), FP: MM}),
    "w8a8_token_k320": (lambda d: int_layer(40, 320, 8, True, fmt="int-quantized", act=TOKEN_INT8, dtype=d),
                        {BF: _int8dot(MM), FP: MM}),
    "w8a8_group_act": (lambda d: int_layer(32, 80, 8, True, fmt="int-quantized", act=GROUP_INT8, dtype=d), {BF: CPP, FP: CPP}),
    # cpu-fp8dot takes bf16 activations only (an fp32 x would be rounded); a 200-wide K: a 72-wide last block.
    "fp8_tensor_static": (lambda d: fp8_layer(48, 96, "tensor", TENSOR_FP8, dtype=d), {BF: F8_BF, FP: CPP}),
    "fp8_channel_token": (lambda d: fp8_layer(64, 576, "channel", TOKEN_FP8, dtype=d), {BF: F8_BF, FP: CPP}),
    "fp8_channel_weight_only": (lambda d: fp8_layer(40, 256, "channel", None, dtype=d), {BF: F8_BF, FP: CPP}),
    "fp8_block_ragged": (lambda d: fp8_layer(200, 200, "block", GROUP_FP8, dtype=d), {BF: F8_BF, FP: CPP}),
    "fp8_block_k320": (lambda d: fp8_layer(256, 320, "block", GROUP_FP8, dtype=d), {BF: F8_BF, FP: CPP}),
}


def _oracle(twin: QuantLinear, x: torch.Tensor):
    """(y, worst-case rounding scale): the reference's activation fake-quant (same dtype as the kernel sees),
    the reference dequantisation in float64, a float64 matmul. The scale is |x| @ (|W| + |zero point * scale|)^T,
    the sum of the magnitudes every output adds up."""
    xq = x
    if twin.fmt.input is not None:
        xq = quantize_activation(x, twin.fmt.input, getattr(twin, "input_scale", None),
                                 getattr(twin, "input_zero_point", None))
    w = reference.dequantize_weight(twin, torch.float64)
    zp = reference.zero_point(twin)
    z = torch.zeros_like(w) if zp is None else (reference._expand(zp, twin, twin.fmt.weights).double()
                                                 * reference._expand(twin.weight_scale.double(), twin, twin.fmt.weights))
    bias = None if twin.bias is None else twin.bias.double()
    return F.linear(xq.double(), w, bias), xq.double().abs() @ (w.abs() + z.abs()).t()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_oracle(case, dtype):
    build, expected = CASES[case]
    layer, twin = build(dtype), build(dtype)  # same seed: identical tensors; the twin stays unprepared
    n, k = layer.out_features, layer.in_features
    name, why = dispatch.prepare_layer(layer)
    assert name == expected[dtype], why
    # The kernel holds its own layout, never a dense floating-point weight, and the checkpoint tensors are gone.
    assert not any(t.is_floating_point() and t.numel() >= n * k for t in layer.held_tensors())
    assert layer.weight_scale is None
    gen = torch.Generator().manual_seed(1)
    for shape in ((1, k), (3, k), (16, k), (17, k), (2, 3, k)):  # 17 rows: past the C++ kernel's GEMV range
        x = (torch.randn(*shape, generator=gen) * 2).to(dtype)
        y = layer(x)
        assert y.dtype == dtype and y.shape == (*shape[:-1], n)
        _assert_near_oracle(y, twin, x, f"{case} {shape}")


def _assert_near_oracle(y: torch.Tensor, twin: QuantLinear, x: torch.Tensor, label: str) -> None:
    y_o, mag = _oracle(twin, x)
    err = (y.double() - y_o).abs()
    if x.dtype == torch.float32:
        # fp32 (unit roundoff 2^-24 ~ 6e-8): exact products summed in another order, zero points folded as
        # -zp * scale; rounding errors of random sign grow like sqrt(K) * 2^-24 * mag (~1.5e-6 at K=576),
        # 1e-5 leaves 7x margin. A wrong scale, group or permutation errs by ~mag.
        assert (err <= 1e-5 * mag + 1e-6).all(), f"{label}: max err / mag {(err / mag).max():.3g}"
    else:
        # bf16 (unit roundoff 2^-9): each output is rounded to bf16 once (2^-9 |y|); torch's int4 op takes
        # zero = -zp * scale rounded to bf16 (2^-9 |zero| per term); the oracle's int8 activations are
        # q * scale rounded to bf16 while torch._int_mm multiplies q exactly (2^-9 |x| per term). So every
        # error is within 2^-9 (|y| + mag); 2^-8 doubles it. In RMS these roundings are random, so 2^-7 of
        # the output's RMS (measured ~2^-8.5) still fails a wrong scale, zero point or group.
        assert (err <= 2**-8 * (y_o.abs() + mag)).all(), f"{label}: max err {err.max():.3g}"
        rel_rms = (err.pow(2).mean() / y_o.pow(2).mean()).sqrt()
        assert rel_rms < 2**-7, f"{label}: relative RMS error {rel_rms:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", [c for c, (_, kern) in CASES.items() if "act_order" not in c
                                  and {kern[torch.bfloat16], kern[torch.float32]} & {CPP, DOT, I8, W8, F8}])
@pytest.mark.parametrize("chunk", ["default", "one tile"])
def test_prefill_through_the_dense_gemm_matches_the_reference(case, dtype, chunk, monkeypatch):
    """Past the GEMV rows the weight is dequantised into x's dtype, each value rounded once as the reference's
    dequantisation, for a dense GEMM. cpu-dequant and torch-int8pack then run the reference's own F.linear: its
    output exactly, bias included. The tile kernels dequantise a chunk of weight rows at a time (forced here down to
    one 16-row tile per chunk, a ragged last one included) and compute y^T chunk by chunk, summing in another order:
    the oracle's bound holds there."""
    build, expected = CASES[case]
    if expected[dtype] not in (CPP, DOT, I8, W8, F8):
        pytest.skip(f"{expected[dtype]} serves {case} in {dtype}")
    if chunk != "default":
        monkeypatch.setattr(base, "PREFILL_CHUNK_ROWS", 16)
    layer, twin = build(dtype), build(dtype)
    dispatch.prepare_layer(layer)
    x = (torch.randn(40, layer.in_features, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    if expected[dtype] in (CPP, I8):
        assert torch.equal(layer(x), reference.linear(x, twin))
    else:
        _assert_near_oracle(layer(x), twin, x, case)


def test_unequal_act_order_groups_fall_back_to_the_reference():
    layer = int_layer(32, 128, 4, True, 32, act_order=True, dtype=torch.bfloat16)
    g_idx = layer.weight_g_idx.clone()
    g_idx[g_idx == 1] = 0  # group 0 now has 64 columns, group 1 none: no contiguous layout of equal groups
    layer.weight_g_idx = g_idx
    name, why = dispatch.prepare_layer(layer)
    assert name == "reference" and "unequal" in why
    x = torch.randn(3, 128).to(torch.bfloat16)
    assert torch.equal(layer(x), reference.linear(x, layer))


def _tiny_checkpoints(tmp_path_factory, schemes):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("kernel_ckpts")
    # bf16 like real checkpoints (so torch's bf16 ops serve where they can); hidden 128 so 128x128 FP8 blocks fit.
    base = make_tiny_model(root / "base", "llama", dtype=torch.bfloat16, hidden_size=128, intermediate_size=256,
                           head_dim=32)
    out = {}
    for scheme, group in schemes:
        r = Recipe()
        r.model.source = str(base)
        r.quantization.scheme, r.quantization.group_size = scheme, group
        r.calibration.num_samples, r.calibration.seq_len = 2, 16
        quantize_model(r, root / scheme)
        out[scheme] = root / scheme
    return out


SCHEMES = [("W4A16", 32), ("W4A16_ASYM", 32), ("W8A16", -1), ("W8A8", -1), ("W8A8_STATIC", -1), ("FP8", -1),
           ("FP8_DYNAMIC", -1), ("FP8_BLOCK", -1)]


@pytest.fixture(scope="module")
def scheme_ckpts(tmp_path_factory):
    return _tiny_checkpoints(tmp_path_factory, SCHEMES)


@pytest.mark.parametrize("scheme", [s for s, _ in SCHEMES])
def test_resident_weights_stay_within_the_checkpoint_size(scheme_ckpts, scheme):
    path = scheme_ckpts[scheme]
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))
    logits, served = {}, {}
    for mode in ("auto", "reference"):
        rt = load_model(path, kernels=mode)
        assert rt.resident_weight_bytes <= 1.15 * size, (mode, rt.kernels, rt.resident_weight_bytes, size)
        with torch.no_grad():
            logits[mode] = rt(input_ids=ids).logits.float()
        # Running does not grow what the model holds (no caches of dense weights).
        assert rt.resident_weight_bytes <= 1.15 * size
        served[mode] = rt.kernels
    assert all("reference" not in by_kernel for by_kernel in served["auto"].values()), served
    # Sanity that the kernel model computes the same function (the close bounds are per layer, above).
    ref = logits["reference"]
    assert (logits["auto"] - ref).pow(2).mean().sqrt() < 0.1 * ref.pow(2).mean().sqrt()


def test_no_kernel_runs_the_reference_and_says_so_once(scheme_ckpts, monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "_KERNELS", {"cpu": {}})  # a device type no kernel is registered for
    monkeypatch.setattr(progress, "_WARNED", set())
    path = scheme_ckpts["W4A16"]
    rt = load_model(path)
    again = load_model(path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no cpu kernel for 14 quantised linear(s)"), err
    assert "torch reference" in err[0] and "w4a16 pack-quantized group 32" in err[0]
    assert rt.kernels == again.kernels == {"w4a16": {"reference": 14}}
    forced = load_model(path, kernels="reference")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(rt(input_ids=ids).logits, forced(input_ids=ids).logits)
    assert capsys.readouterr().err == ""  # asking for the reference is not a fallback


def test_quantkit_reference_env_forces_the_reference(scheme_ckpts, monkeypatch):
    monkeypatch.setenv("QUANTKIT_REFERENCE", "1")
    assert load_model(scheme_ckpts["W4A16"]).kernels == {"w4a16": {"reference": 14}}


def test_unknown_kernels_value_is_refused():
    from quantkit.errors import InputError

    with pytest.raises(InputError, match="unknown kernels 'fast': use auto, reference or cuda-emulated"):
        load_model("/nonexistent", kernels="fast")


@pytest.mark.slow
def test_real_smollm2_w4a16_kernels_match_the_reference(smollm2_path, tmp_path):
    """The real model's W4A16 checkpoint on real text. In fp32 the kernel and the reference compute the same
    products, so their distributions must agree to KL < 1e-4. In bf16 two correct computations already
    differ by bf16 rounding across 30 layers (measured KL ~2e-3 between the bf16 reference and fp32), so
    there the kernel must be at least as close to the fp32 result as the bf16 reference is."""
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(smollm2_path)
    r.quantization.scheme, r.quantization.group_size = "W4A16", 64
    path = tmp_path / "w4"
    quantize_model(r, path)
    ids = build_token_blocks(AutoTokenizer.from_pretrained(smollm2_path), "kjv", 2, 64, 0, split="heldout").input_ids
    logp = {}
    for dtype in ("float32", "bfloat16"):
        for mode in ("auto", "reference"):
            rt = load_model(path, dtype=dtype, kernels=mode)
            if mode == "auto":
                assert "reference" not in rt.kernels["w4a16"], rt.kernels
            with torch.inference_mode():
                logp[dtype, mode] = rt(input_ids=ids).logits.float().log_softmax(-1)
            del rt

    def kl(p, q):
        return float((logp[p].exp() * (logp[p] - logp[q])).sum(-1).mean())

    fp32 = ("float32", "reference")
    assert kl(fp32, ("float32", "auto")) < 1e-4
    assert kl(fp32, ("bfloat16", "auto")) <= 1.25 * kl(fp32, ("bfloat16", "reference")) + 1e-5


def test_a_kernel_that_does_not_build_leaves_the_reference_with_one_warning(tmp_path, monkeypatch, capsys):
    from quantkit.runtime.kernels import cpp

    broken = tmp_path / "broken.cpp"
    broken.write_text("#error deliberately broken\n")
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp, "SOURCE", broken)
    monkeypatch.setattr(progress, "_WARNED", set())
    cpp.extension.cache_clear()
    try:
        layers = [int_layer(32, 64, 4, True, 32, dtype=torch.float32, seed=s) for s in range(2)]  # fp32: cpu-dequant's
        counts = dispatch.prepare_model(torch.nn.Sequential(*layers))
    finally:
        cpp.extension.cache_clear()  # the next use builds (or finds on disk) the real kernel again
    assert counts == {"w4a16": {"reference": 2}}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("warning: cpu-dequant: could not build the CPU kernel"), err
    assert err[1].startswith("warning: no cpu kernel for 2 quantised linear(s)")
    x = torch.randn(3, 64)
    assert torch.equal(layers[0](x), reference.linear(x, int_layer(32, 64, 4, True, 32, dtype=torch.float32)))


ISA_CASES = {"w4_asym_g64_act_order": DOT, "w4_asym_channel_k320": DOT, "w4_sym_g64_k576_n40": DOT,
             "w8_asym_g64_act_order": W8, "w8_sym_g128_k384": W8, "w8a8_token_k320": W8,
             "fp8_block_ragged": F8, "fp8_channel_token": F8}


@pytest.mark.parametrize("case", list(ISA_CASES))
def test_tile_kernel_instruction_sets_agree_with_the_oracle(case, monkeypatch):
    """The scalar, AVX2 and AVX512 (VNNI / BF16) paths of the tile kernels (whichever this CPU runs) each meet the
    oracle's bf16 bound, for every batch size of the GEMV (1..16, each MB template)."""
    from quantkit.runtime.kernels import cpp

    kernel = ISA_CASES[case]
    build, _ = CASES[case]
    layer, twin = build(torch.bfloat16), build(torch.bfloat16)
    name = dispatch.prepare_layer(layer)[0]
    if name != kernel:
        pytest.skip(f"{kernel} is not offered on this CPU ({name} serves {case})")
    if kernel == F8:
        which, isas = "fp8_isa", [cpp.ISA_SCALAR, cpp.ISA_BF16]
    else:
        which = "dot_isa"
        isas = [cpp.ISA_SCALAR, cpp.ISA_AVX2] + ([cpp.ISA_VNNI512] if cpp.extension().has_vnni() else [])
    gen = torch.Generator().manual_seed(5)
    xs = [(torch.randn(m, layer.in_features, generator=gen) * 2).bfloat16() for m in (1, 2, 3, 5, 8, 9, 16)]
    outputs = {}
    for isa in isas:
        monkeypatch.setattr(cpp, which, lambda isa=isa: isa)
        outputs[isa] = [layer(x) for x in xs]
    for isa, ys in outputs.items():
        for x, y in zip(xs, ys):
            y_o, mag = _oracle(twin, x)
            err = (y.double() - y_o).abs()
            assert (err <= 2**-8 * (y_o.abs() + mag)).all(), f"isa {isa} M={x.shape[0]}: max err {err.max():.3g}"


@pytest.mark.parametrize("case", ["w4_asym_g64_act_order", "w4_asym_channel_k320", "w4_sym_g64_k576_n40",
                                  "w8_asym_g64_act_order", "w8_sym_g128_k384"])
def test_int8_token_codes_product_is_the_exact_w4a8_product(case, monkeypatch):
    """QSPEC's integer path (`run_int8_tokens`): x quantised per token to int8 as the eager reference does
    (activation_codes), then codes x stored weights. Oracle: those codes times their scales, in float64, against
    the reference dequantisation in float64. Every instruction set, every row-block size and past the GEMV's 16
    rows; fp32 x, so the bound is fp32 accumulation (2^-18 of the magnitudes summed), far below what the int8
    rounding of x moves the output (about 2^-8 of them): a kernel that skipped the quantisation, or lost a code's low
    bits, fails."""
    from quantkit.quant.activations import activation_codes
    from quantkit.runtime.kernels import cpp

    build, _ = CASES[case]
    layer, twin = build(torch.bfloat16), build(torch.bfloat16)
    name = dispatch.prepare_layer(layer)[0]
    if name not in (DOT, W8):
        pytest.skip(f"{name} serves {case} on this CPU")
    isas = [cpp.ISA_SCALAR, cpp.ISA_AVX2] + ([cpp.ISA_VNNI512] if cpp.extension().has_vnni() else [])
    w = reference.dequantize_weight(twin, torch.float64)
    zp = reference.zero_point(twin)
    z = torch.zeros_like(w)
    if zp is not None:
        w_args = twin.fmt.weights
        z = reference._expand(zp, twin, w_args).double() * reference._expand(twin.weight_scale.double(), twin, w_args)
    gen = torch.Generator().manual_seed(7)
    for m in (1, 2, 3, 5, 8, 9, 16, 33):
        x = torch.randn(m, layer.in_features, generator=gen) * torch.linspace(0.1, 4.0, layer.in_features)
        q, s, _ = activation_codes(x, TOKEN_INT8)
        xq = q.double() * s.double().reshape(-1, 1)
        y_o = F.linear(xq, w, twin.bias.double())
        mag = xq.abs() @ (w.abs() + z.abs()).t() + twin.bias.double().abs()
        unquantised = F.linear(x.double(), w, twin.bias.double())
        assert ((unquantised - y_o).abs() > 2**-14 * mag).any()  # the int8 rounding of x shows at this bound
        for isa in isas:
            monkeypatch.setattr(cpp, "dot_isa", lambda isa=isa: isa)
            y = layer.kernel.run_int8_tokens(x, layer.prepared, TOKEN_INT8)
            err = (y.double() - y_o).abs()
            assert (err <= 2**-18 * mag).all(), f"isa {isa} M={m}: max err {err.max():.3g}"


def test_int8_token_codes_decline_a_layer_that_quantises_its_input_itself():
    layer = CASES["w8a8_token_k320"][0](torch.bfloat16)
    if dispatch.prepare_layer(layer)[0] != W8:
        pytest.skip("cpu-int8dot does not serve W8A8 here")
    assert layer.kernel.run_int8_tokens(torch.randn(2, 320).bfloat16(), layer.prepared, TOKEN_INT8) is None


def test_int4dot_tiles_from_packed_bytes_equal_the_tiles_of_the_unpacked_values():
    """The C++ re-tiling of compressed-tensors' packed rows (what load uses) against the tensor-op tiling of the
    unpacked values (unsigned_weight, compressed-tensors' convention checked in test_reference.py)."""
    from quantkit.runtime.kernels import base, cpp

    layer = int_layer(40, 320, 4, False, dtype=torch.bfloat16)  # 40 rows: a padded last tile
    packed = layer.weight_packed.contiguous().view(torch.uint8)
    assert torch.equal(cpp.extension().tile_u4(packed, 320), cpp.tile_nibbles(base.unsigned_weight(layer)))


def test_int_mm_probe_matches_an_exact_product():
    """torch._int_mm serves W8A8 only where it is exact: on oneDNN's AVX2 path its pair products saturate at
    int16 (`make test-avx2` found it). The probe must agree with a larger full-range product of other shapes."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randint(-128, 128, (33, 576), generator=gen, dtype=torch.int8)
    b = torch.randint(-128, 128, (576, 96), generator=gen, dtype=torch.int8)
    exact = torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long())
    assert int_mm_is_exact() == exact


def test_a_build_killed_mid_compile_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's build lock is a plain file a killed build leaves behind; the next load must not wait on it."""
    import threading

    from quantkit import native

    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "tiny_ext.cpp"
    src.write_text('#include <torch/extension.h>\nint answer() { return 42; }\n'
                   'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }\n')
    build = native.build_folder(src)
    assert build.parent == tmp_path / "cache" / "kernels"
    build.mkdir(parents=True)
    (build / "lock").touch()  # what a build killed mid-compile leaves
    result = {}
    t = threading.Thread(target=lambda: result.update(out=native.load_cpu_extension(src)), daemon=True)
    t.start()
    t.join(timeout=240)
    assert not t.is_alive(), "load_cpu_extension waited on a stale lock"
    module, why = result["out"]
    assert why is None and module.answer() == 42
