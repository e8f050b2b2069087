"""Converting a GGUF source: quantkit's tensor-by-tensor path against transformers' whole-model path, same run.

Each path runs in its own process on the embedded SmolLM2 GGUF (or `--gguf FILE`): wall time and peak RSS above
the process's RSS after its imports (torch, transformers, gguf), as a fraction of the model's fp32 size.

    .venv/bin/python benchmarks/bench_gguf_convert.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, write_results

CHILD = r'''
import json, resource, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
import numpy, torch, transformers, gguf as _g
from quantkit.models import gguf
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
t = time.time()
out = Path(sys.argv[3]); out.mkdir()
if sys.argv[1] == "streaming":
    how = gguf.convert(Path(sys.argv[2]), out)
else:
    gguf.convert_whole(Path(sys.argv[2]), out); how = "whole"
wall = time.time() - t
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"path": how, "wall_s": round(wall, 2), "baseline_rss": base, "peak_rss": peak}))
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path)
    args = ap.parse_args()
    import torch
    from safetensors import safe_open

    from quantkit.models.source import default_gguf_path

    src = args.gguf or default_gguf_path()
    head = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
            "load_average_before": os.getloadavg(), "gguf": str(src), "gguf_bytes": src.stat().st_size, "rows": []}
    print(head["cpu"], "load", head["load_average_before"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for path in ("streaming", "whole"):
            out = Path(tmp) / path
            r = subprocess.run([sys.executable, "-c", CHILD, path, str(src), str(out), str(ROOT)],
                               capture_output=True, text=True, check=True)
            row = json.loads(r.stdout.strip().splitlines()[-1])
            with safe_open(str(out / "model.safetensors"), "pt") as f:
                row["params"] = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
            row["fp32_bytes"] = 4 * row["params"]
            row["extra_rss"] = row["peak_rss"] - row["baseline_rss"]
            row["extra_over_fp32"] = round(row["extra_rss"] / row["fp32_bytes"], 3)
            head["rows"].append(row)
            print(row, flush=True)
    head["load_average_after"] = os.getloadavg()
    s, w = head["rows"]
    md = ["# GGUF source conversion: memory and time", "", head["cpu"],
          f"load average before / after: {head['load_average_before'][0]:.2f} / {head['load_average_after'][0]:.2f}",
          f"source: {Path(src).name} ({head['gguf_bytes'] / 2**20:.0f} MB), {s['params'] / 1e6:.1f} M parameters "
          f"({s['fp32_bytes'] / 2**20:.0f} MB in fp32)", "",
          "| path | wall s | RSS after imports MB | peak RSS MB | peak above imports MB | / fp32 size |", "|---|---|---|---|---|---|"]
    for r in head["rows"]:
        md.append(f"| {r['path']} | {r['wall_s']} | {r['baseline_rss'] / 2**20:.0f} | {r['peak_rss'] / 2**20:.0f} | "
                  f"{r['extra_rss'] / 2**20:.0f} | {r['extra_over_fp32']:.2f}x |")
    md += ["", f"Tensor by tensor: {s['extra_rss'] / w['extra_rss']:.2f}x the whole-model path's memory above the "
           f"imports, {s['wall_s'] / w['wall_s']:.2f}x its time; the tensors are bit-identical "
           "(tests/models/test_gguf.py)."]
    write_results("gguf_convert", head, "\n".join(md) + "\n")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
