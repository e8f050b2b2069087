"""Routing observation: every call's selection per layer, load and entropy statistics, and routing drift
(|sel_ckpt ∩ sel_base| / k per token and MoE layer, the baseline run on the same token blocks)."""

from __future__ import annotations

import math

import torch

from quantkit.models.routing_profile import count_selection


class RoutingRecorder:
    """A router observer that keeps every call's selection (int16) and per-layer score-entropy sums."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.entropy: dict[int, float] = {}
        self.tokens: dict[int, int] = {}

    def __call__(self, layer: int, n: int, selected: torch.Tensor, weights: torch.Tensor,
                 scores: torch.Tensor) -> None:
        self.calls.setdefault(layer, []).append(selected.to(torch.int16).cpu())
        p = scores.double()
        p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)  # sigmoid scores: entropy of the normalised scores
        self.entropy[layer] = self.entropy.get(layer, 0.0) + float(-(p * p.clamp_min(1e-300).log()).sum())
        self.tokens[layer] = self.tokens.get(layer, 0) + n

    def selections(self, layer: int, tokens: int | None = None) -> torch.Tensor:
        """The layer's selections [T, k] in the order seen (block-major), the first `tokens` of them."""
        return torch.cat(self.calls[layer]).long()[:tokens]

    def layer_stats(self) -> list[dict]:
        out = []
        for layer in sorted(self.calls):
            counts, _ = count_selection(self.selections(layer), self.num_experts)
            load = counts.double() / counts.sum().clamp_min(1)
            nz = load[load > 0]
            out.append({"layer": layer, "tokens": self.tokens[layer], "load": [round(v, 5) for v in load.tolist()],
                        "max_over_mean_load": round(float(load.max() * self.num_experts), 4),
                        "load_entropy": round(float(-(nz * nz.log()).sum()), 4),
                        "load_entropy_max": round(math.log(self.num_experts), 4),
                        "score_entropy": round(self.entropy[layer] / max(self.tokens[layer], 1), 4)})
        return out


def topk_overlap(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """|a_t ∩ b_t| / k per token for selections a, b [T, k]."""
    k = a.shape[1]
    ma = torch.zeros(a.shape[0], num_experts, dtype=torch.bool).scatter_(1, a.long(), True)
    hit = ma.gather(1, b.long())
    return hit.sum(1).double() / k


def routing_drift(ckpt: RoutingRecorder, base: RoutingRecorder, tokens: int) -> dict:
    per_layer = {}
    for layer in sorted(set(ckpt.calls) & set(base.calls)):
        a, b = ckpt.selections(layer, tokens), base.selections(layer, tokens)
        if a.shape != b.shape:
            continue
        per_layer[layer] = float(topk_overlap(a, b, ckpt.num_experts).mean())
    if not per_layer:
        return {"routing_topk_overlap": None, "per_layer": {},
                "note": "no layer's routing had the same shape in the checkpoint and the baseline"}
    return {"routing_topk_overlap": round(sum(per_layer.values()) / len(per_layer), 5),
            "per_layer": {str(k): round(v, 5) for k, v in per_layer.items()}}
