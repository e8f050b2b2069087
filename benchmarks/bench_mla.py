"""MLA conversion on SmolLM2: quantkit's conversion vs a plain TransMLA-style baseline at matched KV size.

The baseline is written here, independently of quantkit's method: RoPE decoupled by a real PCA across KV
heads within each frequency (TransMLA's RoRoPE), the first component of the highest rope_dim/2 frequencies
kept with RoPE, then a plain PCA of the concatenated [K_nope; V] activations to kv_lora_rank, without K/V
balancing, output-aware weighting or complex (phase) rotation. Both go through the same writer and the
same linear-regime kv_a_layernorm, so the comparison is about the decomposition only.

    python benchmarks/bench_mla.py [--ranks 64,96,160] [--rope-dim 32] [--num-samples 32] [--seq-len 256]
                                   [--eval-samples 8] [--refine-steps 100] [--out /tmp/bench_mla]

quantkit runs twice per rank: as shipped (closed form + refinement) and closed form only, so the table shows
what each step contributes. Results go to benchmarks/results/mla.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("QUANTKIT_NO_PROGRESS", "1")

from common import HELDOUT_KJV, HELDOUT_PYDOC, pydoc_text, write_results  # noqa: E402
from quantkit.convert.mla import (MLA_NORM_EPS, AttentionWeights, MLADims, MLAOptions, convert_model,  # noqa: E402
                                  evaluate_pair)


def _rows(w: torch.Tensor, heads: int, hd: int) -> torch.Tensor:
    """[heads*hd, in] (half-split RoPE layout) -> [hd/2, heads, 2, in]: per frequency and head the (x, y) rows."""
    w = w.reshape(heads, 2, hd // 2, -1)
    return w.permute(2, 0, 1, 3)


def baseline_attention(w: AttentionWeights, cov_x: torch.Tensor, mean_x: torch.Tensor, dims: MLADims,
                       opts: MLAOptions, residual_scale: float = 1.0) -> dict[str, torch.Tensor]:
    f64 = torch.float64
    cov = cov_x.to(f64)
    hd, n_kv, nh, dr, r = dims.head_dim, dims.n_kv, dims.n_heads, dims.rope_dim, dims.kv_lora_rank
    group, pairs = nh // n_kv, dims.rope_dim // 2
    wq, wk, wv, wo = (t.to(f64) for t in (w.q, w.k, w.v, w.o))
    k4, q4 = _rows(wk, n_kv, hd).clone(), _rows(wq, nh, hd).clone()
    rope_rows = torch.zeros(dr, wk.shape[1], dtype=f64)
    q_rope = torch.zeros(nh, dr, wk.shape[1], dtype=f64)
    for j in range(pairs):
        # real PCA over the n_kv heads, pooling the x and y coordinates of the pair
        c = sum(k4[j, :, a] @ cov @ k4[j, :, a].T for a in range(2))
        vals, vecs = torch.linalg.eigh(c)
        u = vecs[:, -1]
        for a in range(2):
            key = u @ k4[j, :, a]
            rope_rows[2 * j + a] = key
            k4[j, :, a] -= u[:, None] * key[None]
            for h in range(nh):
                q_rope[h, 2 * j + a] = u[h // group] * q4[j, h, a]
    k_nope = k4.permute(1, 2, 0, 3).reshape(n_kv * hd, -1)
    m = torch.cat([k_nope, wv])
    s = m @ cov @ m.T
    vals, vecs = torch.linalg.eigh(0.5 * (s + s.T))
    top = vecs[:, torch.argsort(vals, descending=True)[:r]]
    latent = top.T @ m
    ms = float(torch.trace(latent @ cov @ latent.T) / r)
    small = math.sqrt(1e-5 * MLA_NORM_EPS / ms)
    scale = math.sqrt((hd + dr) / hd)
    q_blocks = []
    for h in range(nh):
        q_blocks += [wq[h * hd:(h + 1) * hd], q_rope[h]]
    kv_b = torch.cat([torch.cat([top[g * hd:(g + 1) * hd], top[(n_kv + g) * hd:(n_kv + g + 1) * hd]])
                      for g in [h // group for h in range(nh)]])
    return {
        "q_proj.weight": torch.cat(q_blocks) * scale,
        "kv_a_proj_with_mqa.weight": torch.cat([latent * small, rope_rows]),
        "kv_a_layernorm.weight": torch.full((r,), math.sqrt(MLA_NORM_EPS) / small, dtype=f64),
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": wo * residual_scale,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--ranks", default="64,96,160")
    ap.add_argument("--rope-dim", type=int, default=32)
    ap.add_argument("--num-samples", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--refine-steps", type=int, default=MLAOptions().refine_steps)
    ap.add_argument("--out", default="/tmp/bench_mla")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    domains = {HELDOUT_KJV: "kjv", HELDOUT_PYDOC: str(pydoc_text(out / "pydoc.txt"))}
    variants = (("quantkit", None, args.refine_steps), ("quantkit closed form", None, 0),
                ("baseline", baseline_attention, 0))
    rows = []
    for rank in [int(r) for r in args.ranks.split(",")]:
        for name, fn, steps in variants:
            t0 = time.time()
            folder = out / f"{name.replace(' ', '-')}-{rank}"
            summary = convert_model(args.model, folder, MLAOptions(rank, args.rope_dim, refine_steps=steps),
                                    num_samples=args.num_samples, seq_len=args.seq_len, overwrite=True,
                                    attention_fn=fn)
            seconds = time.time() - t0
            row = {"method": name, "kv_lora_rank": rank, "rope_dim": args.rope_dim, "refine_steps": steps,
                   "kv_ratio": summary["kv_cache"]["ratio"], "convert_s": round(seconds, 1)}
            for domain, source in domains.items():
                ev = evaluate_pair(args.model, folder, args.eval_samples, args.seq_len, dataset=source)
                row[domain] = {k: ev[k] for k in ("kl", "ppl", "ppl_base", "top1_agreement")}
            rows.append(row)
            print(json.dumps(row), flush=True)

    def pick(rank: int, name: str) -> dict:
        return next(r for r in rows if r["kv_lora_rank"] == rank and r["method"] == name)

    md = ["# MLA conversion: quantkit vs a TransMLA-style baseline at matched KV size", "",
          f"model `{summary['model']}`, calibration KJV {args.num_samples} x {args.seq_len} tokens, rope dim "
          f"{args.rope_dim}; KL / perplexity on {args.eval_samples} x {args.seq_len} held-out tokens of KJV and of "
          f"pydoc (another domain), quantkit's layer-wise float32 reference forward. quantkit = closed form + "
          f"{args.refine_steps} refinement steps per layer.", ""]
    for domain in domains:
        md += [f"## {domain}", "", "| kv_lora_rank | KV size | quantkit KL | closed form KL | baseline KL | "
               "quantkit / baseline | quantkit ppl | baseline ppl | base ppl |", "|---|---|---|---|---|---|---|---|---|"]
        for rank in sorted({r["kv_lora_rank"] for r in rows}):
            a, c, b = pick(rank, "quantkit"), pick(rank, "quantkit closed form"), pick(rank, "baseline")
            md.append(f"| {rank} | {a['kv_ratio']:.3f} | {a[domain]['kl']:.4f} | {c[domain]['kl']:.4f} | "
                      f"{b[domain]['kl']:.4f} | {a[domain]['kl'] / b[domain]['kl']:.2f}x | {a[domain]['ppl']:.2f} | "
                      f"{b[domain]['ppl']:.2f} | {a[domain]['ppl_base']:.2f} |")
        md.append("")
    md += ["| kv_lora_rank | quantkit convert s | closed form s | baseline s |", "|---|---|---|---|"]
    for rank in sorted({r["kv_lora_rank"] for r in rows}):
        md.append(f"| {rank} | {pick(rank, 'quantkit')['convert_s']} | {pick(rank, 'quantkit closed form')['convert_s']}"
                  f" | {pick(rank, 'baseline')['convert_s']} |")
    write_results("mla", rows, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
