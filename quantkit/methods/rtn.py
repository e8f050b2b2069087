"""Round-to-nearest: each weight group is scaled by its own min/max and rounded. Data-free."""

from __future__ import annotations

from quantkit.methods.base import LayerContext, Method, QuantizedWeight
from quantkit.quant import quantize_weight


class RTN(Method):
    name = "rtn"
    needs_calibration = False

    def apply(self, ctx: LayerContext) -> None:
        args = self.scheme.weights
        for name in ctx.pending():
            weight = ctx.targets[name].weight.data
            q, scale, zp = quantize_weight(weight, args, scale_dtype=ctx.weight_dtype)
            ctx.set_quantized(name, QuantizedWeight(q, scale.float(), None if args.symmetric else zp, method=self.name))
