"""Routing rules found on a family's own MoE block (quantkit.runtime.moe.infer_router_spec).

The blocks here route by rules written out in the test, independently of quantkit's `route`: the inferred
RouterSpec must name that rule, and a RuntimeMoE built from it must compute what the block computes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from quantkit.models.adapters import ExpertLayout
from quantkit.models.experts import UnfusedExperts
from quantkit.runtime.moe import RuntimeMoE, infer_router_spec

H, E, K, I = 32, 8, 2, 16


@dataclasses.dataclass
class Rule:
    scoring: str = "softmax"  # softmax | sigmoid | softmax_after_topk | tempered (softmax of logits / 2: no RouterSpec)
    bias: bool = False  # selection bias added to the scores for ranking only
    normalize: bool = False
    scale: float = 1.0
    shared: bool = False
    shared_gate: bool = False


class Config:
    def __init__(self, scale: float):
        self.routed_scaling_factor = scale


class Router(nn.Module):
    def __init__(self, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H) * 0.2)
        if with_bias:
            self.register_buffer("correction", torch.zeros(E))  # zero, as a freshly made model's


class Block(nn.Module):
    """A sparse-MoE block in the style transformers writes them: router, experts called with (x, index, weights),
    optional shared experts and gate."""

    def __init__(self, rule: Rule):
        super().__init__()
        self.rule = rule
        self.gate = Router(rule.bias)
        self.experts = UnfusedExperts(ExpertLayout("experts", "gate_proj", "up_proj", "down_proj"), E, H, I, nn.SiLU(),
                                      torch.float32, "cpu")
        for p in self.experts.parameters():
            nn.init.normal_(p, std=0.2)
        if rule.shared:
            self.shared_mlp = nn.Sequential(nn.Linear(H, I, bias=False), nn.SiLU(), nn.Linear(I, H, bias=False))
        if rule.shared_gate:
            self.shared_mlp_gate = nn.Linear(H, 1, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.reshape(-1, H)
        logits = x @ self.gate.weight.T
        r = self.rule
        if r.scoring == "softmax_after_topk":
            top, idx = logits.topk(K, dim=-1)
            w = top.softmax(-1)
        else:
            scores = {"softmax": logits.softmax(-1), "sigmoid": logits.sigmoid(),
                      "tempered": (logits / 2).softmax(-1)}[r.scoring]
            rank = scores + self.gate.correction if r.bias else scores
            idx = rank.topk(K, dim=-1).indices
            w = scores.gather(1, idx)
            if r.normalize:
                w = w / w.sum(-1, keepdim=True)
        w = w * r.scale
        out = self.experts(x, idx, w)
        if r.shared:
            shared = self.shared_mlp(x)
            out = out + (torch.sigmoid(self.shared_mlp_gate(x)) * shared if r.shared_gate else shared)
        return out.reshape(hidden.shape)


RULES = {
    "mixtral-like": Rule(normalize=True),
    "olmoe-like": Rule(),
    "mistral order": Rule(scoring="softmax_after_topk"),
    "deepseek-like": Rule(scoring="sigmoid", bias=True, normalize=True, scale=2.5, shared=True),
    "qwen2-moe-like": Rule(normalize=False, shared=True, shared_gate=True),
    "sigmoid without bias": Rule(scoring="sigmoid", normalize=True),
}


@pytest.mark.parametrize("name", list(RULES))
def test_the_rule_a_block_routes_by_is_found_and_replayed_exactly(name):
    torch.manual_seed(0)
    rule = RULES[name]
    block = Block(rule).eval()
    spec = infer_router_spec(block, Config(rule.scale))
    assert spec is not None
    if rule.scoring == "softmax_after_topk":
        assert (spec.scoring, spec.softmax_before_topk) == ("softmax", False)
    else:
        assert (spec.scoring, spec.softmax_before_topk, spec.normalize_topk) == (rule.scoring, True, rule.normalize)
    assert spec.selection_bias == ("correction" if rule.bias else None)
    assert spec.routed_scaling_factor == rule.scale and (spec.num_experts, spec.top_k) == (E, K)
    assert spec.shared_experts == ("shared_mlp" if rule.shared else None)
    assert spec.shared_expert_gate == ("shared_mlp_gate" if rule.shared_gate else None)
    if rule.bias:  # the probe's random bias is gone again; a trained one ranks
        assert torch.equal(block.gate.correction, torch.zeros(E))
        block.gate.correction.copy_(torch.rand(E) * 0.5)

    x = torch.randn(3, 10, H)
    with torch.no_grad():
        expected = block(x)
        got = RuntimeMoE(block, spec, 0)(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_a_rule_routespec_cannot_describe_leaves_the_block_alone():
    # Softmax at temperature 2 ranks as softmax does, but its weights differ: no RouterSpec gives them.
    torch.manual_seed(0)
    assert infer_router_spec(Block(Rule(scoring="tempered")).eval(), Config(1.0)) is None


def test_a_block_holding_tensors_of_its_own_is_left_alone():
    torch.manual_seed(0)
    block = Block(Rule(normalize=True)).eval()
    block.register_buffer("temperature", torch.ones(()))
    assert infer_router_spec(block, Config(1.0)) is None
