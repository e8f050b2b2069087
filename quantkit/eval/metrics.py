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


TOPK_KL = ("KL between the baseline's and the candidate's next-token distributions coarse-grained to {the "
           "baseline's top-k tokens, every other token}: a lower bound of the full KL (coarse-graining never raises "
           "a divergence), equal to it when both put all their mass on those k tokens; a baseline top-k token outside "
           "the candidate's top-k gets an equal share of the candidate's remaining mass, at most its k-th probability")


def topk_token_stats(base: dict[str, torch.Tensor], cand: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-token statistics from top-k log-probabilities, as a serving engine reports them (vLLM's
    prompt_logprobs): `actual` [T] (log-probability of the real next token), `top_ids` [T, k] and `top_logprobs`
    [T, k] (sorted, most likely first). Same fields as `token_stats`; the KL is `TOPK_KL`."""
    lb, lc = base["top_logprobs"].double(), cand["top_logprobs"].double()
    pb = lb.exp()
    match = base["top_ids"][:, :, None] == cand["top_ids"][:, None, :]  # [T, kb, kc]
    found = match.any(-1)
    q = (match.double() * lc.exp()[:, None, :]).sum(-1)  # the candidate's probability of each baseline top-k token
    left = (1.0 - lc.exp().sum(-1)).clamp_min(0.0)  # the candidate's mass outside its own top-k
    missing = (~found).sum(-1, keepdim=True)
    share = torch.minimum(left[:, None] / (missing + 1), lc[:, -1:].exp())
    q = torch.where(found, q, share).clamp_min(1e-30)
    p_rest = (1.0 - pb.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - q.sum(-1)).clamp_min(1e-30)
    kl = (pb * (lb - q.log())).sum(-1) + torch.where(p_rest > 0, p_rest * (p_rest.clamp_min(1e-30).log() - q_rest.log()),
                                                     torch.zeros_like(p_rest))
    return {"kl": kl.clamp_min(0.0), "nll": -cand["actual"].double(), "nll_base": -base["actual"].double(),
            "top1": (base["top_ids"][:, 0] == cand["top_ids"][:, 0]).double(),
            "p": cand["actual"].double().exp(), "p_base": base["actual"].double().exp()}
