"""`cpu-int4dot` against torch's int4 matmul on one linear at a time, weights streaming from DRAM as in decode.

    .venv/bin/python benchmarks/bench_int4_kernels.py

For the 1B Llama of bench_runtime.py (hidden 2048, intermediate 5632) each shape gets 40 distinct random W4A16
g128 matrices (about 230 MB, far beyond the caches), cycled; best of 3 passes per kernel and batch size (1, 4, 8
rows of x, bf16). Beside them, in the same process: a plain read of the same tile bytes (torch's sum), the dense
bf16 head of the 1B model (49152 x 2048, F.linear on a parameter as the runtime holds it) through oneDNN and
through ATen's own GEMV, and the same kernels once more in a child with ATen capped at AVX2
(ATEN_CPU_CAPABILITY=avx2, as on an AVX2-only CPU: int4dot then runs its AVX2 path). GB/s = weight bytes / time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from common import ROOT, write_results

SHAPES = [(5632, 2048), (2048, 5632), (2048, 2048)]
BATCHES = (1, 4, 8)
COUNT = 40


def _best(fn, items, passes=3) -> float:
    for item in items[:2]:
        fn(item)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return best


def measure() -> dict:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from quantkit.runtime.kernels import cpp

    ext = cpp.extension()
    empty = torch.empty(0)
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "isa": cpp.dot_isa(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        layers = []
        for _ in range(COUNT):
            u = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
            scale = torch.rand(n, k // 128, generator=gen) * 0.01
            packed = torch._convert_weight_to_int4pack_for_cpu(u.int(), 1)
            table = torch.stack([scale.t(), torch.zeros_like(scale.t())], -1).bfloat16().contiguous()
            layers.append((cpp.tile_nibbles(u), cpp.tile_grid(scale), packed, table))
        gb = n * k / 2 / 1e9
        read = _best(lambda l: l[0].view(torch.int64).sum(), layers)
        for m in BATCHES:
            x = torch.randn(m, k, generator=gen).bfloat16()
            dot = _best(lambda l: ext.dot_linear(x, l[0], l[1], empty, n, 128, cpp.dot_isa(), 16), layers)
            i4 = _best(lambda l: torch._weight_int4pack_mm_for_cpu(x, l[2], 128, l[3]), layers)
            out["rows"].append({"n": n, "k": k, "m": m, "int4dot_ms": dot * 1e3, "int4pack_ms": i4 * 1e3,
                                "read_ms": read * 1e3, "int4dot_gbs": gb / dot, "int4pack_gbs": gb / i4,
                                "read_gbs": gb / read})
        del layers
    head = torch.nn.Parameter(torch.randn(49152, 2048, generator=gen).bfloat16())
    x = torch.randn(1, 2048, generator=gen).bfloat16()
    with torch.inference_mode():
        t = _best(lambda _: F.linear(x, head), [None] * 10)
        torch.backends.mkldnn.enabled = False  # ATen's own GEMV (what the runtime's DenseLinear uses for one row)
        try:
            t_aten = _best(lambda _: F.linear(x, head), [None] * 10)
        finally:
            torch.backends.mkldnn.enabled = True
    out["head_bf16_ms"], out["head_bf16_aten_ms"] = t * 1e3, t_aten * 1e3
    out["head_bf16_gbs"], out["head_bf16_aten_gbs"] = head.numel() * 2 / 1e9 / t, head.numel() * 2 / 1e9 / t_aten
    return out


def main() -> None:
    if "--child" in sys.argv:
        print(json.dumps(measure()))
        return
    load_before = os.getloadavg()[0]
    runs = []
    for env in ({}, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}):
        proc = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True,
                              env={**os.environ, **env}, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    names = {0: "scalar", 1: "AVX2", 2: "AVX512-VNNI"}
    md = ["# cpu-int4dot vs torch-int4pack: one W4A16 g128 linear, weights streaming from DRAM", "",
          f"{os.cpu_count()} CPUs; load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}", ""]
    for run in runs:
        md += [f"## ATen capability {run['capability']} (int4dot path: {names[run['isa']]})", "",
               "| out x in | batch | int4dot ms (GB/s) | int4pack ms (GB/s) | plain read ms (GB/s) | int4dot speed-up |",
               "|---|---|---|---|---|---|"]
        md += [f"| {r['n']} x {r['k']} | {r['m']} | {r['int4dot_ms']:.3f} ({r['int4dot_gbs']:.1f}) | "
               f"{r['int4pack_ms']:.3f} ({r['int4pack_gbs']:.1f}) | {r['read_ms']:.3f} ({r['read_gbs']:.1f}) | "
               f"{r['int4pack_ms'] / r['int4dot_ms']:.2f}x |" for r in run["rows"]]
        md += ["", f"dense bf16 head 49152 x 2048, batch 1: oneDNN {run['head_bf16_ms']:.2f} ms ({run['head_bf16_gbs']:.1f} GB/s), "
                   f"ATen's GEMV (oneDNN off) {run['head_bf16_aten_ms']:.2f} ms ({run['head_bf16_aten_gbs']:.1f} GB/s)", ""]
    write_results("int4_kernels", {"load_average_before": load_before, "runs": runs}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
