"""RuntimeMoE (the runtime's own sparse-MoE block) against transformers' MoE blocks on the same tiny checkpoints.

Tolerance for logits: 1e-5 in fp32. transformers runs each expert's gate and up projections as one fused
[2I, H] matmul, the runtime as two linears; the same products blocked differently can differ by a few ulps
(~1e-7 relative) per layer. A wrong routing decision or weight (a flipped expert, unnormalised top-k weights,
a missing scaling factor) moves logits by more than 1e-3, which `test_a_wrong_router_spec_is_detected` checks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from quantkit.errors import InputError
from quantkit.models.adapters import adapter_for
from quantkit.models.moe import RouterSpec, router_spec
from quantkit.runtime import load_model
from quantkit.runtime.linear import QuantLinear
from quantkit.runtime.moe import RuntimeMoE, moe_blocks, observe_routing, override_routing, route
from tests.conftest import make_tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)
BASE = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]


def _with_random_selection_bias(folder: Path, seed: int = 0) -> Path:
    """Give every DeepSeek router a random e_score_correction_bias (transformers initialises it to zeros)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            # Sigmoid scores here spread by ~0.04 around 0.5: a bias of this size reorders many choices.
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.05
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def moe_models(tiny_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    models = {f: tiny_models[f] for f in BASE}
    models["qwen3_moe_norm"] = make_tiny_model(root / "qwen3_norm", "qwen3_moe", norm_topk_prob=True)
    models["deepseek_v3_grouped"] = _with_random_selection_bias(make_tiny_model(
        root / "ds_grouped", "deepseek_v3", n_routed_experts=8, n_group=2, topk_group=1))
    # Dense layers inside MoE models: Qwen's mlp_only_layers and decoder_sparse_step (DeepSeek's
    # first_k_dense_replace=1 is in the base tiny model).
    models["qwen2_moe_mlp_only"] = make_tiny_model(root / "qwen2_mlp_only", "qwen2_moe", mlp_only_layers=[1])
    models["qwen3_moe_sparse_step"] = make_tiny_model(root / "qwen3_step", "qwen3_moe", decoder_sparse_step=2,
                                                      num_hidden_layers=4)
    return models


CASES = [*BASE, "qwen3_moe_norm", "deepseek_v3_grouped", "qwen2_moe_mlp_only", "qwen3_moe_sparse_step"]


def _ids(batch=2, seq=24, seed=0):
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _reference(path):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def _sparse_layers(ref) -> list[int]:
    return [i for i, layer in enumerate(ref.model.layers) if hasattr(layer.mlp, "experts")]


@pytest.mark.parametrize("case", CASES)
def test_runtime_moe_logits_match_transformers(moe_models, case):
    ids = _ids()
    rt, ref = load_model(moe_models[case]), _reference(moe_models[case])
    sparse = _sparse_layers(ref)
    assert 0 < len(sparse)
    # Exactly the sparse layers are RuntimeMoE; dense ones keep their MLP.
    layers = rt.model.model.layers
    assert [i for i, layer in enumerate(layers) if isinstance(layer.mlp, RuntimeMoE)] == sparse
    assert all(not isinstance(layers[i].mlp, RuntimeMoE) and hasattr(layers[i].mlp, "gate_proj")
               for i in range(len(layers)) if i not in sparse)
    with torch.no_grad():
        got, want = rt(input_ids=ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("family", BASE)
def test_bf16_matches_the_transformers_block_path_bitwise(moe_models, family):
    """In bf16 the dtype facts (router matmul in fp32 or not, weights rounded to bf16 or not) decide bits."""
    ids = _ids(seed=7)
    with torch.no_grad():
        got = load_model(moe_models[family], dtype="bfloat16")(input_ids=ids).logits
        want = load_model(moe_models[family], dtype="bfloat16", runtime_moe=False)(input_ids=ids).logits
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max().item()}"


def _transformers_routing(ref, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(indices, weights) that transformers' own router modules return, per sparse layer."""
    seen = {}
    hooks = [ref.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, args, out, i=i: seen.__setitem__(i, (out[2], out[1]))) for i in _sparse_layers(ref)]
    with torch.no_grad():
        ref(ids)
    for h in hooks:
        h.remove()
    return seen


def _runtime_routing(rt, ids) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    seen = {}
    with observe_routing(rt.model, lambda i, n, sel, w, scores: seen.__setitem__(i, (sel, w))), torch.no_grad():
        rt(input_ids=ids)
    return seen


def _by_expert(selected, weights):
    order = selected.argsort(dim=-1)
    return selected.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("case", CASES)
def test_router_selects_the_experts_transformers_selects(moe_models, case):
    ids = _ids(seed=1)
    ref_routing = _transformers_routing(_reference(moe_models[case]), ids)
    got = _runtime_routing(load_model(moe_models[case]), ids)
    assert sorted(got) == sorted(ref_routing)
    for layer, (ref_sel, ref_w) in ref_routing.items():
        sel, w = _by_expert(*got[layer])
        ref_sel, ref_w = _by_expert(ref_sel, ref_w)
        assert torch.equal(sel, ref_sel), f"layer {layer}: {(sel != ref_sel).any(-1).sum()} tokens differ"
        torch.testing.assert_close(w.float(), ref_w.float(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_predict_selects_what_the_routing_selects(moe_models, case):
    # The offload prefetch predicts with block.predict: the same experts as the block's routing, weights skipped.
    rt = load_model(moe_models[case])
    blocks = {b.layer_index: b for b in moe_blocks(rt.model)}
    captured = []
    with override_routing(rt.model, lambda i, routing, x: captured.append((i, routing, x))), torch.no_grad():
        rt(input_ids=_ids(seed=3))
    assert captured
    for layer, routing, x in captured:
        assert torch.equal(blocks[layer].predict(x).sort(-1).values, routing.selected.sort(-1).values)


def test_group_limits_and_selection_bias_are_exercised(moe_models):
    """The grouped DeepSeek checkpoint is one where the bias and the group limit each change some choices."""
    rt = load_model(moe_models["deepseek_v3_grouped"])
    (block,) = moe_blocks(rt.model)
    spec = block.spec
    assert spec.group_limited and spec.selection_bias and spec.routed_scaling_factor == 2.5
    bias = block.gate.e_score_correction_bias
    assert bias.abs().min() > 0
    captured = []
    with override_routing(rt.model, lambda i, routing, x: captured.append(routing)), torch.no_grad():
        rt(input_ids=_ids(seed=2))
    (routing,) = captured
    # Group-limited with topk_group=1: both experts of a token lie in one group of 4.
    groups = routing.selected // (spec.num_experts // spec.n_group)
    assert (groups == groups[:, :1]).all()

    def choices(s, b):
        return route(s, routing.logits, b).selected.sort(dim=-1).values

    actual = routing.selected.sort(dim=-1).values
    assert (choices(spec, None) != actual).any(), "the bias changes no choice: it is not exercised"
    ungrouped = dataclasses.replace(spec, n_group=1, topk_group=1)
    assert (choices(ungrouped, bias) != actual).any(), "the group limit changes no choice: it is not exercised"


@pytest.mark.parametrize("family", BASE)
def test_observer_sees_every_token_of_every_moe_layer_once(moe_models, family):
    rt = load_model(moe_models[family])
    calls = []

    def observer(layer, count, selected, weights, scores):
        calls.append((layer, count, selected.clone(), weights.shape, scores.shape))

    batch, seq = 3, 7
    with observe_routing(rt, observer) as blocks, torch.no_grad():
        rt(input_ids=_ids(batch, seq))
    spec = blocks[0].spec
    assert sorted(c[0] for c in calls) == sorted(b.layer_index for b in blocks) and len(blocks) > 0
    for layer, count, selected, w_shape, s_shape in calls:
        assert count == batch * seq
        assert selected.shape == w_shape == (batch * seq, spec.top_k)
        assert s_shape == (batch * seq, spec.num_experts)
        assert selected.min() >= 0 and selected.max() < spec.num_experts
        assert (selected.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
    # Leaving the context removes the observer.
    with torch.no_grad():
        rt(input_ids=_ids(batch, seq))
    assert len(calls) == len(blocks)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_kv_cache_generation_is_unchanged_and_observed_per_step(moe_models, family):
    from quantkit.runtime import generate

    ids = _ids(2, 6, seed=6)
    rt = load_model(moe_models[family])
    counts = []
    with observe_routing(rt.model, lambda layer, n, *rest: counts.append(n)) as blocks:
        got = generate(rt, ids, max_new_tokens=5).tokens
    want = generate(load_model(moe_models[family], runtime_moe=False), ids, max_new_tokens=5).tokens
    assert torch.equal(got, want)
    # Prefill: every prompt token once; each of the 4 decode steps: one token per row.
    assert counts == [12] * len(blocks) + [2] * (4 * len(blocks))


def _expert_mlp(t: dict, prefix: str, names: tuple[str, str, str], x: torch.Tensor) -> torch.Tensor:
    gate, up, down = (t[f"{prefix}.{n}.weight"] for n in names)
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_override_forcing_expert_zero_matches_a_hand_computation(moe_models, family):
    path = moe_models[family]
    rt = load_model(path)
    ids = _ids(seed=3)
    block = rt.model.model.layers[1].mlp
    io = {}
    hook = block.register_forward_hook(lambda mod, args, out: io.update(x=args[0], y=out))

    def expert_zero(layer, routing, x):
        ones = torch.ones(x.shape[0], 1, dtype=routing.weights.dtype)
        return dataclasses.replace(routing, selected=torch.zeros(x.shape[0], 1, dtype=torch.long), weights=ones)

    with torch.no_grad():
        plain = rt(input_ids=ids).logits
        with override_routing(rt.model, expert_zero):
            forced = rt(input_ids=ids).logits
    hook.remove()
    assert (forced - plain).abs().max() > 1e-3

    t = load_file(str(path / "model.safetensors"))
    x = io["x"]
    if family == "mixtral":
        want = _expert_mlp(t, "model.layers.1.block_sparse_moe.experts.0", ("w1", "w3", "w2"), x)
    else:
        names = ("gate_proj", "up_proj", "down_proj")
        want = _expert_mlp(t, "model.layers.1.mlp.experts.0", names, x)
        shared = _expert_mlp(t, "model.layers.1.mlp.shared_expert", names, x)
        want = want + torch.sigmoid(F.linear(x, t["model.layers.1.mlp.shared_expert_gate.weight"])) * shared
    torch.testing.assert_close(io["y"], want, atol=1e-6, rtol=1e-6)


def test_dropped_slots_run_no_expert(moe_models):
    rt = load_model(moe_models["mixtral"])
    block = rt.model.model.layers[0].mlp
    x = torch.randn(1, 5, block.gate.weight.shape[1])
    drop_all = lambda layer, r, h: dataclasses.replace(r, selected=torch.full_like(r.selected, -1))  # noqa: E731
    handle = block.add_selection_override(drop_all)
    with torch.no_grad():
        assert torch.equal(block(x), torch.zeros_like(x))
    handle.remove()
    with torch.no_grad():
        assert block(x).abs().max() > 0


def _quantize(model_dir: Path, out: Path) -> Path:
    from quantkit.pipeline.engine import quantize_model
    from quantkit.recipe import Recipe

    r = Recipe()
    r.model.source = str(model_dir)
    r.quantization.method, r.quantization.scheme, r.quantization.group_size = "rtn", "W4A16", 32
    r.calibration.num_samples, r.calibration.seq_len = 2, 16
    quantize_model(r, out)
    return out


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_quantised_moe_checkpoint_matches_the_transformers_block_path(moe_models, tmp_path, family):
    path = _quantize(moe_models[family], tmp_path / "q")
    ids = _ids(seed=4)
    rt, plain = load_model(path), load_model(path, runtime_moe=False)
    blocks = moe_blocks(rt.model)
    assert blocks and not moe_blocks(plain.model)
    assert all(isinstance(e.gate_proj, QuantLinear) for b in blocks for e in b.experts.experts)
    assert all(not isinstance(b.gate, QuantLinear) for b in blocks)  # the router stays unquantised
    assert rt.formats == plain.formats and rt.formats.get("w4a16", 0) > 0
    with torch.no_grad():
        torch.testing.assert_close(rt(input_ids=ids).logits, plain(input_ids=ids).logits, **TOL)


def test_a_wrong_router_spec_is_detected(moe_models):
    """The oracle comparison can fail: the same checkpoint with the top-k weights left unnormalised."""
    rt, ref = load_model(moe_models["qwen3_moe_norm"]), _reference(moe_models["qwen3_moe_norm"])
    for block in moe_blocks(rt.model):
        assert block.spec.normalize_topk
        block.spec = dataclasses.replace(block.spec, normalize_topk=False)
    ids = _ids()
    with torch.no_grad():
        assert (rt(input_ids=ids).logits - ref(ids).logits).abs().max() > 1e-3


def test_router_spec_per_family(moe_models):
    from transformers import AutoConfig

    def spec(case):
        config = AutoConfig.from_pretrained(moe_models[case])
        return router_spec(adapter_for(config.model_type), config)

    mixtral, qwen2, qwen3, qwen3n, ds, dsg = (spec(c) for c in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_norm",
                                                                 "deepseek_v3", "deepseek_v3_grouped"))
    assert (mixtral.scoring, mixtral.normalize_topk, mixtral.num_experts, mixtral.top_k) == ("softmax", True, 4, 2)
    assert mixtral.shared_experts is None and not mixtral.weights_in_model_dtype
    assert (qwen2.shared_experts, qwen2.shared_expert_gate, qwen2.normalize_topk) == (
        "shared_expert", "shared_expert_gate", False)
    assert qwen3.shared_experts is None and not qwen3.normalize_topk and qwen3n.normalize_topk
    assert (ds.scoring, ds.selection_bias, ds.routed_scaling_factor, ds.shared_experts) == (
        "sigmoid", "e_score_correction_bias", 2.5, "shared_experts")
    assert not ds.group_limited and (dsg.num_experts, dsg.n_group, dsg.topk_group, dsg.group_limited) == (8, 2, 1, True)
    assert router_spec(adapter_for("llama"), AutoConfig.for_model("llama")) is None


def test_router_spec_rejects_inconsistent_routing():
    with pytest.raises(InputError, match="n_group"):
        RouterSpec(num_experts=6, top_k=2, n_group=4)
    with pytest.raises(InputError, match="top_k"):
        RouterSpec(num_experts=8, top_k=3, n_group=4, topk_group=1)
    with pytest.raises(InputError, match="scoring"):
        RouterSpec(num_experts=4, top_k=2, scoring="relu")


def test_softmax_after_topk_is_softmax_before_topk_renormalised():
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(5))
    before = route(RouterSpec(num_experts=8, top_k=2, normalize_topk=True), logits)
    after = route(RouterSpec(num_experts=8, top_k=2, softmax_before_topk=False), logits)
    assert torch.equal(before.selected, after.selected)
    torch.testing.assert_close(before.weights, after.weights, atol=1e-6, rtol=1e-6)
    unnormalised = route(RouterSpec(num_experts=8, top_k=2), logits)
    assert (unnormalised.weights.sum(-1) < 0.999).all()
