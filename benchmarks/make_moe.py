"""Make a real-weight MoE from a dense model by MoEfication (quantkit/convert/moefy.py) and report its KL.

    python benchmarks/make_moe.py --model SRC --experts 16 --top-k 4 [--shared-experts S]
        [--layout qwen2_moe|qwen3_moe|deepseek_v3] --output DIR

Prints one JSON object: the conversion summary (per-layer router fit scores of both fits, padding,
temperature) and, unless --eval-samples 0, held-out KL(dense || MoE) at several k and with random routing.
Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quantkit.convert.moefy import LAYOUTS, ROUTER_FITS, MoEfyOptions, evaluate_moe, moefy_model  # noqa: E402
from quantkit.errors import QuantkitError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="dense HF folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--shared-experts", type=int, default=0)
    ap.add_argument("--layout", default=None, choices=LAYOUTS,
                    help="default: qwen3_moe without shared experts, qwen2_moe with")
    ap.add_argument("--router-fit", default="lstsq", choices=ROUTER_FITS)
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=8, help="held-out KJV blocks for the KL report (0: skip)")
    ap.add_argument("--ks", default=None, help="comma-separated k to report KL at (default: 1, k/2, k, 2k, E)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args(argv)
    layout = args.layout or ("qwen2_moe" if args.shared_experts else "qwen3_moe")
    try:
        opts = MoEfyOptions(experts=args.experts, top_k=args.top_k, shared_experts=args.shared_experts,
                            layout=layout, router_fit=args.router_fit)
        ks = ([int(k) for k in args.ks.split(",")] if args.ks else
              sorted({1, max(1, args.top_k // 2), args.top_k, min(args.experts, 2 * args.top_k), args.experts}))
        summary = moefy_model(args.model, args.output, opts, num_samples=args.num_samples, seq_len=args.seq_len,
                              overwrite=args.overwrite)
        if args.eval_samples > 0:
            summary["eval"] = evaluate_moe(args.model, args.output, ks, num_samples=args.eval_samples)
    except QuantkitError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return exc.exit_code
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    summary.pop("layers")
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
