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

Scales are [out, n_groups] (group), [out, 1] (channel), [1] (tensor) or [ceil(out/bh), ceil(in/bw)] (block), in
the checkpoint dtype; static activations add `input_scale` [1] (and `input_zero_point` when asymmetric).
"""

from __future__ import annotations

from typing import ClassVar, Mapping

import torch

from quantkit.quant.args import QuantArgs
from quantkit.quant.packing import pack_int32, packed_columns, unpack_int32

Shape = tuple[int, ...]
Specs = dict[str, tuple[torch.dtype, Shape]]
Rows = tuple[int, int] | None


def scale_shape(args: QuantArgs, out_features: int, in_features: int) -> Shape:
    if args.strategy == "group":
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
                      "weight_scale": (scale_dtype, scale)}
        out.update(self._extra_specs(out_features, in_features))
        if not args.symmetric:
            out["weight_zero_point"] = self.zero_point_spec(args, scale)
        if g_idx:
            out["weight_g_idx"] = (torch.int32, (in_features,))
        if input_args is not None and not input_args.dynamic:
            out["input_scale"] = (scale_dtype, (1,))
            if not input_args.symmetric:
                out["input_zero_point"] = (torch.int8, (1,))
        return out

    def _extra_specs(self, out_features: int, in_features: int) -> Specs:
        return {}

    def compress(self, args: QuantArgs, q: torch.Tensor, scale: torch.Tensor, scale_dtype: torch.dtype,
                 zero_point: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors (leaf name -> tensor) of values q [out, in], scales in the stored layout and the
        optional zero points [like scale], g_idx [in] and static input scale."""
        out_features, in_features = q.shape
        tensors = {self.values_tensor: self._pack_values(args, q),
                   "weight_scale": scale.reshape(scale_shape(args, out_features, in_features)).to(scale_dtype)}
        tensors.update(self._extra(out_features, in_features))
        if not args.symmetric:
            tensors["weight_zero_point"] = self._pack_zero_point(args, zero_point, tensors["weight_scale"].shape)
        if g_idx is not None:
            tensors["weight_g_idx"] = g_idx.to(torch.int32).contiguous()
        if input_scale is not None:
            tensors["input_scale"] = input_scale.reshape(1).to(scale_dtype)
        return tensors

    def _pack_values(self, args: QuantArgs, q: torch.Tensor) -> torch.Tensor:
        return q.contiguous()

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


for _cls in (PackQuantized, IntQuantized, FloatQuantized):
    register_compressor(_cls())

def compressor_for(name: str) -> Compressor:
    """The registered compressor of a format name; KeyError names the known formats."""
    try:
        return COMPRESSORS[name]
    except KeyError:
        raise KeyError(f"unknown format {name!r}; known: {', '.join(COMPRESSORS)}") from None
