"""Round-to-nearest: each weight group (or channel, tensor, block) is scaled by its own range and rounded.

`scale_search` picks each integer group's scale:
  minmax      the plain absmax / min-max scale, as compressed-tensors' and llm-compressor's RTN compute it.
              Data-free.
  mse         shrink the group's range over a grid of 20 factors down to 0.8 and keep the one with the smallest
              squared rounding error: clipping a rare outlier lowers the error of the rest of the group.
              Data-free.
  activation  the same search, each weight's squared error weighted by the mean square of the input it
              multiplies on calibration text (llama.cpp's importance matrix). Only the few samples that flow
              anyway to measure each layer's error (`calibration.error_samples`, 8 x seq_len tokens) are used:
              measured on SmolLM2, 8 samples gave the same held-out KL as 128.
fp4 weights (NVFP4, MXFP4) take the same search over their own scale grid (e4m3 under the global scale, or powers
of two, where the next power up is a candidate as well); fp8 weights always use the plain range.
"""

from __future__ import annotations

import torch

from quantkit.errors import InputError
from contextlib import nullcontext

from quantkit.methods.base import LayerContext, Method, PreviewStats, QuantizedWeight, SharedInputs, check_known_options
from quantkit.quant.fp4 import fp4_global_scale, quantize_fp4, search_fp4_scales
from quantkit.quant.integer import mse_weight_qparams, quantize_weight
from quantkit.quant.weights import as_stored, quantize_any

SCALE_SEARCH = ("minmax", "mse", "activation")
# A column whose input is (almost) always zero on the calibration text still keeps this share of the mean
# importance, so text the calibration set lacks does not meet weights chosen with no regard to their error.
IMPORTANCE_FLOOR = 0.01


def _floored(mean_sq: torch.Tensor) -> torch.Tensor:
    return mean_sq + IMPORTANCE_FLOOR * mean_sq.mean()


class RTN(Method):
    name = "rtn"
    needs_calibration = False
    # Not group by group: importance measured behind quantised groups raised held-out pydoc KL of SmolLM2's demo
    # from 0.3598 to 0.3753 (KJV 0.3881 -> 0.3849), and with 8 samples one pass saves ~0.3 s
    # (benchmarks/results/calibration_phases.md).
    groupwise = False

    def __init__(self, scheme, scale_search: str = "activation", **options):
        check_known_options(self.name, options, ["scale_search"])
        super().__init__(scheme, **options)
        if scale_search not in SCALE_SEARCH:
            raise InputError(f"rtn scale_search must be one of {', '.join(SCALE_SEARCH)}, not {scale_search!r}")
        self.scale_search = scale_search
        self._reset()

    def _reset(self) -> None:
        self._square_sums: dict[str, torch.Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._shared = SharedInputs()  # q/k/v (gate/up) read one tensor: its statistics are gathered once

    def attach(self, ctx: LayerContext) -> list:
        self._reset()
        if not self.uses_statistics:
            return []

        self._shared = SharedInputs(known=ctx.input_leaders)

        def hook(name: str):
            def fn(module, inputs):
                if name in ctx.results or self._shared.see(name, inputs[0]) != name:
                    return
                with ctx.phase("statistics"):
                    x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
                    total = self._square_sums.get(name)
                    sq = x.pow(2).sum(0).double()  # float64 sums: exact, however the batches are split
                    self._square_sums[name] = sq if total is None else total + sq
                    self._tokens[name] = self._tokens.get(name, 0) + x.shape[0]

            return fn

        return [m.register_forward_pre_hook(hook(n)) for n, m in ctx.targets.items()]

    def reduce_statistics(self, ranks) -> None:
        self._square_sums = ranks.reduce(self._square_sums, "sum")
        tokens = ranks.reduce({n: torch.tensor(t) for n, t in self._tokens.items()}, "sum")
        self._tokens = {n: int(t) for n, t in tokens.items()}

    @property
    def uses_statistics(self) -> bool:
        # fp8 weights always take their plain range: nothing to weight
        return self.scale_search == "activation" and not self.scheme.weights.is_fp8

    def importance(self, name: str) -> torch.Tensor | None:
        name = self._shared.leader(name)
        if name not in self._square_sums:
            return None
        return _floored((self._square_sums[name] / max(1, self._tokens[name])).float())

    def _searches(self, args) -> bool:
        return self.scale_search != "minmax" and (args.type == "int" or args.is_fp4)

    def _quantize(self, weight: torch.Tensor, args, weight_dtype: torch.dtype, importance: torch.Tensor | None,
                  shared_global: torch.Tensor | None, searching=nullcontext) -> QuantizedWeight:
        search = self._searches(args)
        if search and args.type == "int":
            with searching():
                scale, zp = mse_weight_qparams(weight, args, weight_dtype, importance=importance)
            q, scale, zp = quantize_weight(weight, args, scale, zp, scale_dtype=weight_dtype)
            return QuantizedWeight(q, scale.float(), None if args.symmetric else zp, method=self.name)
        if search:  # fp4
            global_scale = fp4_global_scale(weight, args, shared_global)
            with searching():
                scale = search_fp4_scales(weight, args, global_scale, importance)
            q = quantize_fp4(weight.float(), scale, args.group_size, global_scale)
            return QuantizedWeight(q, scale, None, global_scale=global_scale, method=self.name)
        q, scale, zp, global_scale = quantize_any(weight, args, weight_dtype, shared_global)
        return QuantizedWeight(q, scale, zp, global_scale=global_scale, method=self.name)

    preview_stats = "importance"

    def preview(self, weight: torch.Tensor, args, stats: PreviewStats | None, weight_dtype: torch.dtype) -> torch.Tensor:
        importance = None
        if self.scale_search == "activation" and stats is not None and stats.mean_square is not None:
            importance = _floored(stats.mean_square.float())
        r = self._quantize(weight, args, weight_dtype, importance, None)
        return as_stored(r.q, r.scale, r.zero_point, args, weight_dtype, global_scale=r.global_scale)

    def apply(self, ctx: LayerContext) -> None:
        for name in ctx.pending():
            weight, args = ctx.targets[name].weight.data, ctx.scheme_for(name).weights
            search = self._searches(args)
            importance = self.importance(name) if search and self.scale_search == "activation" else None
            if search and self.scale_search == "activation" and importance is None:
                ctx.warn(name, "no calibration inputs reached this linear; rtn used the unweighted mse search")
            result = self._quantize(weight, args, ctx.weight_dtype, importance, ctx.global_scale(name),
                                    lambda: ctx.phase("scale_search"))
            ctx.set_quantized(name, result)
        if ctx.active is None:
            self._reset()
        else:  # one-pass schedule: the statistics of later groups are still to come
            for name in ctx.active:
                self._square_sums.pop(self._shared.leader(name), None)
