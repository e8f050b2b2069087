"""The compressed-tensors checkpoint a quantisation run writes: each linear's tensors (laid out by its format's
compressor in `quantkit.formats.compressors`, which the runtime reads back with) and config.json's
`quantization_config`, which matches what the compressed-tensors package's models dump.
"""

from __future__ import annotations

import torch

from quantkit.formats.compressors import compressor_for
from quantkit.formats.safetensors_writer import TensorSpec
from quantkit.methods.base import QuantizedWeight
from quantkit.quant.schemes import Scheme


def quantized_specs(name: str, out_features: int, in_features: int, scheme: Scheme, dtype: torch.dtype,
                    with_g_idx: bool = False) -> list[TensorSpec]:
    """Tensors a quantised linear `name` (checkpoint module name) occupies on disk."""
    specs = compressor_for(scheme.format).specs(scheme.weights, out_features, in_features, dtype,
                                                scheme.input_activations, g_idx=with_g_idx)
    return [TensorSpec(f"{name}.{leaf}", d, shape) for leaf, (d, shape) in specs.items()]


def pack_quantized(name: str, result: QuantizedWeight, scheme: Scheme, dtype: torch.dtype,
                   input_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one quantised linear, matching `quantized_specs`."""
    tensors = compressor_for(scheme.format).compress(
        scheme.weights, result.q, result.scale, dtype, zero_point=result.zero_point, g_idx=result.g_idx,
        input_scale=input_scale if scheme.static_activations else None, global_scale=result.global_scale)
    return {f"{name}.{leaf}": t for leaf, t in tensors.items()}


# The stored scale dtype compressed-tensors records for fp4 (NVFP4: e4m3, MXFP4: e8m0 exponents in uint8).
def _fp4_scale_dtype(a) -> str | None:
    if not a.is_fp4:
        return None
    return "torch.float8_e4m3fn" if a.fp4_global else "torch.uint8"


def _weight_args(scheme: Scheme, actorder: str | None) -> dict:
    w = scheme.weights
    args = {"num_bits": w.num_bits, "type": w.type, "symmetric": w.symmetric,
            "group_size": w.group_size if w.strategy in ("group", "tensor_group") else None, "strategy": w.strategy}
    if w.strategy == "block":
        args["block_structure"] = list(w.block)
    args["dynamic"] = False
    if actorder is not None:
        args["actorder"] = actorder
    if _fp4_scale_dtype(w):
        args["scale_dtype"] = _fp4_scale_dtype(w)
    args["observer"] = "minmax"
    return args


def _activation_args(scheme: Scheme) -> dict | None:
    a = scheme.input_activations
    if a is None:
        return None
    # NVFP4 activations: group scales at run time under a static global one, compressed-tensors' "local".
    dynamic = "local" if a.fp4_global else a.dynamic
    args = {"num_bits": a.num_bits, "type": a.type, "symmetric": True, "group_size": a.group_size,
            "strategy": a.strategy, "dynamic": dynamic}
    if _fp4_scale_dtype(a):
        args["scale_dtype"] = _fp4_scale_dtype(a)
    if dynamic is False or dynamic == "local":
        args["observer"] = "static_minmax" if dynamic == "local" else "minmax"
    return args


def _group(targets: list[str], scheme: Scheme, actorder: str | None) -> dict:
    return {"targets": targets, "weights": _weight_args(scheme, actorder),
            "input_activations": _activation_args(scheme), "output_activations": None, "format": scheme.format}


def build_quantization_config(scheme: Scheme, ignore: list[str], actorder: str | None = None,
                              overrides: dict[str, list[str]] | None = None, kv_cache: str | None = None) -> dict:
    """config.json's `quantization_config`, field for field what compressed-tensors' own pydantic models dump
    (tests/formats/test_compressed_tensors.py holds it to them). Built as plain data because importing
    compressed-tensors pulls in transformers and torch.distributed (about 2 s), which would dominate the
    data-free FP8 path.

    `overrides` maps a scheme label (`Scheme.label`) to the checkpoint module names that use it instead of
    `scheme` (the FP8_BLOCK layers whose K is not a multiple of 128, a mixed plan's other choices); each becomes
    its own config group targeting those names, which both compressed-tensors and vLLM match before the class
    target "Linear".
    """
    from importlib.metadata import version

    from quantkit.quant.kv_cache import kv_cache_scheme
    from quantkit.quant.schemes import parse_choice

    # act-order "group" (g_idx) is what older compressed-tensors / vLLM read; compressed-tensors >= 0.20
    # refuses to validate it and current vLLM refuses such checkpoints loudly.
    groups = {"group_0": _group(["Linear"], scheme, actorder)}
    for k, (label, modules) in enumerate(sorted((overrides or {}).items()), start=1):
        other = parse_choice(label)
        # GPTQ's static act-order is recorded on every integer group it quantised (the FP8 fallbacks it did not)
        groups[f"group_{k}"] = _group(sorted(modules), other, actorder if other.weights.type == "int" else None)
    formats = {g["format"] for g in groups.values()}
    return {
        "config_groups": groups,
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": kv_cache_scheme(kv_cache) if kv_cache else None,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version("compressed-tensors"),
    }
