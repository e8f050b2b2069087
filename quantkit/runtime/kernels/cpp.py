"""The C++ kernels in csrc/cpu/dequant_gemm.cpp.

`cpu-int4dot` serves 4-bit weight-only linears (W4A16, symmetric or not, group/channel/tensor scales, act-order)
whose in_features are a multiple of 64 and whose groups are multiples of 64: at load the nibbles are
re-tiled (16 rows per tile, one sequential stream; the same bytes, not a dense copy) and the scales laid out
per tile; decode-sized batches (up to GEMV_MAX_ROWS rows) run an integer-dot GEMV on the nibbles with x
in 16-bit block fixed point (see the source: error <= absmax * 2^-16 per element, far below bf16's own);
larger batches take the dense path below.

Both integer-dot kernels also take x already quantised per token to int8 (`run_int8_tokens`: QSPEC's W4A8 draft
pass on a W4A16 target): the codes themselves go into the products, one multiply-add per weight byte instead of the
16-bit fixed point's two, for any number of rows.

`cpu-int8dot` is the same GEMV on 8-bit codes (W8A16, and W8A8 after the reference's activation fake-quant), 4
columns per 64-byte tile step (AVX512-VNNI, or AVX2 with 16-bit x). `cpu-fp8dot` serves e4m3 weights on bf16
activations through AVX512-BF16 dot products on 16-row tiles of the weight bytes (each e4m3 value is a bf16, so
the products are the reference's own).

`cpu-dequant` covers every other weight format the torch ops do not (fp32 activations of shapes the 4-bit tiles
do not take, 8-bit weights under fp32 activations, asymmetric or ragged shapes torch refuses, FP8 weights on CPUs
without AVX512-BF16).

Past GEMV_MAX_ROWS rows (prefill) each of them dequantises the weight into the activation dtype, each value formed
exactly in fp32 and rounded once (the reference's own bits), for a dense GEMM: `cpu-dequant` the whole weight into a
shared buffer (`base.dense_scratch`) and the reference's own F.linear (its output exactly); the tile kernels
`base.PREFILL_CHUNK_ROWS` rows at a time into a buffer that stays in cache, one GEMM per chunk (`chunked_linear` in
the source: the reference's products, summed in the GEMM's order), at the dense model's GEMM speed plus one decode
pass over the weight.

The weight stays in its stored bytes (4-bit nibbles, int8 or e4m3: zero-copy views of the checkpoint tensors
where their layout allows) with fp32 scales and int8 zero points; the kernel decodes it eight weights at a
time inside the product and accumulates in fp32, whatever the activation dtype (bf16 matmuls are slow on
CPUs without AVX512-BF16, and fp32 keeps the oracle's precision). Activations of W8A8/FP8 formats are
fake-quantised first in their own dtype, exactly as the reference does.

The extension is compiled at first use with torch.utils.cpp_extension (AVX2 + FMA + F16C) into
`<quantkit cache>/kernels/`; a machine without a compiler or AVX2 gets one warning and the reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from quantkit.native import CSRC
from quantkit.quant.activations import quantize_activation, token_codes
from quantkit.runtime.kernels.base import (NotSupported, Prepared, act_order, chunk_scratch, dense_product, dense_scratch, finish, flat, scale_grid,
                                           signed_weight, unsigned_weight, zero_grid)

SOURCE = CSRC / "cpu" / "dequant_gemm.cpp"
CODES = {"u4": 0, "i8": 1, "e4m3": 2}
# Batches up to this many rows decode the weight inside the product; larger ones dequantise the whole weight once
# into their dtype for one BLAS GEMM (the decode is then paid once instead of once per 8 rows of x).
GEMV_MAX_ROWS = 16


@functools.cache
def source_version() -> str:
    """The hash of the kernels' source and build flags: what a cached timing of them (kernels/choice.py) was
    measured on. The activation quantisation's source counts too: W8A8 and FP8 timings include it."""
    import hashlib

    from quantkit.native import CPU_FLAGS, CSRC, OPENMP_CFLAGS

    try:
        src = SOURCE.read_bytes() + (CSRC / "cpu" / "act_quant.cpp").read_bytes()
        return hashlib.sha256(src + " ".join([*CPU_FLAGS, *OPENMP_CFLAGS]).encode()).hexdigest()[:12]
    except OSError:
        return ""


@functools.cache
def extension():
    """The compiled extension module, or None (after one warning) where it cannot be built or run."""
    from quantkit.native import OPENMP_CFLAGS, load_cpu_extension
    from quantkit.progress import warn_once

    module, why = load_cpu_extension(SOURCE, OPENMP_CFLAGS)
    if module is None:
        warn_once(f"cpu-dequant: {why}; linears it would serve run the torch reference")
    return module


@dataclass
class Dequant(Prepared):
    codes: torch.Tensor  # uint8 [out, bytes per row]
    scale: torch.Tensor  # fp32 [scale rows, groups]
    zero_point: torch.Tensor | None  # int8, like scale
    perm: torch.Tensor | None
    code: int
    group: int
    row_block: int
    input_args: object
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None


def _codes(layer, perm: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    fmt = layer.fmt
    if fmt.weights.type == "float":
        w = layer.weight if perm is None else layer.weight[:, perm]
        if w.dtype != torch.float8_e4m3fn:
            raise NotSupported(f"float weights of dtype {w.dtype}")
        return w.contiguous().view(torch.uint8), CODES["e4m3"]
    bits = fmt.weights.num_bits
    if fmt.format == "pack-quantized" and perm is None:
        # The int32 bit stream read as little-endian bytes is already one byte stream per row (4 bits: two
        # values per byte, low nibble first; 8 bits: one value per byte), each offset by 2^(bits-1).
        raw = layer.weight_packed.contiguous().view(torch.uint8)
        if bits == 4:
            return raw, CODES["u4"]
        return raw ^ 0x80, CODES["i8"]  # offset-128 bytes -> int8 two's complement
    if bits == 8:
        return signed_weight(layer, perm).contiguous().view(torch.uint8), CODES["i8"]
    u = unsigned_weight(layer, perm)
    if u.shape[1] % 2:
        u = torch.nn.functional.pad(u, (0, 1))
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous(), CODES["u4"]


class SourceVersion:
    """The C++ kernels' `version` for the measured choice's cache: their source and build flags."""

    @property
    def version(self) -> str:
        return source_version()


class DequantKernel(SourceVersion):
    name = "cpu-dequant"

    def supports(self, fmt, device, shape, dtype) -> bool:
        w = fmt.weights
        if torch.device(device).type != "cpu" or not dtype.is_floating_point:
            return False
        if (w.type == "int" and w.num_bits not in (4, 8)) or w.is_fp4:  # fp4: the reference serves it
            return False
        if w.strategy == "block" and not w.block:
            return False
        return extension() is not None

    def prepare(self, layer) -> Dequant:
        n, k = layer.out_features, layer.in_features
        perm = act_order(layer)
        codes, code = _codes(layer, perm)
        scale, group, row_block = scale_grid(layer)
        zp = zero_grid(layer)
        a = layer.fmt.input
        return Dequant(k, n, layer.bias, codes, scale.float().contiguous(),
                       None if zp is None else zp.contiguous(), perm, code, group, row_block, a,
                       getattr(layer, "input_scale", None), getattr(layer, "input_zero_point", None))

    def run(self, x: torch.Tensor, p: Dequant) -> torch.Tensor:
        x2 = flat(x, p.in_features)
        if p.input_args is not None:
            x2 = quantize_activation(x2, p.input_args, p.input_scale, p.input_zero_point)
        if p.perm is not None:
            x2 = x2.index_select(1, p.perm)
        zp = p.zero_point if p.zero_point is not None else _EMPTY_I8
        if x2.shape[0] > GEMV_MAX_ROWS:
            w = dense_scratch(p.out_features, p.in_features, x2.dtype)
            extension().dq_weight(p.codes, p.scale, zp, p.code, p.group, p.row_block, w)
            return dense_product(x, x2, w, p)
        y = extension().dq_linear(x2.float().contiguous(), p.codes, p.scale, zp, p.code, p.group, p.row_block,
                                  GEMV_MAX_ROWS)
        return finish(y, x, p)


_EMPTY_I8 = torch.empty(0, dtype=torch.int8)
_EMPTY_F32 = torch.empty(0, dtype=torch.float32)
TILE = 16  # rows per tile (csrc: TILE)
ISA_SCALAR, ISA_AVX2, ISA_VNNI512, ISA_BF16 = 0, 1, 2, 3


@functools.cache
def dot_isa() -> int:
    """The integer-dot GEMV's instruction set here: AVX512-VNNI where ATen itself runs AVX512 and the CPU has
    it (so ATEN_CPU_CAPABILITY=avx2 runs the AVX2 path, as an AVX2-only CPU would), else AVX2, else scalar."""
    ext = extension()
    if ext is not None and torch.backends.cpu.get_cpu_capability() == "AVX512" and ext.has_vnni():
        return ISA_VNNI512
    return ISA_AVX2 if ext is not None and ext.has_avx2() else ISA_SCALAR


def tile_nibbles(u: torch.Tensor) -> torch.Tensor:
    """Unsigned 4-bit values u [N, K] (0..15, K % 8 == 0) -> the kernel's tiles uint8 [ceil(N/16), K/8, 64]:
    per tile and 8-column step, 4 bytes per row, byte t holding columns t (low nibble) and 4 + t (high)."""
    k = u.shape[1]
    v = _pad_rows(u).reshape(-1, TILE, k // 8, 2, 4)  # [tile, row, step, half, t]
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous().reshape(-1, k // 8, 64)


def tile_grid(grid: torch.Tensor) -> torch.Tensor:
    """A per-row [N, G] fp32 grid -> [ceil(N/16), G, 16] (padded rows 0)."""
    return _pad_rows(grid).reshape(-1, TILE, grid.shape[1]).transpose(1, 2).contiguous()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [ceil(N/16) * 16, C], zero rows appended."""
    pad = -t.shape[0] % TILE
    return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t


def tile_bytes(u: torch.Tensor, width: int) -> torch.Tensor:
    """Byte codes u [N, K] (K % width == 0) -> tiles uint8 [ceil(N/16), K/width, 16 * width]: per tile and
    `width`-column step, `width` consecutive bytes per row (8-bit integer tiles: width 4; FP8 tiles: width 2)."""
    k = u.shape[1]
    v = _pad_rows(u).reshape(-1, TILE, k // width, width)
    return v.permute(0, 2, 1, 3).contiguous().reshape(-1, k // width, TILE * width)


def rows_of(scale: torch.Tensor, row_block: int, n: int) -> torch.Tensor:
    """A scale grid whose rows each cover `row_block` output rows -> one row per output row [n, G]."""
    return scale if row_block == 1 else scale.repeat_interleave(row_block, 0)[:n]


def _bias(p: Prepared, dtype: torch.dtype) -> torch.Tensor:
    return _EMPTY_F32 if p.bias is None else p.bias.detach().to(dtype)


@dataclass
class IntTiles(Prepared):
    tiles: torch.Tensor  # uint8 [tiles, K * bits / 32, 64]
    scale: torch.Tensor  # fp32 [tiles, groups, 16]
    zscale: torch.Tensor | None  # fp32 scale * (offset + zp), like scale; None when symmetric
    perm: torch.Tensor | None
    group: int
    input_args: object = None
    input_scale: torch.Tensor | None = None
    input_zero_point: torch.Tensor | None = None
    int_mm_scale: torch.Tensor | None = None  # fp32 [out]: W8A8 prefill through int8 x int8 (see Int8DotKernel)


class IntDotKernel(SourceVersion):
    """The integer-dot GEMV on 16-row tiles of `bits`-bit codes (see the C++ source)."""

    name = "cpu-intdot"
    bits = 4

    @staticmethod
    def _group(fmt, k: int) -> int | None:
        w = fmt.weights
        if w.strategy == "group":
            return w.group_size if w.group_size % 64 == 0 else None
        return k if w.strategy in ("channel", "tensor") else None

    def _isa_ok(self) -> bool:
        return True

    def _input_ok(self, fmt, dtype) -> bool:
        return fmt.input is None

    def supports(self, fmt, device, shape, dtype) -> bool:
        w = fmt.weights
        k = shape[1]
        return (torch.device(device).type == "cpu" and dtype.is_floating_point and self._input_ok(fmt, dtype)
                and w.type == "int" and w.num_bits == self.bits and k % 64 == 0 and self._group(fmt, k) is not None
                and extension() is not None and self._isa_ok())

    def _tiles(self, layer, perm: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def prepare(self, layer) -> IntTiles:
        n, k = layer.out_features, layer.in_features
        perm = act_order(layer)
        tiles = self._tiles(layer, perm)
        scale, _, row_block = scale_grid(layer)
        scale = rows_of(scale.float(), row_block, n)
        zp = zero_grid(layer)
        offset = float(1 << (self.bits - 1))
        zscale = None if zp is None else tile_grid(scale * (offset + rows_of(zp.float(), row_block, n)))
        return IntTiles(k, n, layer.bias, tiles, tile_grid(scale), zscale, perm, self._group(layer.fmt, k),
                        layer.fmt.input, getattr(layer, "input_scale", None), getattr(layer, "input_zero_point", None),
                        self._int_mm_scale(layer.fmt, scale, zp, perm))

    def _int_mm_scale(self, fmt, scale: torch.Tensor, zp, perm) -> torch.Tensor | None:
        return None

    def run(self, x: torch.Tensor, p: IntTiles) -> torch.Tensor:
        x2 = flat(x, p.in_features)
        if x2.shape[0] > GEMV_MAX_ROWS and p.int_mm_scale is not None:
            return self._int_mm_prefill(x, x2, p)
        if p.input_args is not None:
            x2 = quantize_activation(x2, p.input_args, p.input_scale, p.input_zero_point)
        if p.perm is not None:
            x2 = x2.index_select(1, p.perm)
        zs = p.zscale if p.zscale is not None else _EMPTY_F32
        if x2.shape[0] > GEMV_MAX_ROWS:
            y = extension().dot_prefill(x2.contiguous(), p.tiles, p.scale, zs, p.out_features, p.group, self.bits,
                                        _bias(p, x2.dtype), chunk_scratch(p.in_features, x2.dtype))
            return y.reshape(*x.shape[:-1], p.out_features)
        y = extension().dot_linear(x2.contiguous(), p.tiles, p.scale, zs, p.out_features, p.group, self.bits,
                                   dot_isa(), GEMV_MAX_ROWS)
        return finish(y, x, p)

    def run_int8_tokens(self, x: torch.Tensor, p: IntTiles, args) -> torch.Tensor | None:
        """The layer with its input quantised to `args` (dynamic per-token int8) on the way in, computed on the
        int8 codes themselves: exact integer sums of codes x stored weights, scaled per token and group, at one
        multiply-add per weight byte where the 16-bit x of `run` takes two (QSPEC's W4A8 draft on a W4A16 layer).
        None where this layer quantises its input already (the caller fake-quantises instead)."""
        if p.input_args is not None:
            return None
        x2 = flat(x, p.in_features)
        codes, a_scale = token_codes(x2, args)
        if p.perm is not None:
            codes = codes.index_select(1, p.perm)
        zs = p.zscale if p.zscale is not None else _EMPTY_F32
        y = extension().dot_linear_codes(codes.contiguous(), a_scale.contiguous(), p.tiles, p.scale, zs,
                                         p.out_features, p.group, self.bits, dot_isa())
        return finish(y, x, p)


class Int4DotKernel(IntDotKernel):
    name = "cpu-int4dot"
    bits = 4

    def _tiles(self, layer, perm):
        if layer.fmt.format == "pack-quantized" and perm is None:
            # Straight from the checkpoint's bytes (no [out, in] unpacked copy: 2x the packed size per layer,
            # which the allocator then keeps as resident memory).
            return extension().tile_u4(layer.weight_packed.contiguous().view(torch.uint8), layer.in_features)
        return tile_nibbles(unsigned_weight(layer, perm))


class Int8DotKernel(IntDotKernel):
    """8-bit weights (W8A16, and W8A8 with its activations fake-quantised first, as the reference does), on
    AVX512-VNNI (vpdpbusd) or AVX2 (pmaddwd on 16-bit x), and only for bf16 / fp16 activations, whose own rounding
    the 16-bit fixed point of x stays far below (fp32 models keep cpu-dequant's exact fp32 products)."""

    name = "cpu-int8dot"
    bits = 8

    def _isa_ok(self) -> bool:
        return dot_isa() in (ISA_AVX2, ISA_VNNI512)

    def _input_ok(self, fmt, dtype) -> bool:
        return dtype in (torch.bfloat16, torch.float16)

    def _tiles(self, layer, perm):
        return tile_bytes(unsigned_weight(layer, perm), 4)

    def _int_mm_scale(self, fmt, scale: torch.Tensor, zp, perm) -> torch.Tensor | None:
        """W8A8 with dynamic per-token int8 activations and symmetric per-channel (or tensor) weights: prefill runs
        int8 x int8 (torch._int_mm on the tiles turned back into int8 rows, chunk by chunk) and scales the int32 sums
        by activation scale x weight scale in fp32, as torch-int-mm does, at 0.66x the bf16 GEMM's time (measured
        on the 1B Llama's layers) instead of dequantising for it. The weight scale per output row, else None."""
        a = fmt.input
        if (a is None or not a.dynamic or a.strategy != "token" or a.type != "int" or a.num_bits != 8 or zp is not None
                or perm is not None or scale.shape[1] != 1 or dot_isa() != ISA_VNNI512 or fp8_isa() != ISA_BF16):
            return None
        from quantkit.runtime.kernels.torch_cpu import int_mm_is_exact

        return scale.reshape(-1).contiguous() if int_mm_is_exact() else None

    def _int_mm_prefill(self, x: torch.Tensor, x2: torch.Tensor, p: IntTiles) -> torch.Tensor:
        codes, a_scale = token_codes(x2, p.input_args)
        acc = extension().int8_prefill(codes, p.tiles, p.scale, p.out_features, chunk_scratch(p.in_features, torch.int8))
        return finish(acc.float() * (a_scale.reshape(-1, 1) * p.int_mm_scale), x, p)


@functools.cache
def fp8_isa() -> int:
    """The FP8 GEMV's instruction set here: AVX512-BF16 where ATen itself runs AVX512 and the CPU has it, else
    none (FP8 linears then go to cpu-dequant)."""
    ext = extension()
    if ext is not None and torch.backends.cpu.get_cpu_capability() == "AVX512" and ext.has_bf16():
        return ISA_BF16
    return ISA_SCALAR


@dataclass
class Fp8Tiles(Prepared):
    tiles: torch.Tensor  # uint8 [tiles, K / 2, 32]
    scale: torch.Tensor  # fp32 [tiles, groups, 16]
    group: int
    input_args: object
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None


class Fp8DotKernel(SourceVersion):
    """e4m3 weights on bf16 activations through AVX512-BF16 dot products: every e4m3 value is a bf16, so the
    products are the reference's; FP8 activations are fake-quantised first in bf16, as the reference does."""

    name = "cpu-fp8dot"

    @staticmethod
    def _group(fmt, k: int) -> int | None:
        w = fmt.weights
        g = {"group": w.group_size, "block": w.block[1] if w.block else None}.get(w.strategy, k)
        return g if g and (g == k or g % 8 == 0) else None

    def supports(self, fmt, device, shape, dtype) -> bool:
        w = fmt.weights
        k = shape[1]
        return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and w.type == "float"
                and not w.is_fp4 and k % 8 == 0 and self._group(fmt, k) is not None
                and extension() is not None and fp8_isa() == ISA_BF16)

    def prepare(self, layer) -> Fp8Tiles:
        n, k = layer.out_features, layer.in_features
        if layer.weight.dtype != torch.float8_e4m3fn:
            raise NotSupported(f"float weights of dtype {layer.weight.dtype}")
        tiles = tile_bytes(layer.weight.contiguous().view(torch.uint8), 2)
        scale, _, row_block = scale_grid(layer)
        return Fp8Tiles(k, n, layer.bias, tiles, tile_grid(rows_of(scale.float(), row_block, n)),
                        self._group(layer.fmt, k), layer.fmt.input, getattr(layer, "input_scale", None),
                        getattr(layer, "input_zero_point", None))

    def run(self, x: torch.Tensor, p: Fp8Tiles) -> torch.Tensor:
        x2 = flat(x, p.in_features)
        if p.input_args is not None:
            x2 = quantize_activation(x2, p.input_args, p.input_scale, p.input_zero_point)
        if x2.shape[0] > GEMV_MAX_ROWS:
            y = extension().fp8_prefill(x2.contiguous(), p.tiles, p.scale, p.out_features, p.group,
                                        _bias(p, x2.dtype), chunk_scratch(p.in_features, x2.dtype))
            return y.reshape(*x.shape[:-1], p.out_features)
        y = extension().fp8_linear(x2.contiguous(), p.tiles, p.scale, p.out_features, p.group, fp8_isa(),
                                   GEMV_MAX_ROWS)
        return finish(y, x, p)
