"""Independent, deliberately plain held-out quality check: KL(base || candidate).

Needs only torch + transformers (+ compressed-tensors to read quantised checkpoints),
so it runs in either venv and shares no code with quantkit's own evaluation.

    python benchmarks/kl_plain.py --base BASE --candidate CKPT --tokens HELDOUT.safetensors
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


class _Runtime(torch.nn.Module):
    """quantkit's runtime on its torch reference kernels, fp32, called as a transformers model is."""

    def __init__(self, folder: Path):
        super().__init__()
        from quantkit.runtime import load_model

        self.rt = load_model(folder, dtype=torch.float32, kernels="reference")

    def forward(self, input_ids, use_cache=False):
        return self.rt(input_ids=input_ids)


SCORER = {}  # folder -> which engine scored it


def load(folder: Path) -> torch.nn.Module:
    # float32 for both sides so the only difference between them is the quantisation. compressed-tensors'
    # compressed fp4 modules decompress into bf16 whatever the model's dtype (a dtype clash in an fp32 model), so an
    # fp4 checkpoint is decompressed once at load (dequantize=True: the same weights, held dense in float32).
    config = json.loads((folder / "config.json").read_text())
    fmt = str((config.get("quantization_config") or {}).get("format", ""))
    from transformers import CompressedTensorsConfig

    dense = dict(dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True))
    if "fp4" in fmt:
        return AutoModelForCausalLM.from_pretrained(folder, **dense).eval()
    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except RuntimeError:
        pass
    try:
        # transformers' compressed path cannot hold zero points (asymmetric weights): decompressed, the same weights
        return AutoModelForCausalLM.from_pretrained(folder, **dense).eval()
    except RuntimeError:
        # transformers 5.25 decompresses every dense module with one config group's scheme, so a checkpoint mixing
        # asymmetric and symmetric groups loads nowhere in it: quantkit's runtime (held to transformers bit for bit
        # on every scheme it can load, tests/runtime/test_model.py) scores it, and the result says so
        SCORER[str(folder)] = "quantkit runtime (reference kernels, fp32)"
        return _Runtime(folder)


@torch.inference_mode()
def log_probs(model: torch.nn.Module, block: torch.Tensor) -> torch.Tensor:
    """[L-1, V] float64 log-probabilities for positions 0..L-2 of one block."""
    logits = model(input_ids=block[None, :], use_cache=False).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--candidate", type=Path, required=True)
    parser.add_argument("--tokens", type=Path, required=True, help="safetensors with int64 input_ids [N, L]")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    ids = load_file(str(args.tokens))["input_ids"]
    base, candidate = load(args.base), load(args.candidate)

    kl_sum = nll_base_sum = nll_cand_sum = 0.0
    agree = n_tokens = 0
    # One block at a time, batch of one: no padding or masking questions to get wrong.
    for block in ids:
        lp_base = log_probs(base, block)
        lp_cand = log_probs(candidate, block)
        targets = block[1:]

        # KL(P||Q) = sum_v P(v) (log P(v) - log Q(v)), per position.
        kl_sum += (lp_base.exp() * (lp_base - lp_cand)).sum(dim=-1).sum().item()
        nll_base_sum -= lp_base.gather(-1, targets[:, None]).sum().item()
        nll_cand_sum -= lp_cand.gather(-1, targets[:, None]).sum().item()
        agree += (lp_base.argmax(dim=-1) == lp_cand.argmax(dim=-1)).sum().item()
        n_tokens += targets.numel()

    result = {
        "kl_mean": kl_sum / n_tokens,
        "ppl_base": math.exp(nll_base_sum / n_tokens),
        "ppl": math.exp(nll_cand_sum / n_tokens),
        "top1_agree": agree / n_tokens,
        "n_tokens": n_tokens,
        "scorer": SCORER.get(str(args.candidate), "transformers + compressed-tensors"),
    }
    line = json.dumps(result)
    print(line)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")


if __name__ == "__main__":
    main()
