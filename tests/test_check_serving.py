"""`quantkit check-serving` on checkpoints quantised here, at TP sizes that do and do not divide.

Expectations are worked out by hand from vLLM's rules (column/row splits, merged q/k/v and gate/up, each
kernel's can_implement), not read back from quantkit's tables."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quantkit.cli import app
from quantkit.pipeline.engine import quantize_model
from quantkit.recipe import Recipe

runner = CliRunner()


def _quantize(src, out, scheme="W4A16", group=32, method="rtn", tp=None):
    r = Recipe()
    r.model.source = str(src)
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = method, scheme, group
    r.calibration.num_samples, r.calibration.seq_len = 2, 32
    return quantize_model(r, out, tp=tp)


def _check(ckpt, *args):
    result = runner.invoke(app, ["check-serving", str(ckpt), *args, "--json"])
    assert result.exit_code in (0, 3), result.output
    report = json.loads(result.stdout)
    assert set(report) >= {"compatible", "problems"} and all(set(p) == {"tensor", "reason"} for p in report["problems"])
    assert (result.exit_code == 0) == report["compatible"]
    return report


@pytest.fixture(scope="module")
def w4_tiny(tiny_models, tmp_path_factory):
    """Tiny Llama: hidden 64, 4 heads (2 KV heads of 16), MLP 128; W4A16 groups of 32."""
    out = tmp_path_factory.mktemp("serve") / "w4"
    _quantize(tiny_models["llama"], out)
    return out


def test_cpu_build_tp_that_divides_and_one_that_does_not(w4_tiny):
    for tp in (1, 2):
        report = _check(w4_tiny, "--gpu", "cpu", "--tp", str(tp))
        assert report["compatible"], report["problems"]
        assert set(report["kernel_families"]) == {"CPUWNA16LinearKernel"}
    report = _check(w4_tiny, "--gpu", "cpu", "--tp", "4")
    assert not report["compatible"]
    by_tensor = {p["tensor"]: p["reason"] for p in report["problems"]}
    # o_proj is row-parallel: K = 64 / 4 = 16 holds no whole group of 32.
    assert by_tensor["model.layers.0.self_attn.o_proj"] == "K/tp = 16 is not a multiple of group size 32"
    # q/k/v run as one linear: q 64/4 = 16, the 2 KV heads are replicated (one of 16 per rank): N = 48 per rank,
    # and the CPU kernel needs multiples of 32.
    qkv = by_tensor["model.layers.0.self_attn.q_proj+k_proj+v_proj"]
    assert "N per rank 48 is not a multiple of 32" in qkv
    heads = _check(w4_tiny, "--gpu", "cpu", "--tp", "8")
    assert {"tensor": "model.layers.*.self_attn",
            "reason": "4 attention heads are not divisible by tp=8"} in heads["problems"]


def test_gpu_kernel_chain_and_dtype(w4_tiny):
    # sm_90, bf16: Machete takes only groups of 128, Marlin needs K % 128 (only down_proj has K = 128; the rest
    # read the 64-wide hidden state), Exllama float16 only.
    report = _check(w4_tiny, "--gpu", "sm_90")
    assert not report["compatible"]
    by_tensor = {p["tensor"]: p["reason"] for p in report["problems"]}
    assert set(by_tensor) == {f"model.layers.{i}.{m}" for i in range(2) for m in
                              ("self_attn.q_proj+k_proj+v_proj", "self_attn.o_proj", "mlp.gate_proj+up_proj")}
    reason = by_tensor["model.layers.0.mlp.gate_proj+up_proj"]
    assert "MacheteLinearKernel: group size 32 not supported" in reason and "K per rank 64 is not a multiple of 128" in reason
    assert report["kernel_families"] == {"MarlinLinearKernel": 2}  # the two down_proj
    fp16 = _check(w4_tiny, "--gpu", "sm_90", "--dtype", "float16")
    assert fp16["compatible"] and fp16["kernel_families"] == {"MarlinLinearKernel": 2, "ExllamaLinearKernel": 12}


def test_wider_model_picks_machete_on_hopper_and_marlin_on_ampere(tmp_path):
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=4)
    out = tmp_path / "w4g128"
    _quantize(src, out, group=128)
    assert set(_check(out, "--gpu", "sm_90")["kernel_families"]) == {"MacheteLinearKernel"}
    assert set(_check(out, "--gpu", "sm_80")["kernel_families"]) == {"MarlinLinearKernel"}
    # tp=2 on sm_80: o_proj K/2 = 128 (Marlin's k multiple, one group), down K/2 = 256: still Marlin.
    assert _check(out, "--gpu", "sm_80", "--tp", "2")["compatible"]
    # tp=4: o_proj K/4 = 64 holds no whole group of 128.
    report = _check(out, "--gpu", "sm_80", "--tp", "4")
    assert {"tensor": "model.layers.1.self_attn.o_proj",
            "reason": "K/tp = 64 is not a multiple of group size 128"} in report["problems"]


def test_version_features_and_cpu_limits(tmp_path):
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=4)
    block = tmp_path / "fp8b"
    _quantize(src, block, scheme="FP8_BLOCK", method="fp8")
    old = _check(block, "--gpu", "sm_80", "--vllm-version", "0.14.0")
    assert [p["tensor"] for p in old["problems"]] == ["quantization_config"]
    assert "needs vLLM >= 0.15.0" in old["problems"][0]["reason"]
    assert _check(block, "--gpu", "sm_80", "--vllm-version", "0.16.0")["compatible"]
    assert _check(block, "--gpu", "sm_90")["kernel_families"].keys() == {"CutlassFp8BlockScaledMMKernel"}
    assert not _check(block, "--gpu", "cpu")["compatible"]  # vLLM lists no FP8 block kernel for CPU
    asym = tmp_path / "asym"
    _quantize(src, asym, scheme="W4A16_ASYM", group=128)
    assert not _check(asym, "--gpu", "sm_80", "--vllm-version", "0.8.5")["compatible"]
    assert _check(asym, "--gpu", "sm_80")["compatible"]  # Marlin takes zero points
    # vLLM 0.32.0's CPU build loads zero points (measured: benchmarks/results/vllm_agreement.md)
    assert _check(asym, "--gpu", "cpu")["compatible"]
    w8 = tmp_path / "w8"
    _quantize(src, w8, scheme="W8A16", group=-1)
    cpu = _check(w8, "--gpu", "cpu")  # the CPU wna16 kernel is 4-bit only; int8 x int8 needs quantised activations
    assert not cpu["compatible"] and "8-bit weights not supported" in cpu["problems"][0]["reason"]
    assert cpu["fixes"] == []


def test_quantize_tp_warnings_use_the_same_split_rules(tiny_models, w4_tiny, tmp_path):
    summary = _quantize(tiny_models["llama"], tmp_path / "tp4", tp=4)
    warned = {w["module"] for w in summary["tp_warnings"]}
    split = {p["tensor"] for p in _check(w4_tiny, "--gpu", "cpu", "--tp", "4")["problems"] if "K/tp" in p["reason"]}
    assert warned == split == {f"model.layers.{i}.self_attn.o_proj" for i in range(2)}


def test_mla_latent_projection_is_replicated_and_moe_experts_are_split():
    """DeepSeek-V3 in vLLM: kv_a_proj_with_mqa is a ReplicatedLinear (never split), experts' down is row-parallel."""
    from quantkit.quant.schemes import get_scheme
    from quantkit.serving.parallel import QuantShape, split_problem

    block = QuantShape.from_scheme(get_scheme("FP8_BLOCK"))
    # N = 512 + 64 = 576; split 8 ways it would be 72 per rank, not whole blocks: but it is not split.
    assert split_problem("model.layers.3.self_attn.kv_a_proj_with_mqa", 576, 7168, block, 8) is None
    assert split_problem("model.layers.3.self_attn.kv_b_proj", 32768, 512, block, 8) is None  # 4096 per rank
    down = "model.layers.3.mlp.experts.7.down_proj"
    assert split_problem(down, 7168, 2048, block, 8) is None  # K/tp = 256: two whole blocks
    assert split_problem(down, 7168, 2048, block, 32) == "K/tp = 64 is not a multiple of the 128x128 block"
    grouped = QuantShape.from_scheme(get_scheme("W4A16", 128))
    assert split_problem(down, 7168, 2048, grouped, 32) == "K/tp = 64 is not a multiple of group size 128"
    assert split_problem("model.layers.3.mlp.experts.7.gate_proj", 2048, 7168, grouped, 32) is None  # N split


def test_bad_arguments_are_one_line(w4_tiny, tmp_path):
    for args, needle in ((["--gpu", "volta"], "unknown --gpu"), (["--tp", "0"], "--tp and --pp"),
                         (["--vllm-version", "latest"], "cannot read --vllm-version")):
        result = runner.invoke(app, ["check-serving", str(w4_tiny), *args])
        assert result.exit_code == 2 and needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    missing = runner.invoke(app, ["check-serving", str(tmp_path / "nothing")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


def test_problems_are_grouped_by_reason_in_layer_order_with_the_fix_that_loads(tmp_path):
    """12 layers, W4A16 g128, sm_80, tp=4: every o_proj has K/4 = 64, no whole group of 128 (one reason,
    twelve layers). Serving at tp=2 loads; no re-quantisation does (Marlin also wants K per rank in multiples of
    128, which tp=4 leaves at 64): each fix is checked, not guessed."""
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=8,
                          num_key_value_heads=4, num_hidden_layers=12)
    out = tmp_path / "w4g128"
    _quantize(src, out, group=128)
    report = _check(out, "--gpu", "sm_80", "--tp", "4")
    assert not report["compatible"]
    groups = {g["reason"]: g for g in report["problem_groups"]}
    o = groups["K/tp = 64 is not a multiple of group size 128"]
    assert o["count"] == 12 and o["tensors"] == ["model.layers.0-11.self_attn.o_proj"]
    assert report["fixes"] == ["serve with --tensor-parallel-size 2 (the largest that loads)"]
    shown = runner.invoke(app, ["check-serving", str(out), "--gpu", "sm_80", "--tp", "4"])
    assert shown.exit_code == 3
    assert shown.stdout.count("K/tp = 64") == 1 and "model.layers.0-11.self_attn.o_proj" in shown.stdout
    assert "would load after: serve with --tensor-parallel-size 2" in shown.stdout


def test_load_without_vllm_is_one_line_with_the_install_command(w4_tiny, monkeypatch):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is importable here")
    result = runner.invoke(app, ["check-serving", str(w4_tiny), "--gpu", "cpu", "--load"],
                           env={"QUANTKIT_VLLM_PYTHON": None})
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "pip install 'quantkit-llm[vllm]'" in result.stderr


VLLM_PYTHON = __import__("os").environ.get("QUANTKIT_VLLM_PYTHON")


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="set QUANTKIT_VLLM_PYTHON to an interpreter with vLLM")
def test_load_in_vllm_agrees_with_the_rules(w4_tiny, tmp_path, tiny_models):
    """vLLM's CPU build loads the symmetric W4A16 checkpoint the rules pass; the verdict says they agree."""
    report = _check(w4_tiny, "--gpu", "cpu", "--load")
    assert report["vllm_load"]["loaded"] and report["vllm_load"]["agrees_with_rules"] and report["compatible"]


def test_group_act_order_is_refused_from_the_release_that_refuses_it(tiny_models, tmp_path):
    """vLLM 0.32.0 refuses actorder='group' at config validation (measured on its CPU build); older releases
    loaded it with a deprecation warning. The fix is checked: the same tensors with static act-order load."""
    r = Recipe()
    r.model.source = str(tiny_models["llama"])
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = "gptq", "W4A16", 32
    r.quantization.options = {"gptq": {"actorder": "group"}}
    r.calibration.num_samples, r.calibration.seq_len = 4, 32
    out = tmp_path / "g_idx"
    quantize_model(r, out)
    new = _check(out, "--gpu", "cpu", "--vllm-version", "0.32.0")
    assert not new["compatible"] and "is refused from vLLM 0.32.0 on" in new["problems"][0]["reason"]
    assert "re-quantise with --actorder static (no g_idx)" in new["fixes"]
    old = _check(out, "--gpu", "cpu", "--vllm-version", "0.31.0")
    assert old["compatible"] and any("act-order 'group'" in w["reason"] for w in old["warnings"])


def test_static_fp8_is_refused_on_the_cpu_build_with_the_dynamic_fix(tiny_models, tmp_path):
    """vLLM 0.32.0's CPU build fails at load on static per-tensor FP8 activations (measured); FP8_DYNAMIC runs."""
    out = tmp_path / "fp8"
    _quantize(tiny_models["llama"], out, scheme="FP8", method="fp8")
    cpu = _check(out, "--gpu", "cpu")
    assert not cpu["compatible"] and "does not run on the cpu build" in cpu["problems"][0]["reason"]
    assert cpu["fixes"] == ["re-quantise with --scheme FP8_DYNAMIC (per-token activation scales)"]
    assert _check(out, "--gpu", "sm_90")["compatible"]


def test_int4_experts_are_refused_on_the_cpu_build(tiny_models, tmp_path):
    """vLLM 0.32.0's CPU build has no WNA16 FusedMoE backend (measured on a moefied SmolLM2); GPUs have one."""
    out = tmp_path / "moe"
    _quantize(tiny_models["qwen3_moe"], out, group=16)
    cpu = _check(out, "--gpu", "cpu")
    groups = {g["reason"]: g for g in cpu["problem_groups"]}
    experts = next(g for r, g in groups.items() if "no FusedMoE backend for WNA16 experts" in r)
    assert not cpu["compatible"] and all(".mlp.experts." in t for t in experts["tensors"])


def test_mla_latent_size_must_be_one_vllm_takes(tiny_models, tmp_path):
    """kv_lora_rank + qk_rope_head_dim in (320, 512, 576); the tiny DeepSeek-V3 has 32 + 16 = 48."""
    out = tmp_path / "ds"
    _quantize(tiny_models["deepseek_v3"], out, group=16)
    report = _check(out, "--gpu", "sm_90")
    reasons = [p["reason"] for p in report["problems"] if p["tensor"] == "model.layers.*.self_attn"]
    assert reasons and "MLA latent size 48 (kv_lora_rank 32 + qk_rope_head_dim 16)" in reasons[0]
    assert "--kv-lora-rank 304 or 496 or 560" in reasons[0]


def test_tied_deepseek_without_lm_head_is_refused(tiny_models, tmp_path):
    """vLLM's DeepSeek-V3 never ties: a tied checkpoint without lm_head.weight would serve uniform logits (measured:
    NLL ln(vocab) on vLLM 0.32.0's CPU build)."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "ds"
    _quantize(tiny_models["deepseek_v3"], out, group=16)
    assert not any(p["tensor"] == "lm_head.weight" for p in _check(out, "--gpu", "sm_90")["problems"])
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    for f in out.glob("*.safetensors"):
        tensors = {k: v for k, v in load_file(str(f)).items() if k != "lm_head.weight"}
        save_file(tensors, str(f), metadata={"format": "pt"})
    reasons = [p["reason"] for p in _check(out, "--gpu", "sm_90")["problems"] if p["tensor"] == "lm_head.weight"]
    assert reasons and "never ties lm_head" in reasons[0]



def test_mla_on_the_cpu_build_warns_about_its_rope(tiny_models, tmp_path):
    """vLLM 0.32.0's CPU build scores MLA's RoPE part differently from transformers (mla_rope_isolation.md): a
    warning on the cpu target, none on a GPU target."""
    out = tmp_path / "ds"
    _quantize(tiny_models["deepseek_v3"], out, group=16)
    cpu = [w["reason"] for w in _check(out, "--gpu", "cpu")["warnings"]]
    gpu = [w["reason"] for w in _check(out, "--gpu", "sm_90")["warnings"]]
    assert any("RoPE part of MLA attention" in r for r in cpu) and not any("RoPE part" in r for r in gpu)


def test_fp4_has_no_cpu_kernel_and_w4afp8_only_hopper(tiny_models, tmp_path):
    """vLLM 0.32.0's CPU build refuses NVFP4 (`Marlin FP4 not available`, benchmarks/results/vllm_agreement.md); its
    GPU schemes: W4A4Fp4 from sm_75, W4A8Fp8 on sm_90 exactly. fp4 linears have no weight_shape: they are found
    by their packed bytes."""
    nv, w4a8 = tmp_path / "nv", tmp_path / "w4afp8"
    _quantize(tiny_models["llama"], nv, scheme="NVFP4A16")
    _quantize(tiny_models["llama"], w4a8, scheme="W4AFP8")
    cpu = _check(nv, "--gpu", "cpu")
    assert not cpu["compatible"] and cpu["linears_checked"] == 14
    assert "no vLLM nvfp4 kernel on the CPU build" in cpu["problems"][0]["reason"]
    assert _check(nv, "--gpu", "sm_90")["compatible"]
    assert _check(w4a8, "--gpu", "sm_90")["compatible"]
    assert not _check(w4a8, "--gpu", "sm_100")["compatible"]
