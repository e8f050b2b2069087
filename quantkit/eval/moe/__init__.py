"""`quantkit eval --moe`: routing statistics, routing drift, capacity-aware inference, bias balancing and
expert offloading, all through the runtime MoE block's observers and selection overrides
(quantkit/runtime/moe.py). One module per concern: observe (recording, drift), capacity, bias, offload (the
decode driver); this one holds the options and the per-checkpoint analysis that runs them.

- Load per expert, max/mean imbalance and entropy per layer, from every evaluated token.
- Routing drift: for each token and MoE layer |sel_ckpt ∩ sel_base| / k, the baseline (an MoE with the same
  experts) run on the same token blocks; mean over tokens and layers = `routing_topk_overlap`.
- Capacity-aware inference: capacity C = ceil(gamma * T * k / E) slots per expert and forward call of T tokens.
  Each expert keeps its C best-scored slots; an overflowing slot is dropped, or rerouted to the token's next
  choice that has room (one pending slot per token per round, best-scored first, until nothing fits). A shared
  expert already serves every token, so "shared" overflow is the drop of the routed slot (reported once).
- Auxiliary-loss-free bias balancing (DeepSeek-V3's rule, at inference): every `bias_step_tokens` tokens each
  expert's selection bias moves by u toward balance (+u if under-loaded, -u if over-loaded); the bias only
  selects, the combine weights stay the family's weights of the unbiased scores. u is a fraction
  (`bias_rate`) of the layer's typical decision margin (the k-th minus the (k+1)-th score, measured on the
  first step), since score scales differ by orders of magnitude across routers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from quantkit.errors import InputError
from quantkit.eval.moe.bias import BiasState, bias_balancing, decision_margin, max_over_mean
from quantkit.eval.moe.capacity import (CAPACITY_FACTORS, POLICIES, CapacityStats, apply_capacity, capacity,
                                        capacity_override)
from quantkit.eval.moe.observe import RoutingRecorder, routing_drift, topk_overlap
from quantkit.eval.moe.offload import greedy_decode, offload_runs

__all__ = ["MoEEvalOptions", "RoutingRecorder", "routing_drift", "topk_overlap", "capacity", "apply_capacity",
           "CapacityStats", "capacity_override", "BiasState", "bias_balancing", "decision_margin", "max_over_mean",
           "greedy_decode", "offload_runs", "analyze_moe", "moe_spec_of", "check_moe_checkpoints", "check_moe_blocks"]


@dataclass(frozen=True)
class MoEEvalOptions:
    capacity_factors: tuple[float, ...] = CAPACITY_FACTORS
    policies: tuple[str, ...] = ("drop", "reroute", "shared")
    # u = 0.1 decision margins every 16 tokens: a few hundred tokens move the bias by several margins, enough to
    # undo a 2x imbalance within one short eval block.
    bias_rate: float = 0.1
    bias_step_tokens: int = 16
    samples: int = 8  # token blocks for drift, capacity and bias runs (the first ones of the eval set)
    offload_cache: tuple[int, ...] = ()  # cache sizes (experts per layer) for the offload runs; () = E/2
    offload_reads: tuple[str, ...] = ("page-cache",)  # where offloaded experts are read from (runtime.offload.READS)
    offload_scratch: str | None = None  # where quantised experts' kernel tensors go (OffloadOptions.scratch_dir)
    # (policy, prefetch): "" none, "overlap" on the background thread, "sync" in the hook before the layer
    offload_runs: tuple[tuple[str, str], ...] = (("lru", ""), ("lfu", ""), ("trace", ""), ("lru", "overlap"),
                                                 ("lru", "sync"), ("trace", "overlap"))
    prompt_tokens: int = 32  # offload runs: greedy decode of decode_tokens after a prompt of prompt_tokens
    decode_tokens: int = 32
    # Offload runs: every row decodes this many times, the rows taken in turn, and reports its median speed (a
    # single 64-token decode of a row moved by 30% between runs on a shared 2-core machine).
    decode_repeats: int = 3

    def check(self, num_experts: int | None = None, top_k: int | None = None) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise InputError(f"unknown overflow policy {bad[0]!r}; valid: {', '.join(POLICIES)}")
        if any(g <= 0 for g in self.capacity_factors):
            raise InputError("capacity factors must be > 0")
        if self.samples < 1:
            raise InputError("--moe-samples must be at least 1")
        if self.decode_repeats < 1:
            raise InputError("offload decode repeats must be at least 1")
        from quantkit.runtime.offload import READS

        bad = [r for r in self.offload_reads if r not in READS]
        if bad or not self.offload_reads:
            raise InputError(f"unknown --offload-reads {bad[0] if bad else ''!r}; valid: {', '.join(READS)}")
        if self.offload_scratch is not None and not os.path.isdir(self.offload_scratch):
            raise InputError(f"--offload-scratch {self.offload_scratch} is not a folder")
        if num_experts is not None:
            for n in self.offload_cache:
                if not top_k <= n <= num_experts:
                    raise InputError(f"--offload-cache {n} is outside the valid range {top_k}..{num_experts} "
                                     f"(at least top-k = {top_k} experts must fit, at most all {num_experts})")


def moe_spec_of(path) -> "object | None":
    """The RouterSpec of a checkpoint folder's config (None: a dense model), without loading weights."""
    from transformers import AutoConfig

    from quantkit.models.moe import router_spec
    from quantkit.runtime.model import _generic_adapter

    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise InputError(f"cannot read config.json of {path}: {str(exc).splitlines()[0]}") from None
    return router_spec(_generic_adapter(getattr(config, "model_type", "?")), config)


def stores_experts(path) -> bool:
    """Whether a checkpoint folder stores per-expert tensors (a sparse MoE, described here or not)."""
    from quantkit.models.safetensors_index import SafetensorsIndex

    return any(".experts." in name for name in SafetensorsIndex(path).names())


def check_moe_checkpoints(paths) -> None:
    """Refuse a dense checkpoint before any model work. A MoE whose routing is not described here is checked when it
    loads (`check_moe_blocks`): the runtime finds its rule on the loaded router."""
    for p in paths:
        if moe_spec_of(p) is None and not stores_experts(p):
            raise InputError(f"--moe: {p} is a dense model (no sparse-MoE layers); --moe needs a "
                             "Mixture-of-Experts checkpoint")


def check_moe_blocks(rt, opts: MoEEvalOptions) -> None:
    """The loaded model's MoE blocks route by a rule the runtime knows (described, or found on the router), which
    --moe's capacity, bias and offload replays need."""
    from quantkit.runtime.moe import moe_blocks

    blocks = moe_blocks(rt.model)
    if not blocks:
        raise InputError(f"--moe: the routing of {rt.path}'s {getattr(rt.config, 'model_type', '?')!r} MoE blocks "
                         "matches no rule quantkit replays (softmax or sigmoid scores, a selection bias, expert "
                         "groups, scaling, shared experts); its own router runs it in eval and quantize")
    opts.check(blocks[0].spec.num_experts, blocks[0].spec.top_k)


def _kl_of(rt, ids: torch.Tensor, base_logits, batch_size: int) -> float:
    from quantkit.eval.metrics import token_stats

    kls = []
    for s in range(0, ids.shape[0], batch_size):
        batch = ids[s:s + batch_size]
        with torch.inference_mode():
            logits = rt(input_ids=batch.to(rt.device), use_cache=False).logits.cpu()
        for j in range(batch.shape[0]):
            kls.append(token_stats(base_logits(s + j)[:-1], logits[j, :-1], batch[j, 1:])["kl"])
    return float(torch.cat(kls).mean())


def analyze_moe(rt, recorder: RoutingRecorder, token_kl: torch.Tensor, ids: torch.Tensor, base_logits,
                base_path, opts: MoEEvalOptions, batch_size: int, dtype, device) -> dict:
    """The "moe" result of one checkpoint: `recorder` saw its routing in the main pass over `ids`,
    token_kl [N] is that pass's per-token KL, base_logits(i) the baseline logits of block i."""
    from quantkit.runtime import load_model
    from quantkit.runtime.moe import moe_blocks, observe_routing, override_routing

    blocks = moe_blocks(rt.model)
    spec = blocks[0].spec
    n = min(opts.samples, ids.shape[0])
    sub = ids[:n]
    tokens = n * ids.shape[1]
    kl_plain = float(token_kl[: n * (ids.shape[1] - 1)].mean())
    layers = recorder.layer_stats()
    out: dict = {"num_experts": spec.num_experts, "top_k": spec.top_k, "layers": layers,
                 "max_over_mean_load": round(sum(r["max_over_mean_load"] for r in layers) / len(layers), 4),
                 "samples": n, "kl_subset": round(kl_plain, 6)}

    # Drift: the baseline's own routing of the same blocks, when the baseline is an MoE with these experts.
    drift = {"routing_topk_overlap": None, "per_layer": {},
             "note": "baseline is not an MoE with the same experts"}
    base = load_model(base_path, dtype, device) if moe_spec_of(base_path) or stores_experts(base_path) else None
    base_blocks = moe_blocks(base.model) if base is not None else []
    if base_blocks and base_blocks[0].spec.num_experts == spec.num_experts and base_blocks[0].spec.top_k == spec.top_k:
        base_rec = RoutingRecorder(spec.num_experts)
        with observe_routing(base.model, base_rec), torch.inference_mode():
            for s in range(0, n, batch_size):
                base(input_ids=sub[s:s + batch_size].to(device), use_cache=False)
        drift = routing_drift(recorder, base_rec, tokens)
    del base, base_blocks
    out["routing_topk_overlap"] = drift["routing_topk_overlap"]
    out["drift_per_layer"] = drift["per_layer"]
    if drift.get("note"):
        out["routing_note"] = drift["note"]  # why the overlap was not measured

    # Capacity-aware inference.
    shared = bool(spec.shared_experts)
    results = []
    for gamma in opts.capacity_factors:
        for policy in opts.policies:
            if policy == "shared" and not shared:
                continue
            if policy == "shared":
                # The shared expert already serves every token: overflow to it is the drop of the routed slot.
                prev = next(r for r in results if r["gamma"] == gamma and r["policy"] == "drop")
                results.append({**prev, "policy": "shared", "same_as": "drop"})
                continue
            stats = CapacityStats()
            with override_routing(rt.model, capacity_override(gamma, policy, stats)):
                kl = _kl_of(rt, sub, base_logits, batch_size)
            before, after = stats.max_before / stats.calls, stats.max_after / stats.calls
            results.append({"gamma": gamma, "policy": policy,
                            "capacity": capacity(gamma, min(batch_size, n) * ids.shape[1], spec.top_k,
                                                 spec.num_experts),
                            "max_load_before": round(before, 2), "max_load_after": round(after, 2),
                            "max_load_reduction": round(1 - after / before, 4) if before else 0.0,
                            "dropped_frac": round(stats.dropped / stats.slots, 5),
                            "rerouted_frac": round(stats.rerouted / stats.slots, 5),
                            "over_capacity_calls": stats.over_capacity,
                            "kl": round(kl, 6), "kl_change": round(kl - kl_plain, 6)})
    out["capacity"] = results

    # Bias balancing at inference.
    state = BiasState(opts.bias_rate, opts.bias_step_tokens)
    rec = RoutingRecorder(spec.num_experts)
    with override_routing(rt.model, bias_balancing(state)), observe_routing(rt.model, rec):
        kl_bias = _kl_of(rt, sub, base_logits, batch_size)
    plain_sel = {layer: recorder.selections(layer, tokens) for layer in recorder.calls}
    bias_sel = {layer: rec.selections(layer) for layer in rec.calls}
    changed = sum(int((plain_sel[l].sort(1).values != bias_sel[l].sort(1).values).any(1).sum()) for l in bias_sel)
    total = sum(bias_sel[l].shape[0] for l in bias_sel)
    out["bias_balancing"] = {
        "rate": opts.bias_rate, "step_tokens": opts.bias_step_tokens, "steps": state.steps,
        "unit_mean": sum(state.unit.values()) / max(len(state.unit), 1),
        "max_over_mean_load": {"without": round(max_over_mean(plain_sel, spec.num_experts), 4),
                               "with": round(max_over_mean(bias_sel, spec.num_experts), 4)},
        "kl": {"without": round(kl_plain, 6), "with": round(kl_bias, 6)},
        "tokens_rerouted_frac": round(changed / max(total, 1), 5)}
    sizes = opts.offload_cache or (max(spec.top_k, spec.num_experts // 2),)
    out["offload"] = offload_runs(rt.path, ids[0, :opts.prompt_tokens], sizes, opts, dtype, device)
    return out
