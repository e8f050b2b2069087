"""Round-to-nearest: each weight group (or channel, tensor, block) is scaled by its own range and rounded.
Data-free."""

from __future__ import annotations

from quantkit.methods.base import LayerContext, Method, QuantizedWeight
from quantkit.quant.weights import quantize_any


class RTN(Method):
    name = "rtn"
    needs_calibration = False

    def apply(self, ctx: LayerContext) -> None:
        for name in ctx.pending():
            q, scale, zp = quantize_any(ctx.targets[name].weight.data, ctx.scheme_for(name).weights, ctx.weight_dtype)
            ctx.set_quantized(name, QuantizedWeight(q, scale, zp, method=self.name))
