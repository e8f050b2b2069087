"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8 quantisation.

For every smoothing mapping of the architecture (a norm or linear feeding a group of linears, MoE routers
and experts included), the calibration pass records the per-channel absmax of the group's input X; then
s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) (W: the group's quantised weights, stacked) is folded into the
source (X_j / s_j) and the targets (W[:, j] * s_j). The layer computes the same function, but the
activations the consumer quantises per token have a flatter channel profile. A pure transform: a quantiser
follows (`smoothquant` alone means `smoothquant+rtn`; `smoothquant+gptq` runs GPTQ on the smoothed layer). Under
the one-pass schedule norm-fed groups smooth inside the grouped pass: when every batch has reached a group, its
scales are folded, the paused inputs divided by them and GPTQ's Hessian rescaled to match, so no batch runs the
layer a second time for these statistics (the groups after the first see the earlier groups quantised, as GPTQ's
own statistics do). Linear sources and `statistics_tokens` keep a calibration pass of their own.

Options (recipe `quantization.options.smoothquant`):
  alpha     migration strength in [0, 1] (default 0.8); 0 leaves activations alone.
  mappings  "norm" (default): only norm-fed groups, as the SmoothQuant paper and llm-compressor do;
            "all": also linear -> linear pairs (v_proj -> o_proj, up_proj -> down_proj).
  statistics_tokens  calibration tokens (the run's first whole batches) the absmax observers see (0: every token)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from quantkit.errors import InputError
from quantkit.methods.base import LayerContext, Method, check_known_options
from quantkit.quant.smoothing import (
    ResolvedSmoothing,
    apply_smoothing,
    channel_absmax,
    group_max,
    resolve_mappings,
    smoothquant_scales,
    weight_column_absmax,
)

ACTIVATION_SCHEMES = ("W8A8", "W8A8_STATIC", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "W4AFP8", "NVFP4", "MXFP4")


@dataclass(frozen=True)
class SmoothQuantConfig:
    alpha: float = 0.8
    mappings: str = "norm"
    statistics_tokens: int = 0  # 0: every calibration token; else the run's first batches up to this many

    def __post_init__(self) -> None:
        if self.statistics_tokens < 0:
            raise InputError("smoothquant statistics_tokens must be 0 (every token) or positive")
        if not (0.0 <= float(self.alpha) <= 1.0):
            raise InputError(f"smoothquant alpha must be in [0, 1], got {self.alpha}")
        if self.mappings not in ("norm", "all"):
            raise InputError(f"smoothquant mappings must be 'norm' or 'all', got {self.mappings!r}")

    @classmethod
    def from_options(cls, options: dict) -> "SmoothQuantConfig":
        check_known_options("smoothquant", options, [f.name for f in fields(cls)])
        return cls(**options)


class SmoothQuant(Method):
    name = "smoothquant"
    needs_calibration = True
    quantizes = False
    # Smoothing only pays off when activations are quantised; for weight-only schemes it moves error into
    # the weights for nothing (AWQ is the weight-only counterpart).
    schemes = ACTIVATION_SCHEMES

    @property
    def statistics_tokens(self) -> int | None:
        return self.config.statistics_tokens or None

    def __init__(self, scheme, **options):
        super().__init__(scheme, **options)
        self.config = SmoothQuantConfig.from_options(options)
        self._mappings: list[ResolvedSmoothing] = []
        self._absmax: dict[int, torch.Tensor] = {}

    def attach(self, ctx: LayerContext) -> list:
        mappings = resolve_mappings(ctx.layer, ctx.adapter.smoothing if ctx.adapter is not None else ())
        if self.config.mappings == "norm":
            mappings = [m for m in mappings if m.kind != "linear"]
        # Only groups with something to quantise are worth smoothing.
        self._mappings = [m for m in mappings if any(t in ctx.targets for t in m.targets)]
        self._absmax = {}
        modules = dict(ctx.layer.named_modules())
        hooks = []
        for k, m in enumerate(self._mappings):
            def record(x: torch.Tensor, k=k) -> None:
                with ctx.phase("statistics"):
                    a = channel_absmax(x)
                    prev = self._absmax.get(k)
                    self._absmax[k] = a if prev is None else torch.maximum(prev, a)

            if m.kind == "linear":
                # The target's input (after attention / the gated activation), not the source's output.
                hooks.append(modules[m.targets[0]].register_forward_pre_hook(lambda mod, args, r=record: r(args[0])))
            else:
                hooks.append(modules[m.source].register_forward_hook(lambda mod, args, out, r=record: r(out)))
        return hooks

    def reduce_statistics(self, ranks) -> None:
        reduced = ranks.reduce({str(k): a for k, a in self._absmax.items()}, "max")
        self._absmax = {int(k): a for k, a in reduced.items()}

    def apply(self, ctx: LayerContext) -> None:
        for k in range(len(self._mappings)):
            self._smooth(ctx, k)
        self._absmax = {}

    def group_sources(self, ctx: LayerContext) -> dict[str, list[str]] | None:
        # Norm-fed groups only: a linear source (v_proj -> o_proj) is quantised by the time its target's group is
        # reached. A subset of the tokens is cheaper as a pass of its own over the first batches.
        if self.config.statistics_tokens or any(m.kind == "linear" or not set(m.targets) <= set(ctx.targets)
                                                for m in self._mappings):
            return None
        return {m.source: list(m.targets) for m in self._mappings}

    def transform_group(self, ctx: LayerContext, names: list[str]) -> torch.Tensor | None:
        found = [k for k, m in enumerate(self._mappings) if set(m.targets) == set(names)]
        return self._smooth(ctx, found[0]) if found else None

    def _smooth(self, ctx: LayerContext, k: int) -> torch.Tensor | None:
        """Fold mapping k's scales into its source and targets; returns them (None when left unsmoothed)."""
        m = self._mappings[k]
        act = self._absmax.pop(k, None)
        if act is None or not torch.isfinite(act).all():
            ctx.warn(m.targets[0], "smoothquant: no finite calibration statistics; left unsmoothed")
            return None
        # The weights that will be quantised set the balance; routers are only rescaled.
        w = weight_column_absmax([ctx.layer.get_submodule(t).weight.data for t in m.targets if t in ctx.targets])
        if m.head_dim:
            src_out = ctx.layer.get_submodule(m.source).weight.shape[0]
            act, w = group_max(act, src_out, m.head_dim), group_max(w, src_out, m.head_dim)
        s = smoothquant_scales(act.to(w.device), w, float(self.config.alpha))
        apply_smoothing(ctx.layer, m, s)
        return s
