"""The compressed-tensors checkpoint layout (what vLLM and transformers load).

pack-quantized (W4A16, W8A16): per linear `weight_packed` int32 [out, ceil(in*bits/32)], `weight_scale`
[out, n_groups] in the model dtype, `weight_shape` int64 [2], `weight_zero_point` int32
[ceil(out*bits/32), n_groups] (asymmetric only, packed along the output dim), `weight_g_idx` int32 [in]
(act-order "group" only). The config is built and validated with the compressed-tensors package's models.
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


def pack_quantized(name: str, result: QuantizedWeight, scheme: Scheme, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    args = scheme.weights
    out_features, in_features = result.q.shape
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


def build_quantization_config(scheme: Scheme, ignore: list[str], actorder: str | None = None) -> dict:
    """config.json's `quantization_config`, validated by compressed-tensors' own pydantic models."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    w = scheme.weights
    weights = QuantizationArgs(
        num_bits=w.num_bits,
        type="int",
        symmetric=w.symmetric,
        strategy=w.strategy,
        group_size=w.group_size if w.strategy == "group" else None,
        actorder=actorder,
        observer="minmax",
    )
    group = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=None, format=scheme.format)
    config = QuantizationConfig(
        config_groups={"group_0": group},
        format=scheme.format,
        quantization_status="compressed",
        ignore=list(ignore),
    )
    out = config.model_dump(exclude_none=False)
    out["quant_method"] = "compressed-tensors"
    out["sparsity_config"] = {}
    out["transform_config"] = {}
    out["version"] = compressed_tensors.__version__
    return out
