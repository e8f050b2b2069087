"""Shared benchmark plumbing: run a tool as a child process and measure it; make token files; print ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLMC_PYTHON = ROOT / "benchmarks" / ".venv-llmc" / "bin" / "python"
RESULTS = ROOT / "benchmarks" / "results"


def _vm_hwm(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmHWM:")), None)
    except OSError:
        return None


def run_measured(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` as a child; return wall seconds, its peak RSS (bytes) and its output.

    The peak is the child's own VmHWM, polled every 20 ms until it exits (the high-water mark only grows, so the
    last reading misses at most the final 20 ms). wait4's ru_maxrss is not used: Linux carries it over exec,
    so it reports this (parent) process's size whenever that is larger than the child's peak."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err,
                                env={**os.environ, "QUANTKIT_NO_PROGRESS": "1", **(env or {})})
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm(proc.pid) or 0)
            time.sleep(0.02)
        wall = time.time() - start
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        sys.stderr.write(stderr[-4000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return {"wall_s": round(wall, 2), "peak_rss_bytes": peak, "stdout": stdout, "stderr": stderr}


def save_tokens(input_ids, path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"input_ids": input_ids.contiguous()}, str(path))
    return path


def kl_plain(base: Path, candidate: Path, tokens: Path) -> dict:
    res = run_measured([sys.executable, str(ROOT / "benchmarks" / "kl_plain.py"), "--base", str(base),
                        "--candidate", str(candidate), "--tokens", str(tokens)])
    return json.loads(res["stdout"].strip().splitlines()[-1])


def phase_table(columns: dict[str, dict[str, float]], title: str = "Seconds per phase") -> list[str]:
    """Markdown lines: seconds per phase (quantkit's manifest, summed over layers), one column per run."""
    names = sorted({k for p in columns.values() for k in p})
    return (["", f"{title} (quantkit's manifest, summed over layers):", "",
             "| phase | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
            + [f"| {k} | " + " | ".join(f"{p.get(k, 0.0):.1f}" for p in columns.values()) + " |" for k in names])


def write_results(name: str, payload: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)


def machine_line(load: dict) -> str:
    """What every result line is read beside: torch's CPU capability, the CPU count, the load average around it."""
    import torch

    return (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, load average "
            f"before {load['before']:.2f}, after {load['after']:.2f}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x" if b else "n/a"


def prepare_run(model_arg: str | None, work: Path):
    """Resolve the model (default: the embedded SmolLM2), start a clean work folder, load the tokenizer."""
    import shutil

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from quantkit.models.source import resolve_model

    model = resolve_model(model_arg).path
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return model, AutoTokenizer.from_pretrained(model)


def pydoc_text(path: Path) -> Path:
    """Python's language/library reference topics (stdlib `pydoc_data.topics`) as a .txt file: English technical
    prose and code, a domain far from the KJV calibration text."""
    from pydoc_data.topics import topics

    path.write_text("\n\n".join(topics[k].strip() for k in sorted(topics)), encoding="utf-8")
    return path


HELDOUT_KJV, HELDOUT_PYDOC = "kjv held-out", "pydoc (other domain)"


def heldout_sets(tok, work: Path, n_samples: int, seq_len: int) -> dict[str, Path]:
    """Token files for held-out KJV (the calibration domain, disjoint split) and for pydoc (another domain)."""
    from quantkit.data.calibration import build_token_blocks

    blocks = {HELDOUT_KJV: build_token_blocks(tok, "kjv", n_samples, seq_len, seed=1234, split="heldout"),
              HELDOUT_PYDOC: build_token_blocks(tok, str(pydoc_text(work / "pydoc.txt")), n_samples, seq_len, seed=1234)}
    return {k: save_tokens(v.input_ids, work / f"eval-{i}.safetensors") for i, (k, v) in enumerate(blocks.items())}


def comparison_rows(run_a: dict, run_b: dict, kl_a: dict, kl_b: dict) -> list[tuple[str, float, float]]:
    """(metric, a, b) rows for two tools: wall time, peak RSS, and KL / perplexity / top-1 per evaluation set."""
    rows = [("wall time (s)", run_a["wall_s"], run_b["wall_s"]),
            ("peak RSS (MB)", run_a["peak_rss_bytes"] / 1e6, run_b["peak_rss_bytes"] / 1e6)]
    for k in kl_a:
        rows += [(f"KL, {k}", kl_a[k]["kl_mean"], kl_b[k]["kl_mean"]),
                 (f"perplexity, {k} (base {kl_a[k]['ppl_base']:.3f})", kl_a[k]["ppl"], kl_b[k]["ppl"]),
                 (f"top-1 agreement, {k}", kl_a[k]["top1_agree"], kl_b[k]["top1_agree"])]
    return rows


def bench_moe_model(work: Path) -> Path:
    """The MoE benchmarks/bench_moe.py made in `work` (exit with one line when there is none)."""
    import sys

    moes = sorted(p for p in work.glob("smollm2-moe-*") if (p / "config.json").is_file())
    if not moes:
        sys.exit(f"error: no MoE in {work}; run benchmarks/bench_moe.py first")
    return moes[-1]


def check_consumers(checkpoint: Path, ids, source, auto=None) -> dict:
    """A quantised checkpoint loaded by transformers (the consumer; `auto` its model class) and by quantkit's
    runtime, on `ids`, against the unquantised model's logits `source`: the relative change the consumer shows
    (vs_source), and the runtime's largest difference from the consumer relative to the largest logit (or, where
    transformers cannot load it, the runtime's change against the unquantised model). A failure is one line."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.runtime.model import load_model

    def first_line(exc: BaseException) -> str:
        return f"{type(exc).__name__}: " + (str(exc).splitlines() or [""])[0][:120]

    row: dict = {}
    consumer = None
    try:
        with torch.no_grad():
            consumer = (auto or AutoModelForCausalLM).from_pretrained(checkpoint, dtype=torch.float32)(
                input_ids=ids).logits
        row["vs_source"] = round(float((consumer - source).norm() / source.norm()), 4)
    except Exception as exc:
        row["transformers"] = first_line(exc)
    try:
        with torch.no_grad():
            runtime = load_model(checkpoint, dtype=torch.float32)(ids).logits.float()
        if consumer is not None:
            row["runtime_vs_transformers"] = float((runtime - consumer).abs().max() / consumer.abs().max())
        else:
            row["runtime_vs_source"] = round(float((runtime - source).norm() / source.norm()), 4)
    except Exception as exc:
        row["runtime"] = first_line(exc)
    return row


def consumer_cells(row: dict) -> str:
    """The markdown cells of check_consumers' figures: vs unquantised | runtime vs transformers | note."""
    rt = row.get("runtime_vs_transformers")
    note = row.get("why") or row.get("transformers") or row.get("runtime") or ""
    if "runtime_vs_source" in row:
        note += f" (runtime vs unquantised {row['runtime_vs_source']})"
    return f"{row.get('vs_source', '-')} | {'-' if rt is None else f'{rt:.1e}'} | {note.replace('|', '/')}"

