"""Peak memory of `quantkit quantize` on a model much larger than one layer.

    .venv/bin/python benchmarks/bench_memory_scaling.py [--method rtn|gptq|awq] [--offload] [--with-llmcompressor]

Builds (once) a randomly initialised Llama of about 0.7B parameters stored in fp32 (about 2.8 GB of
safetensors), quantises it to W4A16 g128 (RTN by default) and reports peak RSS as a fraction of the model's size on disk.
The streaming engine holds one decoder layer and the activations, so the fraction falls as models grow.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import LLMC_PYTHON, ROOT, ratio, run_measured, save_tokens, write_results

# The vocabulary matches the tokenizer borrowed from the embedded model (SmolLM2's 49152 entries).
CONFIG = dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=10, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=False)


def build_model(folder: Path) -> Path:
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from quantkit.models.source import resolve_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).float()
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="1GB")
    AutoTokenizer.from_pretrained(resolve_model(None).path).save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def byte_budget(summary: dict) -> list[str]:
    """The run's large buffers, from the model's shapes and the calibration size."""
    h, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    tokens = summary["calibration"]["num_samples"] * summary["calibration"]["seq_len"]
    layer = 4 * h * h + 3 * h * inter
    mb = lambda b: f"{b / 1e6:.0f} MB"  # noqa: E731
    return [f"one generation of activations, bf16: {mb(tokens * h * 2)}",
            f"one decoder layer's fp32 master weights: {mb(layer * 4)}",
            f"GPTQ's float64 Hessian sums (q/k/v, o, gate/up inputs and down_proj's): {mb((3 * h * h + inter * inter) * 8)}",
            f"down_proj's factorisation (its Hessian and the factor, two fp32 {inter} x {inter} matrices at once): "
            f"{mb(2 * inter * inter * 4)}",
            f"one-pass only, every batch paused at down_proj (its input, bf16, and four hidden-sized tensors): "
            f"{mb(tokens * (inter + 4 * h) * 2)}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "memory")
    ap.add_argument("--method", choices=["rtn", "gptq", "awq"], default="rtn")
    ap.add_argument("--offload", action="store_true", help="spill the calibration activations to disk (--offload-dir)")
    ap.add_argument("--schedule", choices=["auto", "one-pass", "two-pass"], default=None,
                    help="quantkit's calibration schedule (default: quantize's own default)")
    ap.add_argument("--with-llmcompressor", action="store_true", help="also run llm-compressor's same method on it")
    args = ap.parse_args()
    import os

    import torch

    model = build_model(args.work / "llama-0.7b-fp32")
    cpu = f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs"
    load_before = os.getloadavg()[0]
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    tag = ("-offload" if args.offload else "") + (f"-{args.schedule}" if args.schedule else "")
    out = args.work / f"quantkit-{args.method}-w4a16{tag}"
    shutil.rmtree(out, ignore_errors=True)
    spill = ["--offload-dir", str(args.work / "spill")] if args.offload else []
    qk = run_measured([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--model", str(model), "--method", args.method,
                       "--scheme", "W4A16", "--group-size", "128", "--output", str(out), "--json", *spill,
                       *(["--schedule", args.schedule] if args.schedule else [])])
    shutil.rmtree(args.work / "spill", ignore_errors=True)
    rows = [("quantkit", qk)]
    if args.with_llmcompressor:
        from transformers import AutoTokenizer

        sys.path.insert(0, str(ROOT))
        from quantkit.data.calibration import build_token_blocks

        # RTN is data-free in llm-compressor; its runner takes a token file all the same.
        tokens = save_tokens(build_token_blocks(AutoTokenizer.from_pretrained(model), "kjv", 8, 512).input_ids,
                             args.work / "tokens.safetensors")
        llmc_out = args.work / f"llmc-{args.method}-w4a16"
        shutil.rmtree(llmc_out, ignore_errors=True)
        rows.append(("llm-compressor", run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"),
                                                     "--model", str(model), "--recipe", args.method, "--scheme", "W4A16",
                                                     "--group-size", "128", "--output", str(llmc_out),
                                                     "--tokens", str(tokens)])))
    how = (" (activations spilled to disk)" if args.offload else "") + (f" (--schedule {args.schedule})" if args.schedule else "")
    md = [f"# Memory scaling: {args.method.upper()} W4A16 g128 on a random 0.7B Llama (fp32){how}", "",
          f"model size on disk: {size / 1e9:.2f} GB", cpu,
          f"load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}", "",
          "| tool | wall (s) | peak RSS (MB) | peak RSS / model size |", "|---|---|---|---|"]
    md += [f"| {name} | {r['wall_s']:.1f} | {r['peak_rss_bytes'] / 1e6:.0f} | {r['peak_rss_bytes'] / size:.3f} |"
           for name, r in rows]
    summary = json.loads(qk["stdout"])
    schedules = sorted({r.get("schedule", "?") for r in summary.get("layers", [])})
    md += ["", f"quantkit: compute {summary.get('compute_dtype', '?')}, schedule {', '.join(schedules)}, "
               f"{summary['calibration']['num_samples']} x {summary['calibration']['seq_len']} calibration tokens; "
               "seconds per phase: " + ", ".join(f"{k} {v:.1f}" for k, v in summary.get("phase_seconds", {}).items())]
    md += ["", "Where the bytes go (sizes from the config, not measured):", ""] + [f"- {line}" for line in
                                                                               byte_budget(summary)]
    if len(rows) == 2:
        md += ["", f"quantkit / llm-compressor peak RSS: {ratio(rows[0][1]['peak_rss_bytes'], rows[1][1]['peak_rss_bytes'])}, "
                   f"wall: {ratio(rows[0][1]['wall_s'], rows[1][1]['wall_s'])}"]
    name = ("memory_scaling" + ("" if args.method == "rtn" else f"_{args.method}") + ("_offload" if args.offload else "")
            + (f"_{args.schedule.replace('-', '_')}" if args.schedule else ""))
    write_results(name, {"method": args.method, "offload": args.offload, "model_bytes": size, "cpu": cpu, "load_average_before": load_before, **{n: {**r, "stdout": None, "stderr": None} for n, r in rows}},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
