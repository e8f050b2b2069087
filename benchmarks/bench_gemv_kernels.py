"""Every CPU kernel that can serve a format, one linear at a time, weights streaming from DRAM as in decode.

    .venv/bin/python benchmarks/bench_gemv_kernels.py [--count 12]

Formats (the 1B Llama's shapes of bench_runtime.py: 5632 x 2048 and 2048 x 5632): W4A16 g128, W8A16 per channel
and g128, W8A8 (dynamic per-token int8 activations), FP8_DYNAMIC (e4m3 per channel, dynamic fp8 activations), and
the dense bf16 linear the runtime runs (`DenseLinear`). For each, `--count` distinct random layers (far beyond the
CPU caches), quantised by quantkit's own quantisers, are prepared by every registered kernel whose `supports`
accepts them, and each kernel's `run` (what the runtime calls, Python included) is timed on 1, 4 and 8 bf16 rows,
cycling through the layers; best of 3 passes. GB/s = the bytes the kernel holds for the layer (its prepared
tensors: codes or tiles plus scales) / time. "of read" = that bandwidth over a plain read of the same number of
bytes (torch's sum over an int64 view of a buffer that size, also cycling through `--count` copies). Then once
more in a child with ATen capped at AVX2 (ATEN_CPU_CAPABILITY=avx2, as on an AVX2-only CPU: the kernels that
need AVX-512 are not offered there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import ROOT, write_results

SHAPES = [(5632, 2048), (2048, 5632)]
BATCHES = (1, 4, 8)
FORMATS = ("bf16", "W4A16 g128", "W8A16 channel", "W8A16 g128", "W8A8", "FP8_DYNAMIC")


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


def _layer(fmt: str, n: int, k: int, gen):
    """One QuantLinear of `fmt` (or a DenseLinear for bf16) from a random bf16 weight, as quantkit writes it."""
    import torch

    from quantkit.quant import QuantArgs, pack_int32, quantize_weight
    from quantkit.quant.fp8 import quantize_fp8_weight
    from quantkit.runtime.formats import LinearFormat
    from quantkit.runtime.linear import DenseLinear, QuantLinear

    w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
    if fmt == "bf16":
        layer = DenseLinear(k, n, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            layer.weight.copy_(w)
        return layer
    if fmt == "FP8_DYNAMIC":
        q, scale = quantize_fp8_weight(w.float(), "channel", (128, 128), scale_dtype=torch.bfloat16)
        lf = LinearFormat("float-quantized", QuantArgs(num_bits=8, strategy="channel", type="float"),
                          QuantArgs(num_bits=8, strategy="token", type="float", dynamic=True))
        return QuantLinear(lf, {"weight": q, "weight_scale": scale}, k, n, None, torch.bfloat16)
    bits = 4 if fmt.startswith("W4") else 8
    group = 128 if fmt.endswith("g128") else None
    args = QuantArgs(num_bits=bits, strategy="group" if group else "channel", group_size=group)
    q, scale, _ = quantize_weight(w, args, scale_dtype=torch.bfloat16)
    act = QuantArgs(num_bits=8, strategy="token", dynamic=True) if fmt == "W8A8" else None
    if fmt == "W8A8":
        tensors = {"weight": q.to(torch.int8), "weight_scale": scale.reshape(n, -1)}
        lf = LinearFormat("int-quantized", args, act)
    else:
        tensors = {"weight_packed": pack_int32(q, bits), "weight_scale": scale.reshape(n, -1),
                   "weight_shape": torch.tensor([n, k])}
        lf = LinearFormat("pack-quantized", args, None)
    return QuantLinear(lf, tensors, k, n, None, torch.bfloat16)


def measure(count: int) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from quantkit.runtime import dispatch

    out = {"capability": torch.backends.cpu.get_cpu_capability(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        for fmt in FORMATS:
            layers = [_layer(fmt, n, k, gen) for _ in range(count)]
            if fmt == "bf16":
                served = {"DenseLinear": [(None, layer) for layer in layers]}
            else:
                served = {}
                for kernel in dispatch.kernels_for("cpu"):
                    if kernel.supports(layers[0].fmt, torch.device("cpu"), (n, k), torch.bfloat16):
                        served[kernel.name] = [(kernel, kernel.prepare(layer)) for layer in layers]
            for name, prepared in served.items():
                nbytes = (sum(t.numel() * t.element_size() for t in prepared[0][1].tensors()) if name != "DenseLinear"
                          else n * k * 2)
                buffers = [torch.empty(nbytes // 8, dtype=torch.int64).random_(generator=gen) for _ in range(count)]
                with torch.inference_mode():
                    read = _best(lambda b: b.sum(), buffers)
                    for m in BATCHES:
                        x = torch.randn(m, k, generator=gen).bfloat16()
                        run = (lambda kp: kp[1](x)) if name == "DenseLinear" else (lambda kp: kp[0].run(x, kp[1]))
                        t = _best(run, prepared)
                        out["rows"].append({"format": fmt, "n": n, "k": k, "m": m, "kernel": name, "ms": t * 1e3,
                                            "bytes": nbytes, "gbs": nbytes / 1e9 / t, "read_gbs": nbytes / 1e9 / read})
                        print(json.dumps(out["rows"][-1]), file=sys.stderr, flush=True)
                del buffers
            del layers, served
    return out


def markdown(runs: list[dict], load: tuple[float, float]) -> str:
    md = ["# CPU GEMV kernels per format: one linear at a time, weights streaming from DRAM", "",
          f"{os.cpu_count()} CPUs; load average before / after: {load[0]:.2f} / {load[1]:.2f}", "",
          "GB/s = the kernel's own bytes for the layer / time; of read = that over a plain read of as many bytes; "
          "vs bf16 = the dense bf16 linear's time over this kernel's (same shape and rows).", ""]
    for run in runs:
        md += [f"## ATen capability {run['capability']}", "",
               "| format | out x in | rows | kernel | ms | GB/s | of read | vs bf16 |", "|---|---|---|---|---|---|---|---|"]
        dense = {(r["n"], r["m"]): r["ms"] for r in run["rows"] if r["format"] == "bf16"}
        for r in run["rows"]:
            md.append(f"| {r['format']} | {r['n']} x {r['k']} | {r['m']} | {r['kernel']} | {r['ms']:.3f} | "
                      f"{r['gbs']:.1f} | {r['gbs'] / r['read_gbs']:.2f} | {dense[r['n'], r['m']] / r['ms']:.2f}x |")
        md.append("")
    return "\n".join(md) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=12, help="distinct layers per shape and format")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-avx2", action="store_true", help="leave out the AVX2-capped run")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.count)))
        return
    load_before = os.getloadavg()[0]
    runs = []
    envs = [{}] + ([] if args.no_avx2 else [{"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}])
    for env in envs:
        proc = subprocess.run([sys.executable, __file__, "--child", "--count", str(args.count)], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "QUANTKIT_KERNEL_CHOICE": "priority", **env}, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    load = (load_before, os.getloadavg()[0])
    write_results("gemv_kernels", {"load_average": load, "runs": runs}, markdown(runs, load))


if __name__ == "__main__":
    main()
