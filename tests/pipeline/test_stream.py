"""The data-free FP8 path: same bytes as the engine would write, no skeleton, no data; native FP8 input;
bad input refused with nothing left behind; tensor-parallel warnings."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from quantkit.errors import InputError
from quantkit.models.safetensors_index import SafetensorsIndex
from quantkit.pipeline.engine import quantize_model
from quantkit.quant.fp8 import expand_block_scale, quantize_fp8_weight
from quantkit.recipe import Recipe
from tests.conftest import make_tiny_model


def _recipe(model, method="fp8", scheme="FP8_BLOCK", **quant) -> Recipe:
    r = Recipe()
    r.model.source = str(model)
    r.quantization.method, r.quantization.scheme = method, scheme
    for k, v in quant.items():
        setattr(r.quantization, k, v)
    r.calibration.num_samples, r.calibration.seq_len = 4, 16
    return r


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module")
def model256(tmp_path_factory):
    # K = 256 takes 128x128 blocks, K = 320 (down_proj) falls back; N = 320 gives ragged row blocks.
    return make_tiny_model(tmp_path_factory.mktemp("m256") / "llama", "llama", dtype=torch.bfloat16,
                           hidden_size=256, intermediate_size=320)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "FP8_DYNAMIC"])
def test_stream_writes_what_the_engine_writes(tmp_path, model256, scheme, monkeypatch):
    engine = quantize_model(_recipe(model256, "rtn", scheme), tmp_path / "engine")
    # The data-free path must need neither a model skeleton nor calibration data.
    import transformers

    import quantkit.pipeline.engine as eng

    def refuse(*a, **k):
        raise AssertionError("the data-free path built a skeleton or read calibration data")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", refuse)
    monkeypatch.setattr(eng, "build_token_blocks", refuse)
    stream = quantize_model(_recipe(model256, "fp8", scheme), tmp_path / "stream")
    assert stream["calibration"] == {"data_free": True}
    a, b = _tensors(tmp_path / "engine"), _tensors(tmp_path / "stream")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                                                        b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k]), k
    ca = json.loads((tmp_path / "engine" / "config.json").read_text())["quantization_config"]
    cb = json.loads((tmp_path / "stream" / "config.json").read_text())["quantization_config"]
    assert ca["config_groups"] == cb["config_groups"] and sorted(ca["ignore"]) == sorted(cb["ignore"])
    assert engine["scheme_overrides"] == stream["scheme_overrides"]
    if scheme == "FP8_BLOCK":
        assert stream["scheme_overrides"] == {"FP8_DYNAMIC": ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]}
        assert b["model.layers.0.mlp.gate_proj.weight_scale"].shape == (3, 2)  # ceil(320/128) x ceil(256/128)


def test_stream_moe_experts_quantised_router_kept(tmp_path, tiny_models):
    out = tmp_path / "moe"
    summary = quantize_model(_recipe(tiny_models["qwen2_moe"], "fp8", "FP8_DYNAMIC"), out)
    t = _tensors(out)
    assert t["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays as it was
    assert t["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert "model.layers.0.mlp.shared_expert_gate.weight_scale" not in t
    assert summary["quantized_linears"] == 2 * (4 + 4 * 3 + 3)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"} <= set(ignore)


@pytest.mark.parametrize("scheme", ["FP8_BLOCK", "FP8_DYNAMIC"])
def test_stream_checkpoint_runs_in_transformers_like_runtime(tmp_path, model256, scheme):
    from transformers import AutoModelForCausalLM

    from quantkit.runtime import load_model

    out = tmp_path / "q"
    quantize_model(_recipe(model256, "fp8", scheme), out)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        got = load_model(out, kernels="reference")(input_ids=ids).logits  # bit-exact path; kernels: tests/runtime
    assert torch.equal(got.float(), ref.float())


def _native_fp8(src, dst):
    """A DeepSeek-V3-style native FP8 checkpoint: e4m3 weights with fp32 weight_scale_inv per 128x128 block."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    expected = {}
    for name in list(tensors):
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_fp8_weight(tensors[name].float(), "block", (128, 128), scale_dtype=torch.float32)
            tensors[name] = q
            tensors[name + "_scale_inv"] = scale
            expected[name] = (q.float() * expand_block_scale(scale, tuple(q.shape))).to(torch.bfloat16)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return expected


def test_native_fp8_input_is_dequantised_and_requantised(tmp_path, model256):
    expected = _native_fp8(model256, tmp_path / "native")
    index = SafetensorsIndex(tmp_path / "native")
    assert not any(n.endswith("_scale_inv") for n in index.names())
    name = "model.layers.1.mlp.down_proj.weight"  # 256 x 320: ragged column blocks
    assert index.dtype(name) == torch.bfloat16 and torch.equal(index.get(name), expected[name])
    stream = quantize_model(_recipe(tmp_path / "native", "fp8", "FP8_DYNAMIC"), tmp_path / "dyn")
    engine = quantize_model(_recipe(tmp_path / "native", "rtn", "W8A8"), tmp_path / "w8a8")
    assert stream["quantized_linears"] == engine["quantized_linears"] == 14
    cfg = json.loads((tmp_path / "w8a8" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    t = _tensors(tmp_path / "dyn")
    w = t[name].float() * t[name.replace(".weight", ".weight_scale")].float()
    assert ((w - expected[name].float()).abs() <= expected[name].float().abs().amax(1, keepdim=True) / 16).all()
    # Evaluation reads it as the dense model it encodes.
    from quantkit.runtime import load_model

    dense = tmp_path / "dense"
    import shutil

    shutil.copytree(model256, dense)
    tensors = load_file(str(dense / "model.safetensors"))
    tensors.update(expected)
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "native")(input_ids=ids).logits, load_model(dense)(input_ids=ids).logits)


def test_bad_input_is_refused_and_leaves_nothing(tmp_path, model256):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model256, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"][3, 5] = float("inf")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    for method, scheme in (("fp8", "FP8_BLOCK"), ("rtn", "FP8_DYNAMIC")):
        out = tmp_path / f"out-{method}"
        with pytest.raises(InputError, match="o_proj has 1 inf/NaN"):
            quantize_model(_recipe(bad, method, scheme), out)
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    quantize_model(_recipe(model256, "fp8", "FP8_DYNAMIC"), tmp_path / "q")
    with pytest.raises(InputError, match="already quantised"):
        quantize_model(_recipe(tmp_path / "q", "fp8", "FP8_DYNAMIC"), tmp_path / "again")
    with pytest.raises(InputError, match="down_proj has 320 input features.*--strict"):
        quantize_model(_recipe(model256, "fp8", "FP8_BLOCK", strict=True), tmp_path / "strict")
    with pytest.raises(InputError, match="cannot produce FP8_BLOCK"):
        quantize_model(_recipe(model256, "awq", "FP8_BLOCK"), tmp_path / "x")
    assert not (tmp_path / "strict").exists() and not (tmp_path / "strict.partial").exists()


def test_tp_warnings_name_the_layers(tmp_path, model256):
    s1 = quantize_model(_recipe(model256, "fp8", "FP8_BLOCK"), tmp_path / "tp1", tp=1)
    s2 = quantize_model(_recipe(model256, "fp8", "FP8_BLOCK"), tmp_path / "tp2", tp=2)
    names1 = {w["module"] for w in s1["tp_warnings"]}
    names2 = {w["module"] for w in s2["tp_warnings"]}
    # tp=1: vLLM merges gate/up and needs gate's N (320) in whole blocks; k_proj (N=128) is fine.
    assert names1 == {f"model.layers.{i}.mlp.gate_proj" for i in range(2)}
    # tp=2: o_proj keeps K/2 = 128 (fine) but k/v shards of N=64 and gate/up of 160 are not whole blocks.
    assert {f"model.layers.0.self_attn.{p}" for p in ("k_proj", "v_proj")} <= names2
    assert "model.layers.0.self_attn.o_proj" not in names2 and "model.layers.0.mlp.down_proj" not in names2
    manifest = json.loads((tmp_path / "tp2" / "quantkit_manifest.json").read_text())
    assert manifest["tp_warnings"] == s2["tp_warnings"]
