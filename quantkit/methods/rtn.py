"""Round-to-nearest: each weight group (or channel, tensor, block) is scaled by its own range and rounded.
Data-free.

`scale_search: mse` (integer schemes) shrinks each group's range over a grid of 20 factors down to 0.8 and keeps
the one with the smallest squared rounding error: clipping a rare outlier lowers the error of the rest of the
group. `minmax` is the plain absmax/min-max scale that llm-compressor's RTN uses.
"""

from __future__ import annotations

from quantkit.errors import InputError
from quantkit.methods.base import LayerContext, Method, QuantizedWeight
from quantkit.quant.integer import mse_weight_qparams, quantize_weight
from quantkit.quant.weights import quantize_any

SCALE_SEARCH = ("minmax", "mse")


class RTN(Method):
    name = "rtn"
    needs_calibration = False

    def __init__(self, scheme, scale_search: str = "mse", **options):
        super().__init__(scheme, **options)
        if scale_search not in SCALE_SEARCH:
            raise InputError(f"rtn scale_search must be one of {', '.join(SCALE_SEARCH)}, not {scale_search!r}")
        self.scale_search = scale_search

    def apply(self, ctx: LayerContext) -> None:
        for name in ctx.pending():
            weight, args = ctx.targets[name].weight.data, ctx.scheme_for(name).weights
            if self.scale_search == "mse" and args.type == "int":
                scale, zp = mse_weight_qparams(weight, args, ctx.weight_dtype)
                q, scale, zp = quantize_weight(weight, args, scale, zp, scale_dtype=ctx.weight_dtype)
                result = QuantizedWeight(q, scale.float(), None if args.symmetric else zp, method=self.name)
            else:
                q, scale, zp = quantize_any(weight, args, ctx.weight_dtype)
                result = QuantizedWeight(q, scale, zp, method=self.name)
            ctx.set_quantized(name, result)
