"""One class per compressed-tensors weight format, registered by name: the single description of a quantised
linear's tensors on disk, used by the checkpoint writer (`specs`, `compress`) and by the runtime's loader,
validator and reference path (`specs`, `values`, `zero_point`).

- pack-quantized (W4A16, W8A16): `weight_packed` int32 [out, ceil(in*bits/32)] (values offset to unsigned and
  bit-packed along the input dim), `weight_scale` [out, n_groups], `weight_shape` int64 [2], `weight_zero_point`
  int32 [ceil(out*bits/32), n_groups] (asymmetric only, packed along the output dim), `weight_g_idx` int32 [in]
  (act-order "group" only).
- int-quantized (W8A8; "naive-quantized" is its older name): `weight` int8 [out, in], `weight_scale`,
  `weight_zero_point` int8 shaped like the scale (asymmetric only).
- float-quantized (FP8): `weight` float8_e4m3fn [out, in], `weight_scale`.
- nvfp4-pack-quantized (NVFP4): `weight_packed` uint8 [out, in/2] (two e2m1 codes a byte, the even column in the
  low nibble), `weight_scale` float8_e4m3fn [out, in/16], `weight_global_scale` float32 [1]; NVFP4 activations add
  the static `input_global_scale` float32 [1].
- mxfp4-pack-quantized (MXFP4): `weight_packed` as NVFP4's, `weight_scale` uint8 [out, in/32] (e8m0 exponents).

Scales are [out, n_groups] (group), [out, 1] (channel), [1] (tensor) or [ceil(out/bh), ceil(in/bw)] (block), in
the checkpoint dtype; static activations add `input_scale` [1] (and `input_zero_point` when asymmetric).
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from quantkit.quant.args import QuantArgs
from quantkit.quant.fp4 import MX_BIAS, mx_scale_values, pack_e2m1, unpack_e2m1
from quantkit.quant.packing import pack_int32, packed_columns, unpack_int32

Shape = tuple[int, ...]
Specs = dict[str, tuple[torch.dtype, Shape]]
Rows = tuple[int, int] | None


def scale_shape(args: QuantArgs, out_features: int, in_features: int) -> Shape:
    if args.strategy in ("group", "tensor_group"):
        return (out_features, args.num_groups(in_features))
    if args.strategy == "channel":
        return (out_features, 1)
    if args.strategy == "block":
        bh, bw = args.block
        return (-(-out_features // bh), -(-in_features // bw))
    return (1,)


class Compressor:
    """A weight format: which tensors a quantised linear stores, and how values go in and come out."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    values_tensor: ClassVar[str] = "weight"  # the tensor holding the quantised values

    def value_spec(self, args: QuantArgs, out_features: int, in_features: int) -> tuple[torch.dtype, Shape]:
        """One byte per value: int8, or float8_e4m3fn for float weights."""
        return (torch.float8_e4m3fn if args.type == "float" else torch.int8), (out_features, in_features)

    def zero_point_spec(self, args: QuantArgs, scale: Shape) -> tuple[torch.dtype, Shape]:
        return torch.int8, scale

    def specs(self, args: QuantArgs, out_features: int, in_features: int, scale_dtype: torch.dtype,
              input_args: QuantArgs | None = None, g_idx: bool = False) -> Specs:
        """Every tensor (leaf name -> dtype, shape) one linear stores, in the order the writer plans them."""
        scale = scale_shape(args, out_features, in_features)
        out: Specs = {self.values_tensor: self.value_spec(args, out_features, in_features),
                      "weight_scale": (self.scale_dtype or scale_dtype, scale)}
        out.update(self._extra_specs(out_features, in_features))
        if not args.symmetric:
            out["weight_zero_point"] = self.zero_point_spec(args, scale)
        if g_idx:
            out["weight_g_idx"] = (torch.int32, (in_features,))
        if input_args is not None and not input_args.dynamic:
            if input_args.fp4_global:
                out["input_global_scale"] = (torch.float32, (1,))
            else:
                out["input_scale"] = (scale_dtype, (1,))
            if not input_args.symmetric:
                out["input_zero_point"] = (torch.int8, (1,))
        return out

    # The dtype the format stores scales in, whatever the checkpoint's (None: the checkpoint dtype).
    scale_dtype: ClassVar[torch.dtype | None] = None

    def _extra_specs(self, out_features: int, in_features: int) -> Specs:
        return {}

    def compress(self, args: QuantArgs, q: torch.Tensor, scale: torch.Tensor, scale_dtype: torch.dtype,
                 zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors (leaf name -> tensor) of values q [out, in], scales in the stored layout and the
        optional zero points [like scale], g_idx [in], static input scale and NVFP4 global scale."""
        out_features, in_features = q.shape
        tensors = {self.values_tensor: self._pack_values(args, q),
                   "weight_scale": self._pack_scale(scale.reshape(scale_shape(args, out_features, in_features)),
                                                    scale_dtype)}
        tensors.update(self._extra(out_features, in_features))
        if global_scale is not None:
            tensors["weight_global_scale"] = global_scale.reshape(1).float()
        if not args.symmetric:
            tensors["weight_zero_point"] = self._pack_zero_point(args, zero_point, tensors["weight_scale"].shape)
        if g_idx is not None:
            tensors["weight_g_idx"] = g_idx.to(torch.int32).contiguous()
        if input_scale is not None:
            if args.fp4_global:  # NVFP4 activations: the static part of their scale is a global one
                tensors["input_global_scale"] = input_scale.reshape(1).float()
            else:
                tensors["input_scale"] = input_scale.reshape(1).to(scale_dtype)
        return tensors

    def _pack_values(self, args: QuantArgs, q: torch.Tensor) -> torch.Tensor:
        return q.contiguous()

    def _pack_scale(self, scale: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
        return scale.to(scale_dtype)

    def scale_values(self, tensors: Mapping[str, torch.Tensor], rows: Rows = None) -> torch.Tensor:
        """The stored scales as numbers (output rows [r0, r1) of them), in their stored dtype or fp32."""
        s = tensors["weight_scale"]
        return s if rows is None else s[rows[0]:rows[1]]

    def _pack_zero_point(self, args: QuantArgs, zp: torch.Tensor, scale: torch.Size) -> torch.Tensor:
        return zp.reshape(scale).to(torch.int8).contiguous()

    def _extra(self, out_features: int, in_features: int) -> dict[str, torch.Tensor]:
        return {}

    def values(self, tensors: Mapping[str, torch.Tensor], args: QuantArgs, in_features: int,
               rows: Rows = None) -> torch.Tensor:
        """The quantised values [out, in] (int8, or float8_e4m3fn) of output rows [r0, r1) (default all)."""
        t = tensors[self.values_tensor]
        return t if rows is None else t[rows[0]:rows[1]]

    def zero_point(self, tensors: Mapping[str, torch.Tensor], args: QuantArgs,
                   out_features: int) -> torch.Tensor | None:
        """Zero points in the scale's layout (int8), or None when symmetric."""
        zp = tensors.get("weight_zero_point")
        return None if zp is None or args.symmetric else zp


class PackQuantized(Compressor):
    name = "pack-quantized"
    values_tensor = "weight_packed"

    def value_spec(self, args, out_features, in_features):
        return torch.int32, (out_features, packed_columns(in_features, args.num_bits))

    def zero_point_spec(self, args, scale):
        rows, cols = scale[0], (scale[1] if len(scale) == 2 else 1)
        return torch.int32, (packed_columns(rows, args.num_bits), cols)

    def _extra_specs(self, out_features, in_features):
        return {"weight_shape": (torch.int64, (2,))}

    def _pack_values(self, args, q):
        return pack_int32(q.to(torch.int8), args.num_bits)

    def _pack_zero_point(self, args, zp, scale):
        return pack_int32(zp.reshape(scale[0], -1).to(torch.int8), args.num_bits, packed_dim=0)

    def _extra(self, out_features, in_features):
        return {"weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64)}

    def values(self, tensors, args, in_features, rows=None):
        packed = tensors[self.values_tensor]
        if rows is not None:
            packed = packed[rows[0]:rows[1]]
        return unpack_int32(packed, args.num_bits, in_features)

    def zero_point(self, tensors, args, out_features):
        zp = tensors.get("weight_zero_point")
        if zp is None or args.symmetric:
            return None
        return unpack_int32(zp.to(torch.int32), args.num_bits, out_features, packed_dim=0)


class NVFP4PackQuantized(Compressor):
    name = "nvfp4-pack-quantized"
    values_tensor = "weight_packed"
    scale_dtype = torch.float8_e4m3fn

    def value_spec(self, args, out_features, in_features):
        return torch.uint8, (out_features, in_features // 2)

    def specs(self, args, out_features, in_features, scale_dtype, input_args=None, g_idx=False):
        out = super().specs(args, out_features, in_features, scale_dtype, input_args, g_idx)
        if args.fp4_global:
            out["weight_global_scale"] = (torch.float32, (1,))
        return out

    def _pack_values(self, args, q):
        return pack_e2m1(q.float()).contiguous()

    def _pack_scale(self, scale, scale_dtype):
        return scale.float().to(self.scale_dtype)

    def values(self, tensors, args, in_features, rows=None):
        packed = tensors[self.values_tensor]
        return unpack_e2m1(packed if rows is None else packed[rows[0]:rows[1]])

    def scale_values(self, tensors, rows=None):
        return super().scale_values(tensors, rows).float()


class MXFP4PackQuantized(NVFP4PackQuantized):
    name = "mxfp4-pack-quantized"
    scale_dtype = torch.uint8

    def _pack_scale(self, scale, scale_dtype):
        # Power-of-two scales as biased e8m0 exponents (exact: the scales are powers of two).
        return (MX_BIAS + torch.floor(torch.log2(scale.float()))).to(torch.int32).clamp(0, 255).to(torch.uint8)

    def scale_values(self, tensors, rows=None):
        return mx_scale_values(Compressor.scale_values(self, tensors, rows))


class IntQuantized(Compressor):
    name = "int-quantized"
    aliases = ("naive-quantized",)  # its older name, which held int8 or fp8 values alike


class FloatQuantized(Compressor):
    name = "float-quantized"


COMPRESSORS: dict[str, Compressor] = {}


def register_compressor(compressor: Compressor) -> Compressor:
    for name in (compressor.name, *compressor.aliases):
        COMPRESSORS[name] = compressor
    return compressor


for _cls in (PackQuantized, IntQuantized, FloatQuantized, NVFP4PackQuantized, MXFP4PackQuantized):
    register_compressor(_cls())

def compressor_for(name: str) -> Compressor:
    """The registered compressor of a format name; KeyError names the known formats."""
    try:
        return COMPRESSORS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known: {', '.join(COMPRESSORS)}") from None
