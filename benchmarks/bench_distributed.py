"""Data-parallel calibration: one process against `torchrun --nproc-per-node N`, same command, same machine.

    .venv/bin/python benchmarks/bench_distributed.py [--model M] [--methods gptq,awq] [--nproc 2]
                                                     [--num-samples 128] [--seq-len 512]

Per method, one after the other: (a) one process with every core's threads (how one runs it on this machine),
(b) one process with one thread per core share (`OMP_NUM_THREADS` = cores / N: the byte-identity reference,
since oneDNN's bf16 matmuls round differently with different thread counts), (c) torchrun with N processes of
that many threads (gloo). Reports wall times as ratios, rank 0's peak RSS, bytes moved per layer, and whether
the tensor files of (b) and (c) are byte-identical. Writes benchmarks/results/distributed.{md,json}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import run_measured, write_results  # noqa: E402

ARGS = {"gptq": ["--method", "gptq", "--scheme", "W4A16", "--group-size", "64"],
        "awq": ["--method", "awq", "--scheme", "W4A16", "--group-size", "64"],
        "smoothquant+gptq": ["--method", "smoothquant+gptq", "--scheme", "W8A8"]}


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.safetensors"))}


# (hidden, intermediate, KV width = kv heads x head dim, layers): SmolLM2 as measured; the others the shapes the
# prediction is written for (Llama-3-8B and -70B).
SHAPES = {"SmolLM2-135M": (576, 1536, 192, 30), "Llama-3-8B": (4096, 14336, 1024, 32),
          "Llama-3-70B": (8192, 28672, 1024, 80)}
BANDWIDTHS_GB_S = {"25 GbE": 3.1, "100 Gb/s (IB / RoCE)": 12.5, "400 Gb/s": 50.0}


def gptq_bytes_per_layer(hidden: int, inter: int, kv: int) -> dict[str, float]:
    """What a GPTQ layer moves, from the algorithm: one float64 Hessian per input group (q/k/v share one, gate/up
    one, o and down one each) all-reduced (a ring all-reduce sends and receives about twice the payload per rank),
    and every solve's result (int8 codes, one per weight) gathered by every rank."""
    hessians = 8 * (3 * hidden * hidden + inter * inter)
    weights = hidden * (hidden + 2 * kv) + hidden * hidden + 2 * hidden * inter + inter * hidden
    return {"hessian_allreduce": 2.0 * hessians, "results": float(weights), "total": 2.0 * hessians + weights}


def prediction_lines(measured_per_layer: float | None) -> list[str]:
    lines = ["", "## Communication per layer, predicted", "",
             "GPTQ bytes per layer and rank from the algorithm (`gptq_bytes_per_layer`), and the seconds they take at "
             "a stated link bandwidth (all of it spent on the all-reduce, no overlap with compute).", ""]
    small = gptq_bytes_per_layer(*SHAPES["SmolLM2-135M"][:3])["total"]
    if measured_per_layer:
        lines += [f"Check on the measured model: SmolLM2-135M predicted {small / 1e6:.1f} MB per layer, measured "
                  f"{measured_per_layer / 1e6:.1f} MB ({measured_per_layer / small:.2f}x).", ""]
    head = "| model | MB per layer | layers | " + " | ".join(f"s per layer at {b}" for b in BANDWIDTHS_GB_S) + " |"
    lines += [head, "|" + "---|" * (3 + len(BANDWIDTHS_GB_S))]
    for name, (h, i, kv, n) in SHAPES.items():
        b = gptq_bytes_per_layer(h, i, kv)["total"]
        lines.append(f"| {name} | {b / 1e6:.0f} | {n} | " +
                     " | ".join(f"{b / (gb * 1e9):.2f}" for gb in BANDWIDTHS_GB_S.values()) + " |")
    return lines


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--methods", default="gptq")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    per_rank = max(1, cores // a.nproc)
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {cores} CPUs",
               "load_average_before": os.getloadavg(), "nproc": a.nproc, "threads_per_rank": per_rank, "rows": []}
    common = ["--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len), "--json"]
    if a.model:
        common += ["--model", a.model]
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        for method in a.methods.split(","):
            runs = {}
            plans = {
                f"one process, {cores} threads": ([sys.executable, "-m", "quantkit"], {"OMP_NUM_THREADS": str(cores)}),
                f"one process, {per_rank} thread(s)": ([sys.executable, "-m", "quantkit"],
                                                       {"OMP_NUM_THREADS": str(per_rank)}),
                f"torchrun {a.nproc} x {per_rank} thread(s)": (
                    [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "-m", "quantkit"],
                    {"OMP_NUM_THREADS": str(per_rank)}),
            }
            for label, (cmd, env) in plans.items():
                out = Path(tmp) / f"{method}-{len(runs)}"
                res = run_measured(cmd + ["quantize", *ARGS[method], *common, "--output", str(out)], env=env)
                summary = json.loads(res["stdout"])
                runs[label] = {"wall_s": res["wall_s"], "run_wall_s": summary["wall_seconds"],
                               "peak_rss_rank0": summary["peak_rss_bytes"], "digests": digests(out),
                               "distributed": summary.get("distributed"),
                               "phase_seconds": summary.get("phase_seconds")}
                print(method, label, runs[label]["wall_s"], "s", flush=True)
            labels = list(runs)
            ref, dp = runs[labels[1]], runs[labels[2]]
            payload["rows"].append({"method": method, "runs": runs,
                                    "dp_identical_to_one_process": dp["digests"] == ref["digests"],
                                    "threads_change_bytes": runs[labels[0]]["digests"] != ref["digests"]})
    payload["load_average_after"] = os.getloadavg()

    lines = ["# Data-parallel calibration (torchrun, gloo)", "",
             f"{payload['cpu']}; load average before / after: {payload['load_average_before'][0]:.2f} / "
             f"{payload['load_average_after'][0]:.2f}",
             f"SmolLM2-135M (or --model), {a.num_samples} x {a.seq_len} calibration tokens", "",
             "| method | run | wall s (process) | wall s (run) | vs one process, all threads | rank 0 peak RSS MB | "
             "bytes moved per layer | tensor files |", "|---|---|---|---|---|---|---|---|"]
    for row in payload["rows"]:
        labels = list(row["runs"])
        base = row["runs"][labels[0]]["wall_s"]
        for k, label in enumerate(labels):
            r = row["runs"][label]
            moved = r["distributed"]["bytes_moved_per_layer"] / 1e6 if r["distributed"] else 0
            same = ("reference" if k == 1 else
                    ("identical to the reference" if row["dp_identical_to_one_process"] else "DIFFER from the reference")
                    if k == 2 else ("differ (thread count)" if row["threads_change_bytes"] else "identical"))
            lines.append(f"| {row['method']} | {label} | {r['wall_s']:.1f} | {r['run_wall_s']:.1f} | "
                         f"{r['wall_s'] / base:.2f}x | {r['peak_rss_rank0'] / 1e6:.0f} | "
                         f"{moved:.1f} MB | {same} |")
    dp_rows = [r for row in payload["rows"] if row["method"] == "gptq" for r in row["runs"].values() if r["distributed"]]
    lines += prediction_lines(dp_rows[0]["distributed"]["bytes_moved_per_layer"] if dp_rows else None)
    payload["prediction"] = {name: gptq_bytes_per_layer(*shape[:3]) for name, shape in SHAPES.items()}
    write_results("distributed", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
