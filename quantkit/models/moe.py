"""A MoE model's routing rule, resolved: the adapter's fixed facts (`RouterLayout`) plus the config's numbers.

`RouterSpec` is everything `quantkit.runtime.moe` needs to route a token exactly as the family's reference
implementation does; it is the one place that knows per-family routing, so the runtime block, observers and
later routing tools (capacity, bias balancing) read facts instead of testing model types.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.errors import InputError
from quantkit.models.adapters import Adapter

SCORINGS = ("softmax", "sigmoid")
# Config names of the routed-expert count across families (transformers aliases some, not all).
_NUM_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid" of the router logits, in fp32
    softmax_before_topk: bool = True  # softmax over all experts, then top-k; else top-k logits, softmax over k
    normalize_topk: bool = False  # divide the k weights by their sum
    n_group: int = 1  # group-limited routing: experts split into n_group equal groups ...
    topk_group: int = 1  # ... and only the topk_group best groups (sum of their top-2 scores) are eligible
    selection_bias: str | None = None  # router buffer added to the scores for selection only
    routed_scaling_factor: float = 1.0  # multiplies the (normalised) weights
    fp32_logits: bool = False  # router matmul in fp32 (else in the model dtype)
    weights_in_model_dtype: bool = False  # combine weights rounded to the model dtype
    router: str = "gate"  # module names inside the block
    experts: str = "experts"
    shared_experts: str | None = None
    shared_expert_gate: str | None = None  # sigmoid gate on the shared experts' output

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise InputError(f"router scoring {self.scoring!r}: expected one of {', '.join(SCORINGS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise InputError(f"router top_k {self.top_k} is not within 1..{self.num_experts} experts")
        if self.n_group < 1 or self.num_experts % self.n_group:
            raise InputError(f"{self.num_experts} experts cannot be split into n_group={self.n_group} groups")
        if not 0 < self.topk_group <= self.n_group:
            raise InputError(f"topk_group={self.topk_group} is not within 1..n_group={self.n_group}")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise InputError(f"top_k {self.top_k} exceeds the experts of topk_group={self.topk_group} groups")
        if not self.softmax_before_topk and (self.scoring != "softmax" or self.selection_bias or self.n_group > 1):
            raise InputError("softmax after top-k is a plain softmax router: no sigmoid, selection bias or groups")

    @property
    def group_limited(self) -> bool:
        return self.n_group > 1 and self.topk_group < self.n_group


def _config_int(config, key: str | None) -> int:
    return int(getattr(config, key, 0) or 0) if key else 0


def router_spec(adapter: Adapter, config) -> RouterSpec | None:
    """The routing rule of `config`'s sparse-MoE layers; None for a dense family (no router layout)."""
    layout = adapter.router
    if layout is None:
        return None
    num_experts = next((_config_int(config, k) for k in _NUM_EXPERTS_KEYS if _config_int(config, k)), 0)
    top_k = _config_int(config, "num_experts_per_tok")
    if not num_experts or not top_k:
        return None  # a MoE family configured without experts (every layer dense)
    normalize = layout.normalize
    if normalize is None:
        normalize = bool(getattr(config, "norm_topk_prob", False))
    shared = layout.shared_experts if _config_int(config, layout.shared_size_key) else None
    return RouterSpec(
        num_experts=num_experts,
        top_k=top_k,
        scoring=layout.scoring,
        softmax_before_topk=layout.softmax_before_topk,
        normalize_topk=normalize,
        # Families without group-limited routing or scaling do not have these keys: one group, factor 1.
        n_group=_config_int(config, "n_group") or 1,
        topk_group=_config_int(config, "topk_group") or 1,
        selection_bias=layout.selection_bias,
        routed_scaling_factor=float(getattr(config, "routed_scaling_factor", None) or 1.0),
        fp32_logits=layout.fp32_logits,
        weights_in_model_dtype=layout.weights_in_model_dtype,
        router=layout.router,
        experts=layout.experts,
        shared_experts=shared,
        shared_expert_gate=layout.shared_expert_gate if shared else None,
    )
