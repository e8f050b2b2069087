"""Reading a compressed-tensors `quantization_config`: which linears are quantised, and how.

A config group names its targets (a class name such as "Linear", an exact module name, or "re:" + a regex
on the module name) and gives weight and input-activation arguments plus an on-disk format. The runtime
understands pack-quantized (int weights bit-packed into int32), int-quantized / naive-quantized (int8
weights), float-quantized (float8_e4m3fn weights) and nvfp4- / mxfp4-pack-quantized (e2m1 weights two to a
byte); anything else is refused with one clear line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from quantkit.errors import InputError
from quantkit.formats.compressors import COMPRESSORS, Compressor, compressor_for
from quantkit.quant.args import QuantArgs

SUPPORTED_FORMATS = tuple(COMPRESSORS)
WEIGHT_TENSORS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape",
                  "weight_global_scale")
INPUT_TENSORS = ("input_scale", "input_zero_point", "input_global_scale")


@dataclass(frozen=True)
class LinearFormat:
    format: str
    weights: QuantArgs
    input: QuantArgs | None = None

    @property
    def compressor(self) -> Compressor:
        return compressor_for(self.format)

    @property
    def kind(self) -> str:
        """The op family a kernel registers for: w4a16 / w8a16 / int8 (W8A8) / fp8 / w4afp8 / nvfp4 / mxfp4."""
        if self.weights.is_fp4:
            return "nvfp4" if self.weights.fp4_global else "mxfp4"
        if self.weights.type == "float":
            return "fp8"
        if self.input is not None:
            if self.input.type == "float":
                return f"w{self.weights.num_bits}afp8"
            return f"int{self.input.num_bits}"
        return f"w{self.weights.num_bits}a16"


@dataclass(frozen=True)
class QuantConfig:
    groups: tuple[tuple[tuple[str, ...], LinearFormat], ...]
    ignore: tuple[str, ...]
    kv_cache: str | None = None  # fp8 KV cache with static scales: "tensor" or "attn_head" (kv_cache_scheme)

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


def _args(raw: dict | None, where: str, activation: bool) -> QuantArgs | None:
    if raw is None:
        return None
    kind = raw.get("type", "int")
    bits = int(raw.get("num_bits", 8))
    strategy = raw.get("strategy") or ("token" if activation else "tensor")
    dynamic = raw.get("dynamic", False)
    if kind not in ("int", "float"):
        raise InputError(f"{where}: quantisation type {kind!r} is not supported by quantkit's runtime")
    if kind == "float" and bits not in (4, 8):
        raise InputError(f"{where}: {bits}-bit float quantisation is not supported by quantkit's runtime")
    if dynamic == "local" and strategy == "tensor_group":
        dynamic = False  # NVFP4 activations: dynamic group scales under the stored global one (QuantArgs' spelling)
    if dynamic not in (True, False):
        raise InputError(f"{where}: dynamic={dynamic!r} activations are not supported by quantkit's runtime")
    if activation and dynamic and not raw.get("symmetric", True):
        raise InputError(f"{where}: asymmetric dynamic activations are not supported by quantkit's runtime")
    if strategy not in ("tensor", "channel", "group", "block", "token", "tensor_group"):
        raise InputError(f"{where}: strategy {strategy!r} is not supported by quantkit's runtime")
    block = raw.get("block_structure")
    actorder = raw.get("actorder")
    group_size = raw.get("group_size")
    if strategy in ("group", "tensor_group") and not (isinstance(group_size, int) and group_size > 0):
        raise InputError(f"{where}: group strategy with group_size {group_size!r} (a positive number is needed)")
    if strategy == "block" and not (isinstance(block, (list, tuple)) and len(block) == 2
                                    and all(isinstance(b, int) and b > 0 for b in block)):
        raise InputError(f"{where}: block strategy with block_structure {block!r} (a [rows, cols] pair is needed)")
    try:
        return QuantArgs(
            type=kind, num_bits=bits, symmetric=bool(raw.get("symmetric", True)), strategy=strategy,
            group_size=group_size, block=tuple(block) if block else None, dynamic=bool(dynamic),
            actorder=str(actorder) if actorder not in (None, False) else None,
        )
    except ValueError as exc:
        raise InputError(f"{where}: {exc}") from None


def parse_quantization_config(qc: dict, where: str) -> QuantConfig:
    """Validate a config.json `quantization_config`; raises InputError for anything the runtime cannot run."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise InputError(f"{where} is quantised with {method!r}; quantkit's runtime reads compressed-tensors checkpoints")
    if qc.get("sparsity_config"):
        raise InputError(f"{where} uses sparsity compression, which quantkit's runtime does not support")
    if qc.get("transform_config"):
        raise InputError(f"{where} uses transforms (e.g. Hadamard rotations), which quantkit's runtime does not support")
    kv_cache = _kv_cache(qc.get("kv_cache_scheme"), where)
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
        expected = {"float-quantized": "float", "int-quantized": "int", "pack-quantized": "int",
                    "nvfp4-pack-quantized": "float", "mxfp4-pack-quantized": "float"}.get(fmt)
        if expected and weights.type != expected:
            raise InputError(f"{where}: config group {gname} is {fmt} but its weights are of type {weights.type}")
        fp4_layout = {"nvfp4-pack-quantized": "tensor_group", "mxfp4-pack-quantized": "group"}.get(fmt)
        if (fp4_layout is not None) != weights.is_fp4 or (fp4_layout and weights.strategy != fp4_layout):
            raise InputError(f"{where}: config group {gname} is {fmt} but its weights are {weights.num_bits}-bit "
                             f"{weights.type} with strategy {weights.strategy}")
        inputs = _args(group.get("input_activations"), f"{where} {gname} input activations", activation=True)
        groups.append((tuple(group.get("targets") or ("Linear",)), LinearFormat(fmt, weights, inputs)))
    if not groups:
        raise InputError(f"{where}: quantization_config has no config_groups")
    return QuantConfig(tuple(groups), tuple(qc.get("ignore") or ()), kv_cache)


def _kv_cache(raw: dict | None, where: str) -> str | None:
    """The KV cache strategy of a `kv_cache_scheme`: what vLLM serves (fp8 e4m3, static, symmetric, per tensor or
    per KV head), or one line saying what is not."""
    if not raw:
        return None
    strategy = raw.get("strategy") or "tensor"
    if raw.get("type") != "float" or int(raw.get("num_bits", 0)) != 8 or raw.get("dynamic") not in (False, None) \
            or not raw.get("symmetric", True) or strategy not in ("tensor", "attn_head"):
        raise InputError(f"{where}: kv_cache_scheme {raw} is not an fp8 cache with static symmetric per-tensor or "
                         "per-head scales, the only KV cache quantkit's runtime (and vLLM) runs")
    return strategy
