"""Auxiliary-loss-free bias balancing (DeepSeek-V3's rule, at inference): every `bias_step_tokens` tokens each
expert's selection bias moves by u toward balance (+u if under-loaded, -u if over-loaded); the bias only
selects, the combine weights stay the family's weights of the unbiased scores. u is a fraction (`bias_rate`)
of the layer's typical decision margin (the k-th minus the (k+1)-th score, measured on the first step), since
score scales differ by orders of magnitude across routers."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from quantkit.models.routing_profile import count_selection
from quantkit.runtime.moe import Routing, SelectionOverride, with_selection


@dataclass
class BiasState:
    rate: float
    step_tokens: int
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    unit: dict[int, float] = field(default_factory=dict)
    steps: int = 0


def decision_margin(choice: torch.Tensor, k: int) -> float:
    """Median over tokens of the k-th minus the (k+1)-th selection score: the size of a routing decision."""
    top = choice.float().topk(min(k + 1, choice.shape[1]), dim=1).values
    gap = (top[:, k - 1] - top[:, -1]) if top.shape[1] > k else top[:, k - 1]
    gap = gap[torch.isfinite(gap)]
    return float(gap.median()) if gap.numel() else 0.0


def bias_balancing(state: BiasState) -> SelectionOverride:
    """Selection by choice + bias (bias updated toward balance every step_tokens tokens); weights unbiased."""

    def override(layer: int, routing: Routing, hidden: torch.Tensor) -> Routing:
        spec = routing.spec
        choice = (routing.scores if routing.choice is None else routing.choice).float()
        t, k = routing.selected.shape
        e = spec.num_experts
        if layer not in state.bias:
            state.bias[layer] = torch.zeros(e, device=choice.device)
            margin = decision_margin(choice, k)
            state.unit[layer] = state.rate * (margin if margin > 0 else float(choice[torch.isfinite(choice)].std()))
        parts = []
        for s in range(0, t, state.step_tokens):
            sel = (choice[s:s + state.step_tokens] + state.bias[layer]).topk(k, dim=1).indices
            load = torch.bincount(sel.reshape(-1), minlength=e).float()
            # Under-loaded experts gain u, over-loaded lose u (the sign of mean - load), DeepSeek-V3's update.
            state.bias[layer] += state.unit[layer] * torch.sign(load.mean() - load)
            state.steps += 1
            parts.append(sel)
        return with_selection(routing, torch.cat(parts), hidden)

    return override


def max_over_mean(selected_by_layer: dict[int, torch.Tensor], num_experts: int) -> float:
    vals = []
    for sel in selected_by_layer.values():
        counts, _ = count_selection(sel, num_experts)
        vals.append(float(counts.max()) / max(float(counts.double().mean()), 1e-30))
    return sum(vals) / len(vals) if vals else float("nan")
