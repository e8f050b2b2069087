"""The wall-time floor of any calibrated method here: one forward pass of the model's decoder over the calibration
tokens, with transformers' own modelling code (inference mode, batches of 8), in fp32 and bf16.

    .venv/bin/python benchmarks/bench_forward_floor.py [--model DIR] [--num-samples 64] [--seq-len 512]

GPTQ needs at least the layer inputs (one pass) and, to calibrate each layer on what the quantised model feeds
it, the quantised layer outputs (a second pass), so twice this number bounds its wall time from below on the
machine that runs it; compare with llm-compressor's GPTQ wall time from bench_gptq.py on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from common import ROOT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from quantkit.models.source import resolve_model

    path = resolve_model(args.model).path
    ids = torch.randint(100, 30000, (args.num_samples, args.seq_len), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        decoder = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model
        with torch.inference_mode():
            decoder(ids[:2])  # warm-up
            start = time.perf_counter()
            for i in range(0, args.num_samples, 8):
                decoder(ids[i:i + 8])
            seconds = time.perf_counter() - start
        print(f"{str(dtype).replace('torch.', '')}: one decoder forward pass over {args.num_samples} x {args.seq_len} "
              f"tokens: {seconds:.2f} s", flush=True)


if __name__ == "__main__":
    main()
