"""GPTQ W4A16 side by side with llm-compressor: wall time, peak RSS, KL and perplexity on held-out text of
the calibration domain (KJV) and of another domain (Python's reference documentation, `pydoc_data.topics`,
shipped with CPython: technical English prose with code, nothing like the Bible).

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_gptq.py [--group-size 64] [--calib-samples 64] [--heldout-samples 32]
    .venv/bin/python benchmarks/bench_gptq.py --skip-llmc --variant self="--dataset kjv:0.5,self:0.5"

Both tools get the same calibration tokens (quantkit builds them from its `kjv` source with the same seed; the
token file handed to llm-compressor is those exact ids, and the fingerprint in quantkit's manifest is checked
against it). RTN (quantkit) is the baseline for the other-domain target. Every checkpoint is scored by
benchmarks/kl_plain.py (plain transformers, fp32) on the same token files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
from pathlib import Path

from common import (HELDOUT_KJV, HELDOUT_PYDOC, LLMC_PYTHON, ROOT, heldout_sets, kl_plain, phase_table, prepare_run,
                    ratio, run_measured, save_tokens, write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--skip-llmc", action="store_true", help="reuse nothing, just leave llm-compressor out")
    ap.add_argument("--variant", action="append", default=[],
                    help="extra quantkit GPTQ run: NAME=\"extra quantize flags\" (repeatable)")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "gptq")
    args = ap.parse_args()

    import os

    load_before = os.getloadavg()[0]
    model, tok = prepare_run(args.model, args.work)
    from quantkit.data.calibration import build_token_blocks
    calib = build_token_blocks(tok, "kjv", args.calib_samples, args.seq_len, seed=args.seed)
    calib_file = save_tokens(calib.input_ids, args.work / "calibration.safetensors")
    eval_files = heldout_sets(tok, args.work, args.heldout_samples, args.seq_len)

    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    common = ["quantize", "--model", str(model), "--scheme", "W4A16", "--group-size", str(args.group_size),
              "--dataset", "kjv", "--num-samples", str(args.calib_samples), "--seq-len", str(args.seq_len),
              "--seed", str(args.seed), "--json"]
    runs: dict[str, dict] = {}
    plan = [("quantkit gptq", ["--method", "gptq"]), ("quantkit rtn", ["--method", "rtn"])]
    plan += [(f"quantkit gptq {name}", ["--method", "gptq", *shlex.split(flags)])
             for name, flags in (v.split("=", 1) for v in args.variant)]
    for name, flags in plan:
        out = args.work / name.replace(" ", "_")
        res = run_measured([quantkit, *common, *flags, "--output", str(out)])
        summary = json.loads(res["stdout"])
        # RTN is data-free (it only measures errors on a few samples), so only calibrated runs are checked.
        if "gptq" in flags and "--dataset" not in flags and summary["calibration"]["fingerprint"] != hashlib.sha256(
                calib.input_ids.numpy().tobytes()).hexdigest():
            raise SystemExit(f"{name}: calibration tokens differ from the token file")
        runs[name] = {**res, "out": out, "events": len(summary["events"]), "phases": summary.get("phase_seconds", {})}
    if not args.skip_llmc:
        out = args.work / "llmcompressor_gptq"
        res = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model", str(model),
                            "--recipe", "gptq", "--scheme", "W4A16", "--group-size", str(args.group_size),
                            "--output", str(out), "--tokens", str(calib_file)])
        runs["llm-compressor gptq"] = {**res, "out": out}
    floor = forward_floor(model, args.calib_samples, args.seq_len)
    for name, run in runs.items():
        run["eval"] = {k: kl_plain(model, run["out"], f) for k, f in eval_files.items()}

    names = list(runs)
    import torch

    machine = (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, load average "
               f"before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")
    md = [f"# GPTQ W4A16 g{args.group_size} symmetric: quantkit vs llm-compressor", "",
          f"model `{model.name}`; calibration {args.calib_samples} x {args.seq_len} KJV tokens (identical for both); "
          f"evaluation {args.heldout_samples} x {args.seq_len} tokens per domain; {machine}", "",
          "| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    md.append("| wall time (s) | " + " | ".join(f"{runs[n]['wall_s']:.1f}" for n in names) + " |")
    md.append("| peak RSS (MB) | " + " | ".join(f"{runs[n]['peak_rss_bytes'] / 1e6:.0f}" for n in names) + " |")
    for k in eval_files:
        base_ppl = runs[names[0]]["eval"][k]["ppl_base"]
        md.append(f"| KL, {k} | " + " | ".join(f"{runs[n]['eval'][k]['kl_mean']:.4f}" for n in names) + " |")
        md.append(f"| perplexity, {k} (base {base_ppl:.2f}) | "
                  + " | ".join(f"{runs[n]['eval'][k]['ppl']:.3f}" for n in names) + " |")
    md += phase_table({n: runs[n]["phases"] for n in names if runs[n].get("phases")})
    qk = runs["quantkit gptq"]
    if "llm-compressor gptq" in runs:
        lc = runs["llm-compressor gptq"]
        md += ["", f"quantkit / llm-compressor: wall {ratio(qk['wall_s'], lc['wall_s'])}, "
               f"peak RSS {ratio(qk['peak_rss_bytes'], lc['peak_rss_bytes'])}, "
               f"KJV KL {ratio(qk['eval'][HELDOUT_KJV]['kl_mean'], lc['eval'][HELDOUT_KJV]['kl_mean'])}"]
    if floor:
        lc_wall = runs.get("llm-compressor gptq", {}).get("wall_s")
        md.append("")
        md.append("Floor (`bench_forward_floor.py`, same run: transformers' decoder forward over the calibration tokens, "
                  "batches of 8): " + ", ".join(f"{k} {v:.1f} s" + (f" ({ratio(v, lc_wall)} of llm-compressor's wall)"
                                                                    if lc_wall else "") for k, v in floor.items())
                  + f"; quantkit gptq's forward + statistics phases: "
                  f"{qk['phases'].get('forward', 0) + qk['phases'].get('statistics', 0):.1f} s")
    rtn = runs["quantkit rtn"]["eval"][HELDOUT_PYDOC]["kl_mean"]
    md.append(f"other-domain KL, quantkit gptq / rtn: {ratio(qk['eval'][HELDOUT_PYDOC]['kl_mean'], rtn)}")
    payload = {n: {k: v for k, v in r.items() if k not in ("stdout", "stderr", "out")} for n, r in runs.items()}
    payload["forward_floor_seconds"] = floor
    write_results(f"gptq_w4a16_g{args.group_size}", payload, "\n".join(md) + "\n")


def forward_floor(model, samples: int, seq_len: int) -> dict[str, float]:
    """Seconds of one decoder forward over samples x seq_len tokens per dtype, from bench_forward_floor.py in its
    own process (nothing else running)."""
    import re
    import subprocess

    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "benchmarks" / "bench_forward_floor.py"),
                          "--model", str(model), "--num-samples", str(samples), "--seq-len", str(seq_len)],
                         capture_output=True, text=True, check=True).stdout
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+): one decoder forward .*: ([\d.]+) s$", out, re.M)}


if __name__ == "__main__":
    main()
