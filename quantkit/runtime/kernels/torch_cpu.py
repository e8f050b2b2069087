"""CPU kernels built on torch's own quantised matmuls.

- `torch-int4pack`: W4A16 through `torch._weight_int4pack_mm_for_cpu`. Its packed layout comes from
  `torch._convert_weight_to_int4pack_for_cpu` on [out, in] int32 values in 0..15, and it dequantises
  w = (u - 8) * scale + zero with a [in / group, out, 2] (scale, zero) table in the activation dtype. Our values
  are q = u - 8 and w = (q - zp) * scale, so zero = -zp * scale. torch allows groups of 32, 64, 128 or 256
  (channel and tensor scales become repeated groups), out a multiple of 16, bf16/fp16/fp32 activations; its
  fp32 path is an order of magnitude slower than its bf16 one, so fp32 models go to the C++ kernel instead.
- `torch-int8pack`: symmetric per-channel W8A16 through `torch._weight_int8pack_mm` (int8 [out, in] and
  per-row scales in the activation dtype), again only for bf16/fp16 activations (its fp32 path is slow),
  and only for in % 16 == 0 (other widths give garbage or crash in torch 2.13).
- `torch-int-mm`: W8A8 int8 through `torch._int_mm` (int8 x int8 -> int32, no shape constraints on CPU):
  activations quantised per token (or per tensor, or with the static input_scale) exactly as the reference
  does, the int32 products scaled by activation scale x weight scale in fp32. Static asymmetric activations
  subtract zp * (row sums of the weight).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantkit.quant.activations import activation_codes
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.kernels.base import (NotSupported, Prepared, act_order, dense_product, dense_scratch, finish, flat, scale_grid,
                                           signed_weight, unsigned_weight, zero_grid)

HALF = (torch.bfloat16, torch.float16)
PREFILL_ROWS = 16  # past this many rows the int8 weight-only matmul dequantises once for oneDNN (cpp.GEMV_MAX_ROWS)
INT4_GROUPS = (256, 128, 64, 32)


def _cpu(device: torch.device) -> bool:
    return torch.device(device).type == "cpu"


def _int_weights(fmt: LinearFormat, bits: int) -> bool:
    w = fmt.weights
    return w.type == "int" and w.num_bits == bits and fmt.format in ("pack-quantized", "int-quantized", "naive-quantized")


@dataclass
class Int4Pack(Prepared):
    packed: torch.Tensor  # uint8 [out, in / 2], torch's layout
    scale_zeros: torch.Tensor  # [in / group, out, 2] in the activation dtype
    perm: torch.Tensor | None
    group: int
    dtype: torch.dtype


class Int4PackKernel:
    name = "torch-int4pack"

    @staticmethod
    def _group(fmt: LinearFormat, k: int) -> int | None:
        w = fmt.weights
        if w.strategy == "group":
            return w.group_size if w.group_size in INT4_GROUPS and k % w.group_size == 0 else None
        if w.strategy in ("channel", "tensor"):
            return next((g for g in INT4_GROUPS if k % g == 0), None)
        return None

    def supports(self, fmt, device, shape, dtype) -> bool:
        n, k = shape
        return (_cpu(device) and fmt.input is None and _int_weights(fmt, 4) and dtype in HALF and n % 16 == 0
                and self._group(fmt, k) is not None)

    def prepare(self, layer) -> Int4Pack:
        n, k = layer.out_features, layer.in_features
        group = self._group(layer.fmt, k)
        perm = act_order(layer)
        values = unsigned_weight(layer, perm).to(torch.int32).contiguous()  # q + 8 in 0..15: torch's convention
        packed = torch._convert_weight_to_int4pack_for_cpu(values, 1)
        del values
        scale, width, _ = scale_grid(layer)
        scale = scale.float().expand(n, -1) if scale.shape[0] == 1 else scale.float()
        zp = zero_grid(layer)
        zero = torch.zeros_like(scale) if zp is None else -zp.float().expand_as(scale) * scale
        reps = width // group  # channel / tensor: one scale repeated over k / group groups
        table = torch.stack([scale.repeat_interleave(reps, 1).t(), zero.repeat_interleave(reps, 1).t()], dim=-1)
        dtype = layer.compute_dtype if layer.compute_dtype in HALF else torch.bfloat16
        return Int4Pack(k, n, layer.bias, packed, table.to(dtype).contiguous(), perm, group, dtype)

    def run(self, x: torch.Tensor, p: Int4Pack) -> torch.Tensor:
        x2 = flat(x, p.in_features)
        if p.perm is not None:
            x2 = x2.index_select(1, p.perm)
        y = torch._weight_int4pack_mm_for_cpu(x2.to(p.dtype).contiguous(), p.packed, p.group, p.scale_zeros)
        return finish(y, x, p)


@dataclass
class Int8Pack(Prepared):
    weight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # [out] in the activation dtype
    dtype: torch.dtype


class Int8PackKernel:
    name = "torch-int8pack"

    def supports(self, fmt, device, shape, dtype) -> bool:
        w = fmt.weights
        # K must be a multiple of 16: torch 2.13's CPU kernel reads past the row otherwise (garbage or a crash).
        return (_cpu(device) and fmt.input is None and _int_weights(fmt, 8) and w.symmetric
                and w.strategy in ("channel", "tensor") and dtype in HALF and shape[1] % 16 == 0)

    def prepare(self, layer) -> Int8Pack:
        n, k = layer.out_features, layer.in_features
        dtype = layer.compute_dtype if layer.compute_dtype in HALF else torch.bfloat16
        scale = scale_grid(layer)[0].reshape(-1).expand(n).to(dtype).contiguous()
        return Int8Pack(k, n, layer.bias, signed_weight(layer).contiguous(), scale, dtype)

    def run(self, x: torch.Tensor, p: Int8Pack) -> torch.Tensor:
        x2 = flat(x, p.in_features).to(p.dtype)
        if x2.shape[0] > PREFILL_ROWS:  # prefill: the dense weight once, one oneDNN GEMM (see base.dense_scratch)
            w = torch.mul(p.weight, p.scale[:, None], out=dense_scratch(p.out_features, p.in_features, p.dtype))
            return dense_product(x, x2, w, p)
        y = torch._weight_int8pack_mm(x2.contiguous(), p.weight, p.scale)
        return finish(y, x, p)


@dataclass
class IntMM(Prepared):
    weight_t: torch.Tensor  # int8 [in, out] (a transposed view of the [out, in] weight)
    scale: torch.Tensor  # fp32 [out]
    row_sums: torch.Tensor | None  # int32 [out], static asymmetric activations only
    input_args: object
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None


@functools.lru_cache(maxsize=1)
def int_mm_is_exact() -> bool:
    """Whether torch._int_mm computes int8 x int8 -> int32 exactly on this CPU. With oneDNN on AVX2 alone (no
    AVX512/VNNI) it does not: its u8 x s8 pair products saturate at int16 (measured: errors of 1e5 on
    full-range codes, 2% of every output). Checked once per process on full-range codes, at a GEMV and a GEMM
    shape, against an exact int64 product."""
    gen = torch.Generator().manual_seed(0)
    b = torch.randint(-128, 128, (256, 32), generator=gen, dtype=torch.int8)
    for m in (1, 17):
        a = torch.randint(-128, 128, (m, 256), generator=gen, dtype=torch.int8)
        if not torch.equal(torch._int_mm(a, b).long(), a.long() @ b.long()):
            return False
    return True


class IntMMKernel:
    name = "torch-int-mm"

    def supports(self, fmt, device, shape, dtype) -> bool:
        w, a = fmt.weights, fmt.input
        if not (_cpu(device) and a is not None and _int_weights(fmt, 8) and w.symmetric):
            return False
        if not int_mm_is_exact():
            return False
        if w.strategy not in ("channel", "tensor") or a.type != "int" or a.num_bits != 8:
            return False
        return a.strategy in ("token", "tensor") if a.dynamic else a.strategy == "tensor"

    def prepare(self, layer) -> IntMM:
        n, k = layer.out_features, layer.in_features
        weight = signed_weight(layer)
        if weight.dtype != torch.int8:
            raise NotSupported(f"weights of dtype {weight.dtype}")
        a = layer.fmt.input
        zp = None if a.dynamic or a.symmetric else getattr(layer, "input_zero_point", None)
        sums = None if zp is None else weight.sum(1, dtype=torch.int32)
        scale = scale_grid(layer)[0].reshape(-1).float().expand(n).contiguous()
        return IntMM(k, n, layer.bias, weight.t(), scale, sums, a, getattr(layer, "input_scale", None), zp)

    def run(self, x: torch.Tensor, p: IntMM) -> torch.Tensor:
        x2 = flat(x, p.in_features)
        q, a_scale, zp = activation_codes(x2, p.input_args, p.input_scale, p.input_zero_point)
        acc = torch._int_mm(q.to(torch.int8), p.weight_t)
        if zp is not None:
            acc = acc - zp.to(torch.int32).reshape(1, 1) * p.row_sums
        y = acc.float() * (a_scale.float().reshape(-1, 1) * p.scale)
        return finish(y, x, p)
