"""GPTQ: quantise a linear column by column, pushing each column's rounding error onto the columns not yet
quantised, weighted by the inverse Hessian of the layer's calibration inputs (Frantar et al., 2022).

The Hessian H = (2/n) sum x x^T is accumulated (fp32 sums of bf16 products) during the layer's single calibration pass, once per
distinct input tensor: linears fed the same tensor (q/k/v, gate/up, and in the all-experts statistics
pass every expert's gate/up) share one. The solve is the paper's blocked form (block 128, lazy batch
updates), with the inverse Hessian's upper Cholesky factor; problems with the same input width are solved
together as one batched problem. On CPU the column loop inside a block runs in C++ (csrc/cpu/gptq_solve.cpp, rows in
parallel), the eager torch loop being its reference (QUANTKIT_EAGER_SOLVE=1) and the path on other devices.

Options (recipe `quantization.options.gptq`, all optional):
  actorder   "static" (default): solve in order of decreasing diag(H); groups stay contiguous in the original
             column order, so the checkpoint is a plain grouped one (compressed-tensors actorder "weight").
             "group": groups are consecutive runs of the permuted order; writes weight_g_idx.  "none".
  dampening  added to diag(H) relative to its mean (default 0.1, see the module notes); x10 while Cholesky fails.
  scales     "updated" (default): a group's scale comes from its weights as updated by the solve when the
             solve first reaches the group (the original GPTQ); "original": from the unmodified weights.
  mse        search a shrink factor per group that minimises the group's squared rounding error (default on;
             weighted, see mse_weighting).
  min_tokens a Hessian built from fewer tokens falls back to RTN (warned in the manifest).
  hessian_dtype "bfloat16" (default) or "float32": dtype of the per-batch x^T x matmul (the sum is fp32).
             bf16 activations are exact in bf16 and the matmul accumulates in fp32, only its output is rounded
             (2^-9 relative). Measured on SmolLM2 (benchmarks/bench_gptq.py settings): held-out KL 0.1569 vs
             0.1580 (KJV) and 0.2957 vs 0.3002 (pydoc) for bf16 vs fp32, no Cholesky failure at dampening 0.1,
             122 s vs 140 s. (At dampening 0.01 bf16 made some o_proj Hessians indefinite.)
  mse_weighting "hessian" (default): the group scale search weighs each column's squared rounding error by
             1 / [H_F^-1]_kk, its cost when the solve reaches it; "none": unweighted. Measured on SmolLM2,
             64 x 512 KJV calibration, held-out KL: KJV 0.1745 -> 0.1580, pydoc (other domain) 0.3686 -> 0.3002.

Measured defaults (SmolLM2-135M layer 3, W4A16 g64, 8 x 256 KJV calibration tokens; relative output error
as a ratio to RTN's, on the calibration tokens / on 8 x 256 held-out KJV tokens):
  dampening 0.01 -> 0.1: held-out ratio improves on every linear (down_proj 1.12 -> 0.91, o_proj 0.69 -> 0.63,
             gate/up 0.83 -> 0.79, q 0.53 -> 0.49); at 0.01 down_proj (1536 inputs, 2048 tokens) is *worse*
             than RTN on held-out text: the Hessian overfits when tokens are few relative to the width.
             0.3 helps down/gate/up a little more but hurts q/k/v; 0.1 is the default.
  scales updated vs original: within 0.003 of each other on every linear (e.g. down 0.908 vs 0.910, gate
             0.787 vs 0.786); "updated" (the original GPTQ) is kept as the default.
  act-order static vs none: static better on every linear (q 0.49 vs 0.58, down 0.91 vs 0.93).
  mse scale search on: calibration and held-out ratios drop on every linear (held-out q 0.49 -> 0.46,
             o 0.63 -> 0.60, gate 0.79 -> 0.73, down 0.91 -> 0.84) for ~13% more solve time; default on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from quantkit.compute import one_thread
from quantkit.errors import InputError
from quantkit.methods.base import LayerContext, Method, QuantizedWeight, SharedInputs, check_known_options
from quantkit.quant.integer import SCALE_DTYPE_CODES, group_qparams, round_to_dtype
from quantkit.quant import QuantArgs, dequantize_weight_args
from quantkit.quant.fp4 import fp4_group_scales, round_to_e2m1, search_fp4_scales
from quantkit.quant.hessian import accumulate_hessian, complete_hessian
from quantkit.quant.weights import dequantize_any, quantize_any

ACTORDERS = ("static", "group", "none")
SCALE_MODES = ("updated", "original")


@dataclass(frozen=True)
class GPTQConfig:
    block_size: int = 128
    dampening: float = 0.1  # measured: held-out error falls from 0.01 to 0.1 on every SmolLM2 linear
    actorder: str = "static"
    scales: str = "updated"
    mse: bool = True  # measured: lowers calibration and held-out error of every SmolLM2 linear by 3-8%
    mse_grid: int = 20  # shrink factors 1, 1 - 1/grid*max_shrink, ..., 1 - max_shrink
    mse_max_shrink: float = 0.2
    mse_weighting: str = "hessian"
    min_tokens: int = 64
    hessian_dtype: str = "bfloat16"
    max_damp_raises: int = 6
    batch_problems: bool = True  # solve same-shape problems of a layer (MoE experts) as one batch

    def __post_init__(self) -> None:
        if self.actorder not in ACTORDERS:
            raise InputError(f"unknown actorder {self.actorder!r}; valid: {', '.join(ACTORDERS)}")
        if self.scales not in SCALE_MODES:
            raise InputError(f"unknown gptq scales mode {self.scales!r}; valid: {', '.join(SCALE_MODES)}")
        if not (0 <= self.dampening < 10) or not math.isfinite(self.dampening):
            raise InputError(f"dampening must be in [0, 10), got {self.dampening}")
        if self.block_size <= 0:
            raise InputError("gptq block_size must be positive")
        if self.mse_weighting not in ("hessian", "none"):
            raise InputError("gptq mse_weighting must be hessian or none")
        if self.hessian_dtype not in ("bfloat16", "float32"):
            raise InputError("gptq hessian_dtype must be bfloat16 or float32")

    @classmethod
    def from_options(cls, options: dict) -> "GPTQConfig":
        check_known_options("gptq", options, [f.name for f in fields(cls)])
        opts = dict(options)
        if opts.get("actorder") in (None, False):
            opts["actorder"] = "none" if "actorder" in opts else cls.actorder
        if opts.get("actorder") in ("weight", True):
            opts["actorder"] = "static"
        return cls(**opts)


# ---------------------------------------------------------------------------------------------------------
# Pure numerics
# ---------------------------------------------------------------------------------------------------------


def dampen_(h: torch.Tensor, relative: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: dead inputs (zero diagonal) get diagonal 1 (their weights are then rounded plainly and pass no
    error on); then relative * mean(diag) is added to the diagonal. Returns (h, dead mask)."""
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    dead = diag <= 0
    diag[dead] = 1.0
    mean = diag.mean(dim=-1, keepdim=True)
    diag.add_(relative * mean)
    return h, dead


def dampen(h: torch.Tensor, relative: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dampen_ on a copy: (damped H, dead mask)."""
    return dampen_(h.clone(), relative)


# Blocks up to this width are inverted by a triangular solve; wider ones by halves (two inverses and two matmuls),
# which runs at matmul speed: measured 16 ms against 36 ms for a 1536-wide factor, 0.65 s against 1.23 s at 5504.
_TRIANGULAR_BASE = 192


def lower_inverse_(lower: torch.Tensor) -> torch.Tensor:
    """In place: the inverse of lower-triangular [..., n, n] `lower` (zeros above the diagonal), block by block:
    inv([[A, 0], [C, D]]) = [[inv(A), 0], [-inv(D) C inv(A), inv(D)]]."""
    n = lower.shape[-1]
    if n <= _TRIANGULAR_BASE:
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device).expand_as(lower)
        return lower.copy_(torch.linalg.solve_triangular(lower, eye, upper=False))
    h = n // 2
    a, c, d = lower[..., :h, :h], lower[..., h:, :h], lower[..., h:, h:]
    lower_inverse_(a)
    lower_inverse_(d)
    c.copy_(d @ (c @ a)).neg_()
    return lower


def cholesky_(h: torch.Tensor) -> torch.Tensor:
    """In place: h's lower Cholesky factor, batched; a problem that is not positive definite gets the identity.
    Returns the ok mask per problem."""
    info = torch.empty(h.shape[:-2], dtype=torch.int32, device=h.device)
    torch.linalg.cholesky_ex(h, out=(h, info))
    ok = info == 0
    if not bool(ok.all()):
        h[~ok] = torch.eye(h.shape[-1], device=h.device, dtype=h.dtype)
    h.tril_()
    return ok


def reverse_matrices_(m: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """In place: each contiguous [..., n, n] matrix reversed along both axes (J M J). That is its storage read
    backwards, so the halves are swapped a chunk at a time: no second n x n matrix (m.flip would be one)."""
    n2 = m.shape[-1] * m.shape[-2]
    for flat in m.reshape(-1, n2):  # views: m is contiguous
        half = n2 // 2
        for k in range(0, half, chunk):
            c = min(chunk, half - k)
            front, back = flat[k : k + c], flat[n2 - k - c : n2 - k]
            keep = front.clone()
            front.copy_(back.flip(0))
            back.copy_(keep.flip(0))
    return m


def upper_factor_(lower: torch.Tensor) -> torch.Tensor:
    """U = J L^-1 J, in place, from the lower Cholesky factor L of J H J (J reverses rows and columns), batched.
    U is upper triangular with H^-1 = U^T U: J H J = L L^T gives H^-1 = (J L^-1 J)^T (J L^-1 J). One Cholesky
    and one triangular inverse: about half the work of factorising H, inverting it and factorising the inverse
    (measured 30 ms against 79 ms for 1536 x 1536), and no second n x n matrix."""
    return reverse_matrices_(lower_inverse_(lower.contiguous()))


def reversed_inverse_cholesky_(hr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """U, the upper Cholesky factor of H^-1 (H^-1 = U^T U), from hr = H with rows and columns reversed, batched;
    hr is consumed. Returns (U, ok mask per problem)."""
    ok = cholesky_(hr)
    upper = upper_factor_(hr)
    return upper, ok & torch.isfinite(upper).flatten(-2).all(-1)


def inverse_cholesky(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U), batched; h is left as it was. Returns (U, ok mask per
    problem)."""
    return reversed_inverse_cholesky_(h.flip(-2, -1))


def column_order(h: torch.Tensor, actorder: str) -> torch.Tensor:
    """Solve order: decreasing diag(H) for act-order (stable, so ties keep column order), else identity."""
    n = h.shape[-1]
    if actorder == "none":
        return torch.arange(n, device=h.device)
    return torch.argsort(torch.diagonal(h).neg(), stable=True)


def column_groups(n: int, args: QuantArgs, perm: torch.Tensor, actorder: str) -> torch.Tensor:
    """Group id of every original column: contiguous groups in the original order, except act-order
    "group", where groups are consecutive runs of the solve order (so a g_idx is needed)."""
    if args.strategy not in ("group", "tensor_group"):
        return torch.zeros(n, dtype=torch.long, device=perm.device)
    if actorder == "group":
        groups = torch.empty(n, dtype=torch.long, device=perm.device)
        groups[perm] = torch.arange(n, device=perm.device) // args.group_size
        return groups
    return torch.arange(n, device=perm.device) // args.group_size


@dataclass
class SolveResult:
    q: torch.Tensor  # int8 [B, R, n], original column order
    scale: torch.Tensor  # fp32 [B, R, G] (already rounded to the scale dtype)
    zero_point: torch.Tensor  # fp32 [B, R, G]
    # float64 [B, R]: each row's sum of squared scaled errors e_k = (w_k - deq_k) / U_kk over its columns, which is
    # tr(E H E^T) for that row's error E = W - dequantised under the damped H the factor U came from (W - deq =
    # Err U and U H U^T = I): the solve's own loss, from which the error report takes GPTQ's output error.
    loss: torch.Tensor | None = None


def gptq_extension():
    """The C++ column loop (csrc/cpu/gptq_solve.cpp), or None (after one warning) where it cannot be built;
    QUANTKIT_EAGER_SOLVE=1 keeps the eager loop, its reference."""
    import os

    from quantkit.native import CSRC, EXACT_FP_CFLAGS, load_cpu_extension
    from quantkit.progress import warn_once

    if os.environ.get("QUANTKIT_EAGER_SOLVE"):
        return None
    module, why = load_cpu_extension(CSRC / "cpu" / "gptq_solve.cpp", EXACT_FP_CFLAGS)
    if module is None:
        warn_once(f"gptq: {why}; the eager column loop runs instead (slower, same result)")
    return module


def column_loop_extension(device: torch.device):
    """The compiled column loop for a solve on `device`: only CPU tensors may reach the C++ extension (it reads
    their memory directly); any other device (CUDA) runs the eager torch loop there, in that device's fp32."""
    return gptq_extension() if torch.device(device).type == "cpu" else None


def gptq_solve(
    weight: torch.Tensor,
    u: torch.Tensor,
    perm: torch.Tensor,
    col_group: torch.Tensor,
    args: QuantArgs,
    scale_dtype: torch.dtype | None = torch.bfloat16,
    scales: str = "updated",
    block_size: int = 128,
    mse: bool = False,
    mse_grid: int = 20,
    mse_max_shrink: float = 0.2,
    mse_weighting: str = "none",
    row_global: torch.Tensor | None = None,
) -> SolveResult:
    """The blocked GPTQ solve of B independent problems at once.

    weight [B, R, n] (original column order), u [B, n, n] upper Cholesky factor of the permuted damped
    H^-1, perm [B, n] solve order, col_group [B, n] group of each original column. Each dequantised value is
    rounded to scale_dtype (as a consumer computes (q - zp) * scale in the checkpoint's dtype) before its
    error is propagated. With mse_weighting "hessian", a group's scale search weighs each column's squared
    rounding error by 1 / u_kk^2 = 1 / [H_F^-1]_kk, what rounding that column costs when the solve reaches it
    (the per-column loss of the OBQ/GPTQ derivation).

    fp4 weights (NVFP4, MXFP4) solve on the e2m1 grid: a group's stored scale comes from its members as the solve
    reaches it (under `row_global` [B, R], each row's NVFP4 global scale; with mse, the best of the absmax scale and
    its neighbours on the format's scale grid, `search_fp4_scales`, weighted like the integer search), and the
    result's q holds e2m1 values in fp32.
    """
    bsz, rows, n = weight.shape
    dev = weight.device
    n_groups = int(col_group.max().item()) + 1
    w = torch.gather(weight.float(), 2, perm[:, None, :].expand(bsz, rows, n)).contiguous()
    grp_p = torch.gather(col_group, 1, perm)  # group of each permuted column
    sym = args.symmetric
    scale_g = torch.zeros(bsz, rows, n_groups, device=dev)
    zp_g = torch.zeros(bsz, rows, n_groups, device=dev)
    # The group of each permuted column as a gather index: scale and zero point of column k are
    # scale_g[..., grp_p[k]], read when the solve reaches it (no per-column copies of the grids).
    grp_idx = grp_p[:, None, :]
    # Permuted positions of each group's members, and the position where the solve first reaches it.
    members = [[torch.nonzero(grp_p[b] == g).flatten() for g in range(n_groups)] for b in range(bsz)]
    first_at: dict[int, list[tuple[int, int]]] = {}
    for b in range(bsz):
        for g in range(n_groups):
            if members[b][g].numel():
                first_at.setdefault(int(members[b][g][0]), []).append((b, g))

    col_cost = 1.0 / torch.diagonal(u, dim1=-2, dim2=-1).float().pow(2) if mse_weighting == "hessian" else None

    fp4 = args.is_fp4
    if fp4:
        row_global = torch.ones(bsz, rows, device=dev) if row_global is None else row_global.float()

    def set_group(b: int, g: int, values: torch.Tensor) -> None:
        importance = None if col_cost is None else col_cost[b, members[b][g]]
        if fp4:
            gs = row_global[b][:, None]  # [R, 1], against the [R, 1] scales of this one group
            scale_g[b, :, g] = (search_fp4_scales(values, args, gs, importance) if mse
                                else fp4_group_scales(values, args, gs)).reshape(-1)
            return
        s, z = group_qparams(values, args, scale_dtype, mse, mse_grid, mse_max_shrink, importance=importance)
        scale_g[b, :, g], zp_g[b, :, g] = s, z

    if scales == "original":
        for b in range(bsz):
            for g in range(n_groups):
                if members[b][g].numel():
                    set_group(b, g, w[b][:, members[b][g]])

    q_p = torch.zeros(bsz, rows, n, dtype=torch.int8, device=dev)  # q fits int8 (SolveResult's dtype)
    loss = torch.zeros(bsz, rows, dtype=torch.float64, device=dev)

    def group_start(b: int, g: int, i1: int, i2: int, i: int, w: torch.Tensor, w1: torch.Tensor,
                    err1: torch.Tensor) -> None:
        """Group g of problem b is first reached at column i1 + i: its scale from its members as updated so far."""
        cols = members[b][g]
        inside = cols[cols < i2]
        outside = cols[cols >= i2]
        values = torch.empty(rows, cols.numel(), device=dev)
        n_in = inside.numel()
        values[:, :n_in] = w1[b][:, inside - i1]
        if outside.numel():
            # Bring the lazily updated columns up to date with this block's errors so far.
            values[:, n_in:] = w[b][:, outside] - err1[b][:, :i] @ u[b][i1 : i1 + i][:, outside]
        set_group(b, g, values)

    ext = column_loop_extension(dev) if n and not fp4 else None
    if ext is not None:
        for i1 in range(0, n, block_size):
            i2 = min(i1 + block_size, n)
            w1 = w[:, :, i1:i2].contiguous()
            err1 = torch.zeros(bsz, rows, i2 - i1, device=dev)
            u1 = u[:, i1:i2, i1:i2].float().contiguous()
            grp1 = grp_p[:, i1:i2].contiguous()
            # The C++ loop runs between the columns where a group's scale is set (from the columns as updated).
            starts = sorted(k for k in first_at if i1 <= k < i2) if scales == "updated" else []
            done = i1
            for k in starts + [i2]:
                if k > done:
                    ext.gptq_columns(w1, u1, scale_g, zp_g, grp1, err1, q_p, done - i1, k - i1, i1, int(args.qmin),
                                     int(args.qmax), bool(sym), SCALE_DTYPE_CODES[scale_dtype])
                for b, g in first_at.get(k, []) if k < i2 else []:
                    group_start(b, g, i1, i2, k - i1, w, w1, err1)
                done = k
            loss += err1.double().pow(2).sum(-1)
            if i2 < n:
                w[:, :, i2:].baddbmm_(err1, u[:, i1:i2, i2:], alpha=-1)
        del w
        q_out = torch.empty_like(q_p)
        q_out.scatter_(2, perm[:, None, :].expand(bsz, rows, n), q_p)
        return SolveResult(q_out, scale_g, zp_g, loss)

    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        count = i2 - i1
        with one_thread(dev):  # thousands of small ops; the block's trailing update below uses every thread
            w1 = w[:, :, i1:i2].clone()
            err1 = torch.zeros(bsz, rows, count, device=dev)
            u1 = u[:, i1:i2, i1:i2]
            for i in range(count):
                k = i1 + i
                if scales == "updated" and k in first_at:
                    for b, g in first_at[k]:
                        group_start(b, g, i1, i2, i, w, w1, err1)
                col = w1[:, :, i]
                at = grp_idx[:, :, k : k + 1].expand(bsz, rows, 1)
                s = scale_g.gather(2, at)[:, :, 0]
                if fp4:
                    s = s / row_global
                    v = round_to_e2m1((col / s).clamp_(args.qmin, args.qmax))
                    q, deq = v * 2, v * s  # q: twice the e2m1 value, an integer in [-12, 12]
                elif sym:
                    q = torch.round(col / s).clamp_(args.qmin, args.qmax)
                    deq = q * s
                else:
                    z = zp_g.gather(2, at)[:, :, 0]
                    q = torch.round(col / s + z).clamp_(args.qmin, args.qmax)
                    deq = (q - z) * s
                deq = round_to_dtype(deq, scale_dtype)
                e = (col - deq) / u1[:, i, i][:, None]
                w1[:, :, i:].baddbmm_(e[:, :, None], u1[:, i : i + 1, i:], alpha=-1)
                err1[:, :, i] = e
                q_p[:, :, k] = q
        loss += err1.double().pow(2).sum(-1)
        if i2 < n:
            w[:, :, i2:].baddbmm_(err1, u[:, i1:i2, i2:], alpha=-1)
    del w
    q_out = torch.empty_like(q_p)
    q_out.scatter_(2, perm[:, None, :].expand(bsz, rows, n), q_p)
    return SolveResult(q_out.float() / 2 if fp4 else q_out, scale_g, zp_g, loss)


def stored_weight(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, args: QuantArgs,
                  g_idx: torch.Tensor | None, dtype: torch.dtype | None,
                  global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weights a consumer computes from a stored (q, scale, zp, g_idx), rounded like the checkpoint."""
    if args.is_fp4:  # e4m3 or power-of-two scales: exact in any checkpoint dtype
        return round_to_dtype(dequantize_any(q, scale, None, args, global_scale=global_scale), dtype)
    scale = round_to_dtype(scale.float(), dtype)
    return round_to_dtype(dequantize_weight_args(q, scale, zero_point, args, g_idx), dtype)


def relative_output_errors(weight: torch.Tensor, approxs: list[torch.Tensor], h: torch.Tensor,
                           perm: torch.Tensor | None = None, rows: int = 256,
                           matmul_dtype: torch.dtype = torch.float32) -> list[float]:
    """||(W - Wq) X^T|| / ||W X^T|| over the calibration tokens, from H ~ X^T X, for each approximation.
    `perm`: h is given with rows and columns in that order (the solve's), the weights in the original one.
    Computed `rows` weight rows at a time, so the temporaries stay a few MB whatever the layer's size.
    The product with H runs in `matmul_dtype` (the run's: bf16 where it is the faster, which moves each error by
    ~2^-8 relative; it reports errors and compares GPTQ with RTN, neither of which needs more)."""
    quad = output_error_quads(weight, approxs, h, perm, rows, matmul_dtype).tolist()
    den = quad[0]
    return [math.sqrt(max(v, 0.0) / den) if den > 0 else 0.0 for v in quad[1:]]


def output_error_quads(weight: torch.Tensor, approxs: list[torch.Tensor], h: torch.Tensor,
                       perm: torch.Tensor | None = None, rows: int = 256,
                       matmul_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float64 [1 + len(approxs)] on the weights' device: tr(W H W^T), then tr(D H D^T) for each D = W - approx
    (see relative_output_errors)."""
    w = weight.float()
    hm = h.to(matmul_dtype)
    quad = torch.zeros(len(approxs) + 1, dtype=torch.float64, device=w.device)  # on w's device: a GPU run too
    for r0 in range(0, w.shape[0], rows):
        part = w[r0 : r0 + rows]
        stacked = torch.stack([part] + [part - a[r0 : r0 + rows].float() for a in approxs])
        if perm is not None:
            stacked = stacked[:, :, perm]
        quad += (((stacked.to(matmul_dtype) @ hm).float()) * stacked).flatten(1).sum(-1).double()
    return quad


def relative_output_error(weight: torch.Tensor, approx: torch.Tensor, h: torch.Tensor) -> float:
    return relative_output_errors(weight, [approx], h)[0]


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack, without the copy for one tensor (a single down_proj factor is hundreds of MB)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


# ---------------------------------------------------------------------------------------------------------
# The method
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Problem:
    names: list[str]  # linears sharing this Hessian, rows concatenated in this order
    weight: torch.Tensor | None  # fp32 [R, n], built when the problem is solved (see GPTQ._weights)
    h: torch.Tensor | None  # fp32 [n, n], (2/n_tokens) sum x x^T; dropped once factorised
    rows: list[int]
    args: QuantArgs  # the weights' scheme (a mixed plan may give linears sharing an input different ones)
    # per linear, float64 (tr(W H W^T), tr(D H D^T)) with D = W - its RTN weight: the error report's denominator and
    # the guard's RTN error, taken while H is at hand
    reference: list[tuple[float, float]] | None = None


class GPTQ(Method):
    name = "gptq"
    groupwise = True
    # integer and fp4 weights (fp8's grid is fine enough that GPTQ gains nothing over RTN)
    schemes = ("W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W8A8_STATIC", "W4AFP8", "NVFP4A16", "NVFP4", "MXFP4A16",
               "MXFP4")
    needs_calibration = True

    def __init__(self, scheme, **options):
        super().__init__(scheme, **options)
        self.config = GPTQConfig.from_options(options)
        if scheme.weights.strategy == "tensor":
            raise InputError("gptq supports group and channel weight scales, not one scale per tensor")
        if self.config.actorder == "group" and scheme.weights.is_fp4:
            raise InputError(f"gptq act-order 'group' needs a g_idx tensor, which {scheme.name}'s format does not "
                             "store; use --actorder static (the default) or none")
        self.writes_g_idx = self.config.actorder == "group" and scheme.weights.strategy == "group"
        # What config.json's quantization_config records as `actorder` (vLLM loads "weight"/None).
        self.config_actorder = "group" if self.writes_g_idx else ("weight" if self.config.actorder == "static" else None)
        self.report: list[dict] = []  # per linear: gptq vs rtn relative output error, damping used
        self._reset()

    def _reset(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._bad_batches: dict[str, int] = {}
        self._shared = SharedInputs()

    def attach(self, ctx: LayerContext) -> list:
        self._reset()
        # bf16 products only where the layer's matmuls read bf16 (a bf16 model, or an fp32 one under autocast):
        # an fp32 run keeps fp32 inputs exact, and on CPUs without bf16 units a bf16 matmul is the slower.
        bf16 = self.config.hessian_dtype == "bfloat16" and ctx.matmul_dtype == torch.bfloat16
        mm_dtype = torch.bfloat16 if bf16 else torch.float32

        self._shared = SharedInputs(known=ctx.input_leaders)

        def hook(name):
            def fn(module, inputs):
                x = inputs[0]
                if name in ctx.results or self._shared.see(name, x) != name:
                    return  # quantised already (one-pass schedule), or another linear's input
                with ctx.phase("statistics"):
                    if name not in self._sums:
                        # float64: the sum of the per-batch float32 products is then exact (see
                        # quantkit.distributed), the same however the batches are split over ranks.
                        self._sums[name] = torch.zeros(x.shape[-1], x.shape[-1], dtype=torch.float64,
                                                       device=x.device)
                        self._tokens[name] = 0
                    if accumulate_hessian(self._sums[name], x.detach(), mm_dtype):
                        self._tokens[name] += x.numel() // x.shape[-1]
                    else:
                        self._bad_batches[name] = self._bad_batches.get(name, 0) + 1

            return fn

        return [m.register_forward_pre_hook(hook(n)) for n, m in ctx.targets.items()]

    preview_stats = "hessian"

    def preview(self, weight: torch.Tensor, args, stats, weight_dtype: torch.dtype) -> torch.Tensor:
        """The solve of `weight` alone under `args` with the given H (RTN where H is missing or singular)."""
        if stats is None or stats.hessian is None or stats.tokens < self.config.min_tokens:
            return super().preview(weight, args, stats, weight_dtype)
        cfg = self.config
        actorder = "static" if cfg.actorder == "group" else cfg.actorder
        h = stats.hessian.float()
        perm = column_order(h, actorder)
        rev = perm.flip(0)
        hr, _ = dampen_(h[rev[:, None], rev], cfg.dampening)
        u, ok = reversed_inverse_cholesky_(hr[None])
        del hr
        if not bool(ok[0]):
            return super().preview(weight, args, stats, weight_dtype)
        w = torch.nan_to_num(weight.float(), nan=0.0, posinf=0.0, neginf=0.0)
        from quantkit.quant.fp4 import fp4_global_scale

        gs = fp4_global_scale(w, args)
        row_global = None if gs is None else gs.to(w.device).expand(1, w.shape[0])
        r = gptq_solve(w[None], u, perm[None], column_groups(len(perm), args, perm, actorder)[None], args,
                       scale_dtype=weight_dtype, scales=cfg.scales, block_size=cfg.block_size, mse=cfg.mse,
                       mse_grid=cfg.mse_grid, mse_max_shrink=cfg.mse_max_shrink, mse_weighting=cfg.mse_weighting,
                       row_global=row_global)
        zp = None if args.symmetric else r.zero_point[0].round().to(torch.int8)
        return stored_weight(r.q[0], r.scale[0], zp, args, None, weight_dtype, gs)

    rescales_inputs = True

    def rescale_input_statistics(self, leader: str, s: torch.Tensor) -> None:
        # sum (x/s)(x/s)^T = D^-1 (sum x x^T) D^-1 with D = diag(s), entry by entry (upper blocks included).
        if leader in self._sums:
            inv = s.to(device=self._sums[leader].device, dtype=torch.float64).reciprocal()
            self._sums[leader].mul_(inv[:, None] * inv[None, :])

    def reduce_statistics(self, ranks) -> None:
        self._sums = ranks.reduce(self._sums, "sum")
        names = sorted(set(self._tokens) | set(self._bad_batches))
        counts = ranks.reduce({n: torch.tensor([self._tokens.get(n, 0), self._bad_batches.get(n, 0)])
                               for n in names}, "sum")
        self._tokens = {n: int(c[0]) for n, c in counts.items() if n in self._sums}
        self._bad_batches = {n: int(c[1]) for n, c in counts.items() if int(c[1])}

    def apply(self, ctx: LayerContext) -> None:
        self._shared.release()
        on_cpu = all(t.weight.device.type == "cpu" for t in ctx.targets.values())
        # The eager column loop is thousands of small ops (measured 2-20x slower with 2 threads than with 1); the
        # compiled loop and the factorisations use every thread.
        with one_thread(on=on_cpu and gptq_extension() is None):
            self._apply(ctx)

    def _apply(self, ctx: LayerContext) -> None:
        cfg = self.config
        pending = ctx.pending()
        groups: dict[tuple, list[str]] = {}
        for name in pending:
            groups.setdefault((self._shared.leader(name), ctx.scheme_for(name).weights), []).append(name)
        problems: list[_Problem] = []
        hessians: dict[str, torch.Tensor] = {}
        for (leader, args), names in groups.items():
            tokens = self._tokens.get(leader, 0)
            bad = self._bad_batches.get(leader, 0)
            if bad:
                ctx.warn(leader, f"gptq: skipped {bad} calibration batch(es) with NaN/Inf activations")
            # Routed expert statistics: a starved expert's Hessian is too thin to trust (recipe min_expert_tokens).
            starvable = not ctx.all_expert_tokens and leader in ctx.expert_linears
            least = max(cfg.min_tokens, ctx.min_expert_tokens) if starvable else cfg.min_tokens
            if tokens < least:
                why = "received no calibration tokens" if tokens == 0 else f"saw only {tokens} calibration tokens (< {least})"
                for name in names:
                    ctx.warn(name, f"gptq: {why}; fell back to RTN")
                    self._rtn(ctx, name, reason="no-tokens")
                continue
            if leader not in hessians:  # the float64 sum is freed here; linears of other schemes share the result
                hessians[leader] = complete_hessian(self._sums.pop(leader)).mul_(2.0 / tokens).float()
            rows = [ctx.targets[name].weight.shape[0] for name in names]
            problems.append(_Problem(names, None, hessians[leader], rows, args))
        del hessians
        self._sums = {}
        # Same-shape problems (MoE experts) are solved as one batch; padding rows to batch unequal shapes
        # measured slower than solving them one by one (2.8 s vs 2.0 s for a SmolLM2 layer). Smallest
        # Hessians first, each problem's tensors dropped once solved: the largest (down_proj's) is factorised
        # when the others are gone.
        by_shape: dict[tuple, list[_Problem]] = {}
        for p in problems:
            key = (sum(p.rows), p.h.shape[0], p.args) if cfg.batch_problems else (id(p),)
            by_shape.setdefault(key, []).append(p)
        del problems
        units: list[list[_Problem]] = []
        for key in sorted(by_shape, key=lambda k: by_shape[k][0].h.shape[0]):
            batch = by_shape.pop(key)
            units.extend(batch[i : i + 16] for i in range(0, len(batch), 16))
        if ctx.ranks.distributed:
            self._solve_spread(ctx, units)
            return
        while units:
            self._solve(ctx, units.pop(0))

    def _solve_spread(self, ctx: LayerContext, units: list[list["_Problem"]]) -> None:
        """Data-parallel run: each rank solves its share of the units (longest first onto the least loaded
        rank), then every rank takes every unit's results in unit order, so weights, errors, warnings and the
        report are those of one process solving them all."""
        ranks = ctx.ranks
        owner = ranks.spread([sum(sum(p.rows) * p.h.shape[0] ** 2 + p.h.shape[0] ** 3 / 3 for p in unit) for unit in units])
        events0, report0 = len(ctx.events), len(self.report)
        mine = []
        for u, unit in enumerate(units):
            names = [n for p in unit for n in p.names]
            if owner[u] != ranks.rank:
                for p in unit:
                    p.h = p.weight = None
                continue
            e0, r0 = len(ctx.events), len(self.report)
            self._solve(ctx, unit)
            mine.append((u, {n: _to_cpu(ctx.results[n]) for n in names},
                         {n: ctx.linear_errors[n] for n in names if n in ctx.linear_errors},
                         ctx.events[e0:], self.report[r0:]))
        del ctx.events[events0:], self.report[report0:]
        for name in [n for _, results, *_ in mine for n in results]:
            ctx.linear_errors.pop(name, None)
        device = next(iter(ctx.targets.values())).weight.device
        for u, results, errors, events, report in sorted((x for part in ranks.gather(mine) for x in part),
                                                         key=lambda x: x[0]):
            for name, result in results.items():
                if owner[u] != ranks.rank:  # this rank's own results are in place already
                    ctx.set_quantized(name, _to_device(result, device))
            ctx.linear_errors.update(errors)
            ctx.events.extend(events)
            self.report.extend(report)

    @staticmethod
    def _weights(ctx: LayerContext, p: _Problem) -> torch.Tensor:
        """The problem's weights, fp32 rows of its linears concatenated (NaN/Inf replaced by 0, with a warning)."""
        weights = []
        for name in p.names:
            wt = ctx.targets[name].weight.data.float()
            if not torch.isfinite(wt).all():
                bad_w = int((~torch.isfinite(wt)).sum())
                ctx.warn(name, f"gptq: {bad_w} NaN/Inf weight(s) replaced by 0 before quantisation")
                wt = torch.nan_to_num(wt, nan=0.0, posinf=0.0, neginf=0.0)
            weights.append(wt)
        return torch.cat(weights) if len(weights) > 1 else weights[0]

    def _rtn(self, ctx: LayerContext, name: str, reason: str, weight: torch.Tensor | None = None) -> None:
        args = ctx.scheme_for(name).weights
        w = ctx.targets[name].weight.data.float() if weight is None else weight
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
        q, scale, zp, gs = quantize_any(w, args, ctx.weight_dtype, ctx.global_scale(name))
        ctx.set_quantized(name, QuantizedWeight(q, scale, zp, method="rtn", global_scale=gs))
        self.report.append({"layer": ctx.index, "linear": name, "fallback": reason})

    def _reference(self, ctx: LayerContext, p: _Problem) -> list[tuple[float, float]]:
        """Per linear of p: tr(W H W^T) and tr(D H D^T) for D = W - RTN(W) (see _Problem.reference)."""
        out, off = [], 0
        for name, r in zip(p.names, p.rows):
            w = p.weight[off : off + r]
            off += r
            gs = ctx.global_scale(name)
            q, s, zp, _ = quantize_any(w, p.args, ctx.weight_dtype, gs)
            rtn = stored_weight(q, s, zp, p.args, None, ctx.weight_dtype, gs)
            den, quad = output_error_quads(w, [rtn], p.h, matmul_dtype=ctx.matmul_dtype).tolist()
            out.append((den, quad))
        return out

    def _prepare(self, ctx: LayerContext, p: _Problem):
        """(perm, U, col_group, damping used, diag(H_damped) - diag(H) float64 in the original column order), or
        None when the Hessian cannot be factorised. Drops p.h once the Cholesky factorisation holds."""
        cfg = self.config
        perm = column_order(p.h, cfg.actorder)
        rev = perm.flip(0)  # the factor wants the solve order reversed (upper_factor_): one gather does both
        damp = cfg.dampening
        for attempt in range(cfg.max_damp_raises + 1):
            hr = p.h[rev[:, None], rev]
            before = hr.diagonal().double()
            dampen_(hr, damp)
            added = hr.diagonal().double() - before
            if bool(cholesky_(hr[None])[0]):
                p.h = None  # the reference quads are taken: nothing reads H again, so it is freed before the inverse
                u = upper_factor_(hr[None])[0]
                if not bool(torch.isfinite(u).all()):
                    break
                if attempt:
                    for name in p.names:
                        ctx.warn(name, f"gptq: Cholesky failed at dampening {cfg.dampening:g}; raised to {damp:g}")
                delta = torch.empty_like(added)
                delta[rev] = added
                return perm, u, column_groups(len(perm), p.args, perm, cfg.actorder), damp, delta
            del hr  # before the next attempt's copy
            if attempt < cfg.max_damp_raises:
                damp = damp * 10 if damp > 0 else 1e-4
        for name in p.names:
            ctx.warn(name, f"gptq: Hessian stayed singular up to dampening {damp:g}; fell back to RTN")
        return None

    def _solve(self, ctx: LayerContext, batch: list[_Problem]) -> None:
        ready = []
        for p in batch:
            p.weight = self._weights(ctx, p)
            with ctx.phase("error_report"):
                p.reference = self._reference(ctx, p)
            with ctx.phase("factorisation"):
                prep = self._prepare(ctx, p)
            if prep is None:
                off = 0
                for name, r in zip(p.names, p.rows):
                    self._rtn(ctx, name, "singular", p.weight[off : off + r])
                    off += r
                continue
            ready.append((p, *prep))
        if not ready:
            return
        rows = max(p.weight.shape[0] for p, *_ in ready)
        n = ready[0][0].weight.shape[1]
        dev = ready[0][0].weight.device
        if len(ready) == 1:
            weight = ready[0][0].weight[None]  # a view: the solve works on its own copy
        else:
            weight = torch.zeros(len(ready), rows, n, device=dev)
            for b, (p, *_rest) in enumerate(ready):
                weight[b, : p.weight.shape[0]] = p.weight
        with ctx.phase("solve"):
            result = self._run_solve(ctx, weight, ready)
        del weight
        self._keep_or_fall_back(ctx, ready, result)
        for p in batch:
            p.weight = p.h = None

    def _run_solve(self, ctx: LayerContext, weight: torch.Tensor, ready: list):
        cfg, args = self.config, ready[0][0].args  # a batch holds problems of one scheme
        row_global = None
        if args.fp4_global:
            row_global = torch.ones(weight.shape[:2], device=weight.device)
            for b, (p, *_rest) in enumerate(ready):
                off = 0
                for name, r in zip(p.names, p.rows):
                    row_global[b, off : off + r] = ctx.global_scale(name).to(weight.device)
                    off += r
        return gptq_solve(
            weight,
            _stack([r[2] for r in ready]),
            _stack([r[1] for r in ready]),
            _stack([r[3] for r in ready]),
            args,
            scale_dtype=ctx.weight_dtype,
            scales=cfg.scales,
            block_size=cfg.block_size,
            mse=cfg.mse,
            mse_grid=cfg.mse_grid,
            mse_max_shrink=cfg.mse_max_shrink,
            mse_weighting=cfg.mse_weighting,
            row_global=row_global,
        )

    def _keep_or_fall_back(self, ctx: LayerContext, ready: list, result) -> None:
        for b, (p, perm, _u, col_group, damp, delta) in enumerate(ready):
            args = p.args
            r_all = p.weight.shape[0]
            q, scale, zp = result.q[b, :r_all], result.scale[b, :r_all], result.zero_point[b, :r_all]
            off = 0
            for (name, r), (den, quad_rtn) in zip(zip(p.names, p.rows), p.reference):
                w = p.weight[off : off + r]
                qi, si, zi = q[off : off + r], scale[off : off + r], zp[off : off + r]
                loss = float(result.loss[b, off : off + r].sum())
                off += r
                if not (torch.isfinite(si).all() and (si > 0).all()):
                    ctx.warn(name, "gptq: solve produced invalid scales; fell back to RTN")
                    self._rtn(ctx, name, "invalid-scales", w)
                    continue
                g_idx = col_group.to(torch.int32) if self.writes_g_idx else None
                zero_point = None if args.symmetric else zi.round().to(torch.int8)
                gs = ctx.global_scale(name)
                with ctx.phase("error_report"):
                    # GPTQ's tr(D H D^T) is the solve's loss under the damped H less what the dampening added
                    # on the diagonal (H_damped - H is diagonal): no product with H.
                    approx = stored_weight(qi, si, zero_point, args, g_idx, ctx.weight_dtype, gs)
                    quad = loss - float((delta * (w.double() - approx.double()).pow(2).sum(0)).sum())
                    err, err_rtn = (math.sqrt(max(v, 0.0) / den) if den > 0 else 0.0 for v in (quad, quad_rtn))
                entry = {"layer": ctx.index, "linear": name, "gptq": err, "rtn": err_rtn, "damp": damp}
                if err > err_rtn:
                    # Only possible with a degenerate Hessian; the calibration error decides.
                    ctx.warn(name, f"gptq: output error {err:.4g} above RTN's {err_rtn:.4g}; kept RTN")
                    self._rtn(ctx, name, "worse-than-rtn", w)
                    ctx.linear_errors[name] = err_rtn
                    continue
                ctx.set_quantized(name, QuantizedWeight(qi, si, zero_point, g_idx=g_idx, method=self.name,
                                                        global_scale=gs))
                ctx.linear_errors[name] = err
                self.report.append(entry)


def _to_cpu(r: QuantizedWeight) -> QuantizedWeight:
    return _to_device(r, torch.device("cpu"))


def _to_device(r: QuantizedWeight, device) -> QuantizedWeight:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return QuantizedWeight(move(r.q), move(r.scale), move(r.zero_point), move(r.g_idx), r.method,
                           move(r.global_scale))
