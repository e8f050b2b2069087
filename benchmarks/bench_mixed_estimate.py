"""Does a mixed-precision plan keep what its estimate promised? The sensitivity pass on independent sample sets,
each plan scored by the others.

    .venv/bin/python benchmarks/bench_mixed_estimate.py [--sets 3 --samples 8 --draws 4]

1. The calibration text (KJV, as `quantize` reads it) is cut into `--sets` disjoint slices; on each, one
   sensitivity pass (`pipeline.sensitivity.sensitivity_sums`, the run's method's previews, its own draw seed)
   gives both the sequence-level estimate and the token-level sums.
2. For each estimate (sequence, pooled) and each set, the allocator plans the linears at the bits of uniform
   `--uniform`. The plan's KL relative to the uniform plan is read under the same set's estimate (what it
   promised) and under the sequence estimate of every other set (what it gets on text and draws it did not see:
   the sequence estimate is the unbiased one).
3. The same with the estimate pooled over all sets but one, scored on the one left out.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import ROOT, machine_line, prepare_run, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--choices", default="W4A16:ch,W4A16:g64,W4A16:g32,W4A16_ASYM:ch,W4A16_ASYM:g64,W4A16_ASYM:g32,"
                    "W8A16:ch")
    ap.add_argument("--uniform", default="W4A16:g64", help="the uniform plan whose bits are the budget")
    ap.add_argument("--method", default="rtn")
    ap.add_argument("--sets", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8, help="sequences per set (the recipe's mixed.samples)")
    ap.add_argument("--draws", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=42)
    args = ap.parse_args()
    load = {"before": os.getloadavg()[0]}
    model, tok = prepare_run(args.model, ROOT / "benchmarks" / ".work" / "mixed_estimate")

    from quantkit.data.calibration import build_token_blocks
    from quantkit.methods import build_methods
    from quantkit.models.loader import open_model
    from quantkit.models.source import resolve_model
    from quantkit.pipeline.engine import plan_layers
    from quantkit.pipeline.mixed import allocation_items
    from quantkit.pipeline.sensitivity import SensitivityOptions, pooled_estimate, sensitivity_sums
    from quantkit.quant.allocation import allocate
    from quantkit.quant.schemes import parse_choice

    choices = [parse_choice(c) for c in args.choices.split(",")]
    labels = [c.label for c in choices]
    uniform = parse_choice(args.uniform)
    if uniform.label not in labels:
        raise SystemExit(f"--uniform {uniform.label} must be one of --choices")
    per_set = 2 * args.samples  # a pass reads `samples` sequences and as many for its method's statistics
    ids = build_token_blocks(tok, "kjv", args.sets * per_set, args.seq_len, args.seed).input_ids
    handle = open_model(resolve_model(str(model)), False)
    plans = plan_layers(handle, uniform, ["lm_head"])
    items = allocation_items(plans, choices, handle.source_dtype())
    if items.dropped:
        raise SystemExit("every choice must fit every linear here: " + str(items.dropped[0]))
    members = list(items.tied.values())
    budget = sum(c[labels.index(uniform.label)] for c in items.costs)
    method = build_methods(args.method, uniform)[-1]
    per_linear = {t.checkpoint: choices for p in plans for t in p.targets}

    sets, seconds = [], []
    for k in range(args.sets):
        began = time.time()
        sets.append(sensitivity_sums(handle, plans, per_linear, ids[k * per_set:(k + 1) * per_set],
                                     handle.source_dtype(),
                                     options=SensitivityOptions(samples=args.samples, draws=args.draws, seed=k),
                                     method=method))
        seconds.append(round(time.time() - began, 1))
        print(f"set {k}: {seconds[-1]} s", flush=True)

    def estimate(kind: str, got: dict) -> dict:
        if kind == "sequence":
            return got["sequence"]
        return {n: pooled_estimate(v, got["token"][n]) for n, v in got["sequence"].items()}

    def mean(gots: list[dict]) -> dict:
        return {part: {n: [sum(g[part][n][j] for g in gots) / len(gots) for j in range(len(labels))]
                       for n in gots[0][part]} for part in ("sequence", "token")}

    def item_errors(est: dict) -> list[list[float]]:
        return [[sum(est[t.checkpoint][j] for t in m) for j in range(len(labels))] for m in members]

    def relative(est: dict, picks: list[int]) -> float:
        errs = item_errors(est)
        u = labels.index(uniform.label)
        return sum(e[j] for e, j in zip(errs, picks)) / sum(e[u] for e in errs)

    rows = []
    for kind in ("sequence", "pooled"):
        for k in range(args.sets):
            own = estimate(kind, sets[k])
            picks = allocate(items.costs, item_errors(own), budget=budget).picks
            others = [relative(sets[j]["sequence"], picks) for j in range(args.sets) if j != k]
            rows.append({"estimate": kind, "planned on": f"set {k}", "promised": relative(own, picks),
                         "independent": others})
        for k in range(args.sets):
            rest = mean([sets[j] for j in range(args.sets) if j != k])
            picks = allocate(items.costs, item_errors(estimate(kind, rest)), budget=budget).picks
            rows.append({"estimate": kind, "planned on": f"all sets but {k}",
                         "promised": relative(estimate(kind, rest), picks),
                         "independent": [relative(sets[k]["sequence"], picks)]})
    load["after"] = os.getloadavg()[0]

    def mean_of(kind: str, pooled_sets: bool) -> float:
        vals = [v for r in rows if r["estimate"] == kind and r["planned on"].startswith("all") == pooled_sets
                for v in r["independent"]]
        return sum(vals) / len(vals)

    md = ["# Mixed precision: what a plan's estimate promises against what independent samples measure", "",
          f"model `{model.name}`; method {args.method}; choices `{args.choices}`; budget: the bits of uniform "
          f"{uniform.label}; {args.sets} disjoint KJV sets of {args.samples} x {args.seq_len} tokens "
          f"(+ as many for the method's statistics), {args.draws} draws per sequence, passes "
          f"{', '.join(f'{s} s' for s in seconds)}; {machine_line(load)}", "",
          "KL of the plan relative to uniform (lower is better): under the estimate it was planned on, and under the "
          "unbiased sequence-level estimate of each set it did not see.", "",
          "| estimate | planned on | promised | independent |", "|---|---|---|---|"]
    md += [f"| {r['estimate']} | {r['planned on']} | {r['promised']:.3f} | "
           f"{', '.join(f'{v:.3f}' for v in r['independent'])} |" for r in rows]
    md += ["", "Means of the independent scores: "
           + "; ".join(f"{kind}: one set {mean_of(kind, False):.3f}, pooled sets {mean_of(kind, True):.3f}"
                       for kind in ("sequence", "pooled")) + "."]
    write_results("mixed_estimate", {"load_average": load, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                                     "args": vars(args), "seconds": seconds, "rows": rows}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
