"""Causal self-attention of a calibration batch: transformers' SDPA against quantkit's blocked SDPA.

    .venv/bin/python benchmarks/bench_attention.py [--heads 9 --kv-heads 3 --head-dim 64 --batch 4]

Times one attention call per sequence length (best of five rounds of 10 calls, bf16, the pipeline's allocator
settings), checks both against a float64 softmax(QK^T)V, and writes benchmarks/results/attention.md. The defaults
are SmolLM2-135M's heads at the pipeline's default batch (2048 tokens of 512).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from common import ROOT, ratio, write_results

sys.path.insert(0, str(ROOT))


def best_ms(fn, calls: int = 10, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - began) / calls * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lengths", default="256,384,512,640,768,1024")
    args = ap.parse_args()

    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from quantkit.pipeline import attention
    from quantkit.pipeline.attention import QUERY_BLOCK, blocked_sdpa_forward
    from quantkit.pipeline.memory import return_large_frees_to_os

    longest, attention.LONGEST = attention.LONGEST, 1 << 30  # blocked at every length, to show where it stops paying

    return_large_frees_to_os()
    load_before = os.getloadavg()[0]
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, args.heads // args.kv_heads
    b, h, kv, d = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    for n in (int(x) for x in args.lengths.split(",")):
        torch.manual_seed(n)
        # The attention modules' layout: projections [b, n, heads * d] viewed and transposed, not contiguous.
        q = torch.randn(b, n, h * d, dtype=torch.bfloat16).view(b, n, h, d).transpose(1, 2)
        k, v = (torch.randn(b, n, kv * d, dtype=torch.bfloat16).view(b, n, kv, d).transpose(1, 2) for _ in range(2))
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double().repeat_interleave(h // kv, 1), v.double().repeat_interleave(h // kv, 1),
            is_causal=True).transpose(1, 2)
        sdpa_out, _ = sdpa_attention_forward(module, q, k, v, None)
        ours, _ = blocked_sdpa_forward(module, q, k, v, None)
        t_sdpa = best_ms(lambda: sdpa_attention_forward(module, q, k, v, None))
        t_ours = best_ms(lambda: blocked_sdpa_forward(module, q, k, v, None))
        rows.append((n, t_sdpa, t_ours, (sdpa_out.double() - ref).abs().max().item(),
                     (ours.double() - ref).abs().max().item()))
        print(rows[-1], flush=True)
    machine = (f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, "
               f"{torch.get_num_threads()} threads, load average before {load_before:.2f}, "
               f"after {os.getloadavg()[0]:.2f}")
    md = ["# Causal attention of one calibration batch: SDPA against blocked SDPA", "",
          f"bf16, batch {b}, {h} query heads over {kv} key/value heads of {d}; query blocks of {QUERY_BLOCK} "
          f"(`quantkit/pipeline/attention.py`); best of 5 x 10 calls; {machine}. The pipeline hands sequences past "
          f"{longest} tokens to SDPA unchanged; they are timed blocked here to show why.", "",
          "| tokens | SDPA ms | blocked ms | blocked / SDPA | max abs err SDPA | max abs err blocked |",
          "|---|---|---|---|---|---|"]
    md += [f"| {n} | {a:.2f} | {o:.2f} | {ratio(o, a)} | {ea:.2e} | {eo:.2e} |" for n, a, o, ea, eo in rows]
    md += ["", "Errors against a float64 softmax(QK^T)V of the same bf16 inputs."]
    write_results("attention", {"rows": rows, "machine": machine}, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
