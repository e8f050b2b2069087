"""FP8 weights by round-to-nearest (e4m3, per tensor / channel / 128x128 block), the method behind
`--method fp8`. With a dynamic scheme (FP8_DYNAMIC, FP8_BLOCK) it needs no data and no model skeleton:
quantize_model hands it to quantkit.pipeline.stream, which goes tensor by tensor through the safetensors.
With FP8 (static activation scale) the sequential engine runs it, for the calibration absmax."""

from __future__ import annotations

from quantkit.methods.rtn import RTN


class FP8(RTN):
    name = "fp8"
    schemes = ("FP8", "FP8_DYNAMIC", "FP8_BLOCK")

