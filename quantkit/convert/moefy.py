"""MoEfication: split a dense model's MLPs into experts and write a sparse-MoE checkpoint transformers loads.

Per decoder layer, on calibration text (the dense model's own activations):

1. The MLP's intermediate activations a = act(gate x) * up x [T, I]. Neuron j contributes a_j * down[:, j]
   to the output, so its activation pattern is the token vector |a_j(t)| * ||down[:, j]||.
2. Optional shared experts: the S*m neurons most often among the strongest contributors of a token (the
   top k/E fraction) are always on.
3. The other neurons are split into E equal groups by balanced k-means on their normalised activation
   patterns (cosine similarity; a greedy capacity-constrained assignment each round), so neurons that fire on
   the same tokens land in the same expert and k experts carry most of a token's activation mass. Where I is
   not a multiple of 8 (E+S) the MLP is padded with dead neurons (zero weights: they add nothing anywhere).
4. Router (E x H): each expert's target is the norm of its output contribution ||y_e(x)||. `lstsq` fits
   the targets from the MLP input by ridge least squares; `centroid` uses the mean input of the tokens that
   rank the expert in their top-k (minus the overall mean). Both are scored on the last eighth of the
   calibration tokens (held out from the fit): overlap with the oracle top-k and activation mass captured.

Combine weights. The experts are additive pieces of the dense MLP: sum_e y_e(x) = MLP(x). Any combine weight
that varies with the token changes the function even when all E experts run, so dense at k = E needs a
constant weight, and no family's router gives one exactly with a data-dependent selection. The router is
therefore written at a low temperature: the fitted logits times tau, centred over experts, with tau chosen so
that no calibration logit exceeds 2^-10 in magnitude. Selection depends only on the logits' order, which tau
keeps; the combine weight becomes a constant to within 2^-10 relative: softmax p_e = (1 + O(2^-10)) / E
(Qwen2/3-MoE, norm_topk_prob False), with every routed down_proj multiplied by E; sigmoid 2 s(l) = 1 +
O(2^-10) (DeepSeek-V3, routed_scaling_factor 2, norm_topk_prob False, e_score_correction_bias 0). In bf16
Qwen rounds the weight to the model dtype, where (1 + d)/E with |d| < 2^-9 is exactly 1/E for a
power-of-two E: there the combine is exactly the sum of the selected experts. In fp32 the output at k = E
differs from the dense MLP by < 2^-10 relative (the test checks it; an exactly-zero router reproduces it
to rounding).

Distillation (`MoEfyOptions.distill`, convert/moe_distill.py) gives up that identity for a model that behaves like
a trained MoE: the router at a normal temperature (its logits spread by about one unit per token), top-k weights
normalised, and router and experts fitted to the dense model, first layer by layer and then end to end on its
next-token distributions. Its combine weights vary with the token, so at k = E it is no longer the dense MLP.

Attention: qwen2_moe takes Llama's attention as is (zero q/k/v biases where the source has none: vLLM reads
them whatever the config says); qwen3_moe adds per-head q/k RMSNorms, which are put into their linear regime
(q_proj, k_proj scaled by a power of two so the per-head mean square is <= 1e-6 eps on calibration; the norm
weights undo the scale; the q and k norm weights are picked as the pair of bf16 numbers whose product is
nearest the exact one, since only q.k matters). deepseek_v3
needs MLA attention, so its source is a dense DeepSeek-V3 model (`quantkit convert-mla`) whose attention
is copied as is.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from quantkit.convert.moe_distill import DistillOptions
from quantkit.convert.output import prepare_output
from quantkit.errors import InputError
from quantkit.formats.files import publish
from quantkit.progress import progress_bar

LAYOUTS = ("qwen2_moe", "qwen3_moe", "deepseek_v3")
ROUTER_FITS = ("lstsq", "centroid")
DENSE_SOURCES = ("llama", "mistral", "qwen2", "qwen3")
LOGIT_BOUND = 2.0 ** -10  # largest |router logit| on calibration text: the combine weight's relative spread
_NORM_REGIME = 1e-6  # qwen3 q/k norms: per-head mean square at most this fraction of eps
_ARCH = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True)
class MoEfyOptions:
    experts: int
    top_k: int
    shared_experts: int = 0  # always-on experts of the routed experts' size (one expert in Qwen2-MoE's layout)
    layout: str = "qwen3_moe"
    router_fit: str = "lstsq"
    kmeans_iters: int = 20
    feature_tokens: int = 2048  # calibration tokens whose activations describe a neuron in the clustering
    ridge: float = 1e-3  # lstsq: relative to the mean diagonal of X^T X
    seed: int = 0
    distill: DistillOptions | None = None  # None: the exact low-temperature split (dense at k = E)

    def check(self) -> None:
        if self.distill is not None:
            self.distill.check()
        if self.layout not in LAYOUTS:
            raise InputError(f"unknown --layout {self.layout!r}; valid: {', '.join(LAYOUTS)}")
        if self.router_fit not in ROUTER_FITS:
            raise InputError(f"unknown router fit {self.router_fit!r}; valid: {', '.join(ROUTER_FITS)}")
        if self.experts < 2:
            raise InputError(f"--experts must be at least 2, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise InputError(f"--top-k must be within 1..{self.experts} (the experts), got {self.top_k}")
        if self.shared_experts < 0:
            raise InputError(f"--shared-experts must be 0 or more, got {self.shared_experts}")
        if self.layout == "qwen3_moe" and self.shared_experts:
            raise InputError("the qwen3_moe layout has no shared experts; use qwen2_moe or deepseek_v3 for "
                             "--shared-experts")
        if self.layout in ("qwen2_moe", "deepseek_v3") and not self.shared_experts:
            raise InputError(f"the {self.layout} layout always has a shared expert: give --shared-experts 1 "
                             "or more (or use qwen3_moe for none)")


# ------------------------------------------------------------------------------------------ the split


def balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Each row of sim [N, C] to one column, every column exactly `size` rows (N = C * size): rows sure of
    their best column (largest margin over the second best) choose first, each its best column not yet full."""
    n, c = sim.shape
    if n != c * size:
        raise ValueError(f"{n} rows cannot fill {c} columns of {size}")
    top2 = sim.topk(min(2, c), dim=1).values
    margin = top2[:, 0] - (top2[:, 1] if c > 1 else 0)
    order = margin.argsort(descending=True).tolist()
    prefs = sim.argsort(dim=1, descending=True).tolist()
    fill = [0] * c
    out = [0] * n
    for row in order:
        for col in prefs[row]:
            if fill[col] < size:
                fill[col] += 1
                out[row] = col
                break
    return torch.tensor(out, dtype=torch.long)


def balanced_kmeans(features: torch.Tensor, clusters: int, iters: int = 20, seed: int = 0) -> torch.Tensor:
    """Cluster rows of features [N, D] (compared by cosine) into `clusters` groups of exactly N / clusters."""
    n = features.shape[0]
    size = n // clusters
    f = F.normalize(features.float(), dim=1)
    gen = torch.Generator().manual_seed(seed)
    # Start from a random balanced partition: every centroid is a mean of real rows from the first round on.
    assign = torch.randperm(n, generator=gen) % clusters
    for _ in range(iters):
        cent = torch.zeros(clusters, f.shape[1]).index_add_(0, assign, f)
        cent = F.normalize(cent, dim=1)
        new = balanced_assign(f @ cent.T, size)
        if torch.equal(new, assign):
            break
        assign = new
    return assign


def expert_size(intermediate: int, opts: MoEfyOptions) -> int:
    """Neurons per expert: I / (E + S) rounded up to a multiple of 8, since transformers' grouped expert
    matmul needs 16-byte row strides (8 bf16 / 4 fp32 values); the rest is dead padding."""
    return 8 * math.ceil(intermediate / (opts.experts + opts.shared_experts) / 8)


@dataclass
class LayerSplit:
    experts: torch.Tensor  # [E, m] neuron indices into the padded MLP (indices >= I are dead padding)
    shared: torch.Tensor  # [S*m] always-on neurons
    padded: int  # dead neurons added


def split_neurons(contrib: torch.Tensor, opts: MoEfyOptions) -> LayerSplit:
    """contrib [T, I]: |a_j(t)| * ||down[:, j]||. Shared neurons by activation frequency, the rest by
    balanced k-means of their activation patterns."""
    t, inter = contrib.shape
    groups = opts.experts + opts.shared_experts
    m = expert_size(inter, opts)
    pad = m * groups - inter
    if pad:
        contrib = torch.cat([contrib, contrib.new_zeros(t, pad)], dim=1)
    neurons = torch.arange(inter + pad)
    shared = torch.empty(0, dtype=torch.long)
    if opts.shared_experts:
        # "Active" in a token = among its strongest top_k/E fraction of neurons (what routing keeps).
        keep = max(1, round(inter * opts.top_k / opts.experts))
        thresh = contrib.topk(keep, dim=1).values[:, -1:]
        freq = (contrib >= thresh).float().mean(0)
        freq[inter:] = -1.0  # padding is never shared
        shared = freq.topk(opts.shared_experts * m).indices.sort().values
        mask = torch.ones(inter + pad, dtype=torch.bool)
        mask[shared] = False
        neurons = neurons[mask]
    gen = torch.Generator().manual_seed(opts.seed)
    rows = torch.randperm(t, generator=gen)[: opts.feature_tokens]
    feats = contrib[rows][:, neurons].T  # [N, D] one activation pattern per neuron
    assign = balanced_kmeans(feats, opts.experts, opts.kmeans_iters, opts.seed)
    experts = torch.stack([neurons[assign == e].sort().values for e in range(opts.experts)])
    return LayerSplit(experts, shared, pad)


# ----------------------------------------------------------------------------------------- the router


def expert_outputs_norm(acts: torch.Tensor, down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """||y_e(x)|| [T, E]: the norm of each expert's contribution to the MLP output (padded indices skipped)."""
    inter = down.shape[1]
    cols = []
    for idx in groups:
        idx = idx[idx < inter]
        cols.append((acts[:, idx] @ down[:, idx].T).norm(dim=1))
    return torch.stack(cols, dim=1)


def fit_router(x: torch.Tensor, targets: torch.Tensor, kind: str, top_k: int, ridge: float = 1e-3) -> torch.Tensor:
    """Router rows [E, H] whose logits x @ W.T rank the experts as `targets` [T, E] do."""
    xd, td = x.double(), targets.double()
    if kind == "lstsq":
        gram = xd.T @ xd
        gram += torch.eye(gram.shape[0], dtype=gram.dtype) * (ridge * gram.diagonal().mean())
        w = torch.linalg.solve(gram, xd.T @ td).T
    elif kind == "centroid":
        top = targets.topk(top_k, dim=1).indices
        hit = torch.zeros_like(td).scatter_(1, top, 1.0)  # [T, E]
        w = (hit.T @ xd) / hit.sum(0).clamp_min(1)[:, None] - xd.mean(0)
    else:
        raise InputError(f"unknown router fit {kind!r}; valid: {', '.join(ROUTER_FITS)}")
    # Centred over experts: a per-token constant changes no ranking, and small logits keep the combine flat.
    return (w - w.mean(0, keepdim=True)).float()


def router_quality(x: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, top_k: int) -> dict:
    """Held-out scores of a router: overlap of its top-k with the oracle top-k of `targets`, and the share of
    the oracle top-k's activation mass its choice captures."""
    sel = (x @ weight.T).topk(top_k, dim=1).indices
    oracle = targets.topk(top_k, dim=1)
    hit = torch.zeros_like(targets, dtype=torch.bool).scatter_(1, oracle.indices, True)
    overlap = hit.gather(1, sel).float().mean().item()
    mass = targets.gather(1, sel).sum(1) / oracle.values.sum(1).clamp_min(1e-30)
    return {"oracle_overlap": round(overlap, 4), "mass_captured": round(mass.mean().item(), 4),
            "random_overlap": round(top_k / targets.shape[1], 4)}


@dataclass
class LayerMoE:
    router: torch.Tensor  # [E, H] written router (low temperature)
    router_fit: torch.Tensor  # [E, H] the fitted router before the temperature
    gate: torch.Tensor  # [E, m, H]
    up: torch.Tensor  # [E, m, H]
    down: torch.Tensor  # [E, H, m] (not yet scaled for the combine)
    shared_gate: torch.Tensor | None  # [S*m, H]
    shared_up: torch.Tensor | None
    shared_down: torch.Tensor | None  # [H, S*m]
    report: dict = field(default_factory=dict)


def _padded(w: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    if not pad:
        return w
    shape = list(w.shape)
    shape[dim] = pad
    return torch.cat([w, w.new_zeros(shape)], dim=dim)


@torch.no_grad()
def moefy_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act,
                opts: MoEfyOptions) -> LayerMoE:
    """Split one dense MLP (gate/up [I, H], down [H, I]) given its calibration inputs x [T, H]."""
    x = x.float()
    gate, up, down = gate.float(), up.float(), down.float()
    acts = act(x @ gate.T) * (x @ up.T)  # [T, I]
    contrib = acts.abs() * down.norm(dim=0)
    split = split_neurons(contrib, opts)
    routed = split.experts
    targets = expert_outputs_norm(acts, down, routed)
    # Fit on the first 7/8 of the tokens, score every fit on the last 1/8; the written router is refit on all.
    cut = max(1, x.shape[0] * 7 // 8)
    quality = {}
    for kind in ROUTER_FITS:
        w = fit_router(x[:cut], targets[:cut], kind, opts.top_k, opts.ridge)
        quality[kind] = router_quality(x[cut:], targets[cut:], w, opts.top_k)
    w = fit_router(x, targets, opts.router_fit, opts.top_k, opts.ridge)
    peak = (x @ w.T).abs().max().item()
    tau = LOGIT_BOUND / peak if peak > 0 else 0.0
    gp, upp, dp = _padded(gate, split.padded, 0), _padded(up, split.padded, 0), _padded(down, split.padded, 1)
    out = LayerMoE(router=w * tau, router_fit=w, gate=gp[routed], up=upp[routed], down=dp[:, routed].permute(1, 0, 2),
                   shared_gate=None, shared_up=None, shared_down=None)
    if split.shared.numel():
        out.shared_gate, out.shared_up, out.shared_down = gp[split.shared], upp[split.shared], dp[:, split.shared]
    share = targets.sum(0) / targets.sum()
    out.report = {"router_fit": quality, "padded_neurons": split.padded, "temperature": tau,
                  "expert_mass_share": {"min": round(share.min().item(), 4), "max": round(share.max().item(), 4)}}
    return out


# ------------------------------------------------------------------------------------------- writing


def _bf16_pair(product: float) -> tuple[float, float]:
    """Two bf16 numbers (a, b) with a * b as close to `product` as bf16 allows: a runs over one octave of bf16
    mantissas (near sqrt(product)), b is the nearest bf16 of product / a."""
    root = math.sqrt(product)
    base = torch.tensor(root, dtype=torch.bfloat16).float().item()
    best = (float("inf"), base, base)
    step = 2.0 ** (math.floor(math.log2(base)) - 7)
    for i in range(-64, 64):
        a = torch.tensor(base + i * step, dtype=torch.bfloat16).float().item()
        if a <= 0:
            continue
        b = torch.tensor(product / a, dtype=torch.bfloat16).float().item()
        err = abs(a * b / product - 1)
        if err < best[0]:
            best = (err, a, b)
    return best[1], best[2]


def _pow2_below(v: float) -> float:
    return 2.0 ** math.floor(math.log2(v))


def qwen3_norm_regime(q_ms: float, k_ms: float, eps: float, dtype: torch.dtype) -> tuple[float, float, float, float]:
    """(q scale, k scale, q_norm weight, k_norm weight) that make Qwen3's q/k RMSNorms linear: z = s q has
    mean square <= _NORM_REGIME * eps, so RMSNorm(z) * w = q * s * w / sqrt(eps); w_q w_k = eps / (s_q s_k)."""
    sq = _pow2_below(math.sqrt(_NORM_REGIME * eps / max(q_ms, 1e-30)))
    sk = _pow2_below(math.sqrt(_NORM_REGIME * eps / max(k_ms, 1e-30)))
    product = eps / (sq * sk)
    if dtype == torch.bfloat16:
        wq, wk = _bf16_pair(product)
    else:
        wq = wk = math.sqrt(product)
    return sq, sk, wq, wk


def moe_config(src: dict, opts: MoEfyOptions, moe_size: int) -> dict:
    """config.json of the MoE model: the source's numbers, the layout's MoE fields."""
    e, k, s = opts.experts, opts.top_k, opts.shared_experts
    if opts.layout == "deepseek_v3":
        cfg = dict(src)
        cfg.update({"n_routed_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": moe_size,
                    "n_shared_experts": s, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_group": 1,
                    "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 2.0})
        if opts.distill is not None:
            cfg.update({"norm_topk_prob": True, "routed_scaling_factor": 1.0})
        return cfg
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id",
            "attention_dropout")
    cfg = {key: src[key] for key in keep if key in src}
    cfg["head_dim"] = src.get("head_dim") or src["hidden_size"] // src["num_attention_heads"]
    cfg.update({"architectures": [_ARCH[opts.layout]], "model_type": opts.layout, "num_experts": e,
                "num_experts_per_tok": k, "moe_intermediate_size": moe_size, "norm_topk_prob": False,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False,
                "output_router_logits": False, "use_cache": True})
    if opts.layout == "qwen2_moe":
        # q/k/v biases on, written as zeros where the source has none: vLLM's Qwen2-MoE (0.32) builds them whatever
        # qkv_bias says and leaves the ones a checkpoint lacks uninitialised (NaN logprobs on the CPU build).
        cfg.update({"qkv_bias": True, "shared_expert_intermediate_size": s * moe_size})
    else:
        cfg["attention_bias"] = False
    if opts.distill is not None:
        cfg["norm_topk_prob"] = True
    return cfg


def _copy_side_files(src: Path, dst: Path) -> None:
    for path in src.iterdir():
        if path.is_file() and (path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges",
                                                       "added_tokens", "chat_template", "generation_config"))
                               or path.suffix == ".model"):
            shutil.copy2(path, dst / path.name)


def _layer_tensors(i: int, moe: LayerMoE, opts: MoEfyOptions, dtype: torch.dtype,
                   shared_expert_gate: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A layer's MoE tensors. The exact split scales them for its near-constant combine weights; a distilled
    layer (`shared_expert_gate` given for Qwen2-MoE) is written as fitted."""
    p = f"model.layers.{i}.mlp."
    distilled = opts.distill is not None
    # Softmax routers: every combine weight is ~1/E, so each routed expert's output is scaled by E (exact in
    # any dtype for a power-of-two E). DeepSeek: 2 * sigmoid(~0) = 1 (routed_scaling_factor 2), no scale.
    scale = 1.0 if opts.layout == "deepseek_v3" or distilled else float(opts.experts)
    out = {p + "gate.weight": moe.router.to(dtype)}
    for e in range(opts.experts):
        q = f"{p}experts.{e}."
        out[q + "gate_proj.weight"] = moe.gate[e].to(dtype)
        out[q + "up_proj.weight"] = moe.up[e].to(dtype)
        out[q + "down_proj.weight"] = (moe.down[e] * scale).to(dtype)
    if moe.shared_gate is not None:
        name = "shared_experts" if opts.layout == "deepseek_v3" else "shared_expert"
        q = f"{p}{name}."
        shared_scale = 1.0
        if opts.layout == "qwen2_moe" and distilled:
            out[p + "shared_expert_gate.weight"] = shared_expert_gate.to(dtype)
        elif opts.layout == "qwen2_moe":
            # Qwen2-MoE scales the shared output by sigmoid(shared_expert_gate(x)): a zero gate gives 1/2.
            out[p + "shared_expert_gate.weight"] = torch.zeros(1, moe.router.shape[1], dtype=dtype)
            shared_scale = 2.0
        out[q + "gate_proj.weight"] = moe.shared_gate.to(dtype)
        out[q + "up_proj.weight"] = moe.shared_up.to(dtype)
        out[q + "down_proj.weight"] = (moe.shared_down * shared_scale).to(dtype)
    if opts.layout == "deepseek_v3":
        out[p + "gate.e_score_correction_bias"] = torch.zeros(opts.experts, dtype=torch.float32)
    return out


# ------------------------------------------------------------------------------------------ the driver


def _layout_spec(layout: str, cfg: dict):
    """The RouterSpec the written config will route by (the runtime's reading of it)."""
    from transformers import CONFIG_MAPPING

    from quantkit.models.moe import router_spec
    from quantkit.runtime.model import _generic_adapter

    return router_spec(_generic_adapter(layout), CONFIG_MAPPING[layout](**cfg))


def _load_source(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    return config, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def check_source(config, opts: MoEfyOptions) -> None:
    mt = getattr(config, "model_type", "?")
    if any(getattr(config, key, None) for key in ("num_local_experts", "num_experts", "n_routed_experts")) and (
            mt != "deepseek_v3" or getattr(config, "first_k_dense_replace", 0) < config.num_hidden_layers):
        raise InputError(f"{mt} is already a MoE model; make_moe splits a dense model's MLPs")
    if opts.layout == "deepseek_v3":
        if mt != "deepseek_v3":
            raise InputError(f"the deepseek_v3 layout needs MLA attention: convert {mt} with `quantkit convert-mla` "
                             "first and MoEfy that dense DeepSeek-V3 model (or use --layout qwen2_moe / qwen3_moe)")
    elif mt not in DENSE_SOURCES:
        raise InputError(f"model type {mt} cannot be MoEfied into {opts.layout}; supported: "
                         f"{', '.join(DENSE_SOURCES)} (and dense deepseek_v3 for --layout deepseek_v3)")
    if mt in ("qwen2", "qwen3") and opts.layout != mt + "_moe":
        raise InputError(f"a {mt} source keeps its attention only in the {mt}_moe layout")
    if getattr(config, "mlp_bias", False):
        raise InputError("the source's MLPs have biases, which no MoE layout here keeps")
    inter = config.intermediate_size
    if opts.experts + opts.shared_experts > inter:
        raise InputError(f"{opts.experts} experts + {opts.shared_experts} shared exceed the {inter} MLP neurons")


@torch.no_grad()
def _calibration_inputs(model, ids: torch.Tensor, batch_size: int, want_qk: bool):
    """Per layer: the MLP inputs [T, H] (fp32), and with want_qk the largest per-head mean square of q and k."""
    layers = model.model.layers
    xs: list[list[torch.Tensor]] = [[] for _ in layers]
    qk = [[0.0, 0.0] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.mlp.register_forward_pre_hook(
            lambda mod, args, i=i: xs[i].append(args[0].reshape(-1, args[0].shape[-1]).float())))
        if want_qk:
            hd = model.config.head_dim if getattr(model.config, "head_dim", None) else (
                model.config.hidden_size // model.config.num_attention_heads)
            for j, proj in enumerate((layer.self_attn.q_proj, layer.self_attn.k_proj)):
                def keep(mod, args, out, i=i, j=j, hd=hd):
                    ms = out.float().reshape(*out.shape[:-1], -1, hd).square().mean(-1).max().item()
                    qk[i][j] = max(qk[i][j], ms)
                hooks.append(proj.register_forward_hook(keep))
    try:
        for s in range(0, ids.shape[0], batch_size):
            model(input_ids=ids[s:s + batch_size], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(x) for x in xs], qk


@torch.no_grad()
def moefy_model(source: str | Path | None, output: Path, opts: MoEfyOptions, dataset: str = "kjv",
                num_samples: int = 16, seq_len: int = 256, calib_seed: int = 42, overwrite: bool = False,
                batch_size: int = 4) -> dict:
    """MoEfy `source` (HF folder or None = the embedded SmolLM2) into `output` (written atomically)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model

    opts.check()
    start = time.time()
    resolved = resolve_model(None if source is None else str(source))
    src_path = resolved.path
    config, model = _load_source(src_path)
    check_source(config, opts)
    output = Path(output)
    if output.exists() and not overwrite:
        raise InputError(f"output {output} exists; pass --overwrite to replace it")
    src_cfg = json.loads((src_path / "config.json").read_text())
    dtype_name = str(src_cfg.get("dtype") or src_cfg.get("torch_dtype") or "float32").replace("torch.", "")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.bfloat16, "float32": torch.float32}.get(dtype_name,
                                                                                                  torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src_path))
    calib = build_token_blocks(tokenizer, dataset, num_samples, seq_len, calib_seed, split="calibration")
    qwen3 = opts.layout == "qwen3_moe"
    split_ids = calib.input_ids if opts.distill is None else calib.input_ids[:opts.distill.local_samples]
    xs, qk = _calibration_inputs(model, split_ids, batch_size, qwen3)
    m = expert_size(config.intermediate_size, opts)
    cfg = moe_config(src_cfg, opts, m)
    cfg["dtype"] = str(dtype).replace("torch.", "")
    tensors: dict[str, torch.Tensor] = {}
    moe_names = ("mlp.gate_proj.", "mlp.up_proj.", "mlp.down_proj.")
    for name, t in model.state_dict().items():
        if any(n in name for n in moe_names) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        tensors[name] = t.to(dtype) if t.is_floating_point() else t
    if opts.layout == "qwen2_moe":
        for i, layer in enumerate(model.model.layers):
            for proj in ("q_proj", "k_proj", "v_proj"):
                name = f"model.layers.{i}.self_attn.{proj}.bias"
                if name not in tensors:
                    tensors[name] = torch.zeros(getattr(layer.self_attn, proj).out_features, dtype=dtype)
    layers_report = []
    students = []
    distill = opts.distill
    spec = _layout_spec(opts.layout, cfg) if distill else None
    with progress_bar() as bar:
        split_task = bar.add_task("split" + (" + local fits" if distill else ""), total=len(model.model.layers),
                                  info="")
        gen = torch.Generator().manual_seed(opts.seed)
        for i, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            moe = moefy_layer(xs[i], mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, mlp.act_fn,
                              opts)
            if distill:
                from quantkit.convert.moe_distill import Switch, fit_local, student_from_split

                target = mlp(xs[i])  # the dense MLP's outputs, under moefy_model's no_grad
                with torch.enable_grad():
                    student = student_from_split(moe, spec, mlp.act_fn, xs[i], distill,
                                                 shared_gate=opts.layout == "qwen2_moe")
                    moe.report["local_fit"] = fit_local(student, xs[i], target, distill, gen)
                layer.mlp = Switch(mlp, student)
                students.append(layer.mlp)
                bar.update(split_task, info=f"layer {i}: relative error "
                                            f"{moe.report['local_fit']['relative_error_after']:.3f}")
            else:
                tensors.update(_layer_tensors(i, moe, opts, dtype))
            xs[i] = None  # release the layer's activations as soon as it is done
            if qwen3:
                p = f"model.layers.{i}.self_attn."
                sq, sk, wq, wk = qwen3_norm_regime(qk[i][0], qk[i][1], config.rms_norm_eps, dtype)
                tensors[p + "q_proj.weight"] = (layer.self_attn.q_proj.weight * sq).to(dtype)
                tensors[p + "k_proj.weight"] = (layer.self_attn.k_proj.weight * sk).to(dtype)
                tensors[p + "q_norm.weight"] = torch.full((cfg["head_dim"],), wq, dtype=dtype)
                tensors[p + "k_norm.weight"] = torch.full((cfg["head_dim"],), wk, dtype=dtype)
                moe.report["qk_norm"] = {"q_scale": sq, "k_scale": sk, "q_norm": wq, "k_norm": wk}
            layers_report.append({"layer": i, **moe.report})
            bar.update(split_task, advance=1)
        history = None
        if distill:
            from quantkit.convert.moe_distill import fit_end_to_end

            e2e_task = bar.add_task("distillation", total=distill.steps, info="")
            with torch.enable_grad():
                history = fit_end_to_end(model, students, calib.input_ids, distill, gen,
                                         lambda step, loss: bar.update(e2e_task, completed=step,
                                                                       info=f"KL {loss:.3f}"))
            for i, switch in enumerate(students):
                t = switch.student.tensors()
                fitted = LayerMoE(router=t["router"], router_fit=t["router"], gate=t["gate"], up=t["up"],
                                  down=t["down"], shared_gate=None, shared_up=None, shared_down=None)
                if t["shared"] is not None:
                    fitted.shared_gate, fitted.shared_up, fitted.shared_down = t["shared"]
                tensors.update(_layer_tensors(i, fitted, opts, dtype, t["shared_gate"]))
    partial = prepare_output(output, overwrite)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial / "model.safetensors"),
                  metadata={"format": "pt"})
        (partial / "config.json").write_text(json.dumps(cfg, indent=2))
        _copy_side_files(src_path, partial)
        fits = {kind: {key: round(sum(r["router_fit"][kind][key] for r in layers_report) / len(layers_report), 4)
                       for key in ("oracle_overlap", "mass_captured")} for kind in ROUTER_FITS}
        summary = {"output": str(output), "source": {"model": resolved.label, "path": str(src_path)},
                   "options": asdict(opts), "moe_intermediate_size": m, "dtype": cfg["dtype"],
                   "calibration": calib.describe(), "router_fit_mean": fits, "layers": layers_report,
                   "wall_seconds": round(time.time() - start, 2)}
        if history is not None:
            summary["distillation"] = {"heldout_kl": history,
                                       "local_relative_error_mean": round(sum(
                                           r["local_fit"]["relative_error_after"] for r in layers_report)
                                           / len(layers_report), 5)}
        (partial / "moefy.json").write_text(json.dumps(summary, indent=2, default=str))
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    publish(partial, output)
    return summary


# ----------------------------------------------------------------------------------------- evaluation


def _kl_stats(base: torch.Tensor, cand: torch.Tensor) -> tuple[float, float]:
    """(sum of per-token KL(base || cand), sum of top-1 agreement) over logits [..., V], in float64."""
    lb = torch.log_softmax(base.double(), -1)
    lc = torch.log_softmax(cand.double(), -1)
    kl = (lb.exp() * (lb - lc)).sum(-1).clamp_min(0)
    return float(kl.sum()), float((lb.argmax(-1) == lc.argmax(-1)).double().sum())


@torch.no_grad()
def evaluate_moe(dense: str | Path | None, moe: Path, ks: list[int], num_samples: int = 8, seq_len: int = 256,
                 seed: int = 42, batch_size: int = 4, dtype: str | torch.dtype | None = "float32",
                 precision_overlap: bool = True) -> dict:
    """Held-out KL(dense || MoE) with the checkpoint's router at each k in `ks`, and with random routing of the
    same experts at the checkpoint's k (same combine rule), on quantkit's runtime; with `precision_overlap`, the
    routing overlap of the checkpoint's own bf16 and fp32 runs."""
    from transformers import AutoTokenizer

    from quantkit.data.calibration import build_token_blocks
    from quantkit.models.source import resolve_model
    from quantkit.runtime import load_model
    from quantkit.runtime.moe import moe_blocks, override_routing, random_routing, topk_routing

    dense_path = resolve_model(None if dense is None else str(dense)).path
    tok = AutoTokenizer.from_pretrained(str(dense_path))
    ids = build_token_blocks(tok, "kjv", num_samples, seq_len, seed=seed, split="heldout").input_ids
    base_rt = load_model(dense_path, dtype)
    base = [base_rt(input_ids=ids[s:s + batch_size], use_cache=False).logits for s in range(0, len(ids), batch_size)]
    del base_rt
    rt = load_model(moe, dtype)
    blocks = moe_blocks(rt.model)
    if not blocks:
        raise InputError(f"{moe} has no sparse-MoE layers")
    spec = blocks[0].spec
    runs = [(f"top{k}", topk_routing(k)) for k in ks if 1 <= k <= spec.num_experts]
    runs.append((f"random{spec.top_k}", random_routing(spec.top_k, seed)))
    out = {}
    for name, fn in runs:
        kl = top1 = 0.0
        n = 0
        with override_routing(rt.model, fn):
            for j, s in enumerate(range(0, len(ids), batch_size)):
                logits = rt(input_ids=ids[s:s + batch_size], use_cache=False).logits
                a, b = _kl_stats(base[j][:, :-1], logits[:, :-1])
                kl, top1, n = kl + a, top1 + b, n + logits[:, :-1].shape[:2].numel()
        out[name] = {"kl": kl / n, "top1_agree": top1 / n}
    result = {"num_experts": spec.num_experts, "top_k": spec.top_k, "tokens": n, "runs": out}
    if precision_overlap:
        result["routing_overlap_bf16_fp32"] = precision_routing_overlap(rt, moe, ids, batch_size)
    return result


@torch.no_grad()
def precision_routing_overlap(rt, path: Path, ids: torch.Tensor, batch_size: int = 4) -> float:
    """Mean top-k overlap between the routing of `rt` (fp32) and of the same checkpoint run in bf16, every
    token and MoE layer: how far the routing decisions sit from rounding noise."""
    from quantkit.eval.moe import RoutingRecorder, routing_drift
    from quantkit.runtime import load_model
    from quantkit.runtime.moe import moe_blocks, observe_routing

    num_experts = moe_blocks(rt.model)[0].spec.num_experts
    records = []
    for model in (rt, load_model(path, torch.bfloat16)):
        rec = RoutingRecorder(num_experts)
        with observe_routing(model.model, rec):
            for s in range(0, len(ids), batch_size):
                model(input_ids=ids[s:s + batch_size], use_cache=False)
        records.append(rec)
    return routing_drift(records[1], records[0], ids.numel())["routing_topk_overlap"]
