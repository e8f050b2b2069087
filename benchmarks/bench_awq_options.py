"""AWQ option sets screened one after another (quantkit only): wall time, seconds per phase and held-out KL on
KJV and pydoc, for choosing defaults before the side-by-side run (bench_awq.py).

    .venv/bin/python benchmarks/bench_awq_options.py \\
        "default=" "st4k=statistics_tokens:4096" "cf=search:coarse-fine,coarse_step:4,search_tokens:2048"

Each argument is NAME=KEY:VALUE,... (awq options on top of recipes/awq-w4a16.yaml). Same calibration ids and held-out
sets as bench_awq.py (64 x 512 KJV, seed 42; 32 x 512 held-out KJV and pydoc). Rows are appended to
benchmarks/results/awq_options.jsonl as they finish (a long sweep keeps what it measured), and the Markdown table
is rewritten from all rows of that file after each one. Compare walls only between rows of one sweep on a quiet
machine: each row prints the load average around it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from common import HELDOUT_KJV, HELDOUT_PYDOC, RESULTS, ROOT, heldout_sets, kl_plain, run_measured, save_tokens


def _table(rows: list[dict]) -> str:
    md = ["# AWQ W4A16 g64 option screen (quantkit only, SmolLM2, 64 x 512 KJV calibration)", "",
          "Written by `benchmarks/bench_awq_options.py`; rows in the order they ran. Walls compare only within one "
          "sweep at similar load.", "",
          "| run | options | wall (s) | scale_search s | forward s | statistics s | KL kjv held-out | KL pydoc | "
          "capability, load before -> after | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["phases"]
        md.append(f"| {r['name']} | {r['options'] or 'defaults'} | {r['wall']:.1f} | {p.get('scale_search', 0):.1f} | "
                  f"{p.get('forward', 0):.1f} | {p.get('statistics', 0):.1f} | {r['kl'][HELDOUT_KJV]:.4f} | "
                  f"{r['kl'][HELDOUT_PYDOC]:.4f} | {r['capability']}, {r['load_before']:.2f} -> {r['load_after']:.2f} | "
                  f"{r.get('note', '')} |")
    return "\n".join(md) + "\n"


def main() -> None:
    if len(sys.argv) < 2 or any("=" not in a for a in sys.argv[1:]):
        raise SystemExit(__doc__)
    sys.path.insert(0, str(ROOT))
    import torch
    import yaml
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model

    work = ROOT / "benchmarks" / ".work" / "awq_options"
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(model)
    save_tokens(build_token_blocks(tok, "kjv", 64, 512, seed=42).input_ids, work / "calibration.safetensors")
    evals = heldout_sets(tok, work, 32, 512)
    log = RESULTS / "awq_options.jsonl"
    for spec in sys.argv[1:]:
        name, _, opts = spec.partition("=")
        options = {k: yaml.safe_load(v) for k, v in (o.split(":", 1) for o in opts.split(",") if o)}
        text = yaml.safe_load((ROOT / "recipes" / "awq-w4a16.yaml").read_text())
        text["quantization"]["options"].setdefault("awq", {}).update(options)
        recipe = work / f"recipe-{name}.yaml"
        recipe.write_text(yaml.safe_dump(text))
        out = work / f"q-{name}"
        load_before = os.getloadavg()[0]
        res = run_measured([str(ROOT / ".venv" / "bin" / "quantkit"), "quantize", "--recipe", str(recipe), "--method",
                            "awq", "--model", str(model), "--scheme", "W4A16", "--group-size", "64", "--dataset", "kjv",
                            "--num-samples", "64", "--seq-len", "512", "--seed", "42", "--overwrite", "--json",
                            "--output", str(out)])
        row = {"name": name, "options": options, "wall": res["wall_s"], "load_before": load_before,
               "load_after": os.getloadavg()[0], "phases": json.loads(res["stdout"]).get("phase_seconds", {}),
               "kl": {k: kl_plain(model, out, f)["kl_mean"] for k, f in evals.items()},
               "capability": torch.backends.cpu.get_cpu_capability()}
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        (RESULTS / "awq_options.md").write_text(_table(rows))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
