"""Where a checkpoint loses its accuracy, on the real model: `quantkit eval --attribution` of SmolLM2 (or --model)
quantised with RTN W4A16 g64 (the demo's checkpoint) and GPTQ NVFP4A16, on held-out KJV.

    .venv/bin/python benchmarks/bench_attribution.py [--num-samples 8]

Writes benchmarks/results/attribution.{md,json} and the per-checkpoint bar plots (attribution_*.png).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from common import RESULTS, ROOT, prepare_run, run_measured, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--only", default=None, help="comma-separated checkpoint names to build (default: all)")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "attribution")
    args = ap.parse_args()

    load = {"before": os.getloadavg()[0]}
    model, _ = prepare_run(args.model, args.work)
    qk = str(ROOT / ".venv" / "bin" / "quantkit")
    ckpts = {"RTN W4A16 g64": ["--method", "rtn", "--scheme", "W4A16", "--group-size", "64"],
             "GPTQ NVFP4A16": ["--method", "gptq", "--scheme", "NVFP4A16", "--num-samples", "64"]}
    if args.only:
        ckpts = {k: v for k, v in ckpts.items() if k in args.only.split(",")}
    paths = []
    for name, flags in ckpts.items():
        out = args.work / name.replace(" ", "_")
        run_measured([qk, "quantize", "--model", str(model), *flags, "--output", str(out), "--json"])
        paths.append(out)
    report = args.work / "report"
    res = run_measured([qk, "eval", *map(str, paths), "--baseline", str(model), "--attribution", "--num-samples",
                        str(args.num_samples), "--seq-len", str(args.seq_len), "--seed", "1234", "--report",
                        str(report), "--json"])
    load["after"] = os.getloadavg()[0]
    rows = json.loads(res["stdout"])["results"]
    md = ["# Per-layer attribution of the KL (`quantkit eval --attribution`)", "",
          f"model `{model.name}`; held-out KJV {args.num_samples} x {args.seq_len} tokens; each decoder layer swapped "
          f"back to the unquantised model's, one at a time; eval wall {res['wall_s']:.0f} s for {len(ckpts)} checkpoint(s), taken beside other runs; "
          f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, load average "
          f"before {load['before']:.2f}, after {load['after']:.2f}", ""]
    for name, row in zip(ckpts, rows):
        a = row["attribution"]
        top = sorted(a["layers"], key=lambda x: -x["contribution"])[:5]
        md += [f"## {name}", "",
               f"KL {a['kl_mean']:.5f}; sum of the {len(a['layers'])} layers' contributions {a['sum_of_contributions']:.5f} "
               f"({a['explained']:.1%} of the whole). Largest: "
               + ", ".join(f"layer {x['layer']} {x['contribution']:.5f} ({x['share']:.1%})" for x in top), "",
               "| layer | KL without it | contribution | share |", "|---|---|---|---|"]
        md += [f"| {x['layer']} | {x['kl_without']:.5f} | {x['contribution']:+.5f} | {x['share']:.1%} |"
               for x in a["layers"]]
        md.append("")
    for png in report.glob("attribution_*.png"):
        shutil.copy(png, RESULTS / png.name)
    md.append("Plots: " + ", ".join(f"`benchmarks/results/{p.name}`" for p in sorted(report.glob("attribution_*.png"))))
    write_results("attribution", {"load_average": load, "rows": rows, "eval_wall_s": res["wall_s"]}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
