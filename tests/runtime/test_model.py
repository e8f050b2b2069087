"""The runtime's logits against transformers + compressed-tensors loading the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig

from quantkit.errors import InputError, QuantkitError
from quantkit.runtime import load_model
from quantkit.runtime.linear import QuantLinear
from tests.runtime.ct_fixtures import build_ct_checkpoint, ct_cases, make_base


def _transformers_logits(path, ids, dequantize=False):
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if dequantize else {}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def _runtime_logits(path, ids, kernels="reference"):
    rt = load_model(path, kernels=kernels)
    with torch.no_grad():
        return rt(input_ids=ids).logits.float(), rt


@pytest.fixture(scope="module")
def ct_bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("ct")
    return root, {64: make_base(root / "base64", 64), 256: make_base(root / "base256", 256)}


@pytest.fixture(scope="module")
def ct_paths(ct_bases):
    root, bases = ct_bases
    made = {}

    def build(case):
        if case not in made:
            scheme, static = ct_cases()[case]
            made[case] = build_ct_checkpoint(bases[256 if case == "fp8_block" else 64], root / case, scheme,
                                             static_input=static)
        return made[case]

    return build


@pytest.mark.parametrize("case", list(ct_cases()))
def test_compressed_tensors_formats_match_transformers_bitwise(ct_paths, case):
    path = ct_paths(case)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    # Asymmetric pack-quantized only loads in transformers through its dequantize=True path.
    ref = _transformers_logits(path, ids, dequantize="asym" in case)
    got, rt = _runtime_logits(path, ids, kernels="reference")
    assert sum(rt.formats.values()) == 14  # 2 layers x 7 linears, lm_head ignored
    assert rt.kernels == {next(iter(rt.formats)): {"reference": 14}}
    assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item()}"


@pytest.mark.parametrize("case", list(ct_cases()))
def test_compressed_tensors_formats_with_kernels_match_transformers_closely(ct_paths, case):
    path = ct_paths(case)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _transformers_logits(path, ids, dequantize="asym" in case)
    got, rt = _runtime_logits(path, ids, kernels="auto")
    assert "reference" not in next(iter(rt.kernels.values())), rt.kernels  # a kernel served every linear
    # The checkpoints compute in bf16 (8-bit mantissa). Each kernel output differs from the reference's by
    # bf16 rounding only (~0.3% RMS per linear, tested layer by layer in test_kernels.py: fp32 accumulation of
    # exact products instead of bf16-rounded dequantised weights). Weight-only formats carry that to the logits
    # about unchanged (measured ~0.6%; bound 1.5%). Where activations are quantised, such a difference flips
    # some roundings of the next layer's int8 / fp8 activations (one int8 step is up to 1/127 of a token's
    # range, one e4m3 step 1/8 of a value), so the logits move more (measured 1-4%; bound 6%). A wrong scale,
    # group or zero point moves logits by their own magnitude (~100%).
    err = (got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    bound = 0.015 if rt.quant_config.groups[0][1].input is None else 0.06
    assert err < bound, f"relative RMS error {err.item():.4f} with kernels {rt.kernels}"


def _quantize(model_dir, out, scheme, group_size):
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(model_dir)
    r.quantization.scheme, r.quantization.group_size = scheme, group_size
    r.calibration.num_samples, r.calibration.seq_len = 2, 16
    quantize_model(r, out)
    return out


DENSE = ["llama", "qwen2", "qwen3", "gemma", "mistral"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


CASES = [(f, "W4A16", 32) for f in DENSE + MOE] + [(f, "W4A16_ASYM", 32) for f in ("llama", "qwen2", "gemma")] + [
    (f, "W8A16", -1) for f in ("llama", "qwen3", "mixtral")]


@pytest.mark.parametrize("family,scheme,group", CASES)
def test_quantkit_checkpoints_match_transformers(tiny_models, tmp_path, family, scheme, group):
    path = _quantize(tiny_models[family], tmp_path / "q", scheme, group)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    got, rt = _runtime_logits(path, ids)
    assert any(isinstance(m, QuantLinear) for m in rt.model.modules())
    ref = _transformers_logits(path, ids, dequantize=scheme.endswith("ASYM"))
    if family in MOE:
        # Per-expert gate/up matmuls instead of one fused gate_up matmul: same math, fp32 rounding order differs.
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item()}"


@pytest.mark.parametrize("family,scheme,group", [("llama", "W4A16", 32), ("qwen2", "W4A16_ASYM", 32),
                                                 ("mixtral", "W8A16", -1), ("deepseek_v3", "W4A16", 32)])
def test_quantkit_checkpoints_with_kernels_match_transformers_closely(tiny_models, tmp_path, family, scheme, group):
    path = _quantize(tiny_models[family], tmp_path / "q", scheme, group)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    got, rt = _runtime_logits(path, ids, kernels="auto")
    assert all("reference" not in by_kernel for by_kernel in rt.kernels.values()), rt.kernels
    ref = _transformers_logits(path, ids, dequantize=scheme.endswith("ASYM"))
    # fp32 models: the kernels accumulate in fp32 in another order than the BLAS (and add zero points as
    # -zp * scale), so logits agree to a few fp32 ulps of the sums they come from, far below any format error.
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_plain_model_matches_transformers(tiny_models):
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    for family in ("llama", "qwen2_moe"):
        got, rt = _runtime_logits(tiny_models[family], ids)
        assert rt.formats == {}
        ref = _transformers_logits(tiny_models[family], ids)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_last_position_logits_cost_one_matmul_not_a_weight_copy(tiny_models):
    # A prefill that keeps only the last position's logits hands the head a strided slice of the hidden
    # states. transformers' own model computes it as one mm; ATen's matmul only does the same for weights that
    # require grad, and otherwise copies the whole head weight into a bmm on every call (the 1B model's
    # prefill ran 4.6x slower than transformers' for it).
    from torch.profiler import profile

    rt = load_model(tiny_models["llama"])
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = rt(input_ids=ids).logits[:, -1:]
        with profile() as prof:
            last = rt(input_ids=ids, logits_to_keep=1).logits
    ops = {e.key for e in prof.key_averages()}
    assert "aten::bmm" not in ops, sorted(ops)
    assert torch.allclose(last, full, atol=1e-5)


def test_real_model_rtn_checkpoint_matches_transformers(smollm2_path, tmp_path):
    path = _quantize(smollm2_path, tmp_path / "q", "W4A16", 64)
    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(3))
    got, rt = _runtime_logits(path, ids)
    assert rt.formats == {"w4a16": 210}
    assert torch.equal(got, _transformers_logits(path, ids))


def test_bad_folders_are_one_line_errors(tmp_path, tiny_models):
    with pytest.raises(InputError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="config.json is missing"):
        load_model(tmp_path / "empty")
    import json, shutil

    bad = tmp_path / "gptq"
    shutil.copytree(tiny_models["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "marlin-24",
                                  "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="marlin-24.*does not know"):
        load_model(bad)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="gptq"):
        load_model(bad)


@pytest.fixture(scope="module")
def w4_tiny(tiny_models, tmp_path_factory):
    return _quantize(tiny_models["llama"], tmp_path_factory.mktemp("w4") / "q", "W4A16", 32)


def _edit_tensor(path, name, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = edit(tensors[name]).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


UP = "model.layers.1.mlp.up_proj"  # [128, 64]: 64 inputs of 4 bits pack into 8 int32 words; 2 groups of 32


@pytest.mark.parametrize("tensor,edit,message", [
    ("weight_packed", lambda t: t[:, :-1], "weight_packed is int32 [128, 7] but 128 x 64 4-bit values pack into int32 [128, 8]"),
    ("weight_packed", lambda t: t.to(torch.int16), "weight_packed is int16 [128, 8] but 128 x 64 4-bit values pack into int32 [128, 8]"),
    ("weight_scale", lambda t: t[:, :1], "weight_scale has shape [128, 1] but group scales of a [128, 64] weight "
                                          "(groups of 32) are [128, 2]"),
    ("weight_shape", lambda t: t.flip(0), "weight_shape is [64, 128] but the model config makes this linear [128, 64]"),
])
def test_tensors_that_disagree_with_their_shape_are_named_and_exit_1(w4_tiny, tmp_path, tensor, edit, message):
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(w4_tiny, path)
    _edit_tensor(path, f"{UP}.{tensor}", edit)
    with pytest.raises(QuantkitError) as info:
        load_model(path)
    assert info.value.exit_code == 1
    assert str(info.value) == f"{path}: {UP}.{message}"


def test_tensors_that_disagree_with_the_config_are_named_and_exit_1(w4_tiny, tmp_path):
    import json
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(w4_tiny, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16  # tensors say 32
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match=r"q_proj\.weight_scale has shape \[64, 2\] but group scales .* "
                                            r"\(groups of 16\) are \[64, 4\]") as info:
        load_model(path)
    assert info.value.exit_code == 1


def test_dense_linears_run_one_row_outside_onednn_and_restore_its_switch(tiny_models):
    """Dense linears of a loaded model are DenseLinear; a single bf16 row matches the float64 product to bf16
    rounding, more rows too, and oneDNN's process-wide switch is back on afterwards."""
    from torch import nn

    from quantkit.runtime import load_model
    from quantkit.runtime.linear import DenseLinear

    rt = load_model(str(tiny_models["llama"]), dtype=torch.bfloat16)
    dense = [m for m in rt.model.modules() if isinstance(m, nn.Linear)]
    assert dense and all(type(m) is DenseLinear for m in dense)
    head = rt.model.get_output_embeddings()
    assert torch.backends.mkldnn.enabled
    for rows in (1, 3):
        x = torch.randn(1, rows, head.in_features).bfloat16()
        with torch.inference_mode():
            y = head(x)
        exact = x.double() @ head.weight.double().t()
        assert torch.backends.mkldnn.enabled
        assert ((y.double() - exact).abs() <= 2**-7 * (exact.abs() + 1e-2)).all()


FP4_CASES = [("llama", "rtn", s) for s in ("NVFP4A16", "MXFP4A16", "NVFP4", "MXFP4", "W4AFP8")] + [
    ("llama", "gptq", "NVFP4A16"), ("llama", "smoothquant+gptq", "NVFP4"), ("qwen3_moe", "gptq", "MXFP4A16"),
    ("qwen3_moe", "rtn", "NVFP4A16"), ("llama", "gptq", "W4AFP8")]


@pytest.fixture(scope="module")
def bf16_tiny(tmp_path_factory):
    """bf16 tiny models: compressed-tensors decompresses fp4 weights into bf16, as every real model runs."""
    from tests.conftest import make_tiny_model

    root = tmp_path_factory.mktemp("bf16")
    return {f: make_tiny_model(root / f, f, dtype=torch.bfloat16) for f in ("llama", "qwen3_moe")}


@pytest.mark.parametrize("family,method,scheme", FP4_CASES)
def test_fp4_and_w4afp8_checkpoints_match_transformers_bitwise(bf16_tiny, tmp_path, family, method, scheme):
    from safetensors import safe_open

    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(bf16_tiny[family])
    r.quantization.scheme, r.quantization.group_size, r.quantization.method = scheme, 32, method
    r.calibration.num_samples, r.calibration.seq_len = 4, 16
    path = quantize_model(r, tmp_path / "q") and tmp_path / "q"
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    got, rt = _runtime_logits(path, ids)
    assert set(rt.formats) == {{"W4AFP8": "w4afp8"}.get(scheme, scheme[:5].lower())}
    from quantkit.inspect import inspect_checkpoint

    assert inspect_checkpoint(path)["scheme"] == {"W4AFP8": "W4AFP8 g32"}.get(scheme, scheme)
    if family == "qwen3_moe" and scheme.startswith("NVFP4"):
        # transformers 5.25 stacks the experts into one fused tensor and drops their weight_global_scale there
        # (its expert weights come out ~global-scale times too large), so compressed-tensors' own per-module
        # decompression is the oracle: every linear the runtime holds dequantises to exactly that.
        _assert_every_linear_is_compressed_tensors_decompression(path, rt, scheme)
        return
    ref = _transformers_logits(path, ids)
    if family == "qwen3_moe":  # per-expert matmuls vs transformers' fused experts: rounding order differs
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item()}"
    # The kernels the runtime picks by default serve W4AFP8 (activations rounded to fp8 first) and leave fp4 to the
    # reference; either way, the logits of the reference.
    auto, rt_auto = _runtime_logits(path, ids, kernels="auto")
    assert ("reference" in rt_auto.kernels[next(iter(rt_auto.formats))]) == scheme.startswith(("NV", "MX"))
    torch.testing.assert_close(auto, got, atol=2e-2, rtol=2e-2)
    if scheme.startswith("NVFP4"):
        # vLLM runs q/k/v and gate/up as one matmul under one global scale: the checkpoint gives them one.
        with safe_open(next(path.glob("*.safetensors")), "pt") as f:
            keys = set(f.keys())
            attn = "model.layers.0.self_attn"
            scales = [f.get_tensor(f"{attn}.{p}.weight_global_scale") for p in ("q_proj", "k_proj", "v_proj")]
            weights = [f.get_tensor(f"{attn}.{p}.weight_packed") for p in ("q_proj", "k_proj", "v_proj")]
            assert weights and all(torch.equal(s, scales[0]) for s in scales)
            mlp = "model.layers.0.mlp" + (".experts.0" if family == "qwen3_moe" else "")
            if f"{mlp}.gate_proj.weight_global_scale" in keys:
                assert torch.equal(f.get_tensor(f"{mlp}.gate_proj.weight_global_scale"),
                                   f.get_tensor(f"{mlp}.up_proj.weight_global_scale"))
            assert not torch.equal(scales[0], f.get_tensor(f"{attn}.o_proj.weight_global_scale"))


def _assert_every_linear_is_compressed_tensors_decompression(path, rt, scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from safetensors import safe_open

    from quantkit.runtime import reference

    ct_scheme = QuantizationScheme(targets=["Linear"], **preset_name_to_scheme(scheme, ["Linear"]).model_dump(
        exclude={"targets"}))
    checked = 0
    with safe_open(next(path.glob("*.safetensors")), "pt") as f:
        for key in f.keys():
            if not key.endswith(".weight_packed"):
                continue
            name = key[: -len(".weight_packed")]
            leaves = {k[len(name) + 1:]: f.get_tensor(k) for k in f.keys() if k.rpartition(".")[0] == name}
            fmt = rt.quant_config.format_for(name)
            out_features, packed_cols = leaves["weight_packed"].shape
            layer = QuantLinear(fmt, leaves, packed_cols * 2, out_features)
            theirs = BaseCompressor.get_value_from_registry(fmt.format).decompress(leaves, ct_scheme)["weight"]
            assert torch.equal(reference.dequantize_weight(layer, theirs.dtype), theirs), name
            checked += 1
    assert checked > 8
