"""check-serving against vLLM itself, for every checkpoint kind quantkit writes.

    QUANTKIT_VLLM_PYTHON=benchmarks/.venv-vllm/bin/python \
        .venv/bin/python benchmarks/vllm_agreement.py [--kinds W4A16,FP8,...] [--num-samples 4] [--seq-len 128]

Per kind (built from the embedded SmolLM2 by quantkit's own commands): `quantkit check-serving --gpu cpu` says
whether vLLM's CPU build will load it; vLLM's CPU build then loads it and scores held-out KJV blocks
(`quantkit/eval/vllm_worker.py`); where it loads, its NLL per token is compared with transformers' on the same
tokens (a disagreement over 0.02 nats is flagged). A row agrees when the rule check's verdict is what vLLM did.
Each kind's row is written as soon as it is measured (benchmarks/results/vllm_agreement.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_results  # noqa: E402

QK = [sys.executable, "-m", "quantkit"]
RTN = ["quantize", "--method", "rtn"]
# kind -> (commands that build it, in order; OUT is the kind's folder, SRC an earlier step's output)
KINDS = {
    "W4A16 g64": [RTN + ["--scheme", "W4A16", "--group-size", "64"]],
    "W4A16_ASYM g64": [RTN + ["--scheme", "W4A16_ASYM", "--group-size", "64"]],
    "W4A16 g64 act-order (GPTQ)": [["quantize", "--method", "gptq", "--scheme", "W4A16", "--group-size", "64",
                                    "--actorder", "group", "--num-samples", "16", "--seq-len", "256"]],
    "W8A16 channel": [RTN + ["--scheme", "W8A16", "--group-size", "-1"]],
    "W8A8 dynamic": [RTN + ["--scheme", "W8A8"]],
    "W8A8_STATIC": [RTN + ["--scheme", "W8A8_STATIC"]],
    "FP8 static tensor": [["quantize", "--method", "fp8", "--scheme", "FP8"]],
    "FP8_DYNAMIC channel": [["quantize", "--method", "fp8", "--scheme", "FP8_DYNAMIC"]],
    "FP8_BLOCK": [["quantize", "--method", "fp8", "--scheme", "FP8_BLOCK"]],
    "MoE W4A16 (moefied: 8 experts top-2)": [
        ["moefy", "--experts", "8", "--top-k", "2", "--num-samples", "8", "--seq-len", "256", "--eval-samples", "0",
         "--output", "SRC"],
        RTN + ["--model", "SRC", "--scheme", "W4A16", "--group-size", "64"]],
    "MLA (convert-mla: bf16)": [["convert-mla", "--num-samples", "8", "--seq-len", "256", "--refine-steps", "0"]],
    "W4A16 g64 + fp8 KV cache": [RTN + ["--scheme", "W4A16", "--group-size", "64", "--kv-cache", "fp8"]],
    "W4A16 g64 + fp8 KV cache per head": [RTN + ["--scheme", "W4A16", "--group-size", "64", "--kv-cache", "fp8-head"]],
    "NVFP4A16": [RTN + ["--scheme", "NVFP4A16"]],
    "MXFP4A16": [RTN + ["--scheme", "MXFP4A16"]],
    "W4AFP8": [RTN + ["--scheme", "W4AFP8", "--group-size", "64"]],
    "MLA + fp8 latent KV cache": [
        ["convert-mla", "--num-samples", "8", "--seq-len", "256", "--refine-steps", "0", "--output", "SRC"],
        RTN + ["--model", "SRC", "--scheme", "W4A16", "--group-size", "32", "--kv-cache", "fp8"]],
    # 4-bit choices only: the CPU build has no 8-bit WNA16 kernel (the W8A16 row)
    "mixed W4A16 sym + asym at 4.25 bits": [
        RTN + ["--schemes", "W4A16:ch,W4A16:g64,W4A16:g32,W4A16_ASYM:ch,W4A16_ASYM:g64,W4A16_ASYM:g32",
               "--target-bits", "4.25"]],
}


# NLL gaps over 0.02 that are measured to be the checkpoint's own sensitivity, not an engine's error.
EXPLAINED = {
    "W8A8_STATIC": "not an engine error: this checkpoint's NLL moves 0.16 in vLLM itself when every input_scale moves "
                   "one bf16 step (4.3820 / 4.5453), and quantkit's runtime moves +0.0905 when it divides x/scale in "
                   "fp32 as vLLM does instead of in bf16 as compressed-tensors does; its reference kernels give "
                   "transformers' 4.4936 exactly (benchmarks/results/static_activation_sensitivity.md)",
    "MLA (convert-mla: bf16)": "vLLM's CPU build, not the conversion: on random DeepSeek-V3 models made by "
                               "transformers itself the two engines agree within 0.01 nats/token without the RoPE "
                               "part of the attention scores and differ by 0.78 (these dims) and 0.68 (DeepSeek-V3's "
                               "own 512 + 64) with it (benchmarks/results/mla_rope_isolation.md); transformers' "
                               "logits of this checkpoint follow the source's (results/mla.md). A first cause was "
                               "quantkit's and is fixed: a tied head, which vLLM's DeepSeek-V3 left at zero (NLL "
                               "ln(49152) = 10.80). GPU builds not checked",
}
EXPLAINED["MLA + fp8 latent KV cache"] = (
    "vLLM's CPU build loads it with kv_cache_dtype fp8; the gap is the bf16 MLA row's (+1.77 there, the same RoPE "
    "disagreement of its CPU MLA), so this row cannot yet say how vLLM scales the fp8 latent")
# Measured disagreements not yet explained (kept in the table until they are).
OPEN: dict[str, str] = {}


def build(kind: str, work: Path) -> Path:
    out = work / re.sub(r"[^A-Za-z0-9]+", "-", kind).strip("-") / "ckpt"
    src = out.parent / "src"
    if (out / "config.json").is_file():
        return out
    for step in KINDS[kind]:
        args = [str(src) if a == "SRC" else a for a in step]
        if "--output" not in args:
            args += ["--output", str(out)]
        args += ["--overwrite"]
        proc = subprocess.run(QK + args, capture_output=True, text=True,
                              env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args[:3])}: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


def _block_nll(logits_of, blocks) -> float:
    """Mean NLL per predicted token of `blocks` (lists of ids), one block at a time, in float64."""
    import torch

    total, n = 0.0, 0
    with torch.no_grad():
        for row in blocks:
            ids = torch.tensor([row])
            logp = torch.log_softmax(logits_of(ids)[0, :-1].double(), -1)
            total -= float(logp.gather(-1, ids[0, 1:, None]).sum())
            n += ids.shape[1] - 1
    return total / n


def transformers_nll(folder: Path, blocks) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    except RuntimeError:
        # transformers' default compressed-tensors path cannot load zero points (README, "transformers ... loads
        # asymmetric ones with dequantize=True"): the dequantised load is the same weights.
        from transformers import CompressedTensorsConfig

        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16,
                                                     quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    return _block_nll(lambda ids: model(ids).logits, blocks)


def runtime_nll(folder: Path, blocks) -> float:
    """quantkit's runtime in bf16: it quantises activations as the checkpoint says (transformers' compressed-tensors
    path decompresses the weights and leaves activations in bf16: a W8A16 reference for a W8A8 checkpoint)."""
    import torch

    from quantkit.runtime import load_model

    rt = load_model(folder, torch.bfloat16)
    return _block_nll(lambda ids: rt(input_ids=ids).logits, blocks)


def main() -> None:
    import torch

    from quantkit.data.calibration import build_token_blocks
    from quantkit.eval.vllm_engine import score, vllm_python
    from quantkit.models.source import resolve_model
    from quantkit.serving.check import ServingTarget, check_serving
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kind names (or their first words)")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--merge", action="store_true", help="keep the other kinds' rows of the last results file")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the last results file")
    ap.add_argument("--add-runtime", action="store_true",
                    help="only add quantkit runtime NLLs to the last results file's rows (no vLLM)")
    a = ap.parse_args()
    work = ROOT / "benchmarks" / ".work" / "vllm_agreement"
    work.mkdir(parents=True, exist_ok=True)
    base = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(str(base))
    blocks = build_token_blocks(tok, "kjv", a.num_samples, a.seq_len, 42, split="heldout").input_ids.tolist()
    if a.render:
        _write(json.loads((ROOT / "benchmarks" / "results" / "vllm_agreement.json").read_text()))
        return
    if a.add_runtime:
        payload = json.loads((ROOT / "benchmarks" / "results" / "vllm_agreement.json").read_text())
        for row in payload["rows"]:
            folder = work / re.sub(r"[^A-Za-z0-9]+", "-", row["kind"]).strip("-") / "ckpt"
            if (folder / "config.json").is_file():
                row["nll_quantkit"] = runtime_nll(folder, blocks)
                print(row["kind"], row["nll_quantkit"], flush=True)
        _write(payload)
        return
    python = vllm_python(None)
    opts = SimpleNamespace(top_logprobs=1, tensor_parallel_size=1, throughput=False)
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "tokens": len(blocks) * (a.seq_len - 1), "rows": []}
    kinds = [k for k in KINDS if k in a.kinds.split(",")] or [k for k in KINDS if k.split(" ")[0] in a.kinds.split(",")]
    previous = ROOT / "benchmarks" / "results" / "vllm_agreement.json"
    if a.merge and previous.is_file():
        old = json.loads(previous.read_text())
        payload["merged_from"] = {"load_average_before": old["load_average_before"], "kinds": [
            r["kind"] for r in old["rows"] if r["kind"] not in kinds]}
        payload["rows"] = [r for r in old["rows"] if r["kind"] not in kinds]
    for kind in kinds:
        row = {"kind": kind}
        began = time.perf_counter()
        try:
            ckpt = build(kind, work)
        except RuntimeError as exc:
            row.update(built=False, note=str(exc))
            payload["rows"].append(row)
            continue
        verdict = check_serving(ckpt, ServingTarget(gpu="cpu"))
        row["rules_say_loads"] = verdict["compatible"]
        row["rule_problems"] = [g["reason"] for g in verdict.get("problem_groups", [])]
        try:
            res = score(python, ckpt, blocks, opts, "bfloat16")
            row["vllm_loads"] = True
            row["nll_vllm"] = -sum(v for b in res["blocks"] for v in b["actual"]) / payload["tokens"]
        except Exception as exc:  # noqa: BLE001 - vLLM's refusal is the measurement
            row["vllm_loads"] = False
            row["vllm_error"] = str(exc)[:300]
        try:
            row["nll_transformers"] = transformers_nll(ckpt, blocks)
        except Exception as exc:  # noqa: BLE001
            row["transformers_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        if "nll_vllm" in row and "nll_transformers" in row:
            row["nll_diff"] = row["nll_vllm"] - row["nll_transformers"]
        row["nll_quantkit"] = runtime_nll(ckpt, blocks)
        row["agrees"] = row["rules_say_loads"] == row["vllm_loads"]
        row["seconds"] = round(time.perf_counter() - began, 1)
        payload["rows"].append(row)
        payload["rows"].sort(key=lambda r: list(KINDS).index(r["kind"]))
        print(json.dumps(row), flush=True)
        _write(payload)
    payload["load_average_after"] = os.getloadavg()
    _write(payload)


def _diff(a, b) -> str:
    if a is None or b is None:
        return "-"
    return f"{a - b:+.4f}" + (" (over 0.02)" if abs(a - b) > 0.02 else "")


def _write(payload: dict) -> None:
    lines = ["# check-serving against vLLM's CPU build", "",
             f"{payload['cpu']}; load average before {payload['load_average_before'][0]:.2f}"
             + (f", after {payload['load_average_after'][0]:.2f}" if "load_average_after" in payload else "")
             + f"; {payload['tokens']} held-out KJV tokens; vLLM CPU build, bf16"
             + (f" (rows {', '.join(payload['merged_from']['kinds'])} from the previous run, load average before "
                f"{payload['merged_from']['load_average_before'][0]:.2f})" if "merged_from" in payload else ""), "",
             "NLL in nats per token. transformers (compressed-tensors) decompresses the weights and fake-quantises "
             "activations as the checkpoint says, in bf16 (on the W8A8 rows its NLL equals quantkit's reference "
             "kernels', static_activation_sensitivity.md); quantkit's runtime multiplies the int8 codes exactly.", "",
             "| kind | check-serving (cpu) | vLLM CPU | agree | NLL vLLM | NLL transformers | vLLM - transformers | "
             "NLL quantkit runtime | vLLM - quantkit | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in payload["rows"]:
        if r.get("built") is False:
            lines.append(f"| {r['kind']} | - | - | - | - | - | - | - | - | not built: {r['note']} |")
            continue
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        diff = r.get("nll_diff")
        flag = "" if diff is None or abs(diff) <= 0.02 else " (over 0.02)"
        note = "; ".join(filter(None, [EXPLAINED.get(r["kind"], ""), OPEN.get(r["kind"], ""),
                                       ", ".join(r["rule_problems"]),
                                       r.get("vllm_error", ""),
                                       r.get("transformers_error", "")]))
        lines.append(f"| {r['kind']} | {'loads' if r['rules_say_loads'] else 'refused'} | "
                     f"{'loads' if r['vllm_loads'] else 'refused'} | {'yes' if r['agrees'] else 'NO'} | "
                     f"{fmt(r.get('nll_vllm'))} | {fmt(r.get('nll_transformers'))} | "
                     f"{'-' if diff is None else f'{diff:+.4f}'}{flag} | {fmt(r.get('nll_quantkit'))} | "
                     f"{_diff(r.get('nll_vllm'), r.get('nll_quantkit'))} | {note.replace('|', '/')} |")
    write_results("vllm_agreement", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
