"""The runtime's sparse-MoE block: an explicit router, observer and selection-override hooks, top-k dispatch.

`RuntimeMoE` replaces a transformers sparse-MoE block at load and keeps its children under their own names
(router, per-expert linears, shared experts), so checkpoint names and `QuantLinear` replacement are unchanged.
One forward: router logits from the (unquantised) router weight -> `route` (scores, selection with group
limits and the selection bias, combine weights) -> selection overrides -> observers -> each selected expert
runs on the tokens routed to it only -> plus the shared experts.

Hooks (per block, or over a whole model with the context managers):

- observer `fn(layer_index, token_count, selected [T, k], weights [T, k], scores [T, E])`, called once per
  forward with the routing the experts run (after overrides); scores are the full fp32 router scores.
- override `fn(layer_index, routing: Routing, hidden [T, H]) -> Routing | None`: return a replacement
  (`dataclasses.replace(routing, selected=..., weights=...)`, any k) or None to keep it. An expert index
  outside [0, E) marks a dropped slot (capacity limits): it runs nothing. Overrides chain in order added.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from quantkit.errors import InputError
from quantkit.models.adapters import Adapter, router_names
from quantkit.models.experts import UnfusedExperts
from quantkit.models.loader import _get, _set
from quantkit.models.moe import RouterSpec, router_spec


@dataclass(frozen=True)
class Routing:
    logits: torch.Tensor  # [T, E] router logits
    scores: torch.Tensor  # [T, E] fp32 softmax/sigmoid scores (before any selection bias)
    selected: torch.Tensor  # [T, k] expert indices (int64)
    weights: torch.Tensor  # [T, k] combine weights
    # The rule that made it and the selection scores it ranked (scores + selection bias, groups masked to
    # -inf): routing tools (another k, capacity, bias balancing) re-select by the same rule.
    spec: RouterSpec | None = None
    choice: torch.Tensor | None = None


RouterObserver = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]
SelectionOverride = Callable[[int, Routing, torch.Tensor], "Routing | None"]


def _group_mask(spec: RouterSpec, choice: torch.Tensor) -> torch.Tensor:
    """Keep only experts of the topk_group groups with the best sum of their two best scores."""
    per_group = spec.num_experts // spec.n_group
    grouped = choice.view(choice.shape[0], spec.n_group, per_group)
    group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
    best = group_score.topk(spec.topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


def route(spec: RouterSpec, logits: torch.Tensor, bias: torch.Tensor | None = None,
          weights_dtype: torch.dtype | None = None) -> Routing:
    """Scores, selected experts and combine weights from router logits [T, E]."""
    scores, choice = _choice(spec, logits, bias)
    if spec.scoring == "softmax" and not spec.softmax_before_topk:
        # Mistral's reference order: top-k on the logits, softmax over the k (normalised by construction).
        top_logits, selected = logits.float().topk(spec.top_k, dim=-1)
        weights = top_logits.softmax(dim=-1)
        if spec.routed_scaling_factor != 1.0:
            weights = weights * spec.routed_scaling_factor
        if spec.weights_in_model_dtype and weights_dtype is not None:
            weights = weights.to(weights_dtype)
    else:
        selected = choice.topk(spec.top_k, dim=-1).indices
        weights = combine_weights(spec, scores, selected, weights_dtype)
    return Routing(logits, scores, selected, weights, spec, choice)


def _choice(spec: RouterSpec, logits: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, what top-k ranks): the bias added and the groups masked where the family does so."""
    scores = logits.float().softmax(dim=-1) if spec.scoring == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if spec.group_limited:
        choice = _group_mask(spec, choice)
    return scores, choice


def select_experts(spec: RouterSpec, logits: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts `route` selects [T, k], without the combine weights (a prediction needs only these)."""
    if spec.scoring == "softmax" and not spec.softmax_before_topk:
        return logits.float().topk(spec.top_k, dim=-1).indices
    return _choice(spec, logits, bias)[1].topk(spec.top_k, dim=-1).indices


def combine_weights(spec: RouterSpec, scores: torch.Tensor, selected: torch.Tensor,
                    weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The family's combine weights of experts `selected` [T, k'] from the unbiased scores [T, E], for any k'
    (routing tools that pick other experts or another k reuse the family's rule). Dropped slots (index
    outside [0, E)) get weight 0 and take no part in the normalisation."""
    valid = (selected >= 0) & (selected < spec.num_experts)
    # The selection bias only picks experts; the weights are the unbiased scores.
    weights = scores.gather(1, selected.clamp(0, spec.num_experts - 1)) * valid
    if spec.normalize_topk:
        # The epsilon only guards a row of all-zero sigmoid scores; it is below fp32 resolution otherwise.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    if spec.weights_in_model_dtype and weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights


class RuntimeMoE(nn.Module):
    """One sparse-MoE layer routed by `spec`; `layer_index` is the decoder layer's index (what hooks receive)."""

    def __init__(self, block: nn.Module, spec: RouterSpec, layer_index: int):
        super().__init__()
        # The block's own children under their own names: checkpoint tensors and QuantLinear swaps find them.
        for name, child in block.named_children():
            self.add_module(name, child)
        self.spec = spec
        self.layer_index = layer_index
        # OrderedDict, not dict: RemovableHandle keeps a weak reference to it; order = registration order.
        self._observers: OrderedDict[int, RouterObserver] = OrderedDict()
        self._overrides: OrderedDict[int, SelectionOverride] = OrderedDict()
        # Set by runtime/cuda/ops.py where one CUDA kernel serves every expert: grouped GEMMs, one launch per
        # projection for the whole layer.
        self.grouped = None

    def add_router_observer(self, fn: RouterObserver) -> RemovableHandle:
        handle = RemovableHandle(self._observers)
        self._observers[handle.id] = fn
        return handle

    def add_selection_override(self, fn: SelectionOverride) -> RemovableHandle:
        handle = RemovableHandle(self._overrides)
        self._overrides[handle.id] = fn
        return handle

    def router_module(self) -> nn.Module:
        return self.get_submodule(self.spec.router)

    def selection_bias(self) -> torch.Tensor | None:
        """The router's selection bias as [E] (ERNIE stores it [1, E]), or None."""
        if not self.spec.selection_bias:
            return None
        return _tensor_at(self.router_module(), self.spec.selection_bias).reshape(-1)

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.router_module().weight
        if self.spec.fp32_logits:
            return F.linear(x.float(), weight.float())
        return F.linear(x, weight)

    def route(self, x: torch.Tensor) -> Routing:
        """The block's own routing of tokens x [T, H] (no overrides)."""
        return route(self.spec, self.router_logits(x), self.selection_bias(), weights_dtype=x.dtype)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The experts the block's own routing selects for tokens x [T, H] (no overrides, no combine weights)."""
        return select_experts(self.spec, self.router_logits(x), self.selection_bias())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routing = self.route(x)
        for fn in list(self._overrides.values()):
            routing = self._checked(fn(self.layer_index, routing, x), routing, x.shape[0])
        for fn in list(self._observers.values()):
            fn(self.layer_index, x.shape[0], routing.selected, routing.weights, routing.scores)
        out = self.run_experts(x, routing.selected, routing.weights)
        if self.spec.shared_experts:
            shared = getattr(self, self.spec.shared_experts)(x)
            if self.spec.shared_expert_gate:
                shared = torch.sigmoid(getattr(self, self.spec.shared_expert_gate)(x)) * shared
            out = out + shared
        return out.reshape(shape)

    @staticmethod
    def _checked(new: Routing | None, old: Routing, tokens: int) -> Routing:
        if new is None:
            return old
        if new.selected.shape != new.weights.shape or new.selected.dim() != 2 or new.selected.shape[0] != tokens:
            raise ValueError(f"selection override returned selected {tuple(new.selected.shape)} and weights "
                             f"{tuple(new.weights.shape)}; expected both [{tokens}, k]")
        return new

    def run_experts(self, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over slots of weight * expert(x), each expert run once on only the tokens routed to it."""
        experts = getattr(self, self.spec.experts)
        n, k = selected.shape
        num_experts = self.spec.num_experts
        flat = selected.reshape(-1)
        if self.grouped is not None and x.dtype in (torch.bfloat16, torch.float16) and bool(
                ((flat >= 0) & (flat < num_experts)).all()):  # dropped slots (capacity limits): the loop below
            return self.grouped(x, selected, weights)
        # Dropped slots (index outside [0, E)) sort into an extra bucket that is never run.
        bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
        # Stable: within an expert, tokens stay in order (the same row order as UnfusedExperts).
        order = torch.argsort(bucket, stable=True)
        counts = torch.bincount(bucket, minlength=num_experts + 1).tolist()  # one host sync per block
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts[:num_experts]):
            if count:
                slots = order[start:start + count]
                tokens = slots // k
                routed = experts[e](x[tokens]) * flat_weights[slots, None]
                out.index_add_(0, tokens, routed.to(out.dtype))
            start += count
        return out


def _tensor_at(module: nn.Module, dotted: str) -> torch.Tensor:
    owner, _, leaf = dotted.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, leaf)


def _is_sparse_block(block: nn.Module, spec: RouterSpec) -> bool:
    """A sparse-MoE block has the router and the unfused experts; dense layers (DeepSeek's first_k_dense_replace,
    Qwen's mlp_only_layers / decoder_sparse_step) have a plain MLP there and are left alone."""
    try:
        router = block.get_submodule(spec.router)
    except AttributeError:
        return False
    weight = getattr(router, "weight", None)
    experts = getattr(block, spec.experts, None)
    return isinstance(experts, UnfusedExperts) and weight is not None and weight.shape[0] == spec.num_experts


def _check_block(block: nn.Module, spec: RouterSpec, where: str) -> None:
    """Fail loudly where the block lacks what the spec names: a silent fallback would hide routing from observers."""
    missing = [n for n in (spec.shared_experts, spec.shared_expert_gate) if n and not hasattr(block, n)]
    if spec.selection_bias:
        try:
            _tensor_at(block.get_submodule(spec.router), spec.selection_bias)
        except AttributeError:
            missing.append(f"{spec.router}.{spec.selection_bias}")
    if missing:
        raise InputError(f"{where}: the MoE block has no {', '.join(missing)}, which its router layout names")
    if list(block.named_parameters(recurse=False)) or list(block.named_buffers(recurse=False)):
        raise InputError(f"{where}: the MoE block holds tensors of its own, which RuntimeMoE would drop")


def install_runtime_moe(layers: nn.ModuleList, adapter: Adapter, config) -> int:
    """Replace every sparse-MoE block in `layers` by a RuntimeMoE; returns how many were replaced."""
    spec = router_spec(adapter, config)
    if spec is None:
        return 0
    block_path = adapter.router.block
    replaced = 0
    for i, layer in enumerate(layers):
        try:
            block = _get(layer, block_path)
        except AttributeError:
            continue
        if not _is_sparse_block(block, spec):
            continue
        _check_block(block, spec, f"layer {i}")
        _set(layer, block_path, RuntimeMoE(block, spec, i))
        replaced += 1
    return replaced


def moe_blocks(model) -> list[RuntimeMoE]:
    """The RuntimeMoE blocks of an nn.Module or of a RuntimeModel (which wraps one as `.model`)."""
    net = model if isinstance(model, nn.Module) else model.model
    return [m for m in net.modules() if isinstance(m, RuntimeMoE)]


@contextmanager
def observe_routing(model, fn: RouterObserver) -> Iterator[list[RuntimeMoE]]:
    """`fn` observes every RuntimeMoE of `model` inside the block; yields those blocks."""
    blocks = moe_blocks(model)
    handles = [b.add_router_observer(fn) for b in blocks]
    try:
        yield blocks
    finally:
        for h in handles:
            h.remove()


@contextmanager
def override_routing(model, fn: SelectionOverride) -> Iterator[list[RuntimeMoE]]:
    """`fn` may replace the routing of every RuntimeMoE of `model` inside the block; yields those blocks."""
    blocks = moe_blocks(model)
    handles = [b.add_selection_override(fn) for b in blocks]
    try:
        yield blocks
    finally:
        for h in handles:
            h.remove()



def with_selection(routing: Routing, selected: torch.Tensor, hidden: torch.Tensor) -> Routing:
    """`routing` with other experts selected [T, k'] (indices outside [0, E) drop a slot), weighted by the
    family's combine rule."""
    weights = combine_weights(routing.spec, routing.scores, selected, hidden.dtype)
    return dataclasses.replace(routing, selected=selected, weights=weights)


def topk_routing(k: int) -> SelectionOverride:
    """An override that routes every token to its k best experts by the block's own rule (another top-k)."""

    def override(layer: int, routing: Routing, hidden: torch.Tensor) -> Routing:
        choice = routing.scores if routing.choice is None else routing.choice
        return with_selection(routing, choice.topk(k, dim=-1).indices, hidden)

    return override


def random_routing(k: int, seed: int = 0) -> SelectionOverride:
    """An override that sends every token to k distinct experts drawn uniformly (seeded per layer and call),
    weighted by the family's combine rule: the control that a router must beat."""
    calls: dict[int, int] = {}

    def override(layer: int, routing: Routing, hidden: torch.Tensor) -> Routing:
        calls[layer] = calls.get(layer, 0) + 1
        gen = torch.Generator().manual_seed(seed * 1_000_003 + layer * 7919 + calls[layer])
        t, e = routing.scores.shape
        selected = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(routing.selected.device)
        return with_selection(routing, selected, hidden)

    return override


# Routing inference for MoE families without a described router (quantkit.models.adapters.adapter_for_model keeps
# their own blocks): each candidate rule is tried against what the family's block hands its experts.
_PROBE_TOKENS = 64


def _bias_candidates(router: nn.Module, num_experts: int) -> list[str]:
    return [n for n, t in [*router.named_parameters(), *router.named_buffers()]
            if n != "weight" and t.is_floating_point() and t.numel() == num_experts]


def _candidate_specs(config, base: RouterSpec, biases: list[str]) -> Iterator[RouterSpec]:
    """Every rule RouterSpec describes for `base`'s experts, router and top-k: the config's scaling and expert groups
    or none, each selection-bias candidate or none."""
    scaling = float(getattr(config, "routed_scaling_factor", None) or 1.0)
    n_group = int(getattr(config, "n_group", None) or 1)
    topk_group = int(getattr(config, "topk_group", None) or 1)
    groups = [(n_group, topk_group), (1, 1)] if 1 < n_group and topk_group < n_group else [(1, 1)]
    for scoring, before in (("softmax", True), ("softmax", False), ("sigmoid", True)):
        plain = not before  # top-k of the logits, softmax over the k: no bias, groups or renormalisation
        for bias, normalize, factor, (ng, tg), fp32 in itertools.product(
                [None] if plain else [*biases, None], [False] if plain else [True, False],
                dict.fromkeys((scaling, 1.0)), [(1, 1)] if plain else groups, [True, False]):
            try:
                yield dataclasses.replace(base, scoring=scoring, softmax_before_topk=before, normalize_topk=normalize,
                                          n_group=ng, topk_group=tg, selection_bias=bias,
                                          routed_scaling_factor=factor, fp32_logits=fp32)
            except InputError:
                continue


def _routing_error(spec: RouterSpec, logits: torch.Tensor, bias, seen_idx: torch.Tensor,
                   seen_w: torch.Tensor) -> float:
    """How far `spec`'s combine weights are from those seen, relative to their largest (inf: other experts)."""
    r = route(spec, logits, None if bias is None else bias.reshape(-1), weights_dtype=seen_w.dtype)
    ours, order = r.selected.sort(dim=-1)
    theirs, their_order = seen_idx.sort(dim=-1)
    if not torch.equal(ours, theirs):
        return math.inf
    a, b = r.weights.gather(1, order).float(), seen_w.gather(1, their_order).float()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-6)


@torch.no_grad()
def infer_router_spec(block: nn.Module, config, seed: int = 0) -> RouterSpec | None:
    """The routing rule of a family's own sparse-MoE block (its children: UnfusedExperts, a router with a weight
    [E, H], optional shared experts and their sigmoid gate), found by trying every rule RouterSpec describes on
    random tokens against what the block hands its experts (selected experts and combine weights) and against what
    it adds besides (shared experts). A selection bias the router holds is filled with random values for the probe,
    so a zero bias still tells whether the family ranks with it. None where no rule reproduces the block, or it
    holds tensors of its own: the block then stays as transformers built it."""
    experts = [n for n, c in block.named_children() if isinstance(c, UnfusedExperts)]
    if len(experts) != 1 or list(block.named_parameters(recurse=False)) or list(block.named_buffers(recurse=False)):
        return None
    experts_mod = getattr(block, experts[0])
    num_experts = len(experts_mod.experts)
    # The block's routers (adapters.router_names), less the [1, H] shared-expert gates: the one with a weight [E, H].
    routers = [n for n in router_names(block, experts[0], num_experts)
               if block.get_submodule(n).weight.shape[0] == num_experts]
    if len(routers) != 1:
        return None
    router = block.get_submodule(routers[0])
    weight = router.weight
    if weight.device.type == "meta":
        return None
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(_PROBE_TOKENS, weight.shape[1], generator=gen)
    x = (x * (2.0 / float(F.linear(x, weight.float()).std().clamp_min(1e-6)))).to(weight.dtype)  # logits ~ std 2
    biases = _bias_candidates(router, num_experts)
    saved = {n: _tensor_at(router, n).detach().clone() for n in biases}
    # Random selection biases of the scores' own scale: they change the ranking only where the family ranks with them.
    probe_bias = {n: (torch.rand(t.shape, generator=gen) * 0.3).to(t.dtype) for n, t in saved.items()}
    seen: list = []

    def capture(hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        seen.append((top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k)))
        return torch.zeros_like(hidden_states)

    try:
        for n, t in probe_bias.items():
            _tensor_at(router, n).copy_(t)
        experts_mod.forward = capture
        out = block(x[None])
    except Exception:  # noqa: BLE001 - a block this probe cannot drive keeps its own forward
        return None
    finally:
        experts_mod.__dict__.pop("forward", None)
        for n, t in saved.items():
            _tensor_at(router, n).copy_(t)
    if len(seen) != 1 or seen[0][0].shape[0] != x.shape[0]:
        return None
    out = (out[0] if isinstance(out, tuple) else out).reshape(x.shape)
    idx, w = seen[0]
    tol = 1e-4 if w.dtype == torch.float32 else 2e-2
    base = RouterSpec(num_experts, idx.shape[1], weights_in_model_dtype=w.dtype != torch.float32, router=routers[0],
                      experts=experts[0])
    # In bf16 several rules may agree within rounding (router logits in fp32 or not): the closest one is kept.
    best, found = math.inf, None
    for spec in _candidate_specs(config, base, biases):
        logits = F.linear(x.float(), weight.float()) if spec.fp32_logits else F.linear(x, weight)
        err = _routing_error(spec, logits, probe_bias.get(spec.selection_bias), idx, w)
        if err < best:
            best, found = err, spec
    if found is None or best > tol:
        return None
    # Whatever else the block adds: nothing, its shared experts, or those scaled by sigmoid of a [1, H] gate.
    others = [(n, c) for n, c in block.named_children() if n not in (experts[0], routers[0].split(".")[0])]
    gates = [n for n, c in others if isinstance(getattr(c, "weight", None), torch.Tensor) and c.weight.shape[0] == 1]
    shared = [n for n, c in others if n not in gates]
    scale = max(float(out.float().abs().max()), 1e-6)
    candidates = [(None, None)] + [(s, None) for s in shared] + [(s, g) for s in shared for g in gates]
    for s, g in candidates:
        expect = torch.zeros_like(out) if s is None else getattr(block, s)(x)
        if g is not None:
            expect = torch.sigmoid(getattr(block, g)(x)) * expect
        if float((expect.float() - out.float()).abs().max()) <= tol * scale + 1e-6:
            return dataclasses.replace(found, shared_experts=s, shared_expert_gate=g)
    return None


def install_inferred_moe(layers: nn.ModuleList, config) -> int:
    """Replace every sparse-MoE block of a family without a described router by a RuntimeMoE whose rule
    `infer_router_spec` found on that very block (after its weights are loaded); returns how many."""
    replaced = 0
    for i, layer in enumerate(layers):
        for name, block in list(layer.named_modules()):
            if isinstance(block, RuntimeMoE) or not any(isinstance(c, UnfusedExperts) for c in block.children()):
                continue
            spec = infer_router_spec(block, config, seed=i)
            if spec is not None:
                _set(layer, name, RuntimeMoE(block, spec, i))
                replaced += 1
    return replaced
