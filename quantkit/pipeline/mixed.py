"""Mixed precision: which of the allowed schemes each linear takes, under a size budget (`--target-bits`) or an
accuracy budget (`--max-kl`).

Each linear's choices are priced exactly (the bits its tensors take on disk, from the same specs the writer
uses) and weighed by the KL each adds to the model's output (`pipeline.sensitivity`); `quant.allocation` picks
one per linear, tying the linears an engine serves as one (`tie_key`). A choice a linear cannot take (its groups
do not divide K) is dropped for it and the linears tied to it, and the plan lists it. The plan is written next to
the checkpoint as `precision_plan.json`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import torch

from quantkit.errors import InputError
from quantkit.formats.compressed_tensors import quantized_specs
from quantkit.quant.allocation import allocate
from quantkit.quant.schemes import Scheme, fits, parse_choice
from quantkit.recipe import MixedSpec

PLAN_FILE = "precision_plan.json"


def parse_choices(spec: MixedSpec, group_size: int | None) -> list[Scheme]:
    choices, seen = [], set()
    for text in spec.schemes:
        scheme = parse_choice(text, group_size)
        if scheme.label not in seen:
            seen.add(scheme.label)
            choices.append(scheme)
    return choices


def _bits(t, scheme: Scheme, weight_dtype: torch.dtype) -> int:
    return sum(s.nbytes * 8 for s in quantized_specs(t.checkpoint, t.out_features, t.in_features, scheme, weight_dtype))


def tie_key(module: str) -> str:
    """Linears that must share a scheme because a serving engine runs them as one: q/k/v and gate/up (vLLM
    fuses them and refuses shards of different schemes), and every expert of one MoE block (one fused-MoE kernel
    per block)."""
    from quantkit.serving.parallel import merge_key

    expert = re.match(r"(.*\.experts)\.\d+\.", module)
    if expert:
        return expert.group(1)
    merged = merge_key(module)
    return merged[0] if merged else module


@dataclass
class AllocationItems:
    """The allocation's items: the linears tied into one (tie_key), each item's choices and their exact bits."""

    tied: dict[str, list]  # key -> the LayerPlan targets it ties
    choices: dict[str, list[Scheme]]  # key -> the choices every one of its linears can take
    costs: list[list[int]]  # per item (in `tied`'s order), per choice: bits on disk
    dropped: list[dict]  # the items that lost choices, and which


def allocation_items(plans: list, choices: list[Scheme], weight_dtype: torch.dtype) -> AllocationItems:
    tied: dict[str, list] = {}
    for t in (t for p in plans for t in p.targets):
        tied.setdefault(tie_key(t.checkpoint), []).append(t)
    item_choices: dict[str, list[Scheme]] = {}
    dropped = []
    for key, members in tied.items():
        ok = [s for s in choices if all(fits(s, t.in_features) for t in members)]
        if not ok:
            t = next((t for t in members if not any(fits(s, t.in_features) for s in choices)), members[0])
            raise InputError(f"{t.checkpoint} has {t.in_features} input features and none of --schemes "
                             f"({', '.join(s.label for s in choices)}) fits it and the linears served with it; "
                             f"add one that does (e.g. {choices[0].name}:ch) or --ignore {t.checkpoint}")
        if len(ok) < len(choices):
            dropped.append({"modules": [t.checkpoint for t in members],
                            "dropped": [s.label for s in choices if s not in ok]})
        item_choices[key] = ok
    costs = [[sum(_bits(t, s, weight_dtype) for t in members) for s in item_choices[key]]
             for key, members in tied.items()]
    return AllocationItems(tied, item_choices, costs, dropped)


def plan_precision(handle, plans: list, spec: MixedSpec, choices: list[Scheme], input_ids: torch.Tensor,
                   weight_dtype: torch.dtype, device: str = "cpu", method=None, on_layer=None) -> dict:
    """Set each target's scheme (LayerPlan.targets[*].scheme) and return the plan (see the module docstring).
    `method`: the run's quantising method, whose stored weights the estimates weigh (`Method.preview`)."""
    from quantkit.pipeline.sensitivity import SensitivityOptions, linear_sensitivity

    targets = [t for p in plans for t in p.targets]
    items = allocation_items(plans, choices, weight_dtype)
    tied, item_choices, costs, dropped = items.tied, items.choices, items.costs, items.dropped
    per_linear = {t.checkpoint: item_choices[key] for key, members in tied.items() for t in members}
    weights = sum(t.out_features * t.in_features for t in targets)
    began = time.perf_counter()
    options = SensitivityOptions(samples=min(spec.samples, input_ids.shape[0]), draws=spec.draws,
                                 estimate=spec.estimate)
    kl = linear_sensitivity(handle, plans, per_linear, input_ids, weight_dtype, device, options, method=method,
                            on_layer=on_layer)
    seconds = time.perf_counter() - began
    errors = [[sum(kl[t.checkpoint][j] for t in members) for j in range(len(item_choices[key]))]
              for key, members in tied.items()]
    try:
        if spec.target_bits is not None:
            result = allocate(costs, errors, budget=spec.target_bits * weights)
        else:
            result = allocate(costs, errors, max_error=spec.max_kl)
    except ValueError:
        if spec.target_bits is not None:
            floor = sum(min(c) for c in costs) / weights
            raise InputError(f"--target-bits {spec.target_bits:g} is below the cheapest plan these --schemes allow "
                             f"({floor:.4f} bits per weight, scales included)") from None
        best = sum(min(e) for e in errors)
        raise InputError(f"--max-kl {spec.max_kl:g} is below what these --schemes can reach (estimated KL "
                         f"{best:.4g} with every linear at its most accurate choice)") from None
    linears, counts = [], {}
    for (key, members), j in zip(tied.items(), result.picks):
        for t in members:
            t.scheme = item_choices[key][j]
            label, n = t.scheme.label, t.out_features * t.in_features
            entry = counts.setdefault(label, {"linears": 0, "weights": 0})
            entry["linears"] += 1
            entry["weights"] += n
            linears.append({"module": t.checkpoint, "scheme": label, "tied": key,
                            "bits_per_weight": round(_bits(t, t.scheme, weight_dtype) / n, 4),
                            "kl": {s.label: float(f"{v:.6g}")
                                   for s, v in zip(per_linear[t.checkpoint], kl[t.checkpoint])}})
    return {
        "choices": [s.label for s in choices],
        "target_bits": spec.target_bits,
        "max_kl": spec.max_kl,
        "bits_per_weight": round(result.cost / weights, 4),
        "estimated_kl": float(f"{result.error:.6g}"),
        "schemes": counts,
        "dropped": dropped,
        "sensitivity": {"samples": options.samples, "draws": options.draws, "seconds": round(seconds, 2),
                        "estimate": f"fisher, {options.estimate}", "weights": getattr(method, "name", None) or "rtn",
                        "statistics_held_out": bool(getattr(method, "preview_stats", None))
                        and input_ids.shape[0] >= 2 * options.samples},
        "linears": linears,
    }


def base_scheme(plans: list) -> Scheme:
    """The scheme most linears took (by weights): config.json's catch-all group; the others are listed by name."""
    by: dict[str, list] = {}
    for p in plans:
        for t in p.targets:
            entry = by.setdefault(t.scheme.label, [t.scheme, 0])
            entry[1] += t.out_features * t.in_features
    return max(by.values(), key=lambda e: e[1])[0]
