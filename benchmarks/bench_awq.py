"""AWQ W4A16 side by side with llm-compressor's AWQ: wall time, peak RSS, held-out KL and perplexity.

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_awq.py [--group-size 64] [--scheme W4A16] [--reuse-llmc]

Both tools quantise the same model (the embedded SmolLM2-135M by default) from the same 64 x 512 KJV
calibration tokens: quantkit's `kjv` source with seed 42 builds them (build_token_blocks), and the same
blocks are saved to a file that llm-compressor reads through `--tokens`. Both checkpoints are scored by
benchmarks/kl_plain.py (plain transformers) on the same held-out KJV tokens. quantkit's RTN is scored too,
as the floor both AWQs should beat.

llm-compressor 0.14's AWQ pins its cached activations in accelerator memory and fails on a CPU-only
machine ("Cannot access accelerator device"); benchmarks/llmc_runner.py replaces that pinning call with a
no-op when no accelerator exists (pinning only speeds host-to-device copies) and says so on stderr.
--reuse-llmc takes llm-compressor's result from an earlier run of this script (its run takes long on a CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import (comparison_rows, HELDOUT_KJV, HELDOUT_PYDOC, LLMC_PYTHON, ROOT, heldout_sets, kl_plain, ratio, run_measured,
                    phase_table, save_tokens, write_results)


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def _capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--scheme", default="W4A16", help="W4A16 (llm-compressor's preset) or W4A16_ASYM")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--awq-option", action="append", default=[], metavar="KEY=VALUE",
                    help="quantkit AWQ option (recipe quantization.options.awq; YAML value), e.g. search=coarse-fine")
    ap.add_argument("--skip-llmc", action="store_true", help="leave llm-compressor out (quantkit's rows only)")
    ap.add_argument("--skip-rtn", action="store_true", help="leave quantkit's RTN row out (saves its two KL runs)")
    ap.add_argument("--results", default=None, help="results file name (default awq_<scheme>_g<group>)")
    ap.add_argument("--reuse-llmc", action="store_true", help="reuse llm-compressor's checkpoint and timing from --work")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "awq")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...",
                    help="extra quantkit AWQ run in the same run with these awq options on top of --awq-option, e.g. "
                         "before=statistics_tokens=0,search=grid (repeatable): a row and a phase column each")
    args = ap.parse_args()
    if args.variant and args.skip_llmc:
        ap.error("--variant rows are reported beside llm-compressor's: drop --skip-llmc")
    if args.skip_rtn and args.skip_llmc:
        ap.error("--skip-llmc reports quantkit's AWQ beside its RTN: drop --skip-rtn")

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model

    model = resolve_model(args.model).path
    args.work.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model)
    calib = build_token_blocks(tok, "kjv", args.num_samples, args.seq_len, seed=42)
    calib_file = save_tokens(calib.input_ids, args.work / "calibration.safetensors")
    evals = heldout_sets(tok, args.work, args.heldout_samples, args.seq_len)

    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    common = ["--model", str(model), "--scheme", args.scheme, "--group-size", str(args.group_size), "--dataset", "kjv",
              "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--seed", "42", "--overwrite", "--json"]
    loads = {"before": _load()}

    def recipe_for(name: str, options: list[str]) -> list[str]:
        if not options:
            return []
        import yaml

        text = yaml.safe_load((ROOT / "recipes" / "awq-w4a16.yaml").read_text())
        text["quantization"]["options"]["awq"].update(
            {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in options)})
        (args.work / f"recipe{name}.yaml").write_text(yaml.safe_dump(text))
        return ["--recipe", str(args.work / f"recipe{name}.yaml")]

    qk = run_measured([quantkit, "quantize", *recipe_for("", args.awq_option), "--method", "awq", "--output",
                       str(args.work / "quantkit"), *common])
    variants = {}
    for spec in args.variant:
        name, _, opts = spec.partition("=")
        out = args.work / f"quantkit-{name}"
        variants[name] = {**run_measured([quantkit, "quantize", *recipe_for(f"-{name}", args.awq_option + opts.split(",")),
                                          "--method", "awq", "--output", str(out), *common]),
                          "options": opts, "out": out}
    loads["after_quantkit"] = _load()
    rtn = None if args.skip_rtn else run_measured([quantkit, "quantize", "--method", "rtn", "--output",
                                                    str(args.work / "quantkit-rtn"), *common])
    llmc_json = args.work / "llmc_result.json"
    if args.skip_llmc:
        llmc = None
    elif args.reuse_llmc and llmc_json.exists():
        llmc = json.loads(llmc_json.read_text())
    else:
        llmc = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model", str(model),
                             "--recipe", "awq", "--scheme", args.scheme, "--group-size", str(args.group_size),
                             "--output", str(args.work / "llmcompressor"), "--tokens", str(calib_file)])
        llmc["load_note"] = f"1-min load average after the run: {_load()}"
        llmc_json.write_text(json.dumps(llmc, indent=2))
    loads["after_llmc"] = _load()
    kl_qk = {k: kl_plain(model, args.work / "quantkit", f) for k, f in evals.items()}
    kl_rtn = None if rtn is None else {k: kl_plain(model, args.work / "quantkit-rtn", f) for k, f in evals.items()}
    if llmc is None:
        md = [f"# AWQ {args.scheme} g{args.group_size}, quantkit only (options: {', '.join(args.awq_option) or 'defaults'})",
              "", f"1-min load average: {loads}; torch CPU capability {_capability()}", "",
              "| run | wall (s) | peak RSS (MB) | KL kjv held-out | KL pydoc |", "|---|---|---|---|---|"]
        for name, run, kl in (("quantkit awq", qk, kl_qk), ("quantkit rtn", rtn, kl_rtn)):
            md.append(f"| {name} | {run['wall_s']:.1f} | {run['peak_rss_bytes'] / 1e6:.0f} | "
                      f"{kl[HELDOUT_KJV]['kl_mean']:.4f} | {kl[HELDOUT_PYDOC]['kl_mean']:.4f} |")
        phases = json.loads(qk["stdout"]).get("phase_seconds", {})
        md += ["", "quantkit awq seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())]
        write_results(args.results or f"awq_{args.scheme.lower()}_g{args.group_size}_quantkit",
                      {"options": args.awq_option, "load": loads, "phases": phases,
                       "quantkit": {**qk, "stdout": None, "stderr": None, "kl": kl_qk},
                       "quantkit_rtn": {**rtn, "stdout": None, "stderr": None, "kl": kl_rtn}}, "\n".join(md) + "\n")
        return
    kl_llmc = {k: kl_plain(model, args.work / "llmcompressor", f) for k, f in evals.items()}
    for v in variants.values():
        v["kl"] = {k: kl_plain(model, v["out"], f) for k, f in evals.items()}

    rows = comparison_rows(qk, llmc, kl_qk, kl_llmc)
    md = [f"# AWQ {args.scheme} g{args.group_size}: quantkit vs llm-compressor", "",
          f"model `{model.name}`, calibration KJV {args.num_samples} x {args.seq_len} tokens (seed 42, same blocks "
          f"for both), held-out KJV {args.heldout_samples} x {args.seq_len} tokens, base perplexity "
          f"{kl_qk[HELDOUT_KJV]['ppl_base']:.3f}; also {args.heldout_samples} x {args.seq_len} tokens of pydoc (another domain). llm-compressor ran with its accelerator memory pinning disabled (no GPU here).",
          f"1-min load average: {loads} (shared machine; wall times are only comparable within one run).", "",
          "| metric | quantkit awq | llm-compressor awq | quantkit / llm-compressor |", "|---|---|---|---|"]
    md += [f"| {name} | {a:.4f} | {b:.4f} | {ratio(a, b)} |" for name, a, b in rows]
    if rtn is not None:
        md += ["", f"quantkit RTN (same scheme): KL {kl_rtn[HELDOUT_KJV]['kl_mean']:.4f} (KJV) / "
                   f"{kl_rtn[HELDOUT_PYDOC]['kl_mean']:.4f} (pydoc), wall {rtn['wall_s']:.1f} s."]
    phases = json.loads(qk["stdout"]).get("phase_seconds", {})
    md += ["", "quantkit awq seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
           + f"; options: {', '.join(args.awq_option) or 'defaults'}; torch CPU capability {_capability()}"]
    if variants:
        md += ["", "Other quantkit AWQ runs in the same run (options on top of the above):", "",
               "| run | options | wall (s) | / llm-compressor | peak RSS (MB) | KL kjv held-out | KL pydoc |",
               "|---|---|---|---|---|---|---|"]
        for name, v in variants.items():
            md.append(f"| {name} | {v['options']} | {v['wall_s']:.1f} | {ratio(v['wall_s'], llmc['wall_s'])} | "
                      f"{v['peak_rss_bytes'] / 1e6:.0f} | {v['kl'][HELDOUT_KJV]['kl_mean']:.4f} | "
                      f"{v['kl'][HELDOUT_PYDOC]['kl_mean']:.4f} |")
        columns = {"default": phases, **{n: json.loads(v["stdout"]).get("phase_seconds", {}) for n, v in variants.items()}}
        md += phase_table(columns)
    write_results(args.results or f"awq_{args.scheme.lower()}_g{args.group_size}",
                  {"options": args.awq_option, "phases": phases, "quantkit": {**qk, "stdout": None, "stderr": None, "kl": kl_qk},
                   "quantkit_rtn": None if rtn is None else {**rtn, "stdout": None, "stderr": None, "kl": kl_rtn},
                   "llmcompressor": {**llmc, "stdout": None, "stderr": None, "kl": kl_llmc}, "load": loads,
                   "variants": {n: {**v, "stdout": None, "stderr": None, "out": str(v["out"]),
                                    "phases": json.loads(v["stdout"]).get("phase_seconds", {})}
                                for n, v in variants.items()}},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
