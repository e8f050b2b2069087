"""Metrics against a deliberately plain implementation (python floats, one token and one vocab entry at a time)."""

import math

import numpy as np
import torch

from quantkit.eval.metrics import percentile, summarize, token_stats


def _plain(base, cand, targets):
    kls, nll, nll_b, top1, dps = [], [], [], [], []
    for t in range(len(targets)):
        b, c = [float(v) for v in base[t]], [float(v) for v in cand[t]]
        zb, zc = math.log(sum(math.exp(v) for v in b)), math.log(sum(math.exp(v) for v in c))
        lb, lc = [v - zb for v in b], [v - zc for v in c]
        kls.append(sum(math.exp(p) * (p - q) for p, q in zip(lb, lc)))
        y = int(targets[t])
        nll.append(-lc[y])
        nll_b.append(-lb[y])
        top1.append(lb.index(max(lb)) == lc.index(max(lc)))
        dps.append(math.exp(lc[y]) - math.exp(lb[y]))
    return kls, nll, nll_b, top1, dps


def test_token_stats_and_summary_match_a_plain_implementation():
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(200, 37, generator=gen) * 3
    cand = base + torch.randn(200, 37, generator=gen) * 0.5
    targets = torch.randint(0, 37, (200,), generator=gen)
    kls, nll, nll_b, top1, dps = _plain(base, cand, targets)
    stats = token_stats(base, cand, targets, chunk=64)
    assert np.allclose(stats["kl"].numpy(), kls, rtol=1e-9, atol=1e-12)
    s = summarize(stats)
    assert math.isclose(s["ppl"], math.exp(sum(nll) / len(nll)), rel_tol=1e-9)
    assert math.isclose(s["ppl_base"], math.exp(sum(nll_b) / len(nll_b)), rel_tol=1e-9)
    assert math.isclose(s["kl_mean"], sum(kls) / len(kls), rel_tol=1e-9)
    assert math.isclose(s["kl_median"], float(np.median(kls)), rel_tol=1e-9)
    assert math.isclose(s["kl_p99"], float(np.percentile(kls, 99)), rel_tol=1e-9)
    assert math.isclose(s["kl_max"], max(kls), rel_tol=1e-9)
    assert math.isclose(s["top1_agree"], sum(top1) / len(top1))
    assert math.isclose(s["delta_p_mean"], sum(dps) / len(dps), rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(s["delta_p_p10"], float(np.percentile(dps, 10)), rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(s["delta_p_rms"], math.sqrt(sum(d * d for d in dps) / len(dps)), rel_tol=1e-9)
    assert math.isclose(s["ppl_increase_pct"], 100 * (s["ppl"] / s["ppl_base"] - 1), rel_tol=1e-9)


def test_identical_models_have_zero_kl_and_full_agreement():
    logits = torch.randn(50, 11, generator=torch.Generator().manual_seed(1))
    s = summarize(token_stats(logits, logits.clone(), torch.zeros(50, dtype=torch.long)))
    assert s["kl_mean"] == 0 and s["kl_max"] == 0 and s["top1_agree"] == 1 and s["delta_p_mean"] == 0
    assert s["ppl"] == s["ppl_base"]


def test_percentile_matches_numpy():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    for q in (0, 1, 37.5, 50, 90, 99, 100):
        assert math.isclose(percentile(x, q), float(np.percentile(x.numpy().astype("float64"), q)), rel_tol=1e-12)


def _topk(logits: torch.Tensor, targets: torch.Tensor, k: int) -> dict:
    """What vLLM's prompt_logprobs gives: the real token's log-probability and the top-k, most likely first."""
    lp = torch.log_softmax(logits.double(), -1)
    top = lp.topk(k, dim=-1)
    return {"actual": lp.gather(-1, targets[:, None])[:, 0], "top_ids": top.indices, "top_logprobs": top.values}


def test_topk_stats_with_the_whole_vocabulary_equal_the_full_stats():
    from quantkit.eval.metrics import topk_token_stats

    torch.manual_seed(0)
    base, cand = torch.randn(50, 32) * 3, torch.randn(50, 32) * 3
    targets = torch.randint(0, 32, (50,))
    full = token_stats(base, cand, targets)
    top = topk_token_stats(_topk(base, targets, 32), _topk(cand, targets, 32))
    for k in ("kl", "nll", "nll_base", "top1", "p", "p_base"):
        assert torch.allclose(top[k], full[k], atol=1e-9), k


def test_topk_kl_is_a_lower_bound_that_tightens_with_k_and_is_zero_for_equal_models():
    from quantkit.eval.metrics import topk_token_stats

    torch.manual_seed(1)
    base = torch.randn(200, 64) * 4
    cand = base + torch.randn(200, 64) * 0.3
    targets = torch.randint(0, 64, (200,))
    full = token_stats(base, cand, targets)["kl"]
    means = []
    for k in (4, 16, 64):
        b, c = _topk(base, targets, k), _topk(cand, targets, 64)  # candidate's top-k covers the baseline's
        kl = topk_token_stats(b, c)["kl"]
        assert bool((kl <= full + 1e-12).all())  # coarse-graining never raises a divergence
        means.append(float(kl.mean()))
    assert means[0] <= means[1] <= means[2] and abs(means[2] - float(full.mean())) < 1e-9
    same = topk_token_stats(_topk(base, targets, 8), _topk(base, targets, 8))["kl"]
    assert float(same.abs().max()) < 1e-12
