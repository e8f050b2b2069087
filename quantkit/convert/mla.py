"""GQA/MHA -> Multi-head Latent Attention in the DeepSeek-V3 layout (stock transformers / vLLM, no custom code).

Per decoder layer, from the second moments E[x x^T] of the attention input on calibration text:

1. RoPE decoupling. MLA caches one RoPE key shared by all heads. Within each RoPE frequency the KV
   heads' keys form a complex vector (one entry per KV head); a unitary map across heads commutes with
   RoPE, so a PCA of that vector (complex, so it may also shift phases) puts the positional signal of the
   frequency in its first component. The first component of the `rope_dim/2` highest frequencies becomes
   the shared RoPE key; every other component stays in the keys without RoPE (NoPE). The written
   `rope_theta` is chosen so DeepSeek's RoPE over `rope_dim` dims has exactly those frequencies.
2. Joint low-rank compression of the NoPE keys and the values: reduced-rank PCA in a metric that weighs
   value errors by o_proj (their effect on the layer output; optionally key errors by the query
   covariance), each side normalised to unit total energy ("balanced"). Components that lose RoPE score
   with the mean RoPE phase of their head's attention pattern on calibration text.
3. DeepSeek normalises the latent with an RMSNorm (`kv_a_layernorm`, eps 1e-6 in transformers,
   `rms_norm_eps` in vLLM). The latent is written scaled so small that the norm runs in its linear regime
   (mean square << eps): RMSNorm(s c) = s c / sqrt(eps) to ~1e-5 relative, which the norm weight
   undoes. `rms_norm_eps` is set to 1e-6 so both runtimes agree; a source with another eps gets its
   residual stream rescaled by sqrt(1e-6 / eps), which leaves every other RMSNorm exactly equivalent.
4. The softmax scale (qk_head_dim ** -0.5 in DeepSeek vs head_dim ** -0.5) is absorbed into q_proj.
5. Refinement (`refine_steps`, default 100): starting from that closed form, Adam fits q_proj, the latent
   projection, the RoPE key and kv_b_proj (o_proj fixed) so the layer's MLA attention output matches the
   source attention output on the calibration tokens, step sizes relative to each tensor's RMS. The closed
   form treats keys and values as signals to reconstruct; the fit sees what attention does with them (the
   softmax, the lost RoPE of non-principal components) and recovers much of it: on SmolLM2 at a third of the
   KV cache it cut held-out KL from 0.62 to 0.21 (benchmarks/results/mla.md). The last eighth of the
   calibration sequences is held out, and a layer keeps its closed form unless the fit lowers the error there.

With `kv_lora_rank` at its maximum the latent is exact; the only loss left is RoPE removed from the
non-principal components (zero for a single KV head with rope_dim = head_dim). A GQA model with several
KV heads cannot be converted exactly into any layout with one shared RoPE key: its per-head keys at one
frequency are independent complex numbers, and a single shared one carries only one of them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quantkit.convert.rope import (complex_rows, frequency_rotations, interleave_rows, inv_frequencies,
                                   real_rows)
from quantkit.convert.output import prepare_output
from quantkit.errors import InputError
from quantkit.formats.files import publish

CONVERTIBLE = ("llama", "mistral", "qwen2")
ALREADY_MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2", "minicpm3", "glm4_moe_lite")
MLA_NORM_EPS = 1e-6  # transformers builds kv_a_layernorm with its default eps, whatever the config says
_LINEAR_REGIME = 1e-5  # target mean square of the scaled latent, as a fraction of eps


@dataclass
class MLAOptions:
    kv_lora_rank: int | None = None  # None: the default (n_kv*head_dim/2); -1: the exact maximum
    rope_dim: int | None = None  # None: head_dim / 2
    complex_rotation: bool = True  # False: real rotation per frequency (TransMLA's RoRoPE)
    weighted: bool = True  # False: plain PCA of [K_nope; V]
    weight_keys: bool = False  # with `weighted`: keys in the query metric too (measured worse on SmolLM2)
    balanced: bool = True  # normalise K and V energies before the joint PCA
    expected_phase: bool = True  # NoPE'd components keep RoPE's mean phase under the attention pattern
    refine_steps: int = 100  # Adam steps per layer fitting the MLA attention output to the source's (0: closed form)
    refine_lr: float = 5e-3  # relative to each tensor's RMS (1e-2: held-out KL 0.063 instead of 0.044 on SmolLM2, README)
    # Calibration sequences per Adam step, and the positions of each that a step's loss reads (0: all). The keys of
    # every position are computed either way, so 128 queries of two sequences cost about one whole sequence (SmolLM2:
    # held-out KL 0.0385 in 186 s against 0.0436 in 198 s, fp32; 128 x 4: 0.0357 in 287 s; results/mla_defaults.md).
    refine_batch: int = 2
    refine_queries: int = 128
    # The source layers' forward passes (quantkit.compute: auto = the faster of bf16 and fp32 here); the
    # statistics stay float64 sums (of fp32 per-batch products), and the refinement keeps fp32 parameters, its
    # matmuls under bf16 autocast where the forward runs bf16.
    compute_dtype: str = "auto"


@dataclass(frozen=True)
class MLADims:
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    rope_dim: int
    kv_lora_rank: int
    max_rank: int
    theta: float
    eps: float

    @property
    def cached_before(self) -> int:
        return 2 * self.n_kv * self.head_dim

    @property
    def cached_after(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    @property
    def rope_theta(self) -> float:
        # DeepSeek's frequencies theta'^(-2i/rope_dim) equal the source's first rope_dim/2 frequencies.
        return self.theta ** (self.rope_dim / self.head_dim)


def _cfg(config, name, default=None):
    return getattr(config, name, default)


def default_rank(half_kv: int, rope_dim: int, max_rank: int) -> int:
    """Half the source's per-token KV values, raised to the nearest latent size vLLM's MLA attention serves
    (kv_lora_rank + rope dim in MLA_LATENT_SIZES) when one fits under the exact maximum; a model too small for any
    keeps the plain default (vllm_latent_problem then says so)."""
    from quantkit.serving.vllm_support import MLA_LATENT_SIZES

    plain = min(max_rank, half_kv)
    served = [size - rope_dim for size in MLA_LATENT_SIZES if plain <= size - rope_dim <= max_rank]
    return min(served) if served else plain


def vllm_latent_problem(dims: "MLADims") -> str | None:
    """One line when vLLM's MLA attention would refuse this latent size (check-serving's rule), else None."""
    from quantkit.serving.vllm_support import MLA_LATENT_SIZES

    size = dims.kv_lora_rank + dims.rope_dim
    if size in MLA_LATENT_SIZES:
        return None
    fits = [f"--kv-lora-rank {s - dims.rope_dim}" for s in MLA_LATENT_SIZES if 1 <= s - dims.rope_dim <= dims.max_rank]
    return (f"latent size {size} (kv_lora_rank {dims.kv_lora_rank} + rope dim {dims.rope_dim}) is not one vLLM's MLA "
            f"attention serves ({', '.join(map(str, MLA_LATENT_SIZES))}): transformers loads it, vLLM refuses it"
            + (f"; for vLLM use {' or '.join(fits)}" if fits else ""))


def plan_dims(config, kv_lora_rank: int | None, rope_dim: int | None) -> MLADims:
    """Check that `config` can be converted with these sizes; a one-line InputError names the limit."""
    mt = _cfg(config, "model_type", "?")
    if mt in ALREADY_MLA or _cfg(config, "kv_lora_rank") is not None:
        raise InputError(f"model type {mt} already uses latent attention (MLA); nothing to convert")
    if mt not in CONVERTIBLE:
        moe = any(_cfg(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
        why = "a MoE model" if moe else "not a supported architecture"
        raise InputError(f"convert-mla supports {', '.join(CONVERTIBLE)} (GQA/MHA with RoPE); model type {mt} is {why}")
    if _cfg(config, "use_sliding_window") or (mt == "mistral" and _cfg(config, "sliding_window")):
        raise InputError(f"{mt} uses sliding-window attention (window {_cfg(config, 'sliding_window')}), "
                         "which the DeepSeek-V3 layout cannot preserve")
    rope = _cfg(config, "rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type != "default":
        raise InputError(f"RoPE type {rope_type!r} cannot be preserved (only the default RoPE maps onto DeepSeek's)")
    if (rope.get("partial_rotary_factor") or _cfg(config, "partial_rotary_factor") or 1.0) != 1.0:
        raise InputError("partial rotary embeddings cannot be preserved")
    if _cfg(config, "no_rope_layers") or _cfg(config, "no_rope_layer_interval"):
        raise InputError("models with NoPE layers cannot be converted")
    if _cfg(config, "layer_types") and any(t != "full_attention" for t in config.layer_types):
        raise InputError("models with sliding-window layers cannot be converted")
    if mt in ("llama", "mistral") and _cfg(config, "attention_bias"):
        raise InputError("attention with an o_proj bias cannot be represented in the DeepSeek-V3 layout")
    if _cfg(config, "mlp_bias"):
        raise InputError("MLP biases cannot be represented in the DeepSeek-V3 layout")
    hidden, n_heads = config.hidden_size, config.num_attention_heads
    n_kv = _cfg(config, "num_key_value_heads") or n_heads
    head_dim = _cfg(config, "head_dim") or hidden // n_heads
    if rope_dim is None:
        rope_dim = max(2, head_dim // 2 // 2 * 2)
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise InputError(f"--rope-dim must be even, at least 2 and at most head_dim ({head_dim}); got {rope_dim}")
    max_rank = min(2 * n_kv * head_dim - rope_dim, hidden)
    if kv_lora_rank is None:
        kv_lora_rank = default_rank(n_kv * head_dim // 2, rope_dim, max_rank)
    elif kv_lora_rank == -1:
        kv_lora_rank = max_rank
    if kv_lora_rank < 1 or kv_lora_rank > max_rank:
        raise InputError(
            f"--kv-lora-rank must be between 1 and the exact maximum {max_rank} "
            f"(= min(2*{n_kv} KV heads*{head_dim} - rope dim {rope_dim}, hidden {hidden})); got {kv_lora_rank}")
    theta = float(rope.get("rope_theta", _cfg(config, "rope_theta", 10000.0)))
    return MLADims(hidden, n_heads, n_kv, head_dim, rope_dim, kv_lora_rank, max_rank, theta,
                   float(_cfg(config, "rms_norm_eps", 1e-6)))


# ----------------------------------------------------------------------------------------------- math


def _sqrt_psd(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    vals, vecs = torch.linalg.eigh(0.5 * (m + m.T))
    vals = vals.clamp_min(vals.max().clamp_min(1e-30) * 1e-10)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [n_heads*head_dim, hidden]
    k: torch.Tensor  # [n_kv*head_dim, hidden]
    v: torch.Tensor
    o: torch.Tensor  # [hidden, n_heads*head_dim]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None


def convert_attention(w: AttentionWeights, cov_x: torch.Tensor, mean_x: torch.Tensor, dims: MLADims,
                      opts: MLAOptions, residual_scale: float = 1.0,
                      phase: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One layer's MLA tensors (float64): q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj.

    cov_x = E[x x^T] and mean_x = E[x] of the attention input x (the input_layernorm output).
    phase [n_heads, head_dim/2] (complex): per head and frequency, E[exp(i theta (n - m))] under the
    head's attention pattern; a component that loses RoPE scores with that mean rotation instead of none."""
    f64 = torch.float64
    cov = cov_x.to(f64)
    hd, n_kv, nh, dr = dims.head_dim, dims.n_kv, dims.n_heads, dims.rope_dim
    group = nh // n_kv
    pairs = dr // 2
    wq, wk, wv, wo = (t.to(f64) for t in (w.q, w.k, w.v, w.o))
    if any(b is not None for b in (w.q_bias, w.k_bias, w.v_bias)):
        # No bias exists on these projections in the DeepSeek layout: fold each bias into the weights via
        # the best linear predictor of the constant 1 from x (exact wherever x carries a constant direction).
        ridge = cov.diagonal().mean() * 1e-6
        one = torch.linalg.solve(cov + ridge * torch.eye(cov.shape[0], dtype=f64), mean_x.to(f64))
        wq = wq + w.q_bias.to(f64)[:, None] * one[None] if w.q_bias is not None else wq
        wk = wk + w.k_bias.to(f64)[:, None] * one[None] if w.k_bias is not None else wk
        wv = wv + w.v_bias.to(f64)[:, None] * one[None] if w.v_bias is not None else wv

    # 1. RoPE decoupling.
    keys = complex_rows(wk, n_kv, hd)  # [hd/2, n_kv, H]
    rot, _ = frequency_rotations(keys[:pairs], cov, use_complex=opts.complex_rotation)
    u0 = rot[:, :, 0].to(keys.dtype)  # [pairs, n_kv]
    rope_key = torch.einsum("pg,pgh->ph", u0.conj(), keys[:pairs])  # the shared RoPE key
    nope_keys = keys.clone()
    nope_keys[:pairs] -= u0[:, :, None] * rope_key[:, None, :]
    k_nope = real_rows(nope_keys)  # [n_kv*hd, H], Llama layout per head
    queries = complex_rows(wq, nh, hd)
    heads_group = torch.arange(nh) // group
    q_rope = u0[:, heads_group].conj()[:, :, None] * queries[:pairs]  # [pairs, nh, H]
    q_scale = math.sqrt((hd + dr) / hd)
    if phase is not None:
        # Re(conj(Q) K e^{i theta d}) ~ Re(conj(conj(g) Q) K) with g = E[e^{i theta d}]
        wq_nope = real_rows(queries * phase.T.conj().to(queries.dtype)[:, :, None])
    else:
        wq_nope = wq
    q_rows = []
    for h in range(nh):
        q_rows.append(wq_nope[h * hd:(h + 1) * hd])
        q_rows.append(interleave_rows(q_rope[:, h]))
    q_proj = torch.cat(q_rows) * q_scale

    # 2. Joint low-rank K_nope/V latent in an output-aware metric.
    m = torch.cat([k_nope, wv])  # [2*n_kv*hd, H]
    blocks_k, blocks_v = [], []
    for g in range(n_kv):
        if opts.weighted and opts.weight_keys:
            qh = [wq_nope[h * hd:(h + 1) * hd] for h in range(g * group, (g + 1) * group)]
            blocks_k.append(sum(q @ cov @ q.T for q in qh) / hd)
        else:
            blocks_k.append(torch.eye(hd, dtype=f64))
        if opts.weighted:
            oh = [wo[:, h * hd:(h + 1) * hd] for h in range(g * group, (g + 1) * group)]
            blocks_v.append(sum(o.T @ o for o in oh))
        else:
            blocks_v.append(torch.eye(hd, dtype=f64))
    gk, gv = torch.block_diag(*blocks_k), torch.block_diag(*blocks_v)
    if opts.balanced:
        ek = torch.trace(gk @ k_nope @ cov @ k_nope.T).clamp_min(1e-30)
        ev = torch.trace(gv @ wv @ cov @ wv.T).clamp_min(1e-30)
        gk, gv = gk / ek, gv / ev
    g_half, g_inv_half = zip(*(_sqrt_psd(b) for b in (gk, gv)))
    gh, gih = torch.block_diag(*g_half), torch.block_diag(*g_inv_half)
    s = gh @ m @ cov @ m.T @ gh
    vals, vecs = torch.linalg.eigh(0.5 * (s + s.T))
    top = vecs[:, torch.argsort(vals, descending=True)[: dims.kv_lora_rank]]
    latent = top.T @ gh @ m  # [r, H]
    expand = gih @ top  # [2*n_kv*hd, r]

    # 3. Linear-regime latent for kv_a_layernorm.
    small = _linear_regime_scale(float(torch.trace(latent @ cov @ latent.T) / dims.kv_lora_rank))
    norm_weight = torch.full((dims.kv_lora_rank,), math.sqrt(MLA_NORM_EPS) / small, dtype=f64)
    kv_a = torch.cat([latent * small, interleave_rows(rope_key)])
    k_exp, v_exp = expand[: n_kv * hd], expand[n_kv * hd:]
    kv_b = torch.cat([torch.cat([k_exp[g * hd:(g + 1) * hd], v_exp[g * hd:(g + 1) * hd]])
                      for g in heads_group.tolist()])
    return {
        "q_proj.weight": q_proj,
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": norm_weight,
        "kv_b_proj.weight": kv_b,
        "o_proj.weight": wo * residual_scale,
    }


def mla_attention(x: torch.Tensor, q_proj: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                  kv_b: torch.Tensor, o_proj: torch.Tensor, dims: MLADims, cos: torch.Tensor,
                  sin: torch.Tensor, queries: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V3 attention output for x [B, L, H] with the latent norm in its linear regime (identity on
    `latent` x); differentiable, in x's dtype. cos/sin [L, rope_dim/2] for DeepSeek's interleaved RoPE.
    `queries` (ascending positions): only those positions' outputs [B, len(queries), H], each over the keys up to
    it; None: every position."""
    b, L, _ = x.shape
    nh, hd, dr = dims.n_heads, dims.head_dim, dims.rope_dim

    def rope(t, c, s):
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack([t1 * c - t2 * s, t2 * c + t1 * s], -1).flatten(-2)

    xq, cq, sq, mask = x, cos, sin, None
    if queries is not None:
        xq, cq, sq = x[:, queries], cos[queries], sin[queries]
        mask = queries[:, None] >= torch.arange(L, device=x.device)[None]
    lq = xq.shape[1]
    q = (xq @ q_proj.T).view(b, lq, nh, hd + dr).transpose(1, 2)
    kv = ((x @ latent.T) @ kv_b.T).view(b, L, nh, 2 * hd).transpose(1, 2)
    k_rope = rope(x @ rope_key.T, cos, sin)[:, None].expand(b, nh, L, dr)
    q = torch.cat([q[..., :hd], rope(q[..., hd:], cq, sq)], -1)
    k = torch.cat([kv[..., :hd], k_rope], -1)
    out = nn.functional.scaled_dot_product_attention(q, k, kv[..., hd:], attn_mask=mask, is_causal=mask is None,
                                                     scale=(hd + dr) ** -0.5)
    return out.transpose(1, 2).reshape(b, lq, nh * hd) @ o_proj.T


@dataclass(frozen=True)
class RefineOptions:
    """One layer's refinement (see refine_attention and MLAOptions' refine_* fields)."""

    steps: int
    lr: float
    batch: int = 2
    queries: int = 128
    bf16: bool = False  # the forward and backward under bf16 autocast (the parameters, Adam and the loss stay fp32)
    seed: int = 0
    floor: float = 0.0


# Refinement early stopping (see refine_attention). A check (a whole forward over the held-out eighth) costs about
# two steps: every 25 steps instead of 10 took a SmolLM2 layer from 4.6 s to 3.7 s, with the same best parameters.
CHECK_EVERY, PATIENCE, MIN_GAIN, MIN_STEPS = 25, 2, 0.01, 60
LR_DECAY = 0.9  # the refinement's step size falls linearly to a tenth over its steps


def refine_attention(new: dict[str, torch.Tensor], x: torch.Tensor, target: torch.Tensor, dims: MLADims,
                     opts: RefineOptions) -> tuple[dict[str, torch.Tensor], dict]:
    """Fit q_proj, the latent, the RoPE key and kv_b_proj (o_proj fixed) so the MLA attention output on x
    [N, L, H] matches the source layer's attention output `target` (mean squared error), starting from the
    closed-form conversion `new`. The last eighth of the sequences is held out; the refined tensors are kept
    only if they lower the held-out error by more than `opts.floor`, the relative squared error the target carries from
    its own rounding (the source forward's dtype): below it a fit learns that rounding, not the layer, and moves an
    exact closed form away from the source. A closed form already within `floor` is kept without steps.
    Up to `opts.steps` Adam steps over `opts.batch` sequences each, stopped early once the held-out error stops
    improving (the best parameters kept). `opts.queries` > 0: each step's loss reads that many random positions of
    each sequence (every key still computed for them), a step costing a fraction of a whole sequence's. `opts.bf16`:
    the steps' matmuls under bf16 autocast (SmolLM2: 17% faster, the same held-out KL).
    Returns (tensors, {"before", "after"} relative held-out errors and the steps taken)."""
    r = dims.kv_lora_rank
    f32 = torch.float32
    small = math.sqrt(MLA_NORM_EPS) / float(new["kv_a_layernorm.weight"][0])  # the latent rows were scaled by this
    params = {
        "q": new["q_proj.weight"].to(f32),
        "latent": (new["kv_a_proj_with_mqa.weight"][:r] / small).to(f32),
        "rope": new["kv_a_proj_with_mqa.weight"][r:].to(f32),
        "kv_b": new["kv_b_proj.weight"].to(f32),
    }
    o_proj = new["o_proj.weight"].to(f32)
    L = x.shape[1]
    ang = torch.arange(L, dtype=torch.float64)[:, None] * inv_frequencies(dims.rope_dim, dims.rope_theta)[None]
    cos, sin = ang.cos().to(f32), ang.sin().to(f32)
    n_val = max(1, x.shape[0] // 8)
    x_fit, t_fit, x_val, t_val = x[:-n_val], target[:-n_val], x[-n_val:], target[-n_val:]

    def rel_error(p, xs, ts) -> float:
        with torch.no_grad():
            out = mla_attention(xs, p["q"], p["latent"], p["rope"], p["kv_b"], o_proj, dims, cos, sin)
            return float((out - ts).pow(2).sum() / ts.pow(2).sum())

    before = rel_error(params, x_val, t_val)
    steps, floor = opts.steps, opts.floor
    if before <= floor:
        return new, {"before": round(before, 6), "after": round(before, 6), "skipped": "closed form at the target's precision"}
    trained = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    opt = torch.optim.Adam([{"params": [p], "lr": opts.lr * float(p.detach().pow(2).mean().sqrt())}
                            for p in trained.values()])
    gen = torch.Generator().manual_seed(opts.seed)
    norm = t_fit.pow(2).mean()
    # Few sequences per step (a step over four whole 512-token sequences costs 5-10x one on 2 cores, SDPA's backward
    # then leaving the caches). The step size decays linearly to a tenth, which takes the
    # small batches' noise out of the last steps (constant: held-out KL 0.086 instead of 0.063 on SmolLM2). The
    # held-out error is checked every CHECK_EVERY steps; the best parameters seen are kept, and from MIN_STEPS on
    # the fit stops once PATIENCE checks in a row improved it by less than MIN_GAIN (relative): Adam's first steps
    # often raise the error before they lower it.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - LR_DECAY * min(i, steps) / max(steps, 1))
    best_err, best, stale, taken = before, None, 0, 0
    with torch.enable_grad():
        for step in range(steps):
            idx = torch.randperm(x_fit.shape[0], generator=gen)[:opts.batch]
            pos = None
            if 0 < opts.queries < L:
                pos = torch.randperm(L, generator=gen)[:opts.queries].sort().values
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=opts.bf16):
                out = mla_attention(x_fit[idx], trained["q"], trained["latent"], trained["rope"], trained["kv_b"],
                                    o_proj, dims, cos, sin, pos)
            out = out.float()
            ts = t_fit[idx] if pos is None else t_fit[idx][:, pos]
            loss = (out - ts).pow(2).mean() / norm
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            taken = step + 1
            if taken % CHECK_EVERY and taken != steps:
                continue
            err = rel_error(trained, x_val, t_val)
            if err < best_err * (1 - MIN_GAIN):
                stale = 0
            else:
                stale += 1
            if err < best_err:
                best_err, best = err, {k: v.detach().clone() for k, v in trained.items()}
            if stale >= PATIENCE and taken >= MIN_STEPS:
                break
    report = {"before": round(before, 6), "after": round(best_err, 6), "steps": taken}
    if best is None or not best_err < before - floor:
        return new, report
    trained = best
    f64 = torch.float64
    latent = trained["latent"].detach().to(f64)
    with torch.no_grad():
        ms = float((x_fit @ trained["latent"].T).pow(2).mean())
    small = _linear_regime_scale(ms)
    return {**new, "q_proj.weight": trained["q"].detach().to(f64),
            "kv_a_proj_with_mqa.weight": torch.cat([latent * small, trained["rope"].detach().to(f64)]),
            "kv_a_layernorm.weight": torch.full((r,), math.sqrt(MLA_NORM_EPS) / small, dtype=f64),
            "kv_b_proj.weight": trained["kv_b"].detach().to(f64)}, report


def _linear_regime_scale(mean_square: float) -> float:
    """Factor that brings a latent of this mean square to _LINEAR_REGIME * eps, where RMSNorm is linear."""
    return math.sqrt(_LINEAR_REGIME * MLA_NORM_EPS / max(mean_square, 1e-30))


@torch.no_grad()
def attention_phase(x: torch.Tensor, w: AttentionWeights, dims: MLADims) -> torch.Tensor:
    """E[exp(i theta_j (n - m))] per head and frequency under the source's causal attention on x [B, L, H]."""
    from quantkit.convert.rope import apply_rope_half

    b, L, _ = x.shape
    hd, nh, n_kv = dims.head_dim, dims.n_heads, dims.n_kv
    q = x @ w.q.T + (w.q_bias if w.q_bias is not None else 0)
    k = x @ w.k.T + (w.k_bias if w.k_bias is not None else 0)
    # The attention pattern in fp32 (a float64 one took 6% of a SmolLM2 conversion); the histogram, a sum of up to
    # b * L probabilities per distance, in float64.
    q = q.view(b, L, nh, hd).transpose(1, 2).float()
    k = k.view(b, L, n_kv, hd).transpose(1, 2).float().repeat_interleave(nh // n_kv, dim=1)
    pos = torch.arange(L)
    q, k = apply_rope_half(q, pos, dims.theta), apply_rope_half(k, pos, dims.theta)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    probs = scores.softmax(-1)  # [b, nh, L, L]
    # distance histogram per head: weight of key n = m - d, averaged over queries m
    dist = (pos[:, None] - pos[None, :]).clamp_min(0)  # [L, L]
    hist = torch.zeros(nh, L, dtype=torch.float64)
    hist.index_add_(1, dist.reshape(-1), probs.double().sum(0).permute(1, 2, 0).reshape(L * L, nh).T)
    hist /= hist.sum(-1, keepdim=True)
    ang = -torch.arange(L, dtype=torch.float64)[:, None] * inv_frequencies(hd, dims.theta)[None, :]
    return hist.to(torch.complex128) @ torch.polar(torch.ones_like(ang), ang)  # [nh, hd/2]


def residual_scale(dims: MLADims) -> float:
    """Scale of the residual stream that makes RMSNorm(eps=1e-6) on it equal the source's RMSNorm(eps)."""
    return math.sqrt(MLA_NORM_EPS / dims.eps) if abs(dims.eps - MLA_NORM_EPS) > 1e-12 else 1.0


def deepseek_config(src: dict, dims: MLADims) -> dict:
    n_layers = src["num_hidden_layers"]
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": src["vocab_size"],
        "hidden_size": dims.hidden,
        "intermediate_size": src["intermediate_size"],
        "moe_intermediate_size": src["intermediate_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": dims.n_heads,
        "num_key_value_heads": dims.n_heads,  # MLA expands the latent to every head
        "n_shared_experts": 1,
        "n_routed_experts": 1,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "first_k_dense_replace": n_layers,  # every layer keeps its dense MLP
        "moe_layer_freq": 1,
        "kv_lora_rank": dims.kv_lora_rank,
        "q_lora_rank": None,
        "qk_rope_head_dim": dims.rope_dim,
        "qk_nope_head_dim": dims.head_dim,
        "v_head_dim": dims.head_dim,
        "hidden_act": src.get("hidden_act", "silu"),
        "max_position_embeddings": src.get("max_position_embeddings", 4096),
        "rms_norm_eps": MLA_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": dims.rope_theta},
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        # Never tied: vLLM's DeepSeek-V3 always loads its own lm_head (a tied checkpoint without lm_head.weight
        # loads with a zero head there: uniform logits, NLL ln(vocab), measured on vLLM 0.32.0's CPU build).
        "tie_word_embeddings": False,
        "initializer_range": src.get("initializer_range", 0.02),
        "use_cache": True,
        "dtype": src.get("dtype") or src.get("torch_dtype") or "bfloat16",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if src.get(key) is not None:
            cfg[key] = src[key]
    return cfg


# ----------------------------------------------------------------------------------------- streaming


@dataclass
class ConvertResult:
    output: str
    dims: dict
    layers: list = field(default_factory=list)
    wall_seconds: float = 0.0


def _out_dtype(handle) -> torch.dtype:
    dt = handle.source_dtype()
    # The linear-regime latent needs the exponent range of bf16/fp32; fp16 would underflow.
    return torch.bfloat16 if dt == torch.float16 else dt


def _layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {k: p + k for k in (
        "self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight",
        "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}


def _tensor_specs(dims: MLADims, cfg: dict, dtype: torch.dtype):
    from quantkit.formats.safetensors_writer import TensorSpec

    h, nh, hd, dr, r = dims.hidden, dims.n_heads, dims.head_dim, dims.rope_dim, dims.kv_lora_rank
    inter = cfg["intermediate_size"]
    shapes = {
        "self_attn.q_proj.weight": (nh * (hd + dr), h),
        "self_attn.kv_a_proj_with_mqa.weight": (r + dr, h),
        "self_attn.kv_a_layernorm.weight": (r,),
        "self_attn.kv_b_proj.weight": (nh * 2 * hd, r),
        "self_attn.o_proj.weight": (h, nh * hd),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    specs = [TensorSpec("model.embed_tokens.weight", dtype, (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        for local, full in _layer_names(i).items():
            specs.append(TensorSpec(full, dtype, shapes[local]))
    specs.append(TensorSpec("model.norm.weight", dtype, (h,)))
    specs.append(TensorSpec("lm_head.weight", dtype, (cfg["vocab_size"], h)))
    return specs


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                                       "added_tokens", "chat_template", "generation_config"))
                               or path.suffix == ".model"):
            shutil.copy2(path, dst / path.name)


@torch.no_grad()
def convert_model(source: str | None, output: Path, opts: MLAOptions, dataset: str = "kjv",
                  num_samples: int = 32, seq_len: int = 512, seed: int = 42, overwrite: bool = False,
                  batch_size: int = 4, attention_fn=None) -> dict:
    """Stream the source model layer by layer and write the converted DeepSeek-V3 folder atomically."""
    from transformers import AutoConfig, AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.formats.manifest import package_versions, sha256_file
    from quantkit.formats.safetensors_writer import PlannedShardWriter
    from quantkit.models.loader import open_model, read_config_json
    from quantkit.models.source import resolve_model
    from quantkit.pipeline.capture import capture_layer_inputs, run_layer

    start = time.time()
    resolved = resolve_model(source)
    try:
        config = AutoConfig.from_pretrained(str(resolved.path))
    except Exception as exc:
        raise InputError(f"cannot read config.json of {resolved.path}: {str(exc).splitlines()[0]}") from None
    dims = plan_dims(config, opts.kv_lora_rank, opts.rope_dim)  # refuse before any work or output
    output = Path(output)
    if output.exists() and not overwrite:
        raise InputError(f"output {output} exists; pass --overwrite to replace it")
    handle = open_model(resolved)
    src_cfg = read_config_json(resolved.path)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.path))
    calib = build_token_blocks(tokenizer, dataset, num_samples, seq_len, seed=seed, split="calibration")
    dtype = _out_dtype(handle)
    alpha = residual_scale(dims)
    cfg = deepseek_config(src_cfg, dims)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    from quantkit.compute import choose_compute_dtype, matmul_shapes
    from quantkit.progress import announce, progress_bar

    compute = choose_compute_dtype(opts.compute_dtype, handle.source_dtype(), "cpu", matmul_shapes(config))
    announce(compute.describe())
    run_dtype = compute.layer_dtype
    # The refinement's targets come from the source forward: bf16 (autocast or a bf16 model) rounds them to ~eps.
    target_floor = torch.finfo(torch.bfloat16 if compute.autocast else run_dtype).eps ** 2

    partial = prepare_output(output, overwrite)
    stack = contextlib.ExitStack()
    try:
        progress = stack.enter_context(progress_bar())
        layer_task = progress.add_task("convert-mla layers", total=handle.num_layers, info="")
        writer = PlannedShardWriter(partial, _tensor_specs(dims, cfg, dtype))
        emb = handle.index.get(handle.embedding_path() + ".weight").to(torch.float32) * alpha
        writer.write("model.embed_tokens.weight", emb.to(dtype))
        hidden, calls = capture_layer_inputs(handle, calib.input_ids, batch_size, "cpu", run_dtype)
        layers_report = []
        # Only the source layers' forward passes run under autocast; the refinement's Adam steps stay fp32.
        forward = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute.autocast)  # noqa: E731
        for i in range(handle.num_layers):
            layer = handle.materialize_layer(i, run_dtype)
            attn = layer.self_attn
            cov = torch.zeros(dims.hidden, dims.hidden, dtype=torch.float64)
            mean = torch.zeros(dims.hidden, dtype=torch.float64)
            count = 0
            normed = []  # the attention inputs, kept for the refinement
            for h in hidden:
                xn = layer.input_layernorm(h).detach().float()
                if opts.refine_steps > 0:
                    normed.append(xn)
                x = xn.reshape(-1, dims.hidden)
                cov += (x.T @ x).double()  # a float64 sum of each batch's fp32 product, as GPTQ's Hessians
                mean += x.sum(0, dtype=torch.float64)
                count += x.shape[0]
            cov /= count
            mean /= count
            bias = lambda lin: lin.bias if getattr(lin, "bias", None) is not None else None  # noqa: E731
            f32 = lambda t: None if t is None else t.float()  # noqa: E731
            weights = AttentionWeights(f32(attn.q_proj.weight), f32(attn.k_proj.weight), f32(attn.v_proj.weight),
                                       f32(attn.o_proj.weight), f32(bias(attn.q_proj)), f32(bias(attn.k_proj)),
                                       f32(bias(attn.v_proj)))
            if attention_fn is None:
                phase = None
                if opts.expected_phase:
                    probe = torch.cat(hidden)[:8]
                    phase = attention_phase(layer.input_layernorm(probe).float(), weights, dims)
                new = convert_attention(weights, cov, mean, dims, opts, alpha, phase)
            else:
                new = attention_fn(weights, cov, mean, dims, opts, alpha)
            refine_report = None
            if opts.refine_steps > 0:
                outputs: list[torch.Tensor] = []
                hook = attn.register_forward_hook(lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                                   else out))
                with torch.no_grad(), forward():
                    next_hidden = [run_layer(layer, h, calls[j][i]) for j, h in enumerate(hidden)]
                hook.remove()
                refine = RefineOptions(opts.refine_steps, opts.refine_lr, opts.refine_batch, opts.refine_queries,
                                       bf16=compute.autocast or compute.dtype == torch.bfloat16, seed=seed,
                                       floor=target_floor)
                new, refine_report = refine_attention(new, torch.cat(normed), torch.cat(outputs).float() * alpha, dims,
                                                      refine)
                del outputs
            else:
                next_hidden = None
            del normed
            names = _layer_names(i)
            for local, tensor in new.items():
                writer.write(names["self_attn." + local], tensor.to(dtype))
            writer.write(names["mlp.gate_proj.weight"], layer.mlp.gate_proj.weight.to(dtype))
            writer.write(names["mlp.up_proj.weight"], layer.mlp.up_proj.weight.to(dtype))
            writer.write(names["mlp.down_proj.weight"], (layer.mlp.down_proj.weight * alpha).to(dtype))
            writer.write(names["input_layernorm.weight"], layer.input_layernorm.weight.to(dtype))
            writer.write(names["post_attention_layernorm.weight"], layer.post_attention_layernorm.weight.to(dtype))
            # Statistics of the next layer come from the source model's own activations.
            if next_hidden is None:
                with forward():
                    next_hidden = [run_layer(layer, h, calls[j][i]) for j, h in enumerate(hidden)]
            hidden = next_hidden
            layers_report.append({"layer": i, **({"refine": refine_report} if refine_report else {})})
            progress.update(layer_task, advance=1, info=f"layer {i}" + (
                f" attention error {refine_report['before']:.2e} -> {refine_report['after']:.2e}"
                + (f" ({refine_report['steps']} steps)" if "steps" in refine_report else "") if refine_report else ""))
            del layer
        norm_name = handle.adapter.layers_path.rpartition(".")[0] + ".norm.weight"
        norm = handle.index.get(norm_name).to(torch.float32)
        writer.write("model.norm.weight", norm.to(dtype))
        # A tied source's head is its (unscaled) embedding matrix, written out (the layout is never tied).
        head = "lm_head.weight" if "lm_head.weight" in handle.index else handle.embedding_path() + ".weight"
        writer.write("lm_head.weight", handle.index.get(head).to(dtype))
        writer.close()
        writer.write_index()
        (partial / "config.json").write_text(json.dumps(cfg, indent=2))
        _copy_tokenizer(resolved.path, partial)
        summary = {
            "output": str(output),
            "model": resolved.label,
            "model_path": str(resolved.path),
            "method": "mla",
            "options": asdict(opts),
            "dims": {**asdict(dims), "rope_theta_out": dims.rope_theta, "residual_scale": alpha},
            "kv_cache": kv_cache_report(dims, handle.num_layers),
            "calibration": calib.describe(),
            "dtype": str(dtype).replace("torch.", ""),
            "compute": compute.to_dict(),
            "wall_seconds": round(time.time() - start, 2),
        }
        if opts.refine_steps > 0:
            summary["refine"] = [{"layer": r["layer"], **r["refine"]} for r in layers_report if "refine" in r]
        files = {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                 for p in sorted(partial.iterdir()) if p.is_file()}
        from quantkit.formats.manifest import SCHEMA_VERSION

        manifest = {"schema_version": SCHEMA_VERSION, "quantkit_version": package_versions()["quantkit"],
                    "kind": "convert-mla",
                    "source": {"model": resolved.label, "path": str(resolved.path)},
                    "versions": package_versions(), **{k: summary[k] for k in ("options", "dims", "kv_cache",
                                                                             "calibration", "compute",
                                                                             "wall_seconds")},
                    "files": files}
        from quantkit.formats.manifest import MANIFEST

        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        stack.close()
    publish(partial, output)
    return summary


def kv_cache_report(dims: MLADims, n_layers: int) -> dict:
    before, after = dims.cached_before, dims.cached_after
    return {
        "values_per_token_per_layer": {"before": before, "after": after},
        "bytes_per_token_bf16": {"before": 2 * before * n_layers, "after": 2 * after * n_layers},
        "bytes_per_token_fp8": {"before": before * n_layers, "after": after * n_layers},
        "ratio": round(after / before, 4),
        "vs_mha": round(after / (2 * dims.n_heads * dims.head_dim), 4),
    }


# ------------------------------------------------------------------------------------------ evaluation


def _metrics(base_logits: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> dict:
    base_lp = torch.log_softmax(base_logits.float(), -1)
    lp = torch.log_softmax(logits.float(), -1)
    kl = (base_lp.exp() * (base_lp - lp)).sum(-1)
    nll_base = -base_lp.gather(-1, targets[..., None]).squeeze(-1)
    nll = -lp.gather(-1, targets[..., None]).squeeze(-1)
    top1 = (base_lp.argmax(-1) == lp.argmax(-1)).float()
    return {"kl_sum": float(kl.sum()), "nll_base_sum": float(nll_base.sum()), "nll_sum": float(nll.sum()),
            "top1_sum": float(top1.sum()), "n": kl.numel()}


@torch.no_grad()
def evaluate_pair(base: str | Path | None, converted: Path, num_samples: int = 8, seq_len: int = 512,
                  seed: int = 42, batch_size: int = 2, dtype: torch.dtype = torch.float32,
                  dataset: str = "kjv") -> dict:
    """Held-out KL(base || converted), perplexities and top-1 agreement on `dataset` (the KJV held-out split by
    default; any calibration source, such as a text file, otherwise), one layer in memory at a time."""
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.loader import open_model
    from quantkit.models.source import ResolvedModel, resolve_model
    from quantkit.pipeline.reference import layerwise_logits

    base_resolved = resolve_model(None if base is None else str(base))
    tok = AutoTokenizer.from_pretrained(str(base_resolved.path))
    ids = build_token_blocks(tok, dataset, num_samples, seq_len, seed=seed, split="heldout").input_ids
    h_base = open_model(base_resolved)
    h_conv = open_model(ResolvedModel(Path(converted), str(converted)))
    tot = {"kl_sum": 0.0, "nll_base_sum": 0.0, "nll_sum": 0.0, "top1_sum": 0.0, "n": 0}
    for s in range(0, ids.shape[0], batch_size):
        chunk = ids[s:s + batch_size]
        a = layerwise_logits(h_base, chunk, dtype=dtype)[:, :-1]
        b = layerwise_logits(h_conv, chunk, dtype=dtype)[:, :-1]
        for k, v in _metrics(a, b, chunk[:, 1:]).items():
            tot[k] += v
    n = tot["n"]
    return {"kl": tot["kl_sum"] / n, "ppl_base": math.exp(tot["nll_base_sum"] / n),
            "ppl": math.exp(tot["nll_sum"] / n), "top1_agreement": tot["top1_sum"] / n,
            "tokens": n, "samples": num_samples, "seq_len": seq_len}


# ------------------------------------------------------------------------------ quantkit's MLA forward


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@torch.no_grad()
def mla_reference_logits(folder: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits of a converted folder computed from its tensors with a plain float64 MLA forward (no
    transformers modelling code): the independent check of what DeepseekV3ForCausalLM computes."""
    from quantkit.models.safetensors_index import SafetensorsIndex

    cfg = json.loads((Path(folder) / "config.json").read_text())
    idx = SafetensorsIndex(Path(folder))
    t = lambda n: idx.get(n).to(torch.float64)  # noqa: E731
    nh, r, dr = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    dn, dv, eps = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["rms_norm_eps"]
    theta = cfg["rope_parameters"]["rope_theta"]
    b, L = input_ids.shape
    pos = torch.arange(L, dtype=torch.float64)
    ang = pos[:, None] * inv_frequencies(dr, theta)[None]
    cos, sin = ang.cos(), ang.sin()

    def rope(x):  # interleaved pairs (2j, 2j+1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)

    mask = torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)
    h = t("model.embed_tokens.weight")[input_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, t(p + "input_layernorm.weight"), eps)
        q = (x @ t(p + "self_attn.q_proj.weight").T).view(b, L, nh, dn + dr).transpose(1, 2)
        kv = x @ t(p + "self_attn.kv_a_proj_with_mqa.weight").T
        c = _rms(kv[..., :r], t(p + "self_attn.kv_a_layernorm.weight"), MLA_NORM_EPS)
        k_rope = rope(kv[..., r:])[:, None]  # [b, 1, L, dr], shared by all heads
        kvb = (c @ t(p + "self_attn.kv_b_proj.weight").T).view(b, L, nh, dn + dv).transpose(1, 2)
        k_nope, v = kvb[..., :dn], kvb[..., dn:]
        scores = (q[..., :dn] @ k_nope.transpose(-1, -2) + rope(q[..., dn:]) @ k_rope.transpose(-1, -2))
        att = torch.softmax(scores / math.sqrt(dn + dr) + mask, -1) @ v
        h = h + att.transpose(1, 2).reshape(b, L, nh * dv) @ t(p + "self_attn.o_proj.weight").T
        x = _rms(h, t(p + "post_attention_layernorm.weight"), eps)
        gate = torch.nn.functional.silu(x @ t(p + "mlp.gate_proj.weight").T)
        h = h + (gate * (x @ t(p + "mlp.up_proj.weight").T)) @ t(p + "mlp.down_proj.weight").T
    h = _rms(h, t("model.norm.weight"), eps)
    head = t("lm_head.weight") if "lm_head.weight" in idx else t("model.embed_tokens.weight")
    return h @ head.T


# ------------------------------------------------------------------------------------------------ sweep


def plot_sweep(points: list[dict], path: Path, title: str) -> None:
    from quantkit.optional import require

    matplotlib = require("matplotlib", "convert-mla --sweep")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p["kv_cache"]["ratio"] * 100 for p in points]
    ys = [p["eval"]["kl"] for p in points]
    ax.plot(xs, ys, "o-")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(f"r={p['dims']['kv_lora_rank']}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("KV cache size (% of source)")
    ax.set_ylabel("held-out KL (nats/token)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -------------------------------------------------------------------------------------------- the command


def run_convert(model: str | None, output: Path, ranks: list[int | None], rope_dim: int | None, dataset: str,
                num_samples: int, seq_len: int, eval_samples: int, overwrite: bool, sweep: bool = False,
                opts: MLAOptions | None = None) -> dict:
    """`quantkit convert-mla`: one conversion (or one per rank with `sweep`), each evaluated on held-out text.
    One writer per output (the same lock as quantize)."""
    from quantkit.pipeline.lock import output_lock

    with output_lock(Path(output)):
        return _run_convert(model, output, ranks, rope_dim, dataset, num_samples, seq_len, eval_samples,
                            overwrite, sweep, opts)


def _run_convert(model: str | None, output: Path, ranks: list[int | None], rope_dim: int | None, dataset: str,
                 num_samples: int, seq_len: int, eval_samples: int, overwrite: bool, sweep: bool,
                 opts: MLAOptions | None) -> dict:
    from transformers import AutoConfig

    from quantkit.formats.manifest import MANIFEST
    from quantkit.models.source import resolve_model

    resolved = resolve_model(model)
    try:
        config = AutoConfig.from_pretrained(str(resolved.path))
    except Exception as exc:
        raise InputError(f"cannot read config.json of {resolved.path}: {str(exc).splitlines()[0]}") from None
    for r in ranks:  # every rank is checked before anything is written
        plan_dims(config, r, rope_dim)
    output = Path(output)
    if output.exists() and not overwrite:
        raise InputError(f"output {output} exists; pass --overwrite to replace it")
    base_opts = opts or MLAOptions()
    runs = []
    if sweep:
        partial_root = output.with_name(f".{output.name}.sweep-{os.getpid()}")
        shutil.rmtree(partial_root, ignore_errors=True)
        partial_root.mkdir(parents=True)
    try:
        for r in ranks:
            o = MLAOptions(**{**asdict(base_opts), "kv_lora_rank": r, "rope_dim": rope_dim})
            dims = plan_dims(config, r, rope_dim)
            target = partial_root / f"rank-{dims.kv_lora_rank}" if sweep else output
            summary = convert_model(str(resolved.path), target, o, dataset, num_samples, seq_len,
                                    overwrite=overwrite)
            summary["model"] = resolved.label
            if eval_samples > 0:
                summary["eval"] = evaluate_pair(str(resolved.path), target, eval_samples, seq_len)
                mpath = target / MANIFEST
                manifest = json.loads(mpath.read_text())
                manifest["eval"] = summary["eval"]
                mpath.write_text(json.dumps(manifest, indent=2, default=str))
            runs.append(summary)
        report = {"model": resolved.label, "runs": runs,
                  "warnings": [w for w in (vllm_latent_problem(plan_dims(config, r, rope_dim)) for r in ranks) if w]}
        if sweep:
            for run in runs:
                run["output"] = str(output / Path(run["output"]).name)
            if eval_samples > 0:
                plot_sweep(runs, partial_root / "sweep.png", f"MLA conversion of {resolved.label}")
                report["plot"] = str(output / "sweep.png")
            (partial_root / "sweep.json").write_text(json.dumps(report, indent=2, default=str))
            publish(partial_root, output)
    except BaseException:
        if sweep:
            shutil.rmtree(partial_root, ignore_errors=True)
        raise
    return report
