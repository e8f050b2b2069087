"""Quality metrics of a candidate model against a baseline, as pure functions on logits.

Per token t (predicting token t+1): KL(P_base || P_cand) over the whole vocabulary, both models' NLL of
the real next token, whether both put their top-1 on the same token, and delta-p = P_cand(correct) -
P_base(correct) (as llama.cpp's perplexity tool reports it). Softmax and reductions run in float64.
"""

from __future__ import annotations

import math

import torch

TOKEN_FIELDS = ("kl", "nll", "nll_base", "top1", "p", "p_base")
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)


def token_stats(base_logits: torch.Tensor, cand_logits: torch.Tensor, targets: torch.Tensor,
                chunk: int = 128) -> dict[str, torch.Tensor]:
    """Per-token statistics for logits [T, V] (position t predicts targets[t]); float64 tensors of [T]."""
    if base_logits.shape != cand_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(base_logits.shape)} vs {tuple(cand_logits.shape)}")
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in TOKEN_FIELDS}
    for s in range(0, targets.shape[0], chunk):
        lb = torch.log_softmax(base_logits[s : s + chunk].double(), dim=-1)
        lc = torch.log_softmax(cand_logits[s : s + chunk].double(), dim=-1)
        tgt = targets[s : s + chunk, None].long()
        parts["kl"].append((lb.exp() * (lb - lc)).sum(dim=-1).clamp_min(0.0))
        parts["nll"].append(-lc.gather(-1, tgt)[:, 0])
        parts["nll_base"].append(-lb.gather(-1, tgt)[:, 0])
        parts["top1"].append((lb.argmax(-1) == lc.argmax(-1)).double())
        parts["p"].append(lc.gather(-1, tgt)[:, 0].exp())
        parts["p_base"].append(lb.gather(-1, tgt)[:, 0].exp())
    return {k: torch.cat(v) for k, v in parts.items()}


def nll_only(logits: torch.Tensor, targets: torch.Tensor, chunk: int = 128) -> torch.Tensor:
    """Per-token negative log-likelihood of `targets` under logits [T, V], float64."""
    out = []
    for s in range(0, targets.shape[0], chunk):
        lp = torch.log_softmax(logits[s : s + chunk].double(), dim=-1)
        out.append(-lp.gather(-1, targets[s : s + chunk, None].long())[:, 0])
    return torch.cat(out)


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def percentile(values: torch.Tensor, q: float) -> float:
    """Linear-interpolation percentile (numpy's default definition), q in [0, 100]."""
    v = values.double().flatten().sort().values
    pos = q / 100.0 * (v.numel() - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (v[hi] - v[lo]) * (pos - lo))


def summarize(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Aggregate per-token statistics into the figures `quantkit eval` reports."""
    kl, dp = stats["kl"], stats["p"] - stats["p_base"]
    out = {
        "ppl": perplexity(stats["nll"]),
        "ppl_base": perplexity(stats["nll_base"]),
        "kl_mean": float(kl.mean()),
        "kl_median": percentile(kl, 50),
        "kl_p90": percentile(kl, 90),
        "kl_p99": percentile(kl, 99),
        "kl_max": float(kl.max()),
        "top1_agree": float(stats["top1"].mean()),
        "delta_p_mean": float(dp.mean()),
        "delta_p_rms": float(dp.square().mean().sqrt()),
        "delta_p_min": float(dp.min()),
        "delta_p_max": float(dp.max()),
        "n_tokens": int(kl.numel()),
    }
    out["ppl_increase_pct"] = 100.0 * (out["ppl"] / out["ppl_base"] - 1.0)
    for q in PERCENTILES:
        out[f"delta_p_p{q}"] = percentile(dp, q)
    return out
