"""Where calibration time goes, before and after this round of work, per method, in one run on one machine.

    .venv/bin/python benchmarks/bench_calibration_phases.py [--methods rtn,gptq,smoothquant+gptq] [--kl rtn]

"before" runs today's code with the earlier paths switched back on: the eager shrink-grid search
(QUANTKIT_EAGER_SEARCH=1), the eager GPTQ column loop on one thread (QUANTKIT_EAGER_SOLVE=1) and the two-pass
schedule. "after" is the default. Each method quantises the embedded SmolLM2-135M with W4A16 g64 (W8A8 for
SmoothQuant+GPTQ) on 64 x 512 KJV tokens (RTN: the demo recipe, 8 samples); the table gives wall time, peak RSS,
seconds per phase from the manifest, and whether the tensor files are identical; for the methods in --kl (RTN by
default: GPTQ's are in gptq_w4a16_g64.md), KL on held-out KJV and pydoc (benchmarks/kl_plain.py) of both outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

from common import ROOT, heldout_sets, kl_plain, prepare_run, run_measured, write_results

BEFORE = {"QUANTKIT_EAGER_SEARCH": "1", "QUANTKIT_EAGER_SOLVE": "1"}
METHODS = {
    "rtn": ["--recipe", "recipes/rtn-w4a16.yaml", "--group-size", "64"],
    "gptq": ["--method", "gptq", "--scheme", "W4A16", "--group-size", "64", "--num-samples", "64", "--seq-len", "512"],
    "smoothquant+gptq": ["--method", "smoothquant+gptq", "--scheme", "W8A8", "--group-size", "-1", "--num-samples",
                         "64", "--seq-len", "512"],
}


def _digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.read_bytes())
    return h.hexdigest()


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--kl", default="rtn", help="methods whose outputs are scored for KL (comma-separated; '' for none)")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".work" / "phases")
    ap.add_argument("--merge", action="store_true", help="keep the last results' rows of the methods not run")
    a = ap.parse_args()
    load_before = os.getloadavg()[0]
    model, tok = prepare_run(None, a.work)
    kl_methods = [m for m in a.kl.split(",") if m]
    evals = heldout_sets(tok, a.work, 32, 512) if kl_methods else {}
    quantkit = str(ROOT / ".venv" / "bin" / "quantkit")
    rows = []
    for method in a.methods.split(","):
        for label, env, extra in (("before", BEFORE, ["--schedule", "two-pass"]), ("after", {}, [])):
            out = a.work / f"{method.replace('+', '_')}-{label}"
            res = run_measured([quantkit, "quantize", *METHODS[method], *extra, "--output", str(out), "--overwrite",
                                "--json"], env=env)
            summary = json.loads(res["stdout"])
            row = {"method": method, "label": label, "wall_s": res["wall_s"], "peak_rss_bytes": res["peak_rss_bytes"],
                   "phases": summary.get("phase_seconds", {}), "digest": _digest(out),
                   "schedules": sorted({r.get("schedule", "two-pass") for r in summary.get("layers", [])
                                        if isinstance(r, dict)})}
            if method in kl_methods:
                row["kl"] = {k: kl_plain(model, out, f) for k, f in evals.items()}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "kl"}), flush=True)
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": load_before, "load_average_after": os.getloadavg()[0], "rows": rows}
    previous = ROOT / "benchmarks" / "results" / "calibration_phases.json"
    if a.merge and previous.is_file():  # keep the other methods' rows of the last run, marked as such
        old = json.loads(previous.read_text())
        kept = [r for r in old["rows"] if r["method"] not in {x["method"] for x in rows}]
        payload["merged"] = {"methods": sorted({r["method"] for r in kept}),
                             "load_average_before": old["load_average_before"]}
        payload["rows"] = kept + rows
    _write(payload)


def _write(payload: dict) -> None:
    rows = payload["rows"]
    keys = sorted({k for r in rows for k in r["phases"]})
    head = [f"{r['method']} {r['label']}" for r in rows]
    md = ["# Calibration phases before and after (fused search, compiled GPTQ loop, one-pass schedule)", "",
          f"{payload['cpu']}; load average before {payload['load_average_before']:.2f}, after "
          f"{payload['load_average_after']:.2f}"
          + (f" (rows of {', '.join(payload['merged']['methods'])} from the previous run, load average before "
             f"{payload['merged']['load_average_before']:.2f})" if "merged" in payload else "")
          + "; SmolLM2-135M; seconds summed over layers from the manifest", "",
          "| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|",
          "| wall (s) | " + " | ".join(f"{r['wall_s']:.1f}" for r in rows) + " |",
          "| peak RSS (MB) | " + " | ".join(f"{r['peak_rss_bytes'] / 1e6:.0f}" for r in rows) + " |"]
    md += [f"| {k} | " + " | ".join(f"{r['phases'].get(k, 0.0):.1f}" for r in rows) + " |" for k in keys]
    md.append("| tensor files identical to before | " + " | ".join(
        "-" if r["label"] == "before" else ("yes" if r["digest"] == prev["digest"] else "no")
        for prev, r in zip([rows[0]] + rows, rows)) + " |")
    domains = next((list(r["kl"]) for r in rows if "kl" in r), [])
    for dom in domains:
        md.append(f"| KL, {dom} | " + " | ".join(f"{r['kl'][dom]['kl_mean']:.4f}" if "kl" in r else "-"
                                                 for r in rows) + " |")
    write_results("calibration_phases", payload, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
