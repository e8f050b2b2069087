"""Integer quantisation with the compressed-tensors conventions.

Symmetric:  scale = absmax / ((qmax - qmin) / 2), zero point 0   (int4: absmax / 7.5)
Asymmetric: scale = (max - min) / (2^bits - 1), zp = clamp(round(qmin - min / scale))
Both include 0 in the range, so an all-positive or all-negative group still represents 0 exactly.
Dequantisation is (q - zp) * scale. Quantised values live in the signed range [-2^(b-1), 2^(b-1) - 1].
"""

from __future__ import annotations

import torch

from quantkit.quant.args import QuantArgs


# Elements per chunk of an elementwise search loop: temporaries of 512 KB stay in cache and under the engine's
# mmap threshold (above it each temporary is a fresh mapping that page-faults on every use: measured 4x slower
# for the MSE scale search of a SmolLM2 layer with 1M-element chunks and a 1 MB threshold).
SEARCH_CHUNK = 1 << 17


def group_view(weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """View a [out, in] weight as [out, n_groups, group] (channel: one group per row; tensor: one group)."""
    out_features, in_features = weight.shape
    if args.strategy == "group":
        if in_features % args.group_size:
            raise ValueError(f"in_features {in_features} is not a multiple of group_size {args.group_size}")
        return weight.reshape(out_features, in_features // args.group_size, args.group_size)
    if args.strategy == "channel":
        return weight.reshape(out_features, 1, in_features)
    return weight.reshape(1, 1, -1)


def compute_qparams(
    min_vals: torch.Tensor, max_vals: torch.Tensor, args: QuantArgs
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point (int8 tensor, all zeros when symmetric) from per-group min and max."""
    min_vals = torch.minimum(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.maximum(max_vals, torch.zeros_like(max_vals))
    bit_range = float(args.qmax - args.qmin)
    if args.symmetric:
        scale = torch.maximum(min_vals.abs(), max_vals) / (bit_range / 2)
        zero_point = torch.zeros_like(scale)
    else:
        scale = (max_vals - min_vals) / bit_range
        zero_point = args.qmin - min_vals / torch.where(scale == 0, torch.ones_like(scale), scale)
        zero_point = zero_point.clamp(args.qmin, args.qmax)
    eps = torch.finfo(scale.dtype).eps
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    return scale, torch.round(zero_point).to(torch.int8)


def quantize(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs) -> torch.Tensor:
    """Round to the integer grid; returns int8 values in [qmin, qmax]. Broadcasts scale/zp against x."""
    q = x / scale
    if zero_point is not None:
        q = q + zero_point.to(x.dtype)
    return torch.round(q).clamp(args.qmin, args.qmax).to(torch.int8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None = None) -> torch.Tensor:
    x = q.to(scale.dtype)
    if zero_point is not None:
        x = x - zero_point.to(scale.dtype)
    return x * scale


def _broadcastable(params: torch.Tensor, weight: torch.Tensor, args: QuantArgs) -> torch.Tensor:
    """[out, n_groups] parameters -> broadcast over the [out, n_groups, group] view."""
    return params.reshape(group_view(weight, args).shape[:2]).unsqueeze(-1)


def weight_qparams(weight: torch.Tensor, args: QuantArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point, each shaped [out, n_groups] ([1] for tensor strategy), in fp32."""
    grouped = group_view(weight.float(), args)
    scale, zp = compute_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    if args.strategy == "tensor":
        return scale.reshape(1), zp.reshape(1)
    return scale, zp


def quantize_weight(
    weight: torch.Tensor,
    args: QuantArgs,
    scale: torch.Tensor | None = None,
    zero_point: torch.Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise a [out, in] weight. Returns (q int8 [out, in], scale [out, n_groups], zp int8 [out, n_groups]).

    Scales come from the weight's own min/max unless given (methods that search scales pass them in).
    The scale is rounded to `scale_dtype` (the checkpoint's dtype; default the weight's) before the weights
    are rounded, so the stored scale is exactly the one the integers were computed with.
    """
    if scale is None:
        scale, zero_point = weight_qparams(weight, args)
    scale_dtype = scale_dtype or weight.dtype
    scale = scale.to(scale_dtype).float()
    grouped = group_view(weight.float(), args)
    zp = None if args.symmetric else _broadcastable(zero_point, weight, args)
    q = quantize(grouped, _broadcastable(scale, weight, args), zp, args).reshape(weight.shape)
    if zero_point is None:
        zero_point = torch.zeros_like(scale, dtype=torch.int8)
    return q, scale.to(scale_dtype), zero_point


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs, dtype: torch.dtype
) -> torch.Tensor:
    grouped = group_view(q, args)
    zp = None if (args.symmetric or zero_point is None) else _broadcastable(zero_point, q, args)
    x = dequantize(grouped, _broadcastable(scale.float(), q, args), zp)
    return x.reshape(q.shape).to(dtype)


def fake_quantize(weight: torch.Tensor, args: QuantArgs, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Round-to-nearest quantise-dequantise as a checkpoint stores the weight and a consumer computes with it:
    the scale rounded to `dtype` (the checkpoint's; default the weight's) before the values are rounded, the
    dequantised value rounded to `dtype` again. Computed in fp32, returned in the weight's dtype."""
    dtype = dtype or weight.dtype
    g = group_view(weight.float(), args)
    scale, zp = compute_qparams(g.amin(-1), g.amax(-1), args)
    scale = round_to_dtype(scale, dtype)[..., None]
    zpf = zp.float()[..., None]
    q = torch.round(g / scale + zpf).clamp_(args.qmin, args.qmax)
    return round_to_dtype((q - zpf) * scale, dtype).reshape(weight.shape).to(weight.dtype)


def dequantize_weight_args(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    args: QuantArgs,
    g_idx: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dequantise a stored weight; with g_idx, column j uses the scale of group g_idx[j] (act-order)."""
    if g_idx is None:
        return dequantize_weight(q, scale, zero_point, args, dtype)
    col_scale = scale.float()[:, g_idx.long()]
    x = q.float()
    if zero_point is not None and not args.symmetric:
        x = x - zero_point.float()[:, g_idx.long()]
    return (x * col_scale).to(dtype)


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """Round fp32 values to `dtype`'s grid (the dtype scales are stored in), staying in fp32."""
    return x if dtype is None or dtype == torch.float32 else x.to(dtype).float()


# Scale dtypes the C++ calibration kernels round to (their codes in csrc/cpu/qparam_search.cpp, gptq_solve.cpp).
SCALE_DTYPE_CODES = {None: 0, torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def search_extension():
    """The fused shrink-grid search (csrc/cpu/qparam_search.cpp), or None after one warning where it cannot be
    built; QUANTKIT_EAGER_SEARCH=1 keeps the eager reference."""
    import os

    from quantkit.native import CSRC, EXACT_FP_CFLAGS, load_cpu_extension
    from quantkit.progress import warn_once

    if os.environ.get("QUANTKIT_EAGER_SEARCH"):
        return None
    module, why = load_cpu_extension(CSRC / "cpu" / "qparam_search.cpp", EXACT_FP_CFLAGS)
    if module is None:
        warn_once(f"scale search: {why}; the eager torch search runs instead (slower, same result)")
    return module


def _fused_search(w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None, grid: int, max_shrink: float,
                  importance: torch.Tensor | None):
    """group_qparams' mse search by the C++ kernel, or None where it does not apply (then the eager code runs)."""
    if w.device.type != "cpu" or w.dim() != 2 or w.shape[1] == 0 or scale_dtype not in SCALE_DTYPE_CODES or grid < 1:
        return None
    w = w.float().contiguous()
    if importance is None:
        imp = torch.empty(0)
    else:
        imp = importance.float().reshape(-1, w.shape[1])  # row r weighted by imp[r % P]
        if w.shape[0] % imp.shape[0]:
            return None
        imp = imp.contiguous()
    if not bool(torch.isfinite(w).all()):  # eager's NaN propagation through min/max is kept as it is
        return None
    ext = search_extension()
    if ext is None:
        return None
    scale, zp = ext.shrink_search(w, imp, int(args.qmin), int(args.qmax), bool(args.symmetric),
                                  SCALE_DTYPE_CODES[scale_dtype], int(grid), float(max_shrink))
    return scale, zp


def group_qparams(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None, mse: bool = False, grid: int = 20,
    max_shrink: float = 0.2, importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (rounded to scale_dtype, returned in fp32) and float zero point of each row of w [R, m].

    With mse, the row's range is shrunk by the factor (from a grid) that minimises its squared rounding
    error; clipping a few outliers often lowers the error of everything else. `importance` ([R, m] or [m],
    non-negative) weights each element's squared error, e.g. by the mean square of the input it multiplies.
    On CPU the search runs fused in C++ (`_fused_search`); `group_qparams_eager` is its reference.
    """
    if mse:
        fused = _fused_search(w, args, scale_dtype, grid, max_shrink, importance)
        if fused is not None:
            return fused
    return group_qparams_eager(w, args, scale_dtype, mse, grid, max_shrink, importance)


def group_qparams_eager(
    w: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype | None, mse: bool = False, grid: int = 20,
    max_shrink: float = 0.2, importance: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """group_qparams in torch ops, one grid point at a time over the whole of w."""
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    if not mse:
        scale, zp = compute_qparams(lo, hi, args)
        return round_to_dtype(scale, scale_dtype), zp.float()
    best_err = torch.full_like(lo, float("inf"))
    best_scale = torch.ones_like(lo)
    best_zp = torch.zeros_like(lo)
    for k in range(grid + 1):
        p = 1.0 - max_shrink * k / grid
        scale, zp = compute_qparams(lo * p, hi * p, args)
        scale = round_to_dtype(scale, scale_dtype)
        zpf = zp.float()
        q = torch.round(w / scale[:, None] + zpf[:, None]).clamp(args.qmin, args.qmax)
        err = ((q - zpf[:, None]) * scale[:, None] - w).pow(2)
        err = (err if importance is None else err * importance).sum(-1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zp = torch.where(better, zpf, best_zp)
    return best_scale, best_zp


def mse_weight_qparams(weight: torch.Tensor, args: QuantArgs, scale_dtype: torch.dtype,
                       grid: int = 20, max_shrink: float = 0.2,
                       importance: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale/zero point of a [out, in] weight chosen to minimise each group's squared rounding error
    (the range shrunk over a grid), shaped like weight_qparams' output. `importance` [in] weights the error of
    each input column (llama.cpp's importance matrix: the inputs' mean square)."""
    grouped = group_view(weight.float(), args)
    out, n_groups, size = grouped.shape
    rows = grouped.reshape(-1, size)
    col_weights = None
    if importance is not None:
        # Row r of `rows` is group r % n_groups of its output channel (tensor strategy: one row of all).
        imp = importance.float()
        col_weights = imp.repeat(out).reshape(1, -1) if args.strategy == "tensor" else imp.reshape(n_groups, size)
    fused = _fused_search(rows, args, scale_dtype, grid, max_shrink, col_weights)
    if fused is not None:
        return _shaped(fused[0], torch.round(fused[1]).to(torch.int8), out, n_groups, args)
    step = max(1, SEARCH_CHUNK // size)
    if col_weights is not None:
        step = max(n_groups, step // n_groups * n_groups)  # whole output channels per chunk

    def chunk_importance(n_rows: int) -> torch.Tensor | None:
        return None if col_weights is None else col_weights.repeat(n_rows // col_weights.shape[0], 1)

    parts = [group_qparams_eager(rows[i : i + step], args, scale_dtype, mse=True, grid=grid,
                                 max_shrink=max_shrink, importance=chunk_importance(rows[i : i + step].shape[0]))
             for i in range(0, rows.shape[0], step)]
    return _shaped(torch.cat([p[0] for p in parts]), torch.round(torch.cat([p[1] for p in parts])).to(torch.int8),
                   out, n_groups, args)


def _shaped(scale: torch.Tensor, zp: torch.Tensor, out: int, n_groups: int, args: QuantArgs):
    if args.strategy == "tensor":
        return scale.reshape(1), zp.reshape(1)
    return scale.reshape(out, n_groups), zp.reshape(out, n_groups)
