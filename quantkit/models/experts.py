"""Per-expert view of transformers' fused MoE experts.

transformers 5 stores routed experts as 3-D parameters; quantisation, statistics hooks and checkpoints all
want one nn.Linear per expert projection, named as on disk. `UnfusedExperts` is a drop-in replacement for
the fused module (same forward signature and numerics) whose experts are ordinary linears. With
`calibrate_all_experts` set, every expert also sees every token (for statistics) while the output still
uses the real routing.
"""

from __future__ import annotations

import torch
from torch import nn

from quantkit.models.adapters import ExpertLayout


class ExpertMLP(nn.Module):
    def __init__(self, layout: ExpertLayout, hidden: int, intermediate: int, act_fn: nn.Module, dtype, device):
        super().__init__()
        self._names = (layout.gate, layout.up, layout.down)
        self.add_module(layout.gate, nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device))
        self.add_module(layout.up, nn.Linear(hidden, intermediate, bias=False, dtype=dtype, device=device))
        self.add_module(layout.down, nn.Linear(intermediate, hidden, bias=False, dtype=dtype, device=device))
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self._names)
        return down(self.act_fn(gate(x)) * up(x))


class UnfusedExperts(nn.Module):
    def __init__(self, layout: ExpertLayout, num_experts: int, hidden: int, intermediate: int, act_fn, dtype, device):
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(
            ExpertMLP(layout, hidden, intermediate, act_fn, dtype, device) for _ in range(num_experts)
        )
        self.calibrate_all_experts = False

    def __getitem__(self, idx: int) -> ExpertMLP:
        return self.experts[idx]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.where(top_k_index == e)
            if self.calibrate_all_experts:
                # Statistics hooks see all tokens; only routed tokens contribute to the output.
                full = expert(hidden_states)
                routed = full[token_idx]
            elif token_idx.numel() == 0:
                continue
            else:
                routed = expert(hidden_states[token_idx])
            weight = top_k_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, (routed * weight).to(out.dtype))
        return out


def unfuse_experts(fused: nn.Module, layout: ExpertLayout, device="meta") -> UnfusedExperts:
    """Build an UnfusedExperts with the fused module's sizes (weights left empty on `device`)."""
    num_experts, two_i, hidden = fused.gate_up_proj.shape
    return UnfusedExperts(
        layout, num_experts, hidden, two_i // 2, fused.act_fn, fused.gate_up_proj.dtype, device
    )


def fuse_weights(unfused: UnfusedExperts, layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """The fused parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]) from per-expert linears."""
    gate_up = torch.stack(
        [torch.cat([getattr(e, layout.gate).weight, getattr(e, layout.up).weight], dim=0) for e in unfused.experts]
    )
    down = torch.stack([getattr(e, layout.down).weight for e in unfused.experts])
    return {"gate_up_proj": gate_up, "down_proj": down}
