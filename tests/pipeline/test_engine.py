"""End to end: quantise, then let transformers + compressed-tensors load the checkpoint as a real consumer."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from quantkit.errors import InputError
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from quantkit.pipeline.engine import quantize_model
from quantkit.recipe import Recipe


def _recipe(model: Path, scheme="W4A16", group_size=32, method="rtn", num_samples=4, seq_len=32, **quant) -> Recipe:
    r = Recipe()
    r.model.source = str(model)
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = method, scheme, group_size
    for k, v in quant.items():
        setattr(r.quantization, k, v)
    r.calibration.num_samples, r.calibration.seq_len = num_samples, seq_len
    return r


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _oracle_dense(tensors: dict, module: str, bits: int, group: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Dequantise one linear with compressed-tensors' unpacker and the documented formula (q - zp) * scale."""
    shape = torch.Size(tensors[f"{module}.weight_shape"].tolist())
    q = unpack_from_int32(tensors[f"{module}.weight_packed"], bits, shape).float()
    scale = tensors[f"{module}.weight_scale"].float()
    n_groups = scale.shape[1]
    if f"{module}.weight_zero_point" in tensors:
        zp = unpack_from_int32(tensors[f"{module}.weight_zero_point"], bits, torch.Size([shape[0], n_groups]), packed_dim=0).float()
    else:
        zp = torch.zeros_like(scale)
    per = shape[1] // n_groups
    q = q.reshape(shape[0], n_groups, per)
    return ((q - zp[..., None]) * scale[..., None]).reshape(shape).to(dtype)


def _reference_with_dequantised(original: Path, ckpt: Path, bits: int, group, dtype=torch.float32):
    """The original model with every quantised linear replaced by its oracle-dequantised weight, built as a
    dense checkpoint (per-expert names included) so transformers itself does any expert fusing."""
    import shutil
    from safetensors.torch import save_file

    tensors = _tensors(ckpt)
    dense, replaced = {}, 0
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            module = name[: -len(".weight_packed")]
            dense[module + ".weight"] = _oracle_dense(tensors, module, bits, group, dtype)
            replaced += 1
        elif not name.endswith((".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")):
            dense[name] = t
    folder = ckpt.parent / (ckpt.name + "-oracle")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    save_file(dense, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("quantization_config")
    (folder / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), replaced


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme,group,bits", [("W4A16", 32, 4), ("W8A16", -1, 8)])
def test_checkpoint_loads_in_transformers_and_matches(tmp_path, tiny_models, family, scheme, group, bits):
    src = tiny_models[family]
    out = tmp_path / "q"
    summary = quantize_model(_recipe(src, scheme, group), out)
    assert summary["quantized_linears"] == 14  # 7 linears x 2 layers
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref, replaced = _reference_with_dequantised(src, out, bits, group)
    assert replaced == 14
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)
        # and quantisation did something
        plain = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        assert (plain(ids).logits - ref(ids).logits).abs().max() > 1e-4


def test_asymmetric_checkpoint_matches_with_dequantize_load(tmp_path, tiny_models):
    """Asymmetric W4A16 loads in transformers with dequantize=True (its default path has a zero-point bug)."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    src, out = tiny_models["llama"], tmp_path / "q"
    quantize_model(_recipe(src, "W4A16_ASYM", 32), out)
    tensors = _tensors(out)
    assert "model.layers.0.self_attn.q_proj.weight_zero_point" in tensors
    assert tensors["model.layers.0.self_attn.q_proj.weight_zero_point"].shape == (8, 2)  # [ceil(64*4/32), 64/32]
    loaded = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    ref, _ = _reference_with_dequantised(src, out, 4, 32)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family,gate,expert_fmt,n_experts", [
    ("mixtral", "block_sparse_moe.gate", "block_sparse_moe.experts.{e}.{p}", 4),
    ("qwen2_moe", "mlp.gate", "mlp.experts.{e}.{p}", 4),
])
def test_moe_every_expert_quantised_router_untouched(tmp_path, tiny_models, family, gate, expert_fmt, n_experts):
    src, out = tiny_models[family], tmp_path / "q"
    quantize_model(_recipe(src, "W4A16", 32), out)
    tensors = _tensors(out)
    projs = ("w1", "w2", "w3") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for layer in range(2):
        for e in range(n_experts):
            for p in projs:
                name = f"model.layers.{layer}." + expert_fmt.format(e=e, p=p)
                assert f"{name}.weight_packed" in tensors, name
                assert f"{name}.weight" not in tensors
        router = f"model.layers.{layer}.{gate}"
        original = _tensors(src)
        assert torch.equal(tensors[f"{router}.weight"], original[f"{router}.weight"])
        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert router in ignore
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref, replaced = _reference_with_dequantised(src, out, 4, 32)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        # transformers re-fuses the dequantised experts; routing must then agree exactly
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_sharded_output_loads(tmp_path, tiny_models):
    src, out = tiny_models["llama"], tmp_path / "q"
    quantize_model(_recipe(src), out, max_shard_bytes=20_000)
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    single = tmp_path / "single"
    quantize_model(_recipe(src), single)
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_outputs_are_deterministic_and_manifest_complete(tmp_path, tiny_models):
    src = tiny_models["llama"]
    a, b = tmp_path / "a", tmp_path / "b"
    quantize_model(_recipe(src), a)
    quantize_model(_recipe(src), b)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    manifest = json.loads((a / "quantkit_manifest.json").read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "recipe.yaml"}
    assert len(manifest["calibration"]["fingerprint"]) == 64
    assert len(manifest["layers"]) == 2 and all(0 < l["rel_error"] < 1 for l in manifest["layers"])
    assert manifest["source"]["files"]["model.safetensors"]["sha256"]
    assert not list(tmp_path.glob("*.partial"))


def _run_cli(args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "quantkit.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "QUANTKIT_NO_PROGRESS": "1", **(env or {})}, **kw)


def test_resume_after_sigkill_gives_identical_tensors(tmp_path):
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", num_hidden_layers=6)
    args = ["quantize", "--model", str(src), "--method", "rtn", "--group-size", "32", "--num-samples", "4",
            "--seq-len", "32"]
    clean = tmp_path / "clean"
    assert _run_cli(args + ["--output", str(clean)]).returncode == 0
    out = tmp_path / "killed"
    partial = tmp_path / "killed.partial"
    proc = subprocess.Popen([sys.executable, "-m", "quantkit.cli", *args, "--output", str(out)],
                            env={**os.environ, "QUANTKIT_NO_PROGRESS": "1", "QUANTKIT_DEBUG_LAYER_DELAY": "0.4"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = partial / ".quantkit-journal.json"
    deadline = time.time() + 120
    while time.time() < deadline:
        if journal.exists() and json.loads(journal.read_text() or "{}").get("layers_done", 0) >= 2:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and partial.exists()
    refused = _run_cli(args + ["--output", str(out)])
    assert refused.returncode == 2 and "--resume" in refused.stderr
    resumed = _run_cli(args + ["--output", str(out), "--resume", "--json"])
    assert resumed.returncode == 0, resumed.stderr
    assert not partial.exists()
    # the dtype came from the journal, not from the user: not reported as forced
    assert json.loads(resumed.stdout)["compute"]["reason"] == "resumed"
    assert _tensors(out).keys() == _tensors(clean).keys()
    for k, v in _tensors(clean).items():
        assert torch.equal(_tensors(out)[k], v), k
    assert (out / "model.safetensors").read_bytes() == (clean / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_real_smollm2_w4a16_g64_loads_in_transformers(tmp_path, smollm2_path):
    out = tmp_path / "smol"
    r = _recipe(smollm2_path, "W4A16", 64, num_samples=8, seq_len=128)
    r.model.source = None  # the embedded default
    summary = quantize_model(r, out)
    assert summary["quantized_linears"] == 210
    assert 4.2 < summary["bits_per_weight"] < 4.3
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    ref, replaced = _reference_with_dequantised(smollm2_path, out, 4, 64, dtype=torch.bfloat16)
    assert replaced == 210
    ids = torch.randint(0, 49152, (1, 48))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_offloaded_activations_give_identical_output(tmp_path, tiny_models):
    src = tiny_models["qwen2"]
    quantize_model(_recipe(src), tmp_path / "mem")
    quantize_model(_recipe(src), tmp_path / "disk", offload_dir=tmp_path / "spill")
    assert (tmp_path / "mem" / "model.safetensors").read_bytes() == (tmp_path / "disk" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_STATIC", "FP8", "FP8_DYNAMIC", "FP8_BLOCK"])
def test_activation_schemes_load_and_run_in_transformers(tmp_path, scheme):
    """Every W8A8/FP8 checkpoint must run in transformers + compressed-tensors; FP8_BLOCK layers whose K is not a
    multiple of 128 (here down_proj, K=320) fall back to FP8_DYNAMIC in their own config group."""
    from tests.conftest import make_tiny_model

    src = make_tiny_model(tmp_path / "src", "llama", dtype=torch.bfloat16, hidden_size=256, intermediate_size=320)
    out = tmp_path / scheme
    summary = quantize_model(_recipe(src, scheme), out)
    tensors = _tensors(out)
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.weight"].dtype == (torch.int8 if scheme.startswith("W8") else torch.float8_e4m3fn)
    assert (f"{q}.input_scale" in tensors) == (scheme in ("W8A8_STATIC", "FP8"))
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    if scheme == "FP8_BLOCK":
        assert tensors[f"{q}.weight_scale"].shape == (2, 2)
        fallback = summary["scheme_overrides"]["FP8_DYNAMIC"]
        assert fallback == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
        assert config["config_groups"]["group_1"]["targets"] == fallback
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    if scheme == "FP8_BLOCK":
        assert loaded.get_submodule("model.layers.0.mlp.down_proj").quantization_scheme.weights.strategy == "channel"
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        logits = loaded(ids).logits.float()
        base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)(ids).logits.float()
    assert torch.isfinite(logits).all()
    # 8-bit quantisation is close to the original but not identical to it
    rel = (logits - base).norm() / base.norm()
    assert 0 < rel < 0.2, rel


def test_deepseek_mtp_block_is_kept_at_source_precision_and_ignored(tmp_path):
    """DeepSeek-V3 stores its multi-token-prediction block as one layer past the decoder's
    (num_nextn_predict_layers): transformers' model does not have it, the checkpoint must keep it intact."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_tiny_model

    model = make_tiny_model(tmp_path / "ds", "deepseek_v3", num_nextn_predict_layers=1)
    weights = load_file(str(model / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    mtp = {"model.layers.2.eh_proj.weight": torch.randn(64, 128, generator=g),
           "model.layers.2.enorm.weight": torch.rand(64, generator=g),
           "model.layers.2.hnorm.weight": torch.rand(64, generator=g),
           "model.layers.2.mlp.down_proj.weight": torch.randn(64, 128, generator=g),
           "model.layers.2.shared_head.norm.weight": torch.rand(64, generator=g)}
    save_file({**weights, **mtp}, str(model / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "q"
    quantize_model(_recipe(model, group_size=32), out)
    written = _tensors(out)
    for name, tensor in mtp.items():
        assert torch.equal(written[name], tensor), name
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert "re:model\\.layers\\.2\\..*" in ignore
    assert "model.layers.1.mlp.experts.0.down_proj.weight_packed" in written  # the decoder is quantised
    model_hf = AutoModelForCausalLM.from_pretrained(out)  # loads, the MTP tensors are unexpected keys only
    assert model_hf is not None


@pytest.mark.parametrize("method,named", [("gptq", {"statistics", "factorisation", "solve", "error_report"}),
                                          ("awq", {"statistics", "scale_search", "error_report"}),
                                          ("rtn", {"statistics", "scale_search"})])
def test_every_layer_records_its_phases_without_overlap(tmp_path, tiny_models, method, named):
    from quantkit.pipeline.engine import quantize_model

    r = _recipe(tiny_models["llama"])
    r.quantization.method = method
    summary = quantize_model(r, tmp_path / "out")
    layers = json.loads((tmp_path / "out" / "quantkit_manifest.json").read_text())["layers"]
    for rec in layers:
        phases = rec["phases"]
        assert named | {"load", "forward", "method_other", "write"} <= set(phases), phases
        assert all(v >= 0 for v in phases.values())
        # Phases are disjoint slices of the layer's wall time: together they cannot exceed it.
        assert sum(phases.values()) <= rec["seconds"] * 1.02 + 0.01, rec
    totals = summary["phase_seconds"]
    for k in phases:
        assert totals[k] == pytest.approx(sum(rec["phases"][k] for rec in layers), abs=2e-3)
    assert totals["outside_layers"] >= 0


def test_process_layer_replaces_inputs_by_quantised_outputs_and_measures_error_on_the_error_batches(tiny_models):
    """One generation of activations: on return the store holds the quantised layer's outputs of the original
    inputs, and the error is that of the first `error_batches` batches against the unquantised layer."""
    import copy

    from quantkit.methods.gptq import GPTQ
    from quantkit.pipeline.activations import ActivationStore
    from quantkit.pipeline.capture import capture_layer_inputs, run_layer
    from quantkit.pipeline.engine import LayerBatches, layer_context, plan_layers, process_layer
    from quantkit.models.loader import open_model
    from quantkit.models.source import resolve_model
    from quantkit.quant.schemes import get_scheme

    handle = open_model(resolve_model(str(tiny_models["llama"])))
    ids = torch.randint(0, 256, (6, 24), generator=torch.Generator().manual_seed(3))
    hidden, calls = capture_layer_inputs(handle, ids, batch_size=2)
    scheme = get_scheme("W4A16", 32)
    layer = handle.materialize_layer(0)
    original = copy.deepcopy(layer)
    plan = plan_layers(handle, scheme, ["lm_head"])[0]
    ctx = layer_context(handle, plan, layer, scheme, torch.float32, torch.float32, False)
    acts = ActivationStore()
    for j, h in enumerate(hidden):
        acts[j] = h
    rel = process_layer(layer, ctx, [GPTQ(scheme)], LayerBatches.local(acts, calls, error_batches=2))
    with torch.no_grad():
        quantised = [run_layer(layer, h, c[0]) for h, c in zip(hidden, calls)]
        reference = [run_layer(original, h, c[0]) for h, c in zip(hidden, calls)]
    for j, q in enumerate(quantised):
        torch.testing.assert_close(acts[j], q, rtol=0, atol=0)
        assert not torch.equal(q, reference[j])  # the layer really was quantised
    num = sum((q - r).double().pow(2).sum() for q, r in zip(quantised[:2], reference[:2]))
    den = sum(r.double().pow(2).sum() for r in reference[:2])
    assert rel == pytest.approx(float((num / den).sqrt()), rel=1e-9)


def test_routed_expert_statistics_give_starved_experts_rtn_and_the_manifest_lists_them(tmp_path, tiny_models):
    src = tiny_models["qwen2_moe"]  # 2 layers, 4 experts, top-2
    runs = {}
    for mode in ("all", "routed"):
        r = _recipe(src, "W4A16", 32, method="gptq", num_samples=4, seq_len=32)
        # Above any expert's share of 4 x 32 tokens x top-2: every expert is starved.
        r.calibration.expert_tokens, r.calibration.min_expert_tokens = mode, 10 ** 6
        quantize_model(r, tmp_path / mode)
        runs[mode] = json.loads((tmp_path / mode / "quantkit_manifest.json").read_text())
    for mode, m in runs.items():
        experts = m["experts"]
        assert experts["calibration"] == mode and len(experts["starved"]) == 2 * 4
        # Every routed slot is counted: each layer's listed tokens sum to tokens x k.
        for layer in ("0", "1"):
            listed = [s["routed_tokens"] for s in experts["starved"] if str(s["layer"]) == layer]
            assert sum(listed) == 4 * 32 * 2
        fell_back = {e["module"] for e in m.get("events", []) if "fell back to RTN" in e["event"]}
        if mode == "all":
            assert experts["treatment"] == "all-token statistics" and not fell_back
        else:
            # Every expert projection, and nothing else (attention still saw every token), went to RTN.
            assert experts["treatment"] == "rtn"
            assert fell_back == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(2) for e in range(4)
                                 for p in ("gate_proj", "up_proj", "down_proj")}



def test_routed_expert_statistics_refuse_methods_that_fold_scales_across_experts(tmp_path, tiny_models):
    r = _recipe(tiny_models["qwen2_moe"], "W4A16", 32, method="awq")
    r.calibration.expert_tokens = "routed"
    with pytest.raises(InputError, match="expert_tokens routed does not work with awq"):
        quantize_model(r, tmp_path / "q")
    assert not (tmp_path / "q").exists()
