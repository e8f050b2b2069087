"""`quantkit plan` against the real run on SmolLM2-135M: predicted vs measured output bytes, peak RSS and wall time.

    .venv/bin/python benchmarks/bench_plan.py [--methods rtn,gptq] [--num-samples 64] [--seq-len 512]

For each method the plan and the run are separate child processes (peak RSS is per process, from wait4), run one
after the other on the same machine. The run's own `wall_seconds` (what the plan estimates: from entering the
quantiser to the renamed output) and the process wall (imports included) are both reported. Writes
benchmarks/results/plan.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_measured, write_results  # noqa: E402

ARGS = {"rtn": ["--method", "rtn", "--scheme", "W4A16", "--group-size", "64"],
        "gptq": ["--method", "gptq", "--scheme", "W4A16", "--group-size", "64"],
        "fp8": ["--method", "fp8", "--scheme", "FP8_BLOCK"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="rtn,gptq")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--sizes", default="", help="per-method samples x length, e.g. gptq=16x256 (shared machines)")
    a = ap.parse_args()
    sizes = {m: tuple(int(x) for x in v.split("x")) for m, v in (p.split("=") for p in a.sizes.split(",") if p)}
    rows = []
    cli = [sys.executable, "-m", "quantkit.cli"]
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        for method in a.methods.split(","):
            out = Path(tmp) / method
            n, length = sizes.get(method, (a.num_samples, a.seq_len))
            common = [*ARGS[method], "--num-samples", str(n), "--seq-len", str(length), "--output", str(out), "--json"]
            load_before = os.getloadavg()[0]
            plan = run_measured([*cli, "plan", *common])
            predicted = json.loads(plan["stdout"])
            run = run_measured([*cli, "quantize", *common])
            actual = json.loads(run["stdout"])
            rows.append({
                "method": method, "samples": predicted["samples"], "seq_len": predicted["seq_len"],
                "output_bytes": {"plan": predicted["output_bytes"], "run": actual["output_bytes"]},
                "peak_rss_bytes": {"plan": predicted["peak_rss_bytes"], "run": run["peak_rss_bytes"]},
                "wall_seconds": {"plan": predicted["wall_seconds"], "run": actual["wall_seconds"],
                                 "run_process": run["wall_s"]},
                "plan_process_seconds": plan["wall_s"], "breakdown": predicted["breakdown"],
                "trial": predicted["trial"], "load_avg_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
            })
            _write(rows, a)  # after every method: a long benchmark keeps what it has measured


def _write(rows: list[dict], a) -> None:
    lines = ["# quantkit plan vs the real run (SmolLM2-135M, W4A16 g64 unless noted)", "",
             "Calibration samples x tokens per row (RTN propagates 8 samples); plan and run one after the other.", "",
             "| method | samples x len | output bytes plan / run | peak RSS plan / run (MB) | ratio | wall plan / run (s) | ratio | "
             "plan took (s) | load avg |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        o, m, w = r["output_bytes"], r["peak_rss_bytes"], r["wall_seconds"]
        lines.append(f"| {r['method']} | {r['samples']} x {r['seq_len']} | {o['plan']} / {o['run']} | {m['plan'] / 1e6:.0f} / {m['run'] / 1e6:.0f} | "
                     f"{m['plan'] / m['run']:.3f} | {w['plan']:.1f} / {w['run']:.1f} | {w['plan'] / w['run']:.3f} | "
                     f"{r['plan_process_seconds']:.1f} | {r['load_avg_1min'][0]} -> {r['load_avg_1min'][1]} |")
    write_results("plan", {"rows": rows}, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
