"""SmoothQuant+GPTQ W8A8 and FP8 (block, dynamic) side by side with llm-compressor: wall time, peak RSS,
held-out KL and perplexity on the same calibration and held-out tokens.

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_w8a8_fp8.py [--calib-samples 64] [--heldout-samples 16]

Both tools calibrate on the same KJV token blocks (quantkit's own sampling, handed to llm-compressor as token
ids). Every checkpoint is scored by benchmarks/kl_plain.py (plain transformers + compressed-tensors, which
simulates the activation quantisation) against the unquantised model.

llm-compressor's FP8_BLOCK checkpoint of SmolLM2 does not run in transformers + compressed-tensors (its
1x128 activation groups cannot split K = 576); the table records that failure. quantkit's runtime runs a
ragged last activation group, so `quantkit eval` scores every FP8 checkpoint too (last column, same held-out
blocks), which compares the two FP8_BLOCK checkpoints directly.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from common import (LLMC_PYTHON, ROOT, machine_line, phase_table, prepare_run, ratio, run_measured, save_tokens,
                    write_results)


def try_kl(base: Path, candidate: Path, tokens: Path) -> dict:
    """kl_plain, or the consumer's error when the checkpoint cannot be run."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kl_plain.py"), "--base", str(base),
                           "--candidate", str(candidate), "--tokens", str(tokens)], capture_output=True, text=True)
    if proc.returncode == 0:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return {"error": lines[-1] if lines else f"exit {proc.returncode}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--heldout-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--alpha", type=float, default=0.8)
    ap.add_argument("--fp8-only", action="store_true", help="skip the (slow) SmoothQuant+GPTQ W8A8 pair")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra quantkit SmoothQuant+GPTQ run in the same process: NAME=\"extra quantize flags\" "
                         "(repeatable), e.g. separate=\"--recipe sq_separate.yaml\"")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "w8a8_fp8")
    args = ap.parse_args()

    load = {"before": os.getloadavg()[0]}
    model, tok = prepare_run(args.model, args.work)
    from quantkit.data.calibration import build_token_blocks
    calib = build_token_blocks(tok, "kjv", args.calib_samples, args.seq_len, seed=42, split="calibration")
    heldout = build_token_blocks(tok, "kjv", args.heldout_samples, args.seq_len, seed=1234, split="heldout")
    calib_tokens = save_tokens(calib.input_ids, args.work / "calib.safetensors")
    heldout_tokens = save_tokens(heldout.input_ids, args.work / "heldout.safetensors")

    qk_bin = str(ROOT / ".venv" / "bin" / "quantkit")
    calib_flags = ["--dataset", "kjv", "--num-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
                   "--seed", "42"]
    runs: dict[str, dict] = {}

    def quantkit(name: str, *flags: str) -> None:
        out = args.work / name
        res = run_measured([qk_bin, "quantize", "--model", str(model), "--output", str(out), "--json", *flags])
        summary = json.loads(res["stdout"])
        runs[name] = {"wall_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"], "path": out,
                      "scheme_overrides": summary.get("scheme_overrides", {}),
                      "phases": summary.get("phase_seconds", {})}

    def llmc(name: str, recipe: str) -> None:
        out = args.work / name
        res = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model", str(model),
                            "--recipe", recipe, "--output", str(out), "--tokens", str(calib_tokens)])
        runs[name] = {"wall_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"], "path": out,
                      "inner": json.loads(res["stdout"].strip().splitlines()[-1])}

    if not args.fp8_only:
        quantkit("qk_sq_gptq_w8a8", "--method", "smoothquant+gptq", "--scheme", "W8A8", "--alpha", str(args.alpha),
                 *calib_flags)
        for variant in args.variant:
            name, flags = variant.split("=", 1)
            quantkit(f"qk_sq_gptq_w8a8_{name}", "--method", "smoothquant+gptq", "--scheme", "W8A8", "--alpha",
                     str(args.alpha), *calib_flags, *shlex.split(flags))
        llmc("llmc_sq_gptq_w8a8", "smoothquant_gptq_w8a8")
    quantkit("qk_fp8_block", "--method", "fp8", "--scheme", "FP8_BLOCK")
    llmc("llmc_fp8_block", "fp8_block")
    quantkit("qk_fp8_dynamic", "--method", "fp8", "--scheme", "FP8_DYNAMIC")
    llmc("llmc_fp8_dynamic", "fp8_dynamic")
    for r in runs.values():
        r["kl"] = try_kl(model, r["path"], heldout_tokens)
    # quantkit's runtime runs ragged 1x128 activation groups (the last group of K = 576 covers 64 columns), so it
    # can score llm-compressor's FP8_BLOCK checkpoint, which transformers cannot; same held-out blocks (seed 1234).
    fp8_names = [k for k in runs if "fp8" in k]
    res = run_measured([qk_bin, "eval", *(str(runs[k]["path"]) for k in fp8_names), "--baseline", str(model),
                        "--num-samples", str(args.heldout_samples), "--seq-len", str(args.seq_len), "--seed", "1234",
                        "--dtype", "float32", "--json"])
    for k, row in zip(fp8_names, json.loads(res["stdout"])["results"]):
        runs[k]["kl_runtime"] = {"kl_mean": row["kl_mean"], "ppl": row["ppl"], "top1_agree": row["top1_agree"]}

    def cell(r: dict, key: str) -> str:
        kl = r["kl"]
        return f"{kl[key]:.5f}" if key in kl else "fails to load"

    load["after"] = os.getloadavg()[0]
    md = [f"# W8A8 (SmoothQuant {args.alpha} + GPTQ) and FP8: quantkit vs llm-compressor", "",
          f"model `{model.name}`; calibration KJV {args.calib_samples} x {args.seq_len} tokens (same ids for both); "
          f"held-out KJV {args.heldout_samples} x {args.seq_len}; KL/perplexity from benchmarks/kl_plain.py "
          f"(transformers + compressed-tensors, fp32); {machine_line(load)}.", "",
          "| run | wall s | peak RSS MB | held-out KL | perplexity | top-1 agree | KL in quantkit's runtime |",
          "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        rt = f"{r['kl_runtime']['kl_mean']:.5f}" if "kl_runtime" in r else ""
        md.append(f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 1e6:.0f} | {cell(r, 'kl_mean')} | "
                  f"{cell(r, 'ppl')} | {cell(r, 'top1_agree')} | {rt} |")
    base_ppl = next((r["kl"]["ppl_base"] for r in runs.values() if "ppl_base" in r["kl"]), float("nan"))
    md += ["", f"base perplexity {base_ppl:.3f}", ""]
    phased = {k: runs[k]["phases"] for k in runs if runs[k].get("phases") and "sq_gptq" in k}
    if phased:
        md += phase_table(phased, "Seconds per phase of the SmoothQuant+GPTQ runs")[1:] + [""]
    for name in (k for k in runs if k.startswith("qk_sq_gptq_w8a8_")):
        if "kl_mean" in runs[name]["kl"] and "llmc_sq_gptq_w8a8" in runs:
            md.append(f"- {name}: wall / llm-compressor {ratio(runs[name]['wall_s'], runs['llmc_sq_gptq_w8a8']['wall_s'])}, "
                      f"KL {runs[name]['kl']['kl_mean']:.5f}")
    sq, lsq = (runs[k]["kl"] if k in runs else {} for k in ("qk_sq_gptq_w8a8", "llmc_sq_gptq_w8a8"))
    if "kl_mean" in sq and "kl_mean" in lsq:
        md.append(f"- W8A8 KL quantkit / llm-compressor: {ratio(sq['kl_mean'], lsq['kl_mean'])} "
                  f"({'no worse' if sq['kl_mean'] <= lsq['kl_mean'] else 'WORSE'}); wall quantkit / llm-compressor: "
                  f"{ratio(runs['qk_sq_gptq_w8a8']['wall_s'], runs['llmc_sq_gptq_w8a8']['wall_s'])}")
    qb, lb, ld = runs["qk_fp8_block"], runs["llmc_fp8_block"], runs["llmc_fp8_dynamic"]
    if "error" in lb["kl"]:
        md.append(f"- llm-compressor FP8_BLOCK checkpoint does not run in transformers + compressed-tensors: "
                  f"`{lb['kl']['error'][:200]}`")
    if "kl_mean" in qb["kl"] and "kl_mean" in ld["kl"]:
        md.append(f"- quantkit FP8_BLOCK KL vs llm-compressor FP8_DYNAMIC (nearest runnable reference): "
                  f"{ratio(qb['kl']['kl_mean'], ld['kl']['kl_mean'])}")
    if "kl_runtime" in qb and "kl_runtime" in lb:
        md.append(f"- FP8_BLOCK KL quantkit / llm-compressor, both run by quantkit's runtime (ragged activation groups "
                  f"as DeepSeek-style kernels compute them): {ratio(qb['kl_runtime']['kl_mean'], lb['kl_runtime']['kl_mean'])}")
    n_fallback = sum(len(v) for v in qb["scheme_overrides"].values())
    md.append(f"- quantkit FP8_BLOCK: {n_fallback} linears with K % 128 != 0 fell back to FP8_DYNAMIC (named in the config)")
    md.append(f"- data-free FP8_BLOCK wall time, llm-compressor / quantkit: {ratio(lb['wall_s'], qb['wall_s'])} "
              f"(end to end, process start to exit, both tools)")
    payload = {k: {**{kk: vv for kk, vv in v.items() if kk != "path"}, "path": str(v["path"])} for k, v in runs.items()}
    write_results("fp8" if args.fp8_only else "w8a8_fp8", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
