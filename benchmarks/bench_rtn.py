"""RTN W4A16 side by side with llm-compressor: wall time, peak RSS, held-out KL and perplexity.

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_rtn.py [--group-size 64] [--heldout-samples 32]

Both tools quantise the same model (the embedded SmolLM2-135M by default) with the same scheme; both checkpoints
are then scored by benchmarks/kl_plain.py (plain transformers) on the same held-out KJV tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import LLMC_PYTHON, ROOT, kl_plain, ratio, run_measured, save_tokens, write_results, prepare_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "rtn")
    args = ap.parse_args()

    model, tok = prepare_run(args.model, args.work)
    from quantkit.data.calibration import build_token_blocks
    heldout = build_token_blocks(tok, "kjv", args.heldout_samples, args.seq_len, seed=1234, split="heldout")
    tokens = save_tokens(heldout.input_ids, args.work / "heldout.safetensors")

    qk_out, llmc_out = args.work / "quantkit", args.work / "llmcompressor"
    qk = run_measured([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--model", str(model), "--method", "rtn",
                       "--scheme", "W4A16", "--group-size", str(args.group_size), "--output", str(qk_out), "--json"])
    llmc = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model", str(model),
                         "--recipe", "rtn", "--scheme", "W4A16", "--group-size", str(args.group_size),
                         "--output", str(llmc_out), "--tokens", str(tokens)])
    kl_qk, kl_llmc = kl_plain(model, qk_out, tokens), kl_plain(model, llmc_out, tokens)

    rows = [("wall time (s)", qk["wall_s"], llmc["wall_s"]),
            ("peak RSS (MB)", qk["peak_rss_bytes"] / 1e6, llmc["peak_rss_bytes"] / 1e6),
            ("held-out KL", kl_qk["kl_mean"], kl_llmc["kl_mean"]),
            ("held-out perplexity", kl_qk["ppl"], kl_llmc["ppl"]),
            ("top-1 agreement", kl_qk["top1_agree"], kl_llmc["top1_agree"])]
    md = [f"# RTN W4A16 g{args.group_size}: quantkit vs llm-compressor", "",
          f"model `{model.name}`, held-out KJV {args.heldout_samples} x {args.seq_len} tokens, "
          f"base perplexity {kl_qk['ppl_base']:.3f}", "",
          "| metric | quantkit | llm-compressor | quantkit / llm-compressor |", "|---|---|---|---|"]
    md += [f"| {name} | {a:.4f} | {b:.4f} | {ratio(a, b)} |" for name, a, b in rows]
    write_results(f"rtn_w4a16_g{args.group_size}", {"quantkit": {**qk, "stdout": None, "stderr": None, "kl": kl_qk},
                                                   "llmcompressor": {**llmc, "stdout": None, "stderr": None, "kl": kl_llmc}},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
