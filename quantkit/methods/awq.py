"""AWQ: activation-aware weight quantisation (Lin et al., 2023) with AutoAWQ's scale and clip searches.

Per decoder layer, for every smoothing mapping of the architecture (a norm or linear feeding a group of
linears; MoE: the norm feeding the router, every expert and the shared expert; DeepSeek-V3 MLA: the
input, q_a and kv_a norms):

1. Scale search. s = mean|x|^a / mean|w|^(1-a) (x: the group's calibration inputs; w: the group's weights,
   each normalised by its quantisation group's absmax), divided by sqrt(max(s) * min(s)); a over a grid of
   20 values, plus s = 1. The loss is the MSE of the block's output with the group's weights replaced by
   Q(W * s) / s against the original output. The block is the smallest module holding all of the group's
   linears (self_attn for q/k/v, mlp for gate/up and for a MoE block, whose routing the loss so includes),
   run on a sample of whole calibration batches (`search_tokens`) with the keyword arguments the layer
   really received; a group of one linear (v -> o, up -> down, the MLA norms) is its own block, and its
   loss sum ||(W - Wq) x||^2 is evaluated over all calibration tokens from the Hessian H = sum x x^T.
2. The chosen s is folded into the source (norm weight / s; Gemma: (1 + w) / s - 1; a linear's output
   rows and bias / s) and the targets' columns (* s); routers reading the same tensor get their columns
   scaled too, so routing is unchanged. v -> o under grouped-query attention: s lives on v's channels
   and is repeated over the query heads of each group. A norm weight is stored in the checkpoint dtype, so
   the targets are multiplied by the scale the rounded norm weight really applies (w / bf16(w / s)): the
   fold is exact apart from that rounding of the norm weight itself. The checkpoint is a plain W4A16
   model with no extra ops.
3. Clip search (AutoAWQ's): for each output row and quantisation group, the group's range [min, max] is
   shrunk by p in 1, 0.95, ..., 0.55, keeping the p with the smallest error of the group's partial
   outputs sum_tokens (x_g . (w_g - q_g))^2. AutoAWQ measures it on 512 sampled tokens; here it is
   d_g^T H_gg d_g with the block-diagonal of the (scaled) Hessian, i.e. over every calibration token, at
   less cost. Skipped for query/key projections, whose error goes through the softmax (`clip_skip`).
4. Quantisation with those ranges (scales rounded to the checkpoint dtype first, as stored).

With a later quantiser (`awq+gptq`) AWQ only scales and folds; the engine then collects GPTQ's Hessian in
a second pass over the scaled layer. Statistics come from one calibration pass per layer, in which every
MoE expert sees every token; the reference outputs of each block are computed once.

A group of linears that reads a norm's output but has no mapping in the adapter gets a derived mapping
(norm -> those linears) when the norm is checked to be multiplicative (output scales with its weight);
otherwise it is quantised without scaling, and both cases are reported in the manifest. NaN/Inf
statistics are reported and the affected batches or mappings skipped; they never reach the checkpoint.

Options (recipe `quantization.options.awq`):
  n_grid         scale-search grid size (default 20)
  duo_scaling    true (default): s = x^a / w^(1-a); false: s = x^a
  search_tokens  calibration tokens (whole batches) the block losses run on (default 4096)
  statistics_tokens   calibration tokens (the run's first whole batches, at least search_tokens) the unquantised
                 statistics pass runs on: mean |x|, the Hessians of the linear losses and the clip search, and the
                 block-loss samples (default 4096; 0: every token). Every batch still runs through the quantised
                 layer to feed the next one, so the pass that costs a full forward runs once per layer, not twice.
  loss           "block" (default) or "linear" (every group scored by its linears' outputs via H)
  clip           true (default): AutoAWQ's clip search; false: plain min/max ranges
  clip_grid, clip_max_shrink   shrink grid (default 20, 0.5: p = 1 - k/20 for k < 10)
  clip_skip      regexes of layer-local names excluded from the clip search (default q/k projections)
  derive         derive norm -> linears mappings the adapter lacks (default true)
  search         "coarse-fine" (default: every coarse_step-th ratio, default 4, then the grid between the best one's
                 neighbours, 12 block evaluations instead of 21; see search_grid) or "grid" (every ratio of the grid)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

import torch
from torch import nn

from quantkit.compute import one_thread
from quantkit.errors import InputError
from quantkit.methods.base import LayerContext, Method, QuantizedWeight, SharedInputs, check_known_options
from quantkit.quant import QuantArgs, compute_qparams, fake_quantize, group_view, quantize_weight
from quantkit.quant.hessian import accumulate_hessian, complete_hessian
from quantkit.quant.integer import SEARCH_CHUNK, round_to_dtype
from quantkit.quant.smoothing import (ResolvedSmoothing, expand_gqa, fold_into_norm, resolve_mappings, scale_columns,
                                      scale_rows)

SEARCHES = ("grid", "coarse-fine")
CLIP_SKIP = (r"(.*\.)?(q_proj|k_proj|q_a_proj|q_b_proj|query|key|Wqkv|qkv_proj)",)


@dataclass(frozen=True)
class AWQConfig:
    n_grid: int = 20
    duo_scaling: bool = True
    search_tokens: int = 4096
    loss: str = "block"
    clip: bool = True
    clip_grid: int = 20
    clip_max_shrink: float = 0.5
    clip_skip: tuple[str, ...] = CLIP_SKIP
    derive: bool = True
    search: str = "coarse-fine"
    coarse_step: int = 4
    statistics_tokens: int = 4096  # 0: every calibration token; else the first batches up to this many
    # The block-loss search's forwards: "compute" (the run's compute dtype) or "float32" (a float32 copy of the
    # block and its samples). On SmolLM2 W4A16 g64 (bf16 compute) float32 gave held-out KL 0.263 / 0.272 (KJV /
    # pydoc) against 0.289 / 0.263, at 1.3x the wall time (README, "AWQ").
    search_dtype: str = "compute"

    def __post_init__(self) -> None:
        if self.search_dtype not in ("compute", "float32"):
            raise InputError(f"awq search_dtype must be 'compute' or 'float32', got {self.search_dtype!r}")
        if self.search not in SEARCHES:
            raise InputError(f"awq search must be one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.coarse_step < 1:
            raise InputError("awq coarse_step must be positive")
        if self.n_grid < 1 or self.clip_grid < 1:
            raise InputError("awq n_grid and clip_grid must be positive")
        if self.loss not in ("block", "linear"):
            raise InputError(f"awq loss must be 'block' or 'linear', got {self.loss!r}")
        if not 0 <= self.clip_max_shrink < 1:
            raise InputError(f"awq clip_max_shrink must be in [0, 1), got {self.clip_max_shrink}")
        if self.search_tokens < 1:
            raise InputError("awq search_tokens must be positive")
        if self.statistics_tokens < 0:
            raise InputError("awq statistics_tokens must be 0 (every token) or positive")

    @classmethod
    def from_options(cls, options: dict) -> "AWQConfig":
        check_known_options("awq", options, [f.name for f in fields(cls)])
        opts = dict(options)
        if "clip_skip" in opts:
            opts["clip_skip"] = tuple(opts["clip_skip"] or ())
        return cls(**opts)


# ---------------------------------------------------------------------------------------------------------
# Pure numerics
# ---------------------------------------------------------------------------------------------------------


def scaled_fake_quant(w: torch.Tensor, c: torch.Tensor, args: QuantArgs, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """fake_quantize(w * c) / c for column scales c [in], written into `out` (any dtype; default fp32). Works in
    row chunks whose temporaries stay small and under the engine's mmap threshold (measured: unchunked, with a
    1 MB threshold, most of the time went to page-faulting fresh mappings)."""
    out = torch.empty_like(w) if out is None else out
    if args.strategy == "tensor":  # one scale for the whole matrix: no row chunking
        out.copy_(fake_quantize(w * c[None, :], args, dtype) / c[None, :])
        return out
    step = max(1, SEARCH_CHUNK // w.shape[1])
    for r0 in range(0, w.shape[0], step):
        out[r0 : r0 + step] = fake_quantize(w[r0 : r0 + step] * c[None, :], args, dtype) / c[None, :]
    return out


def weight_mean(weights: list[torch.Tensor], args: QuantArgs) -> torch.Tensor:
    """Per input column: mean over all rows of |w| / (absmax of w's quantisation group)."""
    rows = []
    for w in weights:
        g = group_view(w.float().abs(), args)
        rows.append((g / (g.amax(-1, keepdim=True) + 1e-6)).reshape(w.shape))
    return torch.cat(rows).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, n_grid: int) -> list[tuple[float, torch.Tensor]]:
    """(a, s) for a = 0, 1/n, ..., (n-1)/n: s = x^a / w^(1-a) (w None: x^a), normalised so that
    max(s) * min(s) = 1; plus (-1, ones) = no scaling."""
    out = [(-1.0, torch.ones_like(x_mean))]
    for k in range(n_grid):
        a = k / n_grid
        s = x_mean.pow(a)
        if w_mean is not None:
            s = s / (w_mean.pow(1 - a) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        if torch.isfinite(s).all():
            out.append((a, s))
    return out


def search_grid(candidates: list[tuple[float, torch.Tensor]], loss_at, how: str, losses: dict[int, float],
                step: int = 2) -> None:
    """Fill `losses` (candidate index -> loss) with the candidates the search evaluates. "grid": every one.
    "coarse-fine": the unscaled candidate and every `step`-th ratio, then every ratio between the best coarse one's
    neighbours: the grid's own minimum whenever the loss falls and then rises along the ratios (13 evaluations
    instead of 21 at AutoAWQ's grid of 20 with step 2)."""
    ratios = [i for i, (a, _) in enumerate(candidates) if a >= 0]
    unscaled = [i for i, (a, _) in enumerate(candidates) if a < 0]
    first = unscaled + (ratios if how == "grid" else ratios[::step])
    for i in first:
        losses[i] = loss_at(i)
    if how == "grid" or not ratios:
        return
    best = min((i for i in ratios if i in losses and math.isfinite(losses[i])), key=lambda i: losses[i], default=None)
    if best is None:
        return
    at = ratios.index(best)
    for i in ratios[max(0, at - step + 1) : at + step]:
        if i not in losses:
            losses[i] = loss_at(i)


def hessian_loss(weight: torch.Tensor, approx: torch.Tensor, h: torch.Tensor) -> float:
    """sum over tokens ||(W - Wq) x||^2 from H = sum x x^T. With a bf16 H the product runs in bf16 (fp32
    accumulation; ~9x faster on AMX CPUs): the loss moves by ~3e-5 relative, far below the gaps between
    candidate scales."""
    d = weight - approx
    if h.dtype == torch.bfloat16:
        return float(((d.to(torch.bfloat16) @ h).float() * d).sum())
    return float(((d @ h) * d).sum())


def group_hessians(h: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """The diagonal blocks of H [n, n] that one quantisation group sees: [n_groups, gs, gs]."""
    n = h.shape[0]
    if args.strategy != "group":
        return h[None]
    gs = args.group_size
    ng = n // gs
    return h.reshape(ng, gs, ng, gs).diagonal(dim1=0, dim2=2).permute(2, 0, 1)


def clip_search(w: torch.Tensor, h: torch.Tensor, args: QuantArgs, dtype: torch.dtype, grid: int = 20,
                max_shrink: float = 0.5, row_block: int | None = None) -> torch.Tensor:
    """The shrink factor p [out, n_groups] of each group's range [min, max] minimising the error of the
    group's partial outputs, d_g^T H_gg d_g with d = w - Q(w) (AutoAWQ's clip search, over H's tokens)."""
    g_all = group_view(w, args)  # [out, ng, gs]
    hg = group_hessians(h, args)  # [ng, gs, gs]
    steps = [1.0 - k / grid for k in range(max(1, int(max_shrink * grid)))]
    best_p = torch.ones(g_all.shape[:2], device=w.device)
    row_block = row_block or max(1, SEARCH_CHUNK // w.shape[1])
    for r0 in range(0, g_all.shape[0], row_block):
        g = g_all[r0 : r0 + row_block]
        lo, hi = g.amin(-1), g.amax(-1)
        best = torch.full(g.shape[:2], float("inf"), device=w.device)
        for p in steps:
            scale, zp = compute_qparams(lo * p, hi * p, args)
            scale = round_to_dtype(scale, dtype)[..., None]
            zpf = zp.float()[..., None]
            q = torch.round(g / scale + zpf).clamp_(args.qmin, args.qmax)
            d = (g - round_to_dtype((q - zpf) * scale, dtype)).transpose(0, 1)  # [ng, rows, gs]
            err = ((d @ hg) * d).sum(-1).transpose(0, 1)
            better = err < best
            best = torch.where(better, err, best)
            best_p[r0 : r0 + row_block] = torch.where(better, p, best_p[r0 : r0 + row_block])
    return best_p


def quantize_clipped(w: torch.Tensor, p: torch.Tensor | None, args: QuantArgs, dtype: torch.dtype):
    """(q, scale, zp) of w with each group's range shrunk by p (None: plain min/max)."""
    g = group_view(w, args)
    lo, hi = g.amin(-1), g.amax(-1)
    if p is not None:
        lo, hi = lo * p, hi * p
    scale, zp = compute_qparams(lo, hi, args)
    if args.strategy == "tensor":
        scale, zp = scale.reshape(1), zp.reshape(1)
    return quantize_weight(w, args, scale=scale, zero_point=zp, scale_dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# Calibration statistics
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _InputStats:
    """Statistics of one distinct input tensor (shared by every linear that reads it)."""

    abs_sum: torch.Tensor | None = None
    h: torch.Tensor | None = None
    tokens: int = 0
    bad_batches: int = 0
    source: str | None = None  # the norm-like module whose output this is (derived mappings)

    def add(self, x: torch.Tensor, with_h: bool, matmul_dtype: torch.dtype = torch.float32) -> None:
        x2 = x.detach().reshape(-1, x.shape[-1])
        # Per-batch terms in float32, their sums in float64: exact, however the batches are split over ranks.
        a = x2.abs().sum(0, dtype=torch.float32).double()
        # Any inf/NaN input reaches the column sums (accumulate_hessian checks its own product too).
        if not torch.isfinite(a).all():
            self.bad_batches += 1
            return
        if with_h:
            if self.h is None:
                self.h = torch.zeros(x2.shape[-1], x2.shape[-1], dtype=torch.float64, device=x2.device)
            if not accumulate_hessian(self.h, x2, matmul_dtype):
                self.bad_batches += 1
                return
        self.abs_sum = a if self.abs_sum is None else self.abs_sum + a
        self.tokens += x2.shape[0]

    def mean_hessian(self) -> torch.Tensor:
        """H / tokens in fp32, the sum made whole first (accumulate_hessian sums only its upper blocks)."""
        return (complete_hessian(self.h) / max(self.tokens, 1)).float()

    def mean_abs(self) -> torch.Tensor | None:
        return None if self.abs_sum is None or not self.tokens else (self.abs_sum / self.tokens).float()


@dataclass
class _Mapping:
    m: ResolvedSmoothing
    derived: bool = False
    parent: str | None = None  # module that is the block for the loss (None: linear loss via H)
    samples: list = field(default_factory=list)  # (args, kwargs) of `parent` for the sampled batches
    sampled: int = 0  # tokens in `samples`


class AWQ(Method):
    name = "awq"
    needs_calibration = True
    schemes = ("W4A16", "W4A16_ASYM", "W8A16")

    def __init__(self, scheme, **options):
        super().__init__(scheme, **options)
        self.config = AWQConfig.from_options(options)
        if scheme.weights.type != "int" or scheme.weights.strategy not in ("group", "channel"):
            raise InputError(f"awq makes integer weights with group or channel scales, not {scheme.name}")
        self.only_transform = False
        self.report: list[dict] = []
        self._reset()

    @property
    def statistics_tokens(self) -> int | None:
        # The block losses sample the first search_tokens of the same pass, so the pass covers at least those.
        cfg = self.config
        return max(cfg.statistics_tokens, cfg.search_tokens) if cfg.statistics_tokens else None

    def transform_only(self) -> None:
        """A later method quantises (awq+gptq): scale and fold only."""
        self.only_transform = True
        self.quantizes = False

    def _reset(self) -> None:
        self._stats: dict[str, _InputStats] = {}
        self._shared = SharedInputs()
        self._norm_outputs: list[tuple[torch.Tensor, str]] = []
        self._mappings: list[_Mapping] = []

    # ----- calibration --------------------------------------------------------------------------------

    def attach(self, ctx: LayerContext) -> list:
        self._reset()
        cfg = self.config
        modules = dict(ctx.layer.named_modules())
        resolved = resolve_mappings(ctx.layer, ctx.adapter.smoothing if ctx.adapter is not None else ())
        self._mappings = []
        for m in resolved:
            quantised = [t for t in m.targets if t in ctx.targets]
            # Targets left unquantised (routers, --ignore'd linears) are still scaled, so the fold stays exact.
            if quantised:
                self._mappings.append(_Mapping(m, parent=self._block_of(m, modules)))
        hooks = []
        for name, linear in ctx.targets.items():
            hooks.append(linear.register_forward_pre_hook(self._input_hook(ctx, name)))
        for mp in self._mappings:
            if mp.parent is not None:
                hooks.append(modules[mp.parent].register_forward_pre_hook(self._sample_hook(mp), with_kwargs=True))
        if cfg.derive:
            for name, mod in modules.items():
                w = getattr(mod, "weight", None)
                if (name and not list(mod.children()) and isinstance(w, torch.Tensor) and w.dim() == 1
                        and not isinstance(mod, nn.Linear)):
                    hooks.append(mod.register_forward_hook(self._norm_hook(name)))
        return hooks

    def _block_of(self, m: ResolvedSmoothing, modules: dict) -> str | None:
        if self.config.loss == "linear" or len(m.targets) < 2:
            return None
        parts = [t.split(".") for t in m.targets]
        prefix = []
        for level in zip(*parts):
            if len(set(level)) != 1:
                break
            prefix.append(level[0])
        name = ".".join(prefix)
        return name if name and name in modules else None

    def _input_hook(self, ctx: LayerContext, name: str):
        # bf16 products where the layer's matmuls read bf16 (as GPTQ's statistics); fp32 otherwise.
        mm_dtype = torch.bfloat16 if ctx.matmul_dtype == torch.bfloat16 else torch.float32

        def hook(module, args):
            x = args[0]
            if self._shared.see(name, x) != name:
                return
            with ctx.phase("statistics"):
                if name not in self._stats:
                    src = next((n for t, n in self._norm_outputs if t is x), None)
                    self._stats[name] = _InputStats(source=src)
                self._stats[name].add(x, with_h=True, matmul_dtype=mm_dtype)

        return hook

    def _norm_hook(self, name: str):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                self._norm_outputs = (self._norm_outputs + [(out, name)])[-8:]

        return hook

    def _sample_hook(self, mp: _Mapping):
        def hook(module, args, kwargs):
            if mp.sampled >= self.config.search_tokens:
                return
            if not isinstance(_sample_input(args, kwargs), torch.Tensor):
                return
            mp.samples.append((tuple(args), dict(kwargs)))
            mp.sampled += _tokens_of(args, kwargs)

        return hook

    def reduce_statistics(self, ranks) -> None:
        named = {}
        for name, st in self._stats.items():
            named[f"{name}\0tokens"] = torch.tensor([st.tokens, st.bad_batches])
            for part in ("abs_sum", "h"):
                if getattr(st, part) is not None:
                    named[f"{name}\0{part}"] = getattr(st, part)
        sources = {}
        for part in ranks.gather({n: st.source for n, st in self._stats.items()}):
            for n, src in part.items():
                sources[n] = sources.get(n) or src
        self._stats = {}
        for key, value in ranks.reduce(named, "sum").items():
            name, part = key.split("\0")
            st = self._stats.setdefault(name, _InputStats(source=sources.get(name)))
            if part == "tokens":
                st.tokens, st.bad_batches = int(value[0]), int(value[1])
            else:
                setattr(st, part, value)
        # The block losses run on the first whole batches of the run, up to search_tokens, as in one process:
        # each rank's first batches, in rank order, cut where one process would stop sampling.
        for mp in self._mappings:
            if mp.parent is None:
                continue
            sizes = ranks.gather([_tokens_of(a, k) for a, k in mp.samples])
            kept, total = [], 0
            for r, part in enumerate(sizes):
                for i, n in enumerate(part):
                    if total < self.config.search_tokens:
                        kept.append((r, i))
                        total += n
            samples = []
            for r in range(ranks.world):
                take = sum(1 for owner, _ in kept if owner == r)
                if take:
                    samples += ranks.broadcast(mp.samples[:take] if ranks.rank == r else None, src=r)
            mp.samples, mp.sampled = samples, total

    # ----- search, fold, clip, quantise ----------------------------------------------------------------

    def apply(self, ctx: LayerContext) -> None:
        self._shared.release()
        self._norm_outputs = []
        modules = dict(ctx.layer.named_modules())
        work = {n: lin.weight.data.float().clone() for n, lin in ctx.targets.items()}
        rescale: dict[str, torch.Tensor] = {}  # leader -> s: its input is now x / s
        for name, st in self._stats.items():
            if st.bad_batches:
                ctx.warn(name, f"awq: skipped {st.bad_batches} calibration batch(es) with NaN/Inf activations")
        mappings = self._mappings + self._derived(ctx, modules)
        for mp in mappings:
            with ctx.phase("scale_search"):
                self._search_and_fold(ctx, mp, modules, work, rescale)
            mp.samples = []
        if self.only_transform:
            for n, lin in ctx.targets.items():
                lin.weight.data.copy_(work[n].to(lin.weight.dtype))
            self._stats = {}
            return
        with one_thread(next(iter(work.values())).device if work else torch.device("cpu")):
            for name in ctx.pending():
                self._quantize(ctx, name, work[name], rescale)
        self._stats = {}

    def _derived(self, ctx: LayerContext, modules: dict) -> list[_Mapping]:
        covered = {t for mp in self._mappings for t in mp.m.targets}
        groups: dict[str, list[str]] = {}
        for name in ctx.targets:
            leader = self._shared.leader(name)
            groups.setdefault(leader, []).append(name)
        out = []
        for leader, names in groups.items():
            if any(n in covered for n in names):
                continue
            st = self._stats.get(leader)
            src = st.source if st else None
            if src is None:
                continue
            if not self.config.derive or not _multiplicative(modules[src]):
                ctx.warn(names[0], f"awq: layer {ctx.index}: no mapping for {src} -> {', '.join(names)}; quantised "
                                   f"without scaling")
                continue
            ctx.warn(names[0], f"awq: layer {ctx.index}: derived mapping {src} -> {', '.join(names)} (not in the "
                               f"adapter)")
            out.append(_Mapping(ResolvedSmoothing(src, "norm", names), derived=True))
        return out

    def _search_and_fold(self, ctx: LayerContext, mp: _Mapping, modules: dict, work: dict, rescale: dict) -> None:
        cfg, dtype = self.config, ctx.weight_dtype
        m = mp.m
        quantised = [t for t in m.targets if t in ctx.targets]
        args = ctx.scheme_for(quantised[0]).weights  # the group's mean weight magnitude, in its first one's groups
        leader = self._shared.leader(quantised[0])
        st = self._stats.get(leader)
        x_mean = st.mean_abs() if st else None
        if x_mean is None or not torch.isfinite(x_mean).all():
            ctx.warn(quantised[0], f"awq: no finite calibration statistics for {m.source} -> {quantised[0]}; not scaled")
            return
        w_mean = weight_mean([work[t] for t in quantised], args) if cfg.duo_scaling else None
        src_out = None
        if m.head_dim:
            src_out = modules[m.source].weight.shape[0]
            n_kv = src_out // m.head_dim
            x_mean = x_mean.reshape(n_kv, -1, m.head_dim).mean(1).reshape(-1)
            if w_mean is not None:
                w_mean = w_mean.reshape(n_kv, -1, m.head_dim).mean(1).reshape(-1)

        def cols_for(s: torch.Tensor, target: str) -> torch.Tensor:
            n_in = work[target].shape[1] if target in work else modules[target].weight.shape[1]
            return expand_gqa(s, n_in, m.head_dim) if m.head_dim else s

        candidates = candidate_scales(x_mean, w_mean, cfg.n_grid)
        losses: dict[int, float] = {}
        if mp.parent is not None and mp.samples:
            block, samples = modules[mp.parent], mp.samples
            if cfg.search_dtype == "float32":
                block, samples = _float32_copy(block, samples)
            searched = {t: block.get_submodule(t[len(mp.parent) + 1:]) for t in quantised}
            saved = {t: modules[t].weight.data.clone() for t in quantised}
            with torch.no_grad():
                refs = [_first(block(*a, **k)) for a, k in samples]

                def loss_at(i: int) -> float:
                    s = candidates[i][1]
                    with one_thread(work[quantised[0]].device):
                        for t in quantised:
                            scaled_fake_quant(work[t], cols_for(s, t), ctx.scheme_for(t).weights, dtype,
                                              out=searched[t].weight.data)
                    outs = [_first(block(*a, **k)) for a, k in samples]
                    with one_thread(work[quantised[0]].device):
                        loss = sum(float(torch.linalg.vector_norm(o - r, dtype=torch.float32) ** 2) / o.numel()
                                   for o, r in zip(outs, refs))
                    return loss / len(refs)

                search_grid(candidates, loss_at, cfg.search, losses, cfg.coarse_step)
                for t in quantised:
                    modules[t].weight.data.copy_(saved[t])
        else:
            h = st.mean_hessian()
            if leader in rescale:
                r = rescale[leader]
                h = h / (r[:, None] * r[None, :])
            if ctx.matmul_dtype == torch.bfloat16:
                h = h.to(torch.bfloat16)

            def loss_at(i: int) -> float:
                s = candidates[i][1]
                return sum(hessian_loss(work[t], scaled_fake_quant(work[t], cols_for(s, t), ctx.scheme_for(t).weights,
                                                                   dtype), h) for t in quantised)

            with one_thread(h.device):
                search_grid(candidates, loss_at, cfg.search, losses, cfg.coarse_step)
        finite = sorted(i for i, v in losses.items() if math.isfinite(v))  # ties: the lowest index, as before
        if not finite:
            ctx.warn(quantised[0], f"awq: scale search for {m.source} gave no finite loss; not scaled")
            return
        best = min(finite, key=lambda i: losses[i])
        ratio, s = candidates[best]
        self.report.append({"layer": ctx.index, "source": m.source, "ratio": ratio, "loss": losses[best],
                            "loss_unscaled": losses[0], "derived": mp.derived})
        if ratio < 0:
            return
        s_eff = self._fold(ctx, m, s, modules, work, cols_for)
        # The targets' inputs are now x / s: the clip search's Hessians must see that.
        for lead in dict.fromkeys(self._shared.leader(t) for t in quantised):
            full = cols_for(s_eff, next(t for t in quantised if self._shared.leader(t) == lead))
            prev = rescale.get(lead)
            rescale[lead] = full if prev is None else prev * full

    def _fold(self, ctx: LayerContext, m: ResolvedSmoothing, s: torch.Tensor, modules: dict, work: dict,
              cols_for) -> torch.Tensor:
        """Fold s into the source and targets in place; returns the scale actually applied."""
        dtype = ctx.weight_dtype
        source = modules[m.source]
        with torch.no_grad():
            if m.kind in ("norm", "gemma_norm"):
                w = source.weight.data.float()
                off = 1.0 if m.kind == "gemma_norm" else 0.0
                new = round_to_dtype(fold_into_norm(w, s, gemma=off == 1.0), dtype)
                # The scale the stored (rounded) norm weight really applies: compensate exactly that.
                denom = new + off
                s = torch.where(denom != 0, (w + off) / torch.where(denom != 0, denom, torch.ones_like(denom)), s)
                source.weight.data.copy_(new.to(source.weight.dtype))
            elif m.source in work:
                work[m.source] = scale_rows(work[m.source], s)
                source.weight.data.copy_(work[m.source].to(source.weight.dtype))
            else:
                source.weight.data.copy_(scale_rows(source.weight.data, s).to(source.weight.dtype))
            bias = getattr(source, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.data.copy_((bias.data.float() / s).to(bias.dtype))
            for t in m.targets:
                c = cols_for(s, t)
                if t in work:
                    work[t] = scale_columns(work[t], c)
                    modules[t].weight.data.copy_(work[t].to(modules[t].weight.dtype))
                else:  # routers and other readers that are not quantised
                    tw = modules[t].weight
                    tw.data.copy_(scale_columns(tw.data, c).to(tw.dtype))
        return s

    def _quantize(self, ctx: LayerContext, name: str, w: torch.Tensor, rescale: dict) -> None:
        cfg, args, dtype = self.config, ctx.scheme_for(name).weights, ctx.weight_dtype
        if not torch.isfinite(w).all():
            ctx.warn(name, f"awq: {int((~torch.isfinite(w)).sum())} NaN/Inf weight(s) replaced by 0")
            w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        leader = self._shared.leader(name)
        st = self._stats.get(leader)
        h = None
        if st is not None and st.h is not None and st.tokens:
            h = st.mean_hessian()
            r = rescale.get(leader)
            if r is not None:
                h = h / (r[:, None] * r[None, :])
            if not torch.isfinite(h).all():
                h = None
        p = None
        if cfg.clip and h is not None and not any(re.fullmatch(pat, name) for pat in cfg.clip_skip):
            with ctx.phase("clip_search"):
                p = clip_search(w, h, args, dtype, cfg.clip_grid, cfg.clip_max_shrink)
        q, scale, zp = quantize_clipped(w, p, args, dtype)
        result = QuantizedWeight(q, scale.float(), None if args.symmetric else zp, method=self.name)
        ctx.set_quantized(name, result)
        if h is not None:
            with ctx.phase("error_report"):
                approx = ctx.targets[name].weight.data.float()
                den = float(((w @ h) * w).sum())
                loss = max(hessian_loss(w, approx, h), 0.0)
            ctx.linear_errors[name] = math.sqrt(loss / den) if den > 0 else 0.0


def _float32_copy(block: nn.Module, samples: list) -> tuple[nn.Module, list]:
    """A float32 copy of `block` and of the floating tensors of its sample calls (nested tuples included)."""
    import copy

    def up(v):
        if isinstance(v, torch.Tensor):
            return v.float() if v.is_floating_point() else v
        return tuple(up(u) for u in v) if isinstance(v, tuple) else v

    twin = copy.deepcopy(block).float()
    for m in twin.modules():  # the run's hooks (statistics, samples, taps) belong to the block, not to the copy
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._forward_hooks_with_kwargs,
                      m._forward_pre_hooks_with_kwargs, m._forward_hooks_always_called):
            hooks.clear()
    return twin, [(tuple(up(x) for x in a), {k: up(v) for k, v in kw.items()}) for a, kw in samples]


def _sample_input(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states")


def _tokens_of(args, kwargs) -> int:
    x = _sample_input(args, kwargs)
    return x.numel() // x.shape[-1]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _multiplicative(norm: nn.Module) -> bool:
    """Whether the module's output scales with its weight (an RMSNorm-style `x_hat * w`), so a scale folds in."""
    w = norm.weight
    x = torch.randn(4, w.shape[0], dtype=w.dtype, device=w.device, generator=None)
    saved = w.data.clone()
    try:
        with torch.no_grad():
            a = _first(norm(x)).float()
            w.data.mul_(2)
            b = _first(norm(x)).float()
        return bool(torch.allclose(b, 2 * a, rtol=1e-2, atol=1e-3)) and bool(a.abs().sum() > 0)
    except Exception:
        return False
    finally:
        w.data.copy_(saved)
