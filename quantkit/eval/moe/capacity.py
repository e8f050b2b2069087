"""Capacity-aware inference: capacity C = ceil(gamma * T * k / E) slots per expert and forward call of T tokens.
Each expert keeps its C best-scored slots; an overflowing slot is dropped, or rerouted to the token's next
choice that has room (one pending slot per token per round, best-scored first, until nothing fits). A shared
expert already serves every token, so "shared" overflow is the drop of the routed slot (reported once)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from quantkit.models.routing_profile import count_selection
from quantkit.runtime.moe import Routing, SelectionOverride, with_selection

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)
POLICIES = ("drop", "reroute", "shared")


def capacity(gamma: float, tokens: int, top_k: int, num_experts: int) -> int:
    return max(1, math.ceil(gamma * tokens * top_k / num_experts))


def _keep_best(expert: torch.Tensor, score: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
    """Mask of the slots (expert [N], score [N]) that fit: each expert keeps its room[e] best-scored slots."""
    if expert.numel() == 0:
        return torch.zeros(0, dtype=torch.bool)
    order = torch.argsort(score, descending=True, stable=True)
    order = order[torch.argsort(expert[order], stable=True)]  # grouped by expert, best first within
    e_sorted = expert[order]
    first = torch.searchsorted(e_sorted, e_sorted, right=False)
    rank = torch.arange(e_sorted.numel()) - first
    keep = torch.zeros_like(expert, dtype=torch.bool)
    keep[order] = rank < room[e_sorted]
    return keep


def apply_capacity(selected: torch.Tensor, choice: torch.Tensor, cap: int, policy: str) -> torch.Tensor:
    """A selection [T, k] in which no expert holds more than `cap` slots; overflow is -1 (dropped) or, with
    "reroute", the token's next choice by `choice` [T, E] that still has room."""
    t, k = selected.shape
    e = choice.shape[1]
    sel = selected.clone()
    flat = sel.reshape(-1)
    valid = (flat >= 0) & (flat < e)
    tok = torch.arange(t).repeat_interleave(k)
    score = torch.where(valid, choice.float()[tok, flat.clamp(0, e - 1)], torch.full_like(flat, float("-inf"),
                                                                                            dtype=torch.float32))
    room = torch.full((e + 1,), cap, dtype=torch.long)
    keep = torch.zeros_like(valid)
    keep[valid] = _keep_best(flat[valid], score[valid], room)
    load = torch.bincount(flat[keep], minlength=e)
    flat[~keep] = -1
    if policy != "reroute":
        return sel
    # Reroute: candidates are each token's experts in order of preference, never one it already holds.
    pending = (~keep & valid).reshape(t, k)
    masked = choice.float().clone()
    masked.scatter_(1, selected.clamp(0, e - 1), float("-inf"))
    ranked = masked.argsort(dim=1, descending=True)
    pointer = torch.zeros(t, dtype=torch.long)
    while True:
        tokens = torch.nonzero(pending.any(1) & (pointer < e - k))[:, 0]
        if tokens.numel() == 0 or bool((load >= cap).all()):
            break
        slot = pending[tokens].float().argmax(1)  # the token's first pending slot
        cand = ranked[tokens, pointer[tokens]]
        pointer[tokens] += 1
        cscore = masked[tokens, cand]
        usable = torch.isfinite(cscore)
        room = torch.cat([(cap - load).clamp_min(0), torch.zeros(1, dtype=torch.long)])
        ok = torch.zeros_like(usable)
        ok[usable] = _keep_best(cand[usable], cscore[usable], room)
        acc_t, acc_s, acc_e = tokens[ok], slot[ok], cand[ok]
        sel[acc_t, acc_s] = acc_e
        pending[acc_t, acc_s] = False
        load += torch.bincount(acc_e, minlength=e)
    return sel


@dataclass
class CapacityStats:
    max_before: float = 0.0  # sums over (layer, call) of the largest expert load
    max_after: float = 0.0
    slots: int = 0
    dropped: int = 0
    rerouted: int = 0
    calls: int = 0
    over_capacity: int = 0  # calls in which some expert exceeded C (must stay 0)


def capacity_override(gamma: float, policy: str, stats: CapacityStats) -> SelectionOverride:
    def override(layer: int, routing: Routing, hidden: torch.Tensor) -> Routing:
        spec = routing.spec
        t, k = routing.selected.shape
        cap = capacity(gamma, t, spec.top_k, spec.num_experts)
        choice = routing.scores if routing.choice is None else routing.choice
        new = apply_capacity(routing.selected.cpu(), choice.cpu(), cap, "reroute" if policy == "reroute" else "drop")
        before, _ = count_selection(routing.selected, spec.num_experts)
        after, _ = count_selection(new, spec.num_experts)
        stats.max_before += float(before.max())
        stats.max_after += float(after.max())
        stats.slots += t * k
        stats.dropped += int((new < 0).sum())
        stats.rerouted += int(((new != routing.selected.cpu()) & (new >= 0)).sum())
        stats.calls += 1
        stats.over_capacity += int(after.max() > cap)
        return with_selection(routing, new.to(routing.selected.device), hidden)

    return override
