"""Numerics shared by every method and the runtime."""

from quantkit.quant.args import QuantArgs
from quantkit.quant.integer import (
    compute_qparams,
    dequantize,
    dequantize_weight,
    dequantize_weight_args,
    fake_quantize,
    group_view,
    quantize,
    quantize_weight,
)
from quantkit.quant.packing import pack_int32, packed_columns, unpack_int32
from quantkit.quant.schemes import SCHEMES, Scheme, get_scheme

__all__ = [
    "QuantArgs",
    "Scheme",
    "SCHEMES",
    "compute_qparams",
    "dequantize",
    "dequantize_weight",
    "dequantize_weight_args",
    "fake_quantize",
    "get_scheme",
    "group_view",
    "pack_int32",
    "packed_columns",
    "quantize",
    "quantize_weight",
    "unpack_int32",
]
