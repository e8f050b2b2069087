"""`--dataset self` at its memory: SmolLM2 writes calibration text with one decoder layer resident (quantkit's
streamed model, the default) against transformers' whole model (what it did before), each in its own process:
wall, peak RSS, and whether the tokens agree.

    python benchmarks/bench_self_data.py [--samples 16] [--seq-len 256]

Results: benchmarks/results/self_data.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def child(mode: str, samples: int, seq_len: int, out: str) -> None:
    import resource

    import torch

    from quantkit.data import self_generated
    from quantkit.models.source import resolve_model

    from quantkit.pipeline.memory import return_large_frees_to_os

    return_large_frees_to_os()  # the allocator setting of a quantize run, which is where `self` text is written
    self_generated.CACHE_DIR = Path(tempfile.mkdtemp())  # generate, never read an earlier run's cache
    if mode == "whole":
        from transformers import AutoModelForCausalLM

        self_generated.streamed_model = lambda path, dtype: AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype).eval()
    path = resolve_model(None).path
    start = time.time()
    ids = self_generated.generate_blocks(path, samples, seq_len, seed=0)
    wall = time.time() - start
    torch.save(ids, out)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"mode": mode, "wall_s": round(wall, 1), "peak_rss_mb": round(rss / 2**20, 1)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--child", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.samples, args.seq_len, args.out)
    import torch

    from common import machine_line, write_results
    from quantkit.models.source import resolve_model

    path = resolve_model(None).path
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    load = {"before": os.getloadavg()[0]}
    rows, tokens = [], {}
    for mode in ("whole", "streamed"):
        out = Path(tempfile.mkdtemp()) / "ids.pt"
        proc = subprocess.run([sys.executable, __file__, "--child", mode, "--samples", str(args.samples),
                               "--seq-len", str(args.seq_len), "--out", str(out)], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"error: the {mode} run failed: {proc.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        tokens[mode] = torch.load(out, weights_only=True)
    load["after"] = os.getloadavg()[0]
    same = bool(torch.equal(tokens["whole"], tokens["streamed"]))
    payload = {"rows": rows, "weights_mb": round(weights / 2**20, 1), "same_tokens": same,
               "samples": args.samples, "seq_len": args.seq_len, "load_average": load,
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    lines = [f"# `--dataset self`: {args.samples} x {args.seq_len} tokens written by SmolLM2", "",
             f"{machine_line(load)}; checkpoint {payload['weights_mb']} MB of safetensors. Each mode in its own "
             "process (peak RSS includes torch and transformers themselves).", "",
             "| model | wall s | peak RSS MB |", "|---|---|---|"]
    lines += [f"| {r['mode']} | {r['wall_s']} | {r['peak_rss_mb']} |" for r in rows]
    lines += ["", f"Same tokens from both: {same}."]
    write_results("self_data", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
