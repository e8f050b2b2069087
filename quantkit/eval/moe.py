"""`quantkit eval --moe`: routing statistics, routing drift, capacity-aware inference and bias balancing,
all through the runtime MoE block's observers and selection overrides (quantkit/runtime/moe.py).

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

import math
import time
from dataclasses import dataclass, field

import torch

from quantkit.errors import InputError
from quantkit.models.routing_profile import count_selection
from quantkit.runtime.moe import Routing, SelectionOverride, with_selection

CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)
POLICIES = ("drop", "reroute", "shared")


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
    # (policy, prefetch): "" none, "overlap" on the background thread, "sync" in the hook before the layer
    offload_runs: tuple[tuple[str, str], ...] = (("lru", ""), ("lfu", ""), ("trace", ""), ("lru", "overlap"),
                                                 ("lru", "sync"), ("trace", "overlap"))
    prompt_tokens: int = 32  # offload runs: greedy decode of decode_tokens after a prompt of prompt_tokens
    decode_tokens: int = 32

    def check(self, num_experts: int | None = None, top_k: int | None = None) -> None:
        bad = [p for p in self.policies if p not in POLICIES]
        if bad:
            raise InputError(f"unknown overflow policy {bad[0]!r}; valid: {', '.join(POLICIES)}")
        if any(g <= 0 for g in self.capacity_factors):
            raise InputError("capacity factors must be > 0")
        if self.samples < 1:
            raise InputError("--moe-samples must be at least 1")
        if num_experts is not None:
            for n in self.offload_cache:
                if not top_k <= n <= num_experts:
                    raise InputError(f"--offload-cache {n} is outside the valid range {top_k}..{num_experts} "
                                     f"(at least top-k = {top_k} experts must fit, at most all {num_experts})")


# ------------------------------------------------------------------------------------- observation


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


# --------------------------------------------------------------------------------------- capacity


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


# ---------------------------------------------------------------------------------- bias balancing


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


# ------------------------------------------------------------------------------------------ the runs


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


def check_moe_checkpoints(paths) -> None:
    for p in paths:
        if moe_spec_of(p) is None:
            raise InputError(f"--moe: {p} is a dense model (no sparse-MoE layers); --moe needs a "
                             "Mixture-of-Experts checkpoint")


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
    base_spec = moe_spec_of(base_path)
    drift = {"routing_topk_overlap": None, "per_layer": {},
             "note": "baseline is not an MoE with the same experts"}
    if base_spec is not None and base_spec.num_experts == spec.num_experts and base_spec.top_k == spec.top_k:
        base = load_model(base_path, dtype, device)
        base_rec = RoutingRecorder(spec.num_experts)
        with observe_routing(base.model, base_rec), torch.inference_mode():
            for s in range(0, n, batch_size):
                base(input_ids=sub[s:s + batch_size].to(device), use_cache=False)
        del base
        drift = routing_drift(recorder, base_rec, tokens)
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


@torch.inference_mode()
def greedy_decode(rt, prompt: torch.Tensor, steps: int, on_prefill=None) -> tuple[torch.Tensor, float]:
    """Logits [steps + 1, V] of a greedy decode with the KV cache, and the decode seconds (prefill excluded)."""
    from transformers import DynamicCache

    import inspect

    net = rt.model
    cache = DynamicCache(config=net.config)
    # transformers renamed `past_key_values` to `cache`; pass whichever this version's forward takes.
    key = "cache" if "cache" in inspect.signature(net.forward).parameters else "past_key_values"
    logits = [net(input_ids=prompt[None].to(rt.device), **{key: cache}, use_cache=True).logits[0, -1]]
    if on_prefill:
        on_prefill()
    start = time.perf_counter()
    for _ in range(steps):
        token = logits[-1].argmax(-1).view(1, 1)
        logits.append(net(input_ids=token, **{key: cache}, use_cache=True).logits[0, -1])
    return torch.stack(logits).cpu(), time.perf_counter() - start


def offload_runs(path, prompt: torch.Tensor, sizes, opts: MoEEvalOptions, dtype, device) -> list[dict]:
    """Decode with experts offloaded (quantkit/runtime/offload.py) per cache size and policy; the fully
    resident model's decode is the reference for speed and, exactly, for the logits."""
    from quantkit.models.routing_profile import read_profile
    from quantkit.runtime import load_model
    from quantkit.runtime.offload import OffloadOptions, install_offload

    profile = read_profile(path)
    resident = load_model(path, dtype, device)
    ref, ref_s = greedy_decode(resident, prompt, opts.decode_tokens)
    del resident
    rows = [{"policy": "resident", "prefetch": None, "cache": None, "hit_rate": 1.0, "prefetch_fidelity": None,
             "bytes_moved": 0, "decode_tok_s": round(opts.decode_tokens / ref_s, 2), "exact": True}]
    for size in sizes:
        for policy, prefetch in opts.offload_runs:
            rt = load_model(path, dtype, device)
            cache = install_offload(rt, OffloadOptions(size, policy, bool(prefetch), overlap=prefetch != "sync"),
                                    profile)
            logits, secs = greedy_decode(rt, prompt, opts.decode_tokens, on_prefill=cache.reset_stats)
            st = cache.stats.to_dict()
            name = policy + {"": "", "overlap": "+prefetch", "sync": "+prefetch-sync"}[prefetch]
            rows.append({"policy": name, "prefetch": prefetch or None, "cache": size,
                         "hit_rate": st["hit_rate"], "prefetch_fidelity": st["prefetch_fidelity"],
                         "bytes_moved": st["bytes_moved"], "demand_loads": st["demand_loads"],
                         "prefetch_loads": st["prefetch_loads"], "requests": st["requests"],
                         "decode_tok_s": round(opts.decode_tokens / secs, 2),
                         "profile": profile is not None, "exact": bool(torch.equal(logits, ref))})
            cache.remove()
            del rt, cache
    return rows
