"""Reading a compressed-tensors `quantization_config`: which linears are quantised, and how.

A config group names its targets (a class name such as "Linear", an exact module name, or "re:" + a regex
on the module name) and gives weight and input-activation arguments plus an on-disk format. The runtime
understands pack-quantized (int weights bit-packed into int32), int-quantized / naive-quantized (int8
weights) and float-quantized (float8_e4m3fn weights); anything else is refused with one clear line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import InputError

SUPPORTED_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
WEIGHT_TENSORS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")
INPUT_TENSORS = ("input_scale", "input_zero_point")


@dataclass(frozen=True)
class TensorArgs:
    """Quantisation arguments of one tensor (weights or input activations) of a config group."""

    type: str = "int"  # "int" | "float"
    num_bits: int = 8
    symmetric: bool = True
    strategy: str = "tensor"  # tensor | channel | group | block | token
    group_size: int | None = None
    block_structure: tuple[int, int] | None = None
    dynamic: bool = False
    actorder: str | None = None

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
class LinearFormat:
    format: str
    weights: TensorArgs
    input: TensorArgs | None = None

    @property
    def kind(self) -> str:
        """The op family a kernel registers for: w4a16 / w8a16 / int8 (W8A8) / fp8."""
        if self.weights.type == "float":
            return "fp8"
        if self.input is not None:
            return f"int{self.input.num_bits}"
        return f"w{self.weights.num_bits}a16"


@dataclass(frozen=True)
class QuantConfig:
    groups: tuple[tuple[tuple[str, ...], LinearFormat], ...]
    ignore: tuple[str, ...]

    def format_for(self, module_name: str, class_name: str = "Linear") -> LinearFormat | None:
        """The group that targets this module: name and regex targets win over class-name targets."""
        by_class = None
        for targets, fmt in self.groups:
            for t in targets:
                if t.startswith("re:"):
                    if re.match(t[3:], module_name):
                        return fmt
                elif t == module_name:
                    return fmt
                elif t == class_name and by_class is None:
                    by_class = fmt
        if by_class is None and len(self.groups) == 1:
            by_class = self.groups[0][1]
        return by_class


def _args(raw: dict | None, where: str, activation: bool) -> TensorArgs | None:
    if raw is None:
        return None
    kind = raw.get("type", "int")
    bits = int(raw.get("num_bits", 8))
    strategy = raw.get("strategy") or ("token" if activation else "tensor")
    dynamic = raw.get("dynamic", False)
    if kind not in ("int", "float"):
        raise InputError(f"{where}: quantisation type {kind!r} is not supported by quantkit's runtime")
    if kind == "float" and bits != 8:
        raise InputError(f"{where}: {bits}-bit float quantisation (e.g. NVFP4) is not supported by quantkit's runtime")
    if dynamic not in (True, False):
        raise InputError(f"{where}: dynamic={dynamic!r} activations are not supported by quantkit's runtime")
    if activation and dynamic and not raw.get("symmetric", True):
        raise InputError(f"{where}: asymmetric dynamic activations are not supported by quantkit's runtime")
    if strategy not in ("tensor", "channel", "group", "block", "token"):
        raise InputError(f"{where}: strategy {strategy!r} is not supported by quantkit's runtime")
    block = raw.get("block_structure")
    actorder = raw.get("actorder")
    return TensorArgs(
        type=kind, num_bits=bits, symmetric=bool(raw.get("symmetric", True)), strategy=strategy,
        group_size=raw.get("group_size"), block_structure=tuple(block) if block else None,
        dynamic=bool(dynamic), actorder=str(actorder) if actorder not in (None, False) else None,
    )


def parse_quantization_config(qc: dict, where: str) -> QuantConfig:
    """Validate a config.json `quantization_config`; raises InputError for anything the runtime cannot run."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise InputError(f"{where} is quantised with {method!r}; quantkit's runtime reads compressed-tensors checkpoints")
    if qc.get("sparsity_config"):
        raise InputError(f"{where} uses sparsity compression, which quantkit's runtime does not support")
    if qc.get("transform_config"):
        raise InputError(f"{where} uses transforms (e.g. Hadamard rotations), which quantkit's runtime does not support")
    if qc.get("kv_cache_scheme"):
        raise InputError(f"{where} has a quantised KV cache, which quantkit's runtime does not support yet")
    groups = []
    for gname, group in (qc.get("config_groups") or {}).items():
        fmt = group.get("format") or qc.get("format")
        if fmt not in SUPPORTED_FORMATS:
            raise InputError(
                f"{where}: config group {gname} uses format {fmt!r}, which quantkit's runtime does not know "
                f"(supported: {', '.join(SUPPORTED_FORMATS)})"
            )
        if group.get("output_activations"):
            raise InputError(f"{where}: config group {gname} quantises output activations (not supported)")
        weights = _args(group.get("weights"), f"{where} {gname} weights", activation=False)
        if weights is None:
            raise InputError(f"{where}: config group {gname} has no weight quantisation")
        expected = {"float-quantized": "float", "int-quantized": "int", "pack-quantized": "int"}.get(fmt)
        if expected and weights.type != expected:
            raise InputError(f"{where}: config group {gname} is {fmt} but its weights are of type {weights.type}")
        inputs = _args(group.get("input_activations"), f"{where} {gname} input activations", activation=True)
        groups.append((tuple(group.get("targets") or ("Linear",)), LinearFormat(fmt, weights, inputs)))
    if not groups:
        raise InputError(f"{where}: quantization_config has no config_groups")
    return QuantConfig(tuple(groups), tuple(qc.get("ignore") or ()))
