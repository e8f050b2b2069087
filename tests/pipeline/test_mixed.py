"""Mixed precision under a budget: the plan meets it, uses only the allowed schemes, and the checkpoint loads in
transformers + compressed-tensors with the runtime matching it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.errors import InputError
from quantkit.pipeline.engine import quantize_model
from quantkit.recipe import MixedSpec, Recipe
from quantkit.runtime import load_model
from tests.conftest import make_tiny_model
from tests.test_cli import _assert_one_line_error, _quantize

CHOICES = ["W4A16:g32", "W4A16:ch", "W8A16:ch"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # intermediate 96: the down projections' K is not a multiple of 64
    return make_tiny_model(tmp_path_factory.mktemp("mixed") / "llama", "llama", intermediate_size=96)


def _run(src, out, method="gptq", samples=8, **mixed):
    r = Recipe()
    r.model.source = str(src)
    r.quantization.method = method
    r.quantization.mixed = MixedSpec(**mixed)
    r.calibration.num_samples, r.calibration.seq_len = samples, 32
    return quantize_model(r, out)


def test_size_budget_holds_and_the_checkpoint_runs_as_transformers_runs_it(llama, tmp_path):
    summary = _run(llama, tmp_path / "q", schemes=CHOICES, target_bits=5.0, samples=16)
    plan = json.loads((tmp_path / "q" / "precision_plan.json").read_text())
    # GPTQ's previews were solved on sequences 8-15, the KL scored on 0-7
    assert plan["sensitivity"]["statistics_held_out"] is True
    assert summary["bits_per_weight"] <= 5.0  # the manifest's figure, measured on the written tensors
    assert summary["bits_per_weight"] == pytest.approx(plan["bits_per_weight"], abs=1e-3)
    used = {e["scheme"] for e in plan["linears"]}
    assert used <= set(CHOICES) and len(used) > 1
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    def layout(w):
        return w["num_bits"], w["strategy"], w["group_size"]

    def layout_of(label):
        name, _, g = label.partition(":")
        return (8 if name == "W8A16" else 4), ("channel" if g == "ch" else "group"), (None if g == "ch" else int(g[1:]))

    groups = config["config_groups"]
    catch_all = [g for g in groups.values() if g["targets"] == ["Linear"]]
    assert len(catch_all) == 1
    named = {m: layout(g["weights"]) for g in groups.values() for m in g["targets"] if m != "Linear"}
    for e in plan["linears"]:
        want = layout_of(e["scheme"])
        assert named.get(e["module"], layout(catch_all[0]["weights"])) == want, e
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    rt = load_model(tmp_path / "q", kernels="reference")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        got, want = rt(input_ids=ids).logits.float(), model(ids).logits.float()
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item()}"
    # each linear holds the scheme the plan gave it: 8-bit weights only where the plan put W8A16
    for e in plan["linears"]:
        bits = model.get_submodule(e["module"]).quantization_scheme.weights.num_bits
        assert bits == (8 if e["scheme"].startswith("W8") else 4), e


def test_a_choice_that_does_not_fit_is_dropped_for_that_linear_only(llama, tmp_path):
    _run(llama, tmp_path / "q", method="rtn", schemes=["W4A16:g64", "W8A16:ch"], target_bits=6.0)
    plan = json.loads((tmp_path / "q" / "precision_plan.json").read_text())
    dropped = {m for d in plan["dropped"] for m in d["modules"]}
    assert dropped and all(m.endswith("down_proj") for m in dropped)
    assert all(d["dropped"] == ["W4A16:g64"] for d in plan["dropped"])
    for e in plan["linears"]:
        if e["module"] in dropped:
            assert e["scheme"] == "W8A16:ch" and list(e["kl"]) == ["W8A16:ch"]


def _tied_groups_share(plan, _):
    by: dict[str, set] = {}
    for e in plan["linears"]:
        by.setdefault(e["tied"], set()).add(e["scheme"])
    assert all(len(v) == 1 for v in by.values()), by
    return by


def test_linears_served_as_one_share_a_scheme(llama, tiny_models, tmp_path):
    # a budget that gives some linears 8 bits: q/k/v and gate/up (fused by vLLM) and a MoE block's experts
    # (one fused-MoE kernel) must still come out with one scheme each
    plan = _run(llama, tmp_path / "d", method="rtn", schemes=CHOICES, target_bits=5.5)["precision"]
    full = json.loads((tmp_path / "d" / "precision_plan.json").read_text())
    by = _tied_groups_share(full, None)
    assert any(k.endswith("q_proj+k_proj+v_proj") for k in by) and any(k.endswith("gate_proj+up_proj") for k in by)
    assert len(plan["schemes"]) > 1
    _run(tiny_models["qwen3_moe"], tmp_path / "m", method="rtn", schemes=CHOICES, target_bits=5.5)
    moe = json.loads((tmp_path / "m" / "precision_plan.json").read_text())
    by = _tied_groups_share(moe, None)
    experts = [k for k in by if k.endswith(".experts")]
    assert experts and all(sum(e["tied"] == k for e in moe["linears"]) == 4 * 3 for k in experts)


def test_error_budget_gives_the_smaller_plan_for_the_looser_bound(llama, tmp_path):
    loose = _run(llama, tmp_path / "b", method="rtn", schemes=CHOICES, max_kl=1.0)["precision"]
    linears = json.loads((tmp_path / "b" / "precision_plan.json").read_text())["linears"]
    floor = sum(min(e["kl"].values()) for e in linears)  # every linear at its most accurate choice
    bound = floor * 1.1
    tight = _run(llama, tmp_path / "a", method="rtn", schemes=CHOICES, max_kl=bound)["precision"]
    assert tight["estimated_kl"] <= bound and loose["estimated_kl"] <= 1.0
    assert loose["bits_per_weight"] < tight["bits_per_weight"]
    assert set(loose["schemes"]) == {"W4A16:ch"}  # nothing bought where nothing is needed


def test_bad_budgets_are_one_line_and_leave_nothing(tiny_models, tmp_path):
    base = ["--model", str(tiny_models["llama"]), "--num-samples", "2", "--seq-len", "16", "--output",
            str(tmp_path / "out")]
    _assert_one_line_error(_quantize(*base, "--schemes", "W4A16:g32,W8A16:ch", "--target-bits", "3"), 2,
                           "below the cheapest plan")
    _assert_one_line_error(_quantize(*base, "--schemes", "W4A16:g32"), 2, "exactly one budget")
    _assert_one_line_error(_quantize(*base, "--target-bits", "5"), 2, "--schemes")
    _assert_one_line_error(_quantize(*base, "--schemes", "W4A16:g32,FP8_DYNAMIC", "--target-bits", "5",
                                     "--method", "gptq"), 2, "cannot produce FP8_DYNAMIC")
    _assert_one_line_error(_quantize(*base, "--schemes", "W4A16:x9", "--target-bits", "5"), 2, "W4A16:x9")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()
    with pytest.raises(InputError, match="below what these --schemes can reach"):
        _run(tiny_models["llama"], tmp_path / "o", method="rtn", schemes=["W4A16:g32"], max_kl=1e-12)
    with pytest.raises(InputError, match="mixed.estimate must be pooled or sequence"):
        MixedSpec(schemes=["W4A16:g32"], target_bits=5.0, estimate="exact")


def test_the_written_recipe_reproduces_the_plan(llama, tmp_path):
    _run(llama, tmp_path / "a", method="rtn", schemes=CHOICES, target_bits=5.0)
    again = Recipe.load(tmp_path / "a" / "recipe.yaml")
    assert again.quantization.mixed == MixedSpec(schemes=CHOICES, target_bits=5.0)
    quantize_model(again, tmp_path / "b")
    first, second = (json.loads((tmp_path / d / "precision_plan.json").read_text()) for d in ("a", "b"))
    assert [e["scheme"] for e in first["linears"]] == [e["scheme"] for e in second["linears"]]


def test_flags_override_the_budget_and_keep_the_recipes_other_mixed_fields(llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps({"quantization": {"method": "rtn", "mixed": {
        "schemes": ["W4A16:g32"], "target_bits": 9.0, "samples": 2, "draws": 1, "estimate": "sequence"}}}))
    res = _quantize("--model", str(llama), "--recipe", str(recipe), "--schemes", ",".join(CHOICES), "--target-bits",
                    "5", "--num-samples", "4", "--seq-len", "16", "--output", str(tmp_path / "out"))
    assert res.exit_code == 0, res.output
    plan = json.loads((tmp_path / "out" / "precision_plan.json").read_text())
    assert plan["choices"] == CHOICES and plan["target_bits"] == 5.0
    assert plan["sensitivity"]["estimate"] == "fisher, sequence"
    assert (plan["sensitivity"]["samples"], plan["sensitivity"]["draws"]) == (2, 1)


def test_a_plan_mixing_formats_loads_in_transformers_as_the_runtime_runs_it(llama, tmp_path):
    """int4 groups beside NVFP4 ones: one `mixed-precision` checkpoint, each group with its own format."""
    _run(llama, tmp_path / "q", method="rtn", schemes=["W4A16:ch", "NVFP4A16", "W8A16:ch"], target_bits=4.8,
         samples=16)
    plan = json.loads((tmp_path / "q" / "precision_plan.json").read_text())
    used = {e["scheme"] for e in plan["linears"]}
    assert "NVFP4A16" in used and len(used) > 1, used
    config = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert {g["format"] for g in config["config_groups"].values()} >= {"nvfp4-pack-quantized", "pack-quantized"}
    # compressed-tensors' fp4 modules decompress into bf16 whatever the model's dtype, so both run in bf16, where
    # two engines' matmuls may round a logit one bf16 step apart
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16).eval()
    rt = load_model(tmp_path / "q", dtype=torch.bfloat16, kernels="reference")
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = rt(input_ids=ids).logits.float(), model(ids).logits.float()
    step = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 7)  # one bf16 step at the largest logit
    assert (got - want).abs().max() <= 2 * step, (got - want).abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
