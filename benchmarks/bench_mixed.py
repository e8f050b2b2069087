"""Mixed precision at the size of uniform W4A16 g64: held-out KL of each, by RTN and by GPTQ; and whether the
sensitivity estimate ranks linears as their measured KL does.

    .venv/bin/python benchmarks/bench_mixed.py [--choices W4A16:ch,W4A16:g128,W4A16:g64,W4A16:g32,W8A16:ch]

1. quantkit quantizes uniform W4A16 g64 (RTN, GPTQ); the mixed runs take its measured bits per weight (the
   manifest's, scales included) as --target-bits, so both checkpoints are the same size or the mixed one smaller.
2. Every checkpoint is scored by benchmarks/kl_plain.py (transformers + compressed-tensors) on held-out KJV and
   on pydoc (another domain than the KJV calibration).
3. Rank check: for every linear of five layers, the KL measured by running transformers with that one linear
   rounded to nearest (W4A16 g64) on the sensitivity pass's own tokens, against the pass's estimate of the same.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

import torch

from common import (HELDOUT_KJV, HELDOUT_PYDOC, ROOT, heldout_sets, kl_plain, machine_line, prepare_run, ratio,
                    run_measured, write_results)


def _spearman(a: list[float], b: list[float]) -> float:
    ra = torch.tensor(a).argsort().argsort().float()
    rb = torch.tensor(b).argsort().argsort().float()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def rank_check(model: Path, tok, n_samples: int, seq_len: int, seed: int, samples: int = 8) -> dict:
    """The sensitivity pass's estimate (round to nearest, W4A16 g64, for every linear of five layers) against the KL
    measured by running transformers with that one linear rounded, on the pass's own tokens."""
    from transformers import AutoModelForCausalLM

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.loader import open_model
    from quantkit.models.source import resolve_model
    from quantkit.pipeline.engine import plan_layers
    from quantkit.pipeline.sensitivity import SensitivityOptions, linear_sensitivity
    from quantkit.quant.schemes import parse_choice
    from quantkit.quant.weights import round_trip

    ids = build_token_blocks(tok, "kjv", n_samples, seq_len, seed=seed).input_ids[:samples]
    scheme = parse_choice("W4A16:g64")
    handle = open_model(resolve_model(str(model)), False)
    plans = plan_layers(handle, scheme, ["lm_head"])
    n_layers = len(plans)
    picked = sorted({0, n_layers // 3, n_layers // 2, (2 * n_layers) // 3, n_layers - 1})
    chosen = {t.checkpoint: [scheme] for p in plans if p.index in picked for t in p.targets}
    began = time.time()
    est = linear_sensitivity(handle, plans, chosen, ids, torch.bfloat16, options=SensitivityOptions(samples=samples))
    pass_seconds = time.time() - began
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        base = torch.log_softmax(m(ids).logits, -1)
    rows = []
    for name in chosen:
        mod = m.get_submodule(name)
        w = mod.weight.data.clone()
        mod.weight.data = round_trip(w, scheme.weights, torch.bfloat16)
        with torch.no_grad():
            lp = torch.log_softmax(m(ids).logits, -1)
        mod.weight.data = w
        measured = float((base.exp() * (base - lp)).sum(-1).mean())
        rows.append({"module": name, "measured": measured, "estimated": est[name][0]})
        print(f"  {name}: measured {measured:.3g} estimated {est[name][0]:.3g}", flush=True)
    e, mm = [r["estimated"] for r in rows], [r["measured"] for r in rows]
    ratios = sorted(a / b for a, b in zip(e, mm) if b > 0)
    return {"rows": rows, "spearman": _spearman(e, mm), "median_ratio": ratios[len(ratios) // 2],
            "layers": picked, "tokens": int(ids.numel()), "pass_seconds": round(pass_seconds, 1)}


def _rank_line(check: dict) -> str:
    return (f"Rank check: {len(check['rows'])} linears of layers {check['layers']}, W4A16 g64 round to nearest, "
            f"measured on the sensitivity pass's {check['tokens']} tokens: Spearman {check['spearman']:.3f}, median "
            f"estimate / measured {check['median_ratio']:.3f} (pass {check['pass_seconds']} s, all "
            f"{check['seconds']} s).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--choices", default="W4A16:ch,W4A16:g128,W4A16:g64,W4A16:g32,W8A16:ch;"
                    "W4A16:ch,W4A16:g64,W4A16:g32,W4A16_ASYM:ch,W4A16_ASYM:g64,W4A16_ASYM:g32,W8A16:ch",
                    help="choice sets, ';' between sets; each gives one mixed run per method")
    ap.add_argument("--reference", default="W4A16_ASYM:g64",
                    help="another uniform scheme to list beside them (empty: none)")
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--skip-rank-check", action="store_true")
    ap.add_argument("--rank-check-only", action="store_true", help="only the rank check (results/mixed_rank.md)")
    ap.add_argument("--sensitivity-samples", type=int, default=None,
                    help="recipe quantization.mixed.samples (default: the recipe default)")
    ap.add_argument("--sensitivity-draws", type=int, default=None,
                    help="recipe quantization.mixed.draws (default: the recipe default)")
    ap.add_argument("--estimates", default="pooled",
                    help="recipe quantization.mixed.estimate, comma-separated: one mixed run per estimate")
    ap.add_argument("--results", default="mixed", help="results file name (split a long run by --methods)")
    ap.add_argument("--work", type=Path, default=None, help="default benchmarks/.work/<results>")
    args = ap.parse_args()
    args.work = args.work or ROOT / "benchmarks" / ".work" / args.results

    load = {"before": os.getloadavg()[0]}
    model, tok = prepare_run(args.model, args.work)
    from quantkit.quant.schemes import parse_choice

    if args.rank_check_only:
        began = time.time()
        check = rank_check(model, tok, args.calib_samples, args.seq_len, args.seed)
        check["seconds"] = round(time.time() - began, 1)
        md = ["# Sensitivity estimate against measured single-linear KL", "", f"model `{model.name}`; torch CPU "
              f"capability {torch.backends.cpu.get_cpu_capability()}, load average before {load['before']:.2f}, "
              f"after {os.getloadavg()[0]:.2f}", "", _rank_line(check), "", "| linear | measured KL | estimated |",
              "|---|---|---|"] + [f"| {r['module']} | {r['measured']:.4g} | {r['estimated']:.4g} |" for r in check["rows"]]
        write_results("mixed_rank", {"rank_check": check, "load_average": [load["before"], os.getloadavg()[0]]},
                      "\n".join(md) + "\n")
        return
    eval_files = heldout_sets(tok, args.work, args.heldout_samples, args.seq_len)
    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    calib = ["--dataset", "kjv", "--num-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
             "--seed", str(args.seed)]
    estimates = args.estimates.split(",")
    sensitivity = {}
    for estimate in estimates:
        mixed = {k: v for k, v in (("samples", args.sensitivity_samples), ("draws", args.sensitivity_draws)) if v}
        recipe = args.work / f"sensitivity-{estimate}.yaml"
        recipe.parent.mkdir(parents=True, exist_ok=True)
        # The recipe needs a complete mixed section; --schemes and --target-bits override these two fields.
        recipe.write_text(json.dumps({"quantization": {"mixed": {"schemes": ["W4A16:g64"], "target_bits": 4.25,
                                                                 "estimate": estimate, **mixed}}}))
        sensitivity[estimate] = ["--recipe", str(recipe)]
    runs: dict[str, dict] = {}
    for method in args.methods.split(","):
        name = f"uniform W4A16 g64 {method}"
        out = args.work / name.replace(" ", "_")
        res = run_measured([quantkit, "quantize", "--model", str(model), "--method", method, "--scheme", "W4A16",
                            "--group-size", "64", *calib, "--output", str(out), "--json"])
        summary = json.loads(res["stdout"])
        runs[name] = {"wall_s": res["wall_s"], "bits": summary["bits_per_weight"], "path": out, "method": method}
        print(f"{name}: {res['wall_s']:.1f} s, {summary['bits_per_weight']} bits", flush=True)
        target = summary["bits_per_weight"]
        if args.reference:
            ref = parse_choice(args.reference)
            name = " ".join(x for x in ("uniform", ref.name, ref.label.partition(":")[2], method) if x)
            out = args.work / name.replace(" ", "_")
            group = ref.weights.group_size if ref.weights.strategy == "group" else -1
            res = run_measured([quantkit, "quantize", "--model", str(model), "--method", method, "--scheme", ref.name,
                                "--group-size", str(group), *calib, "--output", str(out), "--json"])
            summary = json.loads(res["stdout"])
            runs[name] = {"wall_s": res["wall_s"], "bits": summary["bits_per_weight"], "path": out, "method": method}
            print(f"{name}: {res['wall_s']:.1f} s, {summary['bits_per_weight']} bits", flush=True)
        for (k, choices), estimate in itertools.product(enumerate(args.choices.split(";"), start=1), estimates):
            name = f"mixed {method} set {k}" + (f" {estimate}" if len(estimates) > 1 else "")
            out = args.work / name.replace(" ", "_")
            res = run_measured([quantkit, "quantize", "--model", str(model), "--method", method, "--schemes",
                                choices, "--target-bits", str(target), *calib, *sensitivity[estimate],
                                "--output", str(out), "--json"])
            summary = json.loads(res["stdout"])
            runs[name] = {"wall_s": res["wall_s"], "bits": summary["bits_per_weight"], "path": out, "method": method,
                          "precision": summary["precision"], "set": k, "estimate": estimate}
            print(f"{name}: {res['wall_s']:.1f} s, {summary['bits_per_weight']} bits, "
                  f"{summary['precision']['schemes']}", flush=True)
    for name, r in runs.items():
        r["kl"] = {k: kl_plain(model, r["path"], f) for k, f in eval_files.items()}
        print(name, {k: round(v["kl_mean"], 4) for k, v in r["kl"].items()}, flush=True)
    check = None
    if not args.skip_rank_check:
        began = time.time()
        check = rank_check(model, tok, args.calib_samples, args.seq_len, args.seed)
        check["seconds"] = round(time.time() - began, 1)
    load["after"] = os.getloadavg()[0]

    md = ["# Mixed precision at the size of uniform W4A16 g64", "",
          f"model `{model.name}`; "
          + "; ".join(f"choice set {k}: `{c}`" for k, c in enumerate(args.choices.split(";"), 1))
          + f"; calibration KJV {args.calib_samples} x {args.seq_len} "
          f"tokens (the sensitivity pass reads the first {args.sensitivity_samples or 8} with "
          f"{args.sensitivity_draws or 4} draws each, estimate {args.estimates}); held-out "
          f"{args.heldout_samples} x {args.seq_len} tokens "
          f"per domain, scored by benchmarks/kl_plain.py (transformers + compressed-tensors); {machine_line(load)}",
          "",
          f"| run | wall s | bits/weight | KL {HELDOUT_KJV} | KL {HELDOUT_PYDOC} | perplexity {HELDOUT_KJV} | "
          f"top-1 {HELDOUT_KJV} | scored by |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        kj, py = r["kl"][HELDOUT_KJV], r["kl"][HELDOUT_PYDOC]
        md.append(f"| {name} | {r['wall_s']:.1f} | {r['bits']} | {kj['kl_mean']:.4f} | {py['kl_mean']:.4f} | "
                  f"{kj['ppl']:.3f} | {kj['top1_agree']:.4f} | {kj.get('scorer', '')} |")
    md.append("")
    for name, m in runs.items():
        if "precision" not in m:
            continue
        method = m["method"]
        u = runs[f"uniform W4A16 g64 {method}"]
        p = m["precision"]
        md.append(f"- {method}, set {m['set']}, {m['estimate']} estimate: mixed / uniform KL {HELDOUT_KJV} {ratio(m['kl'][HELDOUT_KJV]['kl_mean'], u['kl'][HELDOUT_KJV]['kl_mean'])}, "
                  f"{HELDOUT_PYDOC} {ratio(m['kl'][HELDOUT_PYDOC]['kl_mean'], u['kl'][HELDOUT_PYDOC]['kl_mean'])}; "
                  f"bits {m['bits']} vs {u['bits']}; wall {ratio(m['wall_s'], u['wall_s'])} (sensitivity pass "
                  f"{p['sensitivity']['seconds']} s); plan: " + ", ".join(
                      f"{label} {v['linears']} linears ({100 * v['weights'] / sum(x['weights'] for x in p['schemes'].values()):.1f}% of weights)"
                      for label, v in sorted(p["schemes"].items())))
    if check:
        md += ["", _rank_line(check)]
    payload = {"load_average": load, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "choices": args.choices, "rank_check": check,
               "runs": {k: {**{kk: vv for kk, vv in v.items() if kk != "path"}, "path": str(v["path"])}
                        for k, v in runs.items()}}
    write_results(args.results, payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
