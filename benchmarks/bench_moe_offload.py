"""Offload speed with prefetch, measured harder than bench_moe.py does: the MoE of benchmarks/bench_moe.py (its
work folder) decoded greedily with experts offloaded at one cache size, LRU with and without prefetch, each row
decoded --repeats times from a fresh load, the rows in turn, median and spread reported.

    python benchmarks/bench_moe_offload.py [--cache 8] [--repeats 7] [--tokens 64] [--reads page-cache,storage]
                                           [--model DIR] [--results NAME]

Why: bench_moe.py's rows are medians of 3 decodes, and rows that load experts the same way differ there by more than
prefetch changes. Each row runs per read source: `page-cache` (the checkpoint in memory: a load is a memory copy,
CPU work that a prefetch thread takes from the decode's cores) and `storage` (every read dropped from the page cache
after it, as for a checkpoint larger than memory: a load waits on the disk, and a prefetch overlaps the wait).
Results: benchmarks/results/moe_offload.md and .json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "moe")
    ap.add_argument("--cache", type=int, default=8, help="experts per layer kept resident")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reads", default="page-cache,storage", help="read sources, comma-separated")
    ap.add_argument("--model", type=Path, help="an MoE checkpoint (default: the MoE of bench_moe.py's --work)")
    ap.add_argument("--results", default="moe_offload", help="results file name in benchmarks/results/")
    args = ap.parse_args()
    os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")
    from common import bench_moe_model, machine_line, write_results
    from quantkit.eval.moe import MoEEvalOptions
    from quantkit.eval.runner import EvalOptions, run_eval

    moe = args.model or bench_moe_model(args.work)
    if not (moe / "config.json").is_file():
        sys.exit(f"error: {moe} has no config.json")
    load = {"before": os.getloadavg()[0]}
    started = time.time()
    runs = (("lru", ""), ("lru", "overlap"), ("lru", "sync"))
    opts = MoEEvalOptions(samples=1, capacity_factors=(1.25,), policies=("drop",), offload_cache=(args.cache,),
                          offload_runs=runs, decode_tokens=args.tokens, decode_repeats=args.repeats,
                          offload_reads=tuple(args.reads.split(",")))
    result = run_eval(EvalOptions(checkpoints=[moe], baseline=str(moe), num_samples=1, seq_len=256, moe=True,
                                  moe_options=opts)).report["results"][0]
    rows = result["moe"]["offload"]
    load["after"] = os.getloadavg()[0]
    payload = {"moe": str(moe), "cache": args.cache, "repeats": args.repeats, "tokens": args.tokens, "rows": rows,
               "load_average": load, "wall_seconds": round(time.time() - started, 1)}
    lines = [f"# Offload with prefetch: {moe.name}, {args.cache} experts per layer resident", "",
             f"{machine_line(load)}; {args.tokens} greedy tokens per decode, {args.repeats} decodes per row from a "
             f"fresh load, the rows in turn; wall {payload['wall_seconds']} s.", "",
             "| policy | reads | hit rate | prefetch fidelity | decode tok/s (median) | each decode (tok/s) | exact |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        each = ", ".join(f"{v:.1f}" for v in r.get("decode_tok_s_each", []))
        lines.append(f"| {r['policy']} | {r.get('reads') or '-'} | {r['hit_rate']} | "
                     f"{r.get('prefetch_fidelity') or '-'} | {r['decode_tok_s']} | {each} | {r['exact']} |")
    lines.append("")
    for reads in args.reads.split(","):
        by = {r["policy"]: r for r in rows if r.get("reads") == reads}
        lru = by["lru"]["decode_tok_s"]
        for name in ("lru+prefetch", "lru+prefetch-sync"):
            lines.append(f"- reads from {reads}: {name} against LRU: {by[name]['decode_tok_s'] / lru:.3f}x decode "
                         f"speed; hit rate {by['lru']['hit_rate']} -> {by[name]['hit_rate']}.")
    write_results(args.results, payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
