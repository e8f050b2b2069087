"""Why W8A8_STATIC's NLL differs between vLLM, transformers and quantkit's runtime (benchmarks/results/vllm_agreement.md).

    .venv/bin/python benchmarks/static_activation_sensitivity.py [--vllm]   # --vllm: QUANTKIT_VLLM_PYTHON set

The three engines implement one rule, q = round(clamp(x / input_scale)), but not in one precision: compressed-tensors
(transformers) and quantkit divide in the activation dtype (bf16), vLLM's int8 kernels convert x to fp32 first. For
the W8A8_STATIC and W8A8 (dynamic) checkpoints of vllm_agreement.py, on the same held-out blocks, this measures
quantkit's runtime NLL under changes that no implementation would call a bug:
- the division in fp32 instead of bf16 (what vLLM does),
- every stored input_scale one bf16 step up, or one step down (a rounding of the calibrated absmax),
- the reference kernels (dequantised weights, bf16 matmul: how transformers computes) instead of the int8 GEMM.
With --vllm, vLLM scores the one-step-up and one-step-down copies too. If a checkpoint's NLL moves by more than the
0.02 agreement tolerance under these, the tolerance cannot be met by any two correct engines for that checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import write_results  # noqa: E402
from vllm_agreement import _block_nll, build  # noqa: E402

KINDS = ("W8A8_STATIC", "W8A8 dynamic")


def shifted_copy(ckpt: Path, out: Path, factor: float) -> Path:
    """A copy of `ckpt` whose every input_scale is multiplied by `factor` and rounded back to its dtype."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(ckpt, out)
    for f in out.glob("*.safetensors"):
        tensors = load_file(str(f))
        for name, t in tensors.items():
            if name.endswith("input_scale"):
                tensors[name] = (t.float() * factor).to(t.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    (out / "quantkit_manifest.json").unlink(missing_ok=True)  # the hashes no longer hold
    return out


def fp32_division():
    """A context in which activation quantisation divides in fp32 and rounds there (vLLM's kernels)."""
    import contextlib

    import torch

    import quantkit.quant.activations as acts

    original = acts.activation_codes

    def codes(x, args, input_scale=None, input_zero_point=None):
        q, scale, zp = original(x.float(), args, None if input_scale is None else input_scale.float(), input_zero_point)
        return q.to(x.dtype), scale.to(torch.float32), zp

    @contextlib.contextmanager
    def patched():
        holders = [m for name, m in sys.modules.items()
                   if name.startswith("quantkit") and getattr(m, "activation_codes", None) is original]
        for m in holders:
            m.activation_codes = codes
        try:
            yield
        finally:
            for m in holders:
                m.activation_codes = original

    return patched()


def runtime_nll(folder: Path, blocks, kernels: str = "auto") -> float:
    import torch

    from quantkit.runtime import load_model

    rt = load_model(folder, torch.bfloat16, kernels=kernels)
    return _block_nll(lambda ids: rt(input_ids=ids).logits, blocks)


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vllm", action="store_true", help="also score the shifted copies in vLLM")
    a = ap.parse_args()
    work = ROOT / "benchmarks" / ".work" / "vllm_agreement"
    base = resolve_model(None).path
    tok = AutoTokenizer.from_pretrained(str(base))
    blocks = build_token_blocks(tok, "kjv", a.num_samples, a.seq_len, 42, split="heldout").input_ids.tolist()
    payload = {"cpu": f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs",
               "load_average_before": os.getloadavg(), "tokens": len(blocks) * (a.seq_len - 1), "rows": []}
    up, down = 1 + 2 ** -7, 1 - 2 ** -8  # one bf16 step either way for scales whose mantissa is not at an edge
    for kind in KINDS:
        folder = build(kind, work)
        row = {"kind": kind, "runtime": runtime_nll(folder, blocks), "reference_kernels": runtime_nll(
            folder, blocks, "reference")}
        with fp32_division():
            row["fp32_division"] = runtime_nll(folder, blocks)
        if kind == "W8A8_STATIC":
            shifted = {"scale_up": shifted_copy(folder, work / "W8A8_STATIC-up" / "ckpt", up),
                       "scale_down": shifted_copy(folder, work / "W8A8_STATIC-down" / "ckpt", down)}
            for name, path in shifted.items():
                row[name] = runtime_nll(path, blocks)
            if a.vllm:
                from types import SimpleNamespace

                from quantkit.eval.vllm_engine import score, vllm_python

                python = vllm_python(None)
                opts = SimpleNamespace(top_logprobs=1, tensor_parallel_size=1, throughput=False)
                for name, path in {"original": folder, **shifted}.items():
                    res = score(python, path, blocks, opts, "bfloat16")
                    row[f"vllm_{name}"] = -sum(v for b in res["blocks"] for v in b["actual"]) / payload["tokens"]
        payload["rows"].append(row)
        print(row, flush=True)
    payload["load_average_after"] = os.getloadavg()
    _write(payload)


def _write(payload: dict) -> None:
    cols = [("runtime", "quantkit runtime (int8 GEMM, x/scale in bf16)"),
            ("fp32_division", "same, x/scale in fp32 (vLLM's way)"),
            ("reference_kernels", "reference kernels (dequantised bf16 matmul)"),
            ("scale_up", "input_scale one bf16 step up"), ("scale_down", "input_scale one bf16 step down"),
            ("vllm_original", "vLLM"), ("vllm_scale_up", "vLLM, scale one step up"),
            ("vllm_scale_down", "vLLM, scale one step down")]
    lines = ["# How far a W8A8 checkpoint's NLL moves under numerics no engine would call wrong", "",
             f"{payload['cpu']}; load average before {payload['load_average_before'][0]:.2f}, after "
             f"{payload['load_average_after'][0]:.2f}; {payload['tokens']} held-out KJV tokens (the blocks of "
             "vllm_agreement.md); NLL in nats per token, bf16.", "",
             "| variant | " + " | ".join(r["kind"] for r in payload["rows"]) + " |",
             "|---|" + "---|" * len(payload["rows"])]
    for key, label in cols:
        if not any(key in r for r in payload["rows"]):
            continue
        cells = [f"{r[key]:.4f} ({r[key] - r['runtime']:+.4f})" if key in r else "-" for r in payload["rows"]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for r in payload["rows"]:
        vals = [r[k] for k, _ in cols if k in r]
        r["spread"] = max(vals) - min(vals)
    lines += ["", "In brackets: the change from the first row. Spread (max - min over the rows): "
              + ", ".join(f"{r['kind']} {r['spread']:.4f}" for r in payload["rows"]) + "."]
    write_results("static_activation_sensitivity", payload, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
