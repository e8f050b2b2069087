"""Named quantisation schemes (weights + activations + on-disk format), as compressed-tensors presets name them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantkit.errors import InputError
from quantkit.quant.integer import QuantArgs

BLOCK = (128, 128)


@dataclass(frozen=True)
class ActivationArgs:
    """Input-activation quantisation of a linear (what the consumer does at run time)."""

    num_bits: int = 8
    type: str = "int"  # "int" | "float"
    strategy: str = "token"  # "token" | "tensor" | "group"
    dynamic: bool = True  # False: a static `input_scale` calibrated offline
    group_size: int | None = None
    symmetric: bool = True

    @property
    def qmin(self) -> float:
        return -448.0 if self.type == "float" else float(-(1 << (self.num_bits - 1)))

    @property
    def qmax(self) -> float:
        return 448.0 if self.type == "float" else float((1 << (self.num_bits - 1)) - 1)

    @property
    def half_range(self) -> float:
        """(qmax - qmin) / 2, the symmetric scale divisor (int8: 127.5, fp8 e4m3: 448)."""
        return (self.qmax - self.qmin) / 2


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: QuantArgs
    format: str  # compressed-tensors format: pack-quantized | int-quantized | float-quantized
    input_activations: ActivationArgs | None = None

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None

    @property
    def static_activations(self) -> bool:
        return self.input_activations is not None and not self.input_activations.dynamic


_TOKEN_INT8 = ActivationArgs(8, "int", "token", True)
_TENSOR_INT8 = ActivationArgs(8, "int", "tensor", False)
_SCHEMES: dict[str, tuple[QuantArgs, str, ActivationArgs | None, str]] = {
    "W4A16": (QuantArgs(4, True), "pack-quantized", None, "4-bit symmetric weights, 16-bit activations"),
    "W4A16_ASYM": (QuantArgs(4, False), "pack-quantized", None, "4-bit asymmetric weights with zero points"),
    "W8A16": (QuantArgs(8, True), "pack-quantized", None, "8-bit symmetric weights, 16-bit activations"),
    "W8A8": (QuantArgs(8, True, "channel", None), "int-quantized", _TOKEN_INT8,
             "int8 per-channel weights, dynamic per-token int8 activations"),
    "W8A8_STATIC": (QuantArgs(8, True, "channel", None), "int-quantized", _TENSOR_INT8,
                    "int8 per-channel weights, static per-tensor int8 activations (input_scale)"),
    "FP8": (QuantArgs(8, True, "tensor", None, "float"), "float-quantized", ActivationArgs(8, "float", "tensor", False),
            "fp8 e4m3 per-tensor weights, static per-tensor fp8 activations"),
    "FP8_DYNAMIC": (QuantArgs(8, True, "channel", None, "float"), "float-quantized", ActivationArgs(8, "float", "token", True),
                    "fp8 e4m3 per-channel weights, dynamic per-token fp8 activations"),
    "FP8_BLOCK": (QuantArgs(8, True, "block", None, "float", BLOCK), "float-quantized",
                  ActivationArgs(8, "float", "group", True, BLOCK[1]),
                  "fp8 e4m3 128x128 weight blocks, dynamic 1x128 fp8 activation groups (DeepSeek-V3 style)"),
}

SCHEMES: dict[str, str] = {name: spec[3] for name, spec in _SCHEMES.items()}


def get_scheme(name: str, group_size: int | None = 128) -> Scheme:
    """Resolve a scheme name. group_size applies to the weight-only integer schemes; -1 (or None) means
    one scale per output channel."""
    key = name.upper()
    if key not in _SCHEMES:
        raise InputError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}")
    args, fmt, acts, _ = _SCHEMES[key]
    if fmt == "pack-quantized":
        if group_size is not None and group_size != -1 and group_size <= 0:
            raise InputError(f"invalid group size {group_size}: use a positive number or -1 for per-channel")
        if group_size is None or group_size == -1:
            args = replace(args, strategy="channel", group_size=None)
        else:
            args = replace(args, strategy="group", group_size=group_size)
    return Scheme(name=key, weights=args, format=fmt, input_activations=acts)


def block_fallback(scheme: Scheme, in_features: int) -> Scheme | None:
    """The scheme a linear falls back to when its input size K is not a multiple of the FP8 block: the dynamic
    1x128 activation groups would not divide K and consumers cannot run it (per-channel FP8 they can)."""
    if scheme.weights.strategy != "block" or in_features % scheme.weights.block[1] == 0:
        return None
    return get_scheme("FP8_DYNAMIC")
