"""Named quantisation schemes (weights + activations + on-disk format), as compressed-tensors presets name them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantkit.errors import InputError
from quantkit.quant.integer import QuantArgs


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: QuantArgs
    format: str  # compressed-tensors format of the quantised linears
    input_activations: dict | None = None  # compressed-tensors QuantizationArgs fields, None for weight-only

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None


_WEIGHT_ONLY = {
    "W4A16": QuantArgs(num_bits=4, symmetric=True),
    "W4A16_ASYM": QuantArgs(num_bits=4, symmetric=False),
    "W8A16": QuantArgs(num_bits=8, symmetric=True),
}

SCHEMES: dict[str, str] = {
    "W4A16": "4-bit symmetric weights, 16-bit activations (pack-quantized)",
    "W4A16_ASYM": "4-bit asymmetric weights with zero points (pack-quantized)",
    "W8A16": "8-bit symmetric weights, 16-bit activations (pack-quantized)",
}


def get_scheme(name: str, group_size: int | None = 128) -> Scheme:
    """Resolve a scheme name; group_size -1 (or None) means one scale per output channel."""
    key = name.upper()
    if key not in _WEIGHT_ONLY:
        raise InputError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}")
    if group_size is not None and group_size != -1 and group_size <= 0:
        raise InputError(f"invalid group size {group_size}: use a positive number or -1 for per-channel")
    args = _WEIGHT_ONLY[key]
    if group_size is None or group_size == -1:
        args = replace(args, strategy="channel", group_size=None)
    else:
        args = replace(args, strategy="group", group_size=group_size)
    return Scheme(name=key, weights=args, format="pack-quantized")
