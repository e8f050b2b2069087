"""The Fisher estimate of each linear's KL against the KL measured by running transformers with that one linear
quantised; the pooled estimate against the sequence-level one across draw seeds."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.models.loader import open_model
from quantkit.models.source import resolve_model
from quantkit.pipeline.engine import plan_layers
from quantkit.pipeline.sensitivity import SensitivityOptions, linear_sensitivity, pooled_estimate, sensitivity_sums
from quantkit.quant.schemes import parse_choice
from quantkit.quant.weights import round_trip
from tests.conftest import make_tiny_model


def _ranks(x):
    return torch.tensor(x).argsort().argsort().float()


def _spearman(a, b) -> float:
    return float(torch.corrcoef(torch.stack([_ranks(a), _ranks(b)]))[0, 1])


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sens") / "llama", "llama", num_hidden_layers=3)


def _estimates(path, choices, ids, **opts):
    handle = open_model(resolve_model(str(path)), False)
    plans = plan_layers(handle, choices[0], ["lm_head"])
    per = {t.checkpoint: list(choices) for p in plans for t in p.targets}
    return linear_sensitivity(handle, plans, per, ids, torch.float32, options=SensitivityOptions(**opts))


def _measured(path, name, scheme, ids, base):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    module = model.get_submodule(name)
    module.weight.data = round_trip(module.weight.data, scheme.weights, torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits, -1)
    return float((base.exp() * (base - logp)).sum(-1).mean())


@pytest.mark.parametrize("estimate", ["pooled", "sequence"])
def test_estimates_rank_and_size_like_the_measured_kl(llama3, estimate):
    choices = [parse_choice("W4A16:g32"), parse_choice("W4A16:ch"), parse_choice("W8A16:ch")]
    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    est = _estimates(llama3, choices, ids, samples=16, draws=8, estimate=estimate)
    model = AutoModelForCausalLM.from_pretrained(llama3, dtype=torch.float32).eval()
    with torch.no_grad():
        base = torch.log_softmax(model(ids).logits, -1)
    assert len(est) == 3 * 7
    got, want = [], []
    for name, values in est.items():
        for scheme, value in zip(choices, values):
            got.append(value)
            want.append(_measured(llama3, name, scheme, ids, base))
    assert _spearman(got, want) > 0.9
    ratio = torch.tensor(got) / torch.tensor(want)
    # a sampled estimate (8 draws of 16 sequences): typically within tens of percent, never off by 3x in the median
    assert 0.6 < float(ratio.median()) < 1.6


def test_moe_experts_and_shared_linears_get_estimates(tiny_models):
    choices = [parse_choice("W4A16:g32"), parse_choice("W8A16:ch")]
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    est = _estimates(tiny_models["qwen3_moe"], choices, ids, samples=2, draws=2)
    experts = [n for n in est if ".experts." in n]
    assert experts and len(est) == len({n for n in est})
    for name, (four, eight) in est.items():
        assert four >= 0 and eight >= 0 and torch.isfinite(torch.tensor([four, eight])).all(), name
    # 8 bits add far less KL than 4 over the model as a whole
    assert sum(v[1] for v in est.values()) < 0.1 * sum(v[0] for v in est.values())


def test_pooled_estimate_weighs_a_linears_choices_with_far_less_noise(llama3):
    """What the allocator acts on within a linear is how its choices compare. Across draw seeds, that comparison
    (each choice's estimate over the first's) moves far less in the pooled estimate than in the sequence-level one,
    and the pooled estimates of each choice themselves move less."""
    choices = [parse_choice("W4A16:g32"), parse_choice("W4A16:ch"), parse_choice("W4A16_ASYM:g32"),
               parse_choice("W8A16:ch")]
    ids = torch.randint(0, 256, (16, 64), generator=torch.Generator().manual_seed(1))
    handle = open_model(resolve_model(str(llama3)), False)
    plans = plan_layers(handle, choices[0], ["lm_head"])
    per = {t.checkpoint: list(choices) for p in plans for t in p.targets}
    runs = [sensitivity_sums(handle, plans, per, ids, torch.float32, options=SensitivityOptions(samples=4, draws=2,
                                                                                                 seed=seed))
            for seed in range(6)]

    def spread(values: list[list[float]]) -> torch.Tensor:  # per column: std / mean over the seeds
        t = torch.tensor(values, dtype=torch.float64)
        return t.std(0) / t.mean(0)

    value, ratio = {"sequence": [], "pooled": []}, {"sequence": [], "pooled": []}
    for name in per:
        per_seed = {"sequence": [r["sequence"][name] for r in runs],
                    "pooled": [pooled_estimate(r["sequence"][name], r["token"][name]) for r in runs]}
        for kind, rows in per_seed.items():
            value[kind].append(spread(rows))
            ratio[kind].append(spread([[v / row[0] for v in row[1:]] for row in rows]))
    median = {k: {kind: float(torch.cat(v[kind]).median()) for kind in v} for k, v in
              (("value", value), ("ratio", ratio))}
    assert median["ratio"]["pooled"] < 0.35 * median["ratio"]["sequence"], median
    assert median["value"]["pooled"] < median["value"]["sequence"], median


def test_pooled_estimate_keeps_the_level_and_takes_the_differences():
    # a linear whose sequence estimates were 3, 1 and whose token sums are 1, 3: the level (4) stays, split 1 : 3
    assert pooled_estimate([3.0, 1.0], [1.0, 3.0]) == [1.0, 3.0]
    assert pooled_estimate([2.0, 0.5], [0.0, 0.0]) == [2.0, 0.5]  # no token signal (nothing reached the output)
