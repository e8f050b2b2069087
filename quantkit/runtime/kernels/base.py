"""The kernel protocol and the layout conversions kernels share.

A kernel serves quantised linears of some formats on one device type:

- `name`: what reports and `RuntimeModel.kernels` call it;
- `supports(fmt, device, shape, dtype)`: whether it can serve a linear of `LinearFormat` fmt with
  shape = (out_features, in_features) on `device`, activations arriving in `dtype` (checks the format only);
- `prepare(layer) -> Prepared`: a one-time repack of the layer's checkpoint tensors into the kernel's layout,
  at load (never a dense copy of the weight); may raise `NotSupported` for what only the tensors reveal
  (e.g. act-order groups of unequal size), and the next kernel is tried;
- `run(x, prepared) -> y`: x [..., in] in the activation dtype -> y [..., out] in the same dtype, bias added.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from quantkit.runtime import reference
from quantkit.runtime.formats import LinearFormat


class NotSupported(Exception):
    """prepare() found something in this layer's tensors that the kernel cannot serve."""


@dataclass
class Prepared:
    """A kernel's own layout of one linear. Subclasses add their tensors and static fields."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def tensors(self) -> list[torch.Tensor]:
        return [v for f in dataclasses.fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)]

    def apply(self, fn) -> None:
        """Apply a module `_apply` function (a move) to every tensor held."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                setattr(self, f.name, fn(v))


class Kernel(Protocol):
    name: str

    def supports(self, fmt: LinearFormat, device: torch.device, shape: tuple[int, int], dtype: torch.dtype) -> bool: ...

    def prepare(self, layer) -> Prepared: ...

    def run(self, x: torch.Tensor, prepared: Prepared) -> torch.Tensor: ...


# Prefill-sized batches (more rows than a GEMV serves) dequantise the whole weight once into the compute dtype
# and run one dense GEMM (oneDNN: AMX / AVX512-BF16 for bf16), as fast as the dense model's own matmul once the
# rows amortise the decode. One buffer per dtype, grown to the largest weight and reused by every layer: the
# runtime runs one linear at a time.
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def dense_scratch(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable [n, k] buffer of `dtype` for a layer's dequantised weight (contents undefined)."""
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < n * k:
        _SCRATCH.pop(dtype, None)
        with torch.inference_mode(False):  # a normal tensor: writable inside inference mode and outside it
            buf = _SCRATCH[dtype] = torch.empty(n * k, dtype=dtype)
    return buf[: n * k].view(n, k)


# The tile kernels' prefill dequantises this many weight rows at a time (csrc/cpu/dequant_gemm.cpp, chunked_linear):
# few enough to stay in the last-level cache between the dequantisation and the GEMM that reads them (4-11 MB of bf16
# at K = 2048-5632), enough that each GEMM keeps its speed (measured on the 1B Llama's layers: 1024 rows within 0-3%
# of one GEMM, 512 rows 3-5% slower, 176 rows 20%).
PREFILL_CHUNK_ROWS = 1024


def chunk_scratch(k: int, dtype: torch.dtype) -> torch.Tensor:
    """A reusable [PREFILL_CHUNK_ROWS, k] buffer of `dtype` for a chunk of dequantised weight rows."""
    return dense_scratch(max(16, PREFILL_CHUNK_ROWS // 16 * 16), k, dtype)


def dense_product(x: torch.Tensor, x2: torch.Tensor, w: torch.Tensor, p: Prepared) -> torch.Tensor:
    """x2 [M, in] @ w^T with the bias, as the reference computes it (one F.linear, bias inside), shaped like x."""
    bias = None if p.bias is None else p.bias.to(x2.dtype)
    return torch.nn.functional.linear(x2, w, bias).to(x.dtype).reshape(*x.shape[:-1], p.out_features)


def flat(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(-1, k)


def finish(y: torch.Tensor, x: torch.Tensor, p: Prepared) -> torch.Tensor:
    """[M, out] -> x's leading dims and dtype, plus the bias."""
    y = y.to(x.dtype)
    if p.bias is not None:
        y = y + p.bias.to(x.dtype)
    return y.reshape(*x.shape[:-1], p.out_features)


def act_order(layer) -> torch.Tensor | None:
    """For act-order (`weight_g_idx`): the column permutation that makes each group contiguous, or None when
    the columns are already in group order.

    Sorting columns by group (stable) puts group g at columns [g * group_size, (g + 1) * group_size) provided
    every group has group_size columns (GPTQ's act-order assigns them so); a kernel then permutes x's columns
    the same way at run time, which leaves x @ W^T unchanged."""
    g_idx = getattr(layer, "weight_g_idx", None)
    args = layer.fmt.weights
    if g_idx is None or args.strategy != "group":
        return None
    g_idx = g_idx.long()
    k, size = layer.in_features, args.group_size
    if torch.equal(g_idx, torch.arange(k, device=g_idx.device) // size):
        return None
    counts = torch.bincount(g_idx, minlength=-(-k // size))
    expected = torch.full_like(counts, size)
    expected[-1] = k - size * (len(counts) - 1)
    if not torch.equal(counts, expected):
        raise NotSupported("act-order groups of unequal size")
    return torch.sort(g_idx, stable=True).indices


def signed_weight(layer, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The integer weight values [out, in] as int8 (a view of the checkpoint tensor where it is int8 already),
    columns permuted by `perm`."""
    q = reference.integer_weight(layer)
    return q if perm is None else q[:, perm]


def unsigned_weight(layer, perm: torch.Tensor | None = None) -> torch.Tensor:
    """The weight values offset to unsigned (q + 2^(bits-1)) as uint8 [out, in], columns permuted by `perm`.

    For 4 and 8 bits the pack-quantized int32 stream read as bytes is already that, one or two values per
    byte (low nibble first), so this is a few byte-wise ops instead of a general bit unpack."""
    args = layer.fmt.weights
    k = layer.in_features
    if layer.fmt.format == "pack-quantized" and args.num_bits in (4, 8):
        raw = layer.weight_packed.contiguous().view(torch.uint8)
        u = raw if args.num_bits == 8 else torch.stack([raw & 15, raw >> 4], dim=-1).flatten(1)
        u = u[:, :k]
    else:
        u = (signed_weight(layer).to(torch.int16) + (1 << (args.num_bits - 1))).to(torch.uint8)
    return u if perm is None else u[:, perm]


def scale_grid(layer) -> tuple[torch.Tensor, int, int]:
    """The weight scales as a [scale rows, groups] grid with (group width, rows per scale row):
    group [out, G] / 1 row each; channel [out, 1] of width in; tensor [1, 1] covering every row; block
    [ceil(out/bh), ceil(in/bw)] of width bw, bh rows each."""
    args, scale = layer.fmt.weights, layer.weight_scale
    n, k = layer.out_features, layer.in_features
    if args.strategy == "group":
        return scale.reshape(n, -1), args.group_size, 1
    if args.strategy == "channel":
        return scale.reshape(n, 1), k, 1
    if args.strategy == "block":
        bh, bw = args.block
        return scale.reshape(-(-n // bh), -(-k // bw)), bw, bh
    return scale.reshape(1, 1), k, n


def zero_grid(layer) -> torch.Tensor | None:
    """Zero points (int8) on the same grid as `scale_grid`, or None when symmetric."""
    zp = reference.zero_point(layer)
    if zp is None:
        return None
    shape = scale_grid(layer)[0].shape
    return zp.reshape(shape).to(torch.int8)
