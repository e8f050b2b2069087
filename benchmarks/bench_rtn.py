"""RTN W4A16 side by side with llm-compressor: wall time, peak RSS, held-out KL and perplexity.

    bash benchmarks/setup_llmcompressor.sh        # once: llm-compressor in its own venv
    .venv/bin/python benchmarks/bench_rtn.py [--group-size 64] [--heldout-samples 32]

Both tools quantise the same model (the embedded SmolLM2-135M by default) with the same scheme; both checkpoints
are then scored by benchmarks/kl_plain.py (plain transformers) on the same held-out KJV tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import (comparison_rows, HELDOUT_KJV, LLMC_PYTHON, ROOT, heldout_sets, kl_plain, prepare_run, ratio,
                    run_measured, write_results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "rtn")
    args = ap.parse_args()

    model, tok = prepare_run(args.model, args.work)
    evals = heldout_sets(tok, args.work, args.heldout_samples, args.seq_len)

    qk_out, llmc_out = args.work / "quantkit", args.work / "llmcompressor"
    qk = run_measured([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--model", str(model), "--method", "rtn",
                       "--scheme", "W4A16", "--group-size", str(args.group_size), "--output", str(qk_out), "--json"])
    llmc = run_measured([str(LLMC_PYTHON), str(ROOT / "benchmarks" / "llmc_runner.py"), "--model", str(model),
                         "--recipe", "rtn", "--scheme", "W4A16", "--group-size", str(args.group_size),
                         "--output", str(llmc_out), "--tokens", str(evals[HELDOUT_KJV])])  # unused by data-free RTN
    kl_qk = {k: kl_plain(model, qk_out, f) for k, f in evals.items()}
    kl_llmc = {k: kl_plain(model, llmc_out, f) for k, f in evals.items()}

    rows = comparison_rows(qk, llmc, kl_qk, kl_llmc)
    md = [f"# RTN W4A16 g{args.group_size}: quantkit vs llm-compressor", "",
          f"model `{model.name}`; evaluation {args.heldout_samples} x {args.seq_len} tokens of held-out KJV and of "
          f"pydoc (another domain); quantkit's default scale search (importance-weighted, 8 KJV samples)", "",
          "| metric | quantkit | llm-compressor | quantkit / llm-compressor |", "|---|---|---|---|"]
    md += [f"| {name} | {a:.4f} | {b:.4f} | {ratio(a, b)} |" for name, a, b in rows]
    write_results(f"rtn_w4a16_g{args.group_size}", {"quantkit": {**qk, "stdout": None, "stderr": None, "kl": kl_qk},
                                                   "llmcompressor": {**llmc, "stdout": None, "stderr": None, "kl": kl_llmc}},
                  "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
