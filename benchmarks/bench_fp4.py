"""NVFP4 / MXFP4 weights (and W4AFP8) by RTN and GPTQ, side by side with llm-compressor: wall time, peak RSS,
held-out KL and perplexity on the calibration domain (KJV) and another (pydoc).

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_fp4.py [--schemes NVFP4A16,MXFP4A16] [--calib-samples 64]

Both tools calibrate on the same KJV token ids. Every checkpoint is scored by benchmarks/kl_plain.py
(transformers + compressed-tensors decompressing the fp4 weights, then fp32) against the unquantised model.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from common import (HELDOUT_KJV, HELDOUT_PYDOC, LLMC_PYTHON, ROOT, heldout_sets, kl_plain, machine_line, prepare_run,
                    ratio, run_measured, save_tokens, write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--schemes", default="NVFP4A16,MXFP4A16")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--skip-llmc", action="store_true")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "fp4")
    args = ap.parse_args()

    load = {"before": os.getloadavg()[0]}
    model, tok = prepare_run(args.model, args.work)
    from quantkit.data.calibration import build_token_blocks

    calib = build_token_blocks(tok, "kjv", args.calib_samples, args.seq_len, seed=args.seed)
    calib_file = save_tokens(calib.input_ids, args.work / "calibration.safetensors")
    eval_files = heldout_sets(tok, args.work, args.heldout_samples, args.seq_len)
    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    calib_flags = ["--dataset", "kjv", "--num-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
                   "--seed", str(args.seed)]
    runs: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for scheme in args.schemes.split(","):
        for method in ("rtn", "gptq"):
            name = f"quantkit {method} {scheme}"
            out = args.work / name.replace(" ", "_")
            res = run_measured([quantkit, "quantize", "--model", str(model), "--scheme", scheme, "--method", method,
                                *calib_flags, "--output", str(out), "--json"])
            runs[name] = {"wall_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"], "path": out,
                          "scheme": scheme, "method": method, "tool": "quantkit"}
            print(f"{name}: {res['wall_s']:.1f} s", flush=True)
            if args.skip_llmc:
                continue
            name = f"llm-compressor {method} {scheme}"
            out = args.work / name.replace(" ", "_")
            try:
                res = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model",
                                    str(model), "--recipe", method, "--scheme", scheme, "--output", str(out),
                                    "--tokens", str(calib_file)])
            except SystemExit as exc:  # the peer's refusal is the measurement
                failures[name] = str(exc).splitlines()[0][:300]
                print(f"{name}: failed", flush=True)
                continue
            runs[name] = {"wall_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"], "path": out,
                          "scheme": scheme, "method": method, "tool": "llm-compressor"}
            print(f"{name}: {res['wall_s']:.1f} s", flush=True)
    for name, r in runs.items():
        r["kl"] = {k: kl_plain(model, r["path"], f) for k, f in eval_files.items()}
        print(name, {k: round(v["kl_mean"], 4) for k, v in r["kl"].items()}, flush=True)
    load["after"] = os.getloadavg()[0]

    md = ["# fp4 weights (NVFP4, MXFP4): RTN and GPTQ, quantkit vs llm-compressor", "",
          f"model `{model.name}`; calibration KJV {args.calib_samples} x {args.seq_len} tokens (same ids for both "
          f"tools); held-out {args.heldout_samples} x {args.seq_len} tokens per domain, scored by "
          f"benchmarks/kl_plain.py (transformers + compressed-tensors); {machine_line(load)}", "",
          f"| run | wall s | peak RSS MB | KL {HELDOUT_KJV} | KL {HELDOUT_PYDOC} | perplexity {HELDOUT_KJV} | "
          f"top-1 {HELDOUT_KJV} |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        kj, py = r["kl"][HELDOUT_KJV], r["kl"][HELDOUT_PYDOC]
        md.append(f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 1e6:.0f} | {kj['kl_mean']:.4f} | "
                  f"{py['kl_mean']:.4f} | {kj['ppl']:.3f} | {kj['top1_agree']:.4f} |")
    base = next(iter(runs.values()))["kl"][HELDOUT_KJV]["ppl_base"]
    md += ["", f"base perplexity, {HELDOUT_KJV}: {base:.3f}", ""]
    for scheme in args.schemes.split(","):
        g, rt = runs[f"quantkit gptq {scheme}"], runs[f"quantkit rtn {scheme}"]
        for dom in (HELDOUT_KJV, HELDOUT_PYDOC):
            md.append(f"- {scheme} {dom}: quantkit GPTQ KL / quantkit RTN KL = "
                      f"{ratio(g['kl'][dom]['kl_mean'], rt['kl'][dom]['kl_mean'])}")
        for method in ("rtn", "gptq"):
            theirs = runs.get(f"llm-compressor {method} {scheme}")
            if theirs is None:
                continue
            ours = runs[f"quantkit {method} {scheme}"]
            md.append(f"- {scheme} {method}: quantkit / llm-compressor wall {ratio(ours['wall_s'], theirs['wall_s'])}, "
                      f"KL {HELDOUT_KJV} {ratio(ours['kl'][HELDOUT_KJV]['kl_mean'], theirs['kl'][HELDOUT_KJV]['kl_mean'])}, "
                      f"KL {HELDOUT_PYDOC} {ratio(ours['kl'][HELDOUT_PYDOC]['kl_mean'], theirs['kl'][HELDOUT_PYDOC]['kl_mean'])}")
    md += [f"- {name} failed: `{why}`" for name, why in failures.items()]
    payload = {"failures": failures, "load_average": load, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
               "runs": {k: {**{kk: vv for kk, vv in v.items() if kk != "path"}, "path": str(v["path"])}
                        for k, v in runs.items()}}
    write_results("fp4", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
