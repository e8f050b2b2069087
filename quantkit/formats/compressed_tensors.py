"""The compressed-tensors checkpoint layout (what vLLM and transformers load).

pack-quantized (W4A16, W8A16): per linear `weight_packed` int32 [out, ceil(in*bits/32)], `weight_scale`
[out, n_groups] in the model dtype, `weight_shape` int64 [2], `weight_zero_point` int32
[ceil(out*bits/32), n_groups] (asymmetric only, packed along the output dim), `weight_g_idx` int32 [in]
(act-order "group" only). The config matches what the compressed-tensors package's models dump.
"""

from __future__ import annotations

import torch

from quantkit.formats.safetensors_writer import TensorSpec
from quantkit.methods.base import QuantizedWeight
from quantkit.quant import pack_int32, packed_columns
from quantkit.quant.schemes import Scheme


def quantized_specs(name: str, out_features: int, in_features: int, scheme: Scheme, dtype: torch.dtype,
                    with_g_idx: bool = False) -> list[TensorSpec]:
    """Tensors a quantised linear `name` (checkpoint module name) occupies on disk."""
    args = scheme.weights
    if scheme.format == "pack-quantized":
        groups = args.num_groups(in_features)
        specs = [
            TensorSpec(f"{name}.weight_packed", torch.int32, (out_features, packed_columns(in_features, args.num_bits))),
            TensorSpec(f"{name}.weight_scale", dtype, (out_features, groups)),
            TensorSpec(f"{name}.weight_shape", torch.int64, (2,)),
        ]
        if not args.symmetric:
            specs.append(TensorSpec(f"{name}.weight_zero_point", torch.int32,
                                    (packed_columns(out_features, args.num_bits), groups)))
        if with_g_idx:
            specs.append(TensorSpec(f"{name}.weight_g_idx", torch.int32, (in_features,)))
        return specs
    # int-quantized / float-quantized: the values themselves, one byte each
    value_dtype = torch.float8_e4m3fn if args.type == "float" else torch.int8
    scale_shape = {"tensor": (1,), "channel": (out_features, 1)}.get(args.strategy)
    if args.strategy == "block":
        bh, bw = args.block
        scale_shape = (-(-out_features // bh), -(-in_features // bw))
    specs = [TensorSpec(f"{name}.weight", value_dtype, (out_features, in_features)),
             TensorSpec(f"{name}.weight_scale", dtype, scale_shape)]
    if scheme.static_activations:
        specs.append(TensorSpec(f"{name}.input_scale", dtype, (1,)))
    return specs


def pack_quantized(name: str, result: QuantizedWeight, scheme: Scheme, dtype: torch.dtype,
                   input_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one quantised linear, matching `quantized_specs`."""
    args = scheme.weights
    out_features, in_features = result.q.shape
    if scheme.format != "pack-quantized":
        tensors = {f"{name}.weight": result.q.contiguous(), f"{name}.weight_scale": result.scale.to(dtype).contiguous()}
        if scheme.static_activations:
            tensors[f"{name}.input_scale"] = input_scale.reshape(1).to(dtype)
        return tensors
    tensors = {
        f"{name}.weight_packed": pack_int32(result.q.to(torch.int8), args.num_bits),
        f"{name}.weight_scale": result.scale.reshape(out_features, -1).to(dtype),
        f"{name}.weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not args.symmetric:
        zp = result.zero_point.reshape(out_features, -1).to(torch.int8)
        tensors[f"{name}.weight_zero_point"] = pack_int32(zp, args.num_bits, packed_dim=0)
    if result.g_idx is not None:
        tensors[f"{name}.weight_g_idx"] = result.g_idx.to(torch.int32)
    return tensors


def _weight_args(scheme: Scheme, actorder: str | None) -> dict:
    w = scheme.weights
    args = {"num_bits": w.num_bits, "type": w.type, "symmetric": w.symmetric,
            "group_size": w.group_size if w.strategy == "group" else None, "strategy": w.strategy}
    if w.strategy == "block":
        args["block_structure"] = list(w.block)
    args["dynamic"] = False
    if actorder is not None:
        args["actorder"] = actorder
    args["observer"] = "minmax"
    return args


def _activation_args(scheme: Scheme) -> dict | None:
    a = scheme.input_activations
    if a is None:
        return None
    args = {"num_bits": a.num_bits, "type": a.type, "symmetric": True, "group_size": a.group_size,
            "strategy": a.strategy, "dynamic": a.dynamic}
    if not a.dynamic:
        args["observer"] = "minmax"
    return args


def _group(targets: list[str], scheme: Scheme, actorder: str | None) -> dict:
    return {"targets": targets, "weights": _weight_args(scheme, actorder),
            "input_activations": _activation_args(scheme), "output_activations": None, "format": scheme.format}


def build_quantization_config(scheme: Scheme, ignore: list[str], actorder: str | None = None,
                              overrides: dict[str, list[str]] | None = None) -> dict:
    """config.json's `quantization_config`, field for field what compressed-tensors' own pydantic models dump
    (tests/formats/test_compressed_tensors.py holds it to them). Built as plain data because importing
    compressed-tensors pulls in transformers and torch.distributed (about 2 s), which would dominate the
    data-free FP8 path.

    `overrides` maps a scheme name to the checkpoint module names that use it instead of `scheme` (e.g. the
    FP8_BLOCK layers whose K is not a multiple of 128); each becomes its own config group targeting those
    names, which both compressed-tensors and vLLM match before the class target "Linear".
    """
    from importlib.metadata import version

    from quantkit.quant.schemes import get_scheme

    # act-order "group" (g_idx) is what older compressed-tensors / vLLM read; compressed-tensors >= 0.20
    # refuses to validate it and current vLLM refuses such checkpoints loudly.
    groups = {"group_0": _group(["Linear"], scheme, actorder)}
    for k, (name, modules) in enumerate(sorted((overrides or {}).items()), start=1):
        groups[f"group_{k}"] = _group(sorted(modules), get_scheme(name), None)
    formats = {g["format"] for g in groups.values()}
    return {
        "config_groups": groups,
        "quant_method": "compressed-tensors",
        "kv_cache_scheme": None,
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": version("compressed-tensors"),
    }
