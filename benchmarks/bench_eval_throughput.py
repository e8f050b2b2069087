"""quantkit's runtime against transformers' own compressed-tensors path, on one checkpoint, side by side.

Both models run the same KV-cache loop (quantkit.runtime.generate) on the same random prompts, alternating
run by run so machine load hits both alike; each figure is the best of --repeats. Prints a table and one
JSON line; exits 1 if quantkit is slower than transformers by more than --tolerance on any figure.

    python benchmarks/bench_eval_throughput.py CKPT [--prefill-len 256] [--decode-tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch

os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")


def _prefill(model, ids) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0


def main() -> None:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    from transformers.utils import logging as hf_logging

    from quantkit.runtime import generate, load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.05, help="allowed relative slowdown (noise)")
    args = parser.parse_args()

    hf_logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    cfg = json.load(open(os.path.join(args.checkpoint, "config.json")))
    asym = any(g.get("weights", {}).get("symmetric") is False
               for g in cfg.get("quantization_config", {}).get("config_groups", {}).values())
    kwargs = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if asym else {}
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(args.checkpoint, **kwargs).eval()
    load_hf = time.perf_counter() - t0
    t0 = time.perf_counter()
    qk = load_model(args.checkpoint)
    load_qk = time.perf_counter() - t0
    vocab = qk.vocab_size
    g = torch.Generator().manual_seed(0)
    long_ids = torch.randint(0, vocab, (1, args.prefill_len), generator=g)
    prompts = {b: torch.randint(0, vocab, (b, args.prompt_len), generator=g) for b in (1, 8)}
    models = {"transformers": hf, "quantkit": qk}
    for m in models.values():  # warm-up: first-forward decompression / dense weight caches
        generate(m, prompts[1], 2)
    best: dict[str, dict[str, float]] = {name: {} for name in models}

    def keep(name, key, value):
        best[name][key] = max(best[name].get(key, 0.0), value)

    for _ in range(args.repeats):
        for name, m in models.items():
            keep(name, "prefill_tok_s", args.prefill_len / _prefill(m, long_ids))
            for b in (1, 8):
                r = generate(m, prompts[b], args.decode_tokens)
                keep(name, f"decode_tok_s_b{b}", b * r.decode_steps / r.decode_seconds)
                if b == 1:
                    keep(name, "ttft_inv", 1.0 / r.prefill_seconds)
    same = torch.equal(generate(hf, prompts[1], 8).tokens, generate(qk, prompts[1], 8).tokens)

    keys = ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8")
    ratios = {k: best["quantkit"][k] / best["transformers"][k] for k in keys}
    print(f"checkpoint {args.checkpoint}; threads {torch.get_num_threads()}; load s: transformers {load_hf:.2f}, "
          f"quantkit {load_qk:.2f}; greedy tokens identical: {same}")
    print(f"{'figure':18s} {'transformers':>14s} {'quantkit':>14s} {'ratio':>7s}")
    for k in keys:
        print(f"{k:18s} {best['transformers'][k]:14.1f} {best['quantkit'][k]:14.1f} {ratios[k]:7.3f}")
    for name in models:
        print(f"ttft_ms {name}: {1000 / best[name]['ttft_inv']:.1f}")
    print(json.dumps({"checkpoint": args.checkpoint, "transformers": best["transformers"], "quantkit": best["quantkit"],
                      "ratio": ratios, "greedy_identical": same, "load_seconds": {"transformers": load_hf, "quantkit": load_qk}}))
    if any(r < 1 - args.tolerance for r in ratios.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
