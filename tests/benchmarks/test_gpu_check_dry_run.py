"""benchmarks/gpu_check.py --dry-run: the whole prepared GPU check on the CPU (tiny shapes, the CPU kernels standing
in for the CUDA ones, the quantize phase on a tiny random model), so the script a GPU session runs once is known to
work end to end before it gets there."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"w4a16", "w8a16", "int8", "fp8"}


def test_dry_run_writes_every_phase(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "OUT": str(out), "QUANTKIT_NO_PROGRESS": "1", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    r = json.loads((out / "gpu_check.json").read_text())
    assert r["info"]["dry_run"] is True and r["info"]["kernels_mode"] == "auto"
    assert r["problems"] == [] and r["skipped"] == {} and r["parity_failures"] == 0
    assert set(r["phase_seconds"]) == {"parity", "quantize", "timing", "decode"}

    # parity: every format through the dispatch point, served by a named kernel, close to the reference.
    linear = [row for row in r["parity"] if row["kind"] in KINDS]
    assert {row["kind"] for row in linear} == KINDS and len(linear) >= 30
    for row in linear:
        assert row["ok"] and "error" not in row, row
        assert isinstance(row["kernel"], str) and row["kernel"], row
        assert math.isfinite(row["rel_err"]) and row["rel_err"] >= 0, row
    assert any(row["kernel"] != "reference" for row in linear)  # the CPU kernels really were attached
    assert {row["kind"] for row in r["parity"]} >= {"moe-w4a16", "mla-decode", "tree-mask"}

    # quantize: a real CPU run's manifest fields, and the KL code (its own output as the stand-in: KL exactly 0).
    q = r["quantize"]
    assert q["device"] == "cpu" and q["device_peak_bytes"] is None and q["activations"] == "device"
    assert q["wall_s"] > 0 and q["peak_rss_bytes"] > 0 and q["layers"] == 2
    assert 0 < q["mean_layer_rel_error"] < 1 and q["same_calibration"] and q["same_recipe"]
    assert q["kl"]["vs_source"]["kl_mean"] > 0 and q["kl"]["vs_source"]["n_tokens"] > 0
    assert q["kl"]["vs_cpu_checkpoint"]["kl_mean"] == 0.0 and q["kl"]["vs_cpu_checkpoint"]["top1_agree"] == 1.0

    # timing: each format and the MLA op, a positive time and the kernel that was timed.
    assert {row["kind"] for row in r["timing"]} == KINDS | {"mla-decode"}
    for row in r["timing"]:
        assert "error" not in row and row["ms"] > 0, row
        assert row["kind"] == "mla-decode" or row["kernel"], row

    # decode: bf16 and every format, the quantised ones prepared through dispatch (counts per op kind and kernel).
    decode = {row["format"]: row for row in r["decode"]}
    assert set(decode) == {"bf16"} | KINDS
    for fmt, row in decode.items():
        assert "error" not in row and row["tokens_per_s"] > 0 and row["vs_bf16"] > 0, row
        if fmt != "bf16":
            assert set(row["kernels"]) == {fmt} and sum(row["kernels"][fmt].values()) == 14, row  # 2 layers x 7
    assert "parity cases ok" in proc.stdout
