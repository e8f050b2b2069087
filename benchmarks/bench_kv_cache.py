"""A calibrated fp8 KV cache (`quantize --kv-cache fp8 / fp8-head`): what it costs in KL against the same
checkpoint with a 16-bit cache, and against unit scales (an fp8 cache served without calibrated scales).

    .venv/bin/python benchmarks/bench_kv_cache.py [--scheme W4A16] [--num-samples 32]

Checkpoints: SmolLM2 (or --model) quantised once per cache mode with the same weights method; the unit-scale
checkpoint is the per-tensor one with every k_scale / v_scale set to 1. quantkit's runtime scores all of them on
the same held-out blocks (KJV and pydoc); `--no-kv-cache` gives the 16-bit-cache row of the same weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import torch

from common import HELDOUT_KJV, HELDOUT_PYDOC, ROOT, pydoc_text, prepare_run, run_measured, write_results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--scheme", default="W4A16")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--num-samples", type=int, default=32, help="held-out blocks per domain")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "kv_cache")
    args = ap.parse_args()

    load = {"before": os.getloadavg()[0]}
    model, _ = prepare_run(args.model, args.work)
    qk = str(ROOT / ".venv" / "bin" / "quantkit")
    ckpts: dict[str, Path] = {}
    walls = {}
    for mode in ("fp8", "fp8-head"):
        out = args.work / f"kv-{mode}"
        res = run_measured([qk, "quantize", "--model", str(model), "--method", "rtn", "--scheme", args.scheme,
                            "--group-size", str(args.group_size), "--num-samples", str(args.calib_samples),
                            "--kv-cache", mode, "--output", str(out), "--json"])
        ckpts[mode], walls[mode] = out, res["wall_s"]
    unit = args.work / "kv-unit-scales"
    shutil.copytree(ckpts["fp8"], unit)
    from safetensors.torch import load_file, save_file

    for f in unit.glob("*.safetensors"):
        tensors = load_file(str(f))
        tensors = {k: (torch.ones_like(v) if k.endswith(("k_scale", "v_scale")) else v) for k, v in tensors.items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    ckpts["fp8, unit scales"] = unit
    for f in unit.glob("quantkit_manifest.json"):
        f.unlink()  # its hashes describe the calibrated scales

    domains = {HELDOUT_KJV: "kjv", HELDOUT_PYDOC: str(pydoc_text(args.work / "pydoc.txt"))}
    rows: dict[str, dict] = {}
    for dom, dataset in domains.items():
        common = ["--baseline", str(model), "--dataset", dataset, "--num-samples", str(args.num_samples),
                  "--seq-len", str(args.seq_len), "--seed", "1234", "--json"]
        res = run_measured([qk, "eval", *(str(p) for p in ckpts.values()), *common])
        for name, row in zip(ckpts, json.loads(res["stdout"])["results"]):
            rows.setdefault(name, {})[dom] = {"kl_mean": row["kl_mean"], "ppl": row["ppl"],
                                              "top1_agree": row["top1_agree"], "kv_cache": row.get("kv_cache")}
        res = run_measured([qk, "eval", str(ckpts["fp8"]), "--no-kv-cache", *common])
        row = json.loads(res["stdout"])["results"][0]
        rows.setdefault("16-bit cache (same weights)", {})[dom] = {
            "kl_mean": row["kl_mean"], "ppl": row["ppl"], "top1_agree": row["top1_agree"], "kv_cache": row.get("kv_cache")}
    load["after"] = os.getloadavg()[0]

    ref = rows["16-bit cache (same weights)"]
    md = [f"# fp8 KV cache: calibrated scales vs a 16-bit cache and unit scales ({args.scheme} g{args.group_size} RTN "
          "weights)", "",
          f"model `{model.name}`; calibration KJV {args.calib_samples} x 512; held-out {args.num_samples} x "
          f"{args.seq_len} tokens per domain, scored by quantkit's runtime against the unquantised model; torch CPU "
          f"capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, load average before "
          f"{load['before']:.2f}, after {load['after']:.2f}", "",
          f"| KV cache | KL {HELDOUT_KJV} | added by the cache | KL {HELDOUT_PYDOC} | added by the cache | "
          f"perplexity {HELDOUT_KJV} |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        kj, py = r[HELDOUT_KJV], r[HELDOUT_PYDOC]
        md.append(f"| {name} | {kj['kl_mean']:.5f} | {kj['kl_mean'] - ref[HELDOUT_KJV]['kl_mean']:+.5f} | "
                  f"{py['kl_mean']:.5f} | {py['kl_mean'] - ref[HELDOUT_PYDOC]['kl_mean']:+.5f} | {kj['ppl']:.3f} |")
    md += ["", f"quantisation wall time with --kv-cache: fp8 {walls['fp8']:.1f} s, fp8-head {walls['fp8-head']:.1f} s"]
    payload = {"load_average": load, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows,
               "quantize_wall_s": walls}
    write_results("kv_cache", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
