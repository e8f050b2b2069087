"""Served MoE: the benchmark MoE and its quantised checkpoints (benchmarks/bench_moe.py's work folder) scored by
vLLM's CPU build and by quantkit's runtime (which computes transformers' logits, tested) on the same held-out
blocks: mean NLL per token of each, and what vLLM refuses, in its own words.

    QUANTKIT_VLLM_PYTHON=benchmarks/.venv-vllm/bin/python python benchmarks/bench_moe_vllm.py [--num-samples 4]

Target (issue #31): every checkpoint vLLM loads scores an NLL within 0.02 of quantkit's runtime; the others are
listed with vLLM's reason. Results: benchmarks/results/moe_vllm.md and .json.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CHECKPOINTS = (("MoE original (bf16)", None), ("W4A16 RTN", "rtn"), ("W4A16 GPTQ", "gptq"),
               ("W8A8 SmoothQuant+GPTQ", "smoothquant_w8a8"), ("FP8_BLOCK", "fp8_block"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "moe")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")
    python = os.environ.get("QUANTKIT_VLLM_PYTHON")
    if not python:
        sys.exit("error: set QUANTKIT_VLLM_PYTHON to the interpreter of vLLM's venv (benchmarks/setup_vllm.sh)")
    import torch

    from common import bench_moe_model, machine_line, write_results
    from quantkit.errors import QuantkitError
    from quantkit.eval.runner import EvalOptions, run_eval

    moe = bench_moe_model(args.work)
    load = {"before": os.getloadavg()[0]}
    started = time.time()
    rows = []
    for label, name in CHECKPOINTS:
        path = moe if name is None else args.work / name
        if not (path / "config.json").is_file():
            continue
        row = {"checkpoint": label, "path": str(path)}
        common = dict(checkpoints=[path], baseline=str(moe), num_samples=args.num_samples, seq_len=args.seq_len)
        own = run_eval(EvalOptions(**common, dtype="bfloat16")).report["results"][0]
        row["nll_quantkit"] = math.log(own["ppl"])
        try:
            served = run_eval(EvalOptions(**common, engine="vllm", vllm_python=python)).report["results"][0]
            row["nll_vllm"] = math.log(served["ppl"])
            row["nll_diff"] = row["nll_vllm"] - row["nll_quantkit"]
            row["loaded"] = True
        except QuantkitError as exc:
            row["loaded"] = False
            row["refused"] = str(exc).splitlines()[0][:400]
        rows.append(row)
        print(row, flush=True)
    load["after"] = os.getloadavg()[0]
    payload = {"moe": str(moe), "rows": rows, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "load_average": load, "wall_seconds": round(time.time() - started, 1)}
    lines = [f"# Served MoE: vLLM's CPU build against quantkit's runtime ({moe.name})", "",
             f"{machine_line(load)}; {args.num_samples} x {args.seq_len} held-out KJV tokens; wall "
             f"{payload['wall_seconds']} s. NLL: mean negative log-likelihood per token (nats).", "",
             "| checkpoint | quantkit NLL | vLLM NLL | difference | within 0.02 |", "|---|---|---|---|---|"]
    for r in rows:
        if r["loaded"]:
            lines.append(f"| {r['checkpoint']} | {r['nll_quantkit']:.4f} | {r['nll_vllm']:.4f} | "
                         f"{r['nll_diff']:+.4f} | {'yes' if abs(r['nll_diff']) <= 0.02 else 'NO'} |")
        else:
            lines.append(f"| {r['checkpoint']} | {r['nll_quantkit']:.4f} | refused | - | - |")
    refused = [r for r in rows if not r["loaded"]]
    if refused:
        lines += ["", "What vLLM refused:", ""] + [f"- {r['checkpoint']}: {r['refused']}" for r in refused]
    write_results("moe_vllm", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
