"""Named quantisation schemes (weights + activations + on-disk format), as compressed-tensors presets name them."""

from __future__ import annotations

from dataclasses import dataclass, replace

from quantkit.errors import InputError
from quantkit.quant.args import FP4_GROUPS, QuantArgs

BLOCK = (128, 128)


@dataclass(frozen=True)
class Scheme:
    name: str
    weights: QuantArgs
    format: str  # compressed-tensors format: pack-quantized | int-quantized | float-quantized
    input_activations: QuantArgs | None = None

    @property
    def weight_only(self) -> bool:
        return self.input_activations is None

    @property
    def static_activations(self) -> bool:
        return self.input_activations is not None and not self.input_activations.dynamic

    @property
    def label(self) -> str:
        """The name plus the weight grouping where a scheme lets the user choose it (`W4A16:g64`, `W8A16:ch`):
        one spelling per distinct on-disk layout, read back by `parse_choice`."""
        w = self.weights
        if self.format != "pack-quantized" or w.strategy not in ("group", "channel"):
            return self.name
        return f"{self.name}:g{w.group_size}" if w.strategy == "group" else f"{self.name}:ch"


def _weights(bits: int, symmetric: bool = True, strategy: str = "group", kind: str = "int") -> QuantArgs:
    return QuantArgs(num_bits=bits, symmetric=symmetric, strategy=strategy, group_size=128, type=kind,
                     block=BLOCK if strategy == "block" else None)


def _inputs(kind: str, strategy: str, dynamic: bool) -> QuantArgs:
    return QuantArgs(num_bits=8, type=kind, strategy=strategy, dynamic=dynamic, group_size=BLOCK[1])


def _fp4(strategy: str, dynamic: bool = False) -> QuantArgs:
    return QuantArgs(num_bits=4, type="float", strategy=strategy, group_size=FP4_GROUPS[strategy], dynamic=dynamic)


_SCHEMES: dict[str, tuple[QuantArgs, str, QuantArgs | None, str]] = {
    "W4A16": (_weights(4), "pack-quantized", None, "4-bit symmetric weights, 16-bit activations"),
    "W4A16_ASYM": (_weights(4, False), "pack-quantized", None, "4-bit asymmetric weights with zero points"),
    "W8A16": (_weights(8), "pack-quantized", None, "8-bit symmetric weights, 16-bit activations"),
    "W8A8": (_weights(8, strategy="channel"), "int-quantized", _inputs("int", "token", True),
             "int8 per-channel weights, dynamic per-token int8 activations"),
    "W8A8_STATIC": (_weights(8, strategy="channel"), "int-quantized", _inputs("int", "tensor", False),
                    "int8 per-channel weights, static per-tensor int8 activations (input_scale)"),
    "FP8": (_weights(8, strategy="tensor", kind="float"), "float-quantized", _inputs("float", "tensor", False),
            "fp8 e4m3 per-tensor weights, static per-tensor fp8 activations"),
    "FP8_DYNAMIC": (_weights(8, strategy="channel", kind="float"), "float-quantized", _inputs("float", "token", True),
                    "fp8 e4m3 per-channel weights, dynamic per-token fp8 activations"),
    "FP8_BLOCK": (_weights(8, strategy="block", kind="float"), "float-quantized", _inputs("float", "group", True),
                  "fp8 e4m3 128x128 weight blocks, dynamic 1x128 fp8 activation groups (DeepSeek-V3 style)"),
    "W4AFP8": (_weights(4), "pack-quantized", _inputs("float", "token", True),
               "4-bit symmetric weight groups, dynamic per-token fp8 activations"),
    "NVFP4A16": (_fp4("tensor_group"), "nvfp4-pack-quantized", None,
                 "fp4 e2m1 weights in groups of 16 with e4m3 scales and a global scale, 16-bit activations"),
    "NVFP4": (_fp4("tensor_group"), "nvfp4-pack-quantized", _fp4("tensor_group"),
              "NVFP4 weights and activations (dynamic e4m3 group scales under a calibrated global scale)"),
    "MXFP4A16": (_fp4("group"), "mxfp4-pack-quantized", None,
                 "fp4 e2m1 weights in groups of 32 with power-of-two (e8m0) scales, 16-bit activations"),
    "MXFP4": (_fp4("group"), "mxfp4-pack-quantized", _fp4("group", dynamic=True),
              "MXFP4 weights and dynamic MXFP4 activations"),
}

SCHEMES: dict[str, str] = {name: spec[3] for name, spec in _SCHEMES.items()}


def get_scheme(name: str, group_size: int | None = 128) -> Scheme:
    """Resolve a scheme name. group_size applies to the weight-only integer schemes; -1 (or None) means
    one scale per output channel."""
    key = name.upper()
    if key not in _SCHEMES:
        raise InputError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}")
    args, fmt, acts, _ = _SCHEMES[key]
    if fmt == "pack-quantized" and args.strategy == "group":
        if group_size is not None and group_size != -1 and group_size <= 0:
            raise InputError(f"invalid group size {group_size}: use a positive number or -1 for per-channel")
        if group_size is None or group_size == -1:
            args = replace(args, strategy="channel")
        else:
            args = replace(args, strategy="group", group_size=group_size)
    return Scheme(name=key, weights=args, format=fmt, input_activations=acts)


def block_fallback(scheme: Scheme, in_features: int) -> Scheme | None:
    """The scheme a linear falls back to when its input size K is not a multiple of the FP8 block: the dynamic
    1x128 activation groups would not divide K and consumers cannot run it (per-channel FP8 they can)."""
    if scheme.weights.strategy != "block" or in_features % scheme.weights.block[1] == 0:
        return None
    return get_scheme("FP8_DYNAMIC")


def parse_choice(text: str, group_size: int | None = 128) -> Scheme:
    """A scheme spelt as `Scheme.label` writes it: `W4A16:g64`, `W8A16:ch` (per output channel), or a bare name
    (the integer weight-only schemes then take `group_size`)."""
    name, _, grouping = text.strip().partition(":")
    if not grouping:
        return get_scheme(name, group_size)
    g = grouping.lower()
    if g in ("ch", "channel", "g-1"):
        size = -1
    elif g.startswith("g") and g[1:].isdigit():
        size = int(g[1:])
    else:
        raise InputError(f"cannot read {text!r}: write a scheme as NAME, NAME:gSIZE or NAME:ch (e.g. W4A16:g64)")
    scheme = get_scheme(name, size)
    if scheme.label != scheme.name or size == 128:
        return scheme
    raise InputError(f"{text!r}: {scheme.name} has a fixed layout, it takes no group size")


def fits(scheme: Scheme, in_features: int) -> bool:
    """Whether a linear with `in_features` inputs can take `scheme` as consumers load it: whole weight groups,
    whole FP8 blocks along K (dynamic 1x128 activation groups must divide K)."""
    w = scheme.weights
    if w.strategy in ("group", "tensor_group"):
        return in_features % w.group_size == 0
    if w.strategy == "block":
        return in_features % w.block[1] == 0
    return True
