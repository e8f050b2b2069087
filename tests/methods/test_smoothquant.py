"""SmoothQuant: folding is exact, the scale rule is the paper's, it helps W8A8 where activations have
outliers, and its checkpoints load in transformers + compressed-tensors exactly as quantkit's runtime runs them."""

import json

import pytest
import torch
from torch import nn

from quantkit.errors import InputError
from quantkit.methods import LayerContext, build_methods
from quantkit.methods.smoothquant import SmoothQuant
from quantkit.models.experts import UnfusedExperts
from quantkit.models.loader import open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.capture import capture_layer_inputs, run_layer
from quantkit.pipeline.engine import method_stages, plan_layers, quantize_model
from quantkit.quant.schemes import get_scheme
from quantkit.quant.smoothing import expand_gqa, smoothquant_scales
from quantkit.recipe import Recipe
from tests.conftest import make_tiny_model

FAMILIES = ["llama", "qwen2", "gemma", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


def _set_all_experts(layer, on):
    for m in layer.modules():
        if isinstance(m, UnfusedExperts):
            m.calibrate_all_experts = on


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mappings", ["norm", "all"])
def test_smoothing_is_exact_without_quantisation(tiny_models, family, mappings):
    handle = open_model(resolve_model(str(tiny_models[family])))
    scheme = get_scheme("W8A8")
    plans = plan_layers(handle, scheme, ["lm_head"])
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    hidden, calls = capture_layer_inputs(handle, ids, 2, "cpu", torch.float32)
    changed = set()
    for plan in plans:
        layer = handle.materialize_layer(plan.index, torch.float32)
        modules = dict(layer.named_modules())
        before = {n: p.detach().clone() for n, p in layer.named_parameters()}
        ctx = LayerContext(index=plan.index, layer=layer, targets={t.local: modules[t.local] for t in plan.targets},
                           scheme=scheme, checkpoint_names={t.local: t.checkpoint for t in plan.targets},
                           adapter=handle.adapter)
        with torch.no_grad():
            ref = run_layer(layer, hidden[0], calls[0][plan.index])
            sq = SmoothQuant(scheme, alpha=0.8, mappings=mappings)
            hooks = sq.attach(ctx)
            _set_all_experts(layer, True)
            run_layer(layer, hidden[0], calls[0][plan.index])
            _set_all_experts(layer, False)
            for h in hooks:
                h.remove()
            assert sq._mappings, "no smoothing mapping resolved"
            sq.apply(ctx)
            out = run_layer(layer, hidden[0], calls[0][plan.index])
        rel = ((out - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, (family, plan.index, rel)
        changed |= {n for n, p in layer.named_parameters() if not torch.equal(p, before[n])}
    assert any("input_layernorm" in n for n in changed)
    if handle.adapter.experts is not None:
        # The MoE norm -> router + experts mapping really rescaled the router and the experts.
        assert any(n.endswith("mlp.gate.weight") for n in changed), sorted(changed)
        assert any("experts.experts.0." in n for n in changed)
    if mappings == "all" and family == "llama":
        assert any(n.endswith("v_proj.weight") for n in changed) and any(n.endswith("up_proj.weight") for n in changed)


def test_scale_rule_and_gqa_expansion():
    a = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smoothquant_scales(a, w, 0.8)
    assert torch.allclose(s[:2], torch.tensor([4.0 ** 0.8 / 1.0 ** 0.2, 1.0 / 4.0 ** 0.2]))
    assert s[2] == 1 and s[3] == 1  # no signal on one side: leave the channel alone
    # 2 kv heads of dim 3, 2 query heads per kv head: query head h reads kv head h // 2.
    sv = torch.arange(6.0)
    so = expand_gqa(sv, 12, 3)
    assert so.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]


def test_method_chain_and_capabilities():
    w8 = get_scheme("W8A8")
    assert [m.name for m in build_methods("smoothquant", w8)] == ["smoothquant", "rtn"]
    chain = build_methods("smoothquant+gptq", w8)
    assert [[m.name for m in st] for st in method_stages(chain)] == [["smoothquant"], ["gptq"]]
    with pytest.raises(InputError, match="cannot produce W4A16"):
        build_methods("smoothquant", get_scheme("W4A16"))
    with pytest.raises(InputError, match="cannot produce W8A8.*fp8"):
        build_methods("fp8", w8)
    with pytest.raises(InputError, match="alpha"):
        build_methods("smoothquant", w8, {"smoothquant": {"alpha": 1.5}})


def _recipe(model, method, scheme, **opts) -> Recipe:
    r = Recipe()
    r.model.source = str(model)
    r.quantization.method, r.quantization.scheme = method, scheme
    r.quantization.options = opts
    r.calibration.num_samples, r.calibration.seq_len = 8, 32
    return r


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    """A tiny llama whose norms have a few huge channels: the activation outliers SmoothQuant is for."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path_factory.mktemp("outlier") / "llama", "llama")
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in tensors.items():
        if name.endswith("layernorm.weight"):
            t[[3, 17, 40]] *= 40.0
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def test_smoothquant_reduces_w8a8_error_with_outliers(tmp_path, outlier_model):
    plain = quantize_model(_recipe(outlier_model, "rtn", "W8A8"), tmp_path / "rtn")
    smooth = quantize_model(_recipe(outlier_model, "smoothquant", "W8A8"), tmp_path / "sq")
    err = lambda s: sum(r["rel_error"] for r in s["layers"]) / len(s["layers"])  # noqa: E731
    assert smooth["method"] == "smoothquant+rtn"
    assert err(smooth) < 0.8 * err(plain), (err(smooth), err(plain))


@pytest.mark.parametrize("method,scheme", [("smoothquant+gptq", "W8A8"), ("smoothquant", "W8A8_STATIC"),
                                           ("smoothquant", "FP8"), ("smoothquant", "FP8_BLOCK")])
def test_checkpoint_loads_in_transformers_and_matches_runtime(tmp_path, method, scheme):
    from transformers import AutoModelForCausalLM

    from quantkit.runtime import load_model

    model = make_tiny_model(tmp_path / "base", "llama", hidden_size=128, intermediate_size=192)
    out = tmp_path / "q"
    summary = quantize_model(_recipe(model, method, scheme), out)
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    if scheme == "FP8_BLOCK":
        # K = 192 (down_proj) is not a multiple of 128: that linear falls back, by name, in its own group.
        assert summary["scheme_overrides"] == {"FP8_DYNAMIC": [f"model.layers.{i}.mlp.down_proj" for i in range(2)]}
        assert any(g["targets"] == summary["scheme_overrides"]["FP8_DYNAMIC"] for g in cfg["config_groups"].values())
        manifest = json.loads((out / "quantkit_manifest.json").read_text())
        assert manifest["scheme_overrides"] == summary["scheme_overrides"]
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits.float()
        rt = load_model(out, kernels="reference")  # the bit-exact path; kernels are tested in tests/runtime
        got = rt(input_ids=ids).logits.float()
        base = AutoModelForCausalLM.from_pretrained(model).eval()(ids).logits.float()
    assert sum(rt.formats.values()) == 14
    assert torch.equal(got, ref), (got - ref).abs().max()
    assert 0 < (ref - base).abs().max() < 0.5 * base.abs().max()  # quantised, and still the same model


@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
def test_statistics_tokens_smooth_as_a_run_on_the_first_batches_only(tiny_models, schedule):
    """`statistics_tokens`: the absmax observers see only the run's first batches, so the folded norms are those
    of a run that had only those batches (GPTQ after it still sees every batch: its weights are not compared),
    under either schedule; every batch still leaves the layer (W8A8's simulated activations make its output
    differ from a plain forward, so only that it moved is checked here; AWQ's test checks the output itself)."""
    import copy

    from quantkit.methods.gptq import GPTQ
    from quantkit.pipeline.activations import ActivationStore
    from quantkit.pipeline.engine import LayerBatches, layer_context, process_layer

    handle = open_model(resolve_model(str(tiny_models["llama"])))
    scheme = get_scheme("W8A8")
    plan = plan_layers(handle, scheme, ["lm_head"])[0]
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    hidden, calls = capture_layer_inputs(handle, ids, 2, "cpu", torch.float32)  # 4 batches of 2 x 16 tokens
    base = handle.materialize_layer(0, torch.float32)
    norms, outs = {}, {}
    for label, n_batches, options in (("first", 4, {"statistics_tokens": 64}), ("only", 2, {"statistics_tokens": 64})):
        layer = copy.deepcopy(base)
        ctx = layer_context(handle, plan, layer, scheme, torch.float32, torch.float32, False)
        acts = ActivationStore(None)
        for j in range(n_batches):
            acts[j] = hidden[j].clone()
        batches = LayerBatches.local(acts, calls[:n_batches], error_batches=1)
        batches.batch_tokens = 2 * 16
        process_layer(layer, ctx, [SmoothQuant(scheme, **options), GPTQ(scheme)], batches, schedule=schedule)
        assert ctx.schedule == schedule
        norms[label] = {n: p.detach().clone() for n, p in layer.named_parameters() if n.endswith("norm.weight")}
        outs[label] = [acts[j] for j in range(n_batches)]
        if label == "first":  # a batch the observers never saw still went through the layer
            assert acts[3].shape == hidden[3].shape and not torch.equal(acts[3], hidden[3])
    assert norms["first"].keys() == norms["only"].keys() and norms["first"]
    assert all(torch.equal(norms["first"][n], norms["only"][n]) for n in norms["first"])
    assert not all(torch.equal(norms["first"][n], base.get_parameter(n)) for n in norms["first"])
