"""Sums of x^T x over calibration batches (GPTQ's Hessian, AWQ's loss and clip statistics), kept in float64.

A float64 sum of float32 (or bf16) per-batch products is exact unless one entry's terms span more than 2^29 in
magnitude, so the total does not depend on how batches are split over data-parallel ranks (quantkit.distributed).
"""

from __future__ import annotations

import torch

# From this input width on, x^T x is accumulated as its upper block triangle (HESSIAN_BLOCKS column blocks: 10 of
# the 16 blocks), and mirrored once before the solve. Measured on 2048-token bf16 batches (2 AVX-512 threads),
# product, finiteness check and float64 sum together: 5504 wide 0.126 s instead of 0.176 s; 1536 wide 15.6 ms
# instead of 25.7 ms; 576 wide 2.5 ms instead of 3.6 ms.
HESSIAN_TRIANGLE_MIN = 512
HESSIAN_BLOCKS = 4
# From this width on, WIDE_HESSIAN_BLOCKS blocks (36 of 64): the smaller blocks' extra calls cost less than the
# products they skip. Measured on another AVX-512 CPU, best of 5: 1536 wide 7.8 ms instead of 8.8 ms, 5504 wide
# 134 ms instead of 162 ms; 576 wide 1.7 ms instead of 1.4 ms, so narrower inputs keep 4. The sums came out
# bit-identical to 4 blocks' there (1536 and 5504 wide).
WIDE_HESSIAN_MIN = 1024
WIDE_HESSIAN_BLOCKS = 8


def hessian_blocks(n: int) -> list[tuple[int, int]]:
    """The column blocks [i0, i1) whose upper triangle accumulate_hessian sums, for an input width n."""
    if n < HESSIAN_TRIANGLE_MIN:
        return [(0, n)]
    blocks = WIDE_HESSIAN_BLOCKS if n >= WIDE_HESSIAN_MIN else HESSIAN_BLOCKS
    step = -(-n // blocks)
    return [(i, min(i + step, n)) for i in range(0, n, step)]


def accumulate_hessian(h_sum: torch.Tensor, x: torch.Tensor, matmul_dtype: torch.dtype = torch.float32) -> bool:
    """h_sum += x^T x over all tokens of x [..., in], on and above the diagonal blocks of `hessian_blocks`
    (below them h_sum is left alone: `complete_hessian` mirrors the sum once it is whole). Returns False (and adds
    nothing) when the product is not finite, so one bad batch cannot poison the statistics.

    bf16 inputs are exact in bf16; a bf16 matmul accumulates in fp32 internally and only rounds its output
    (relative error ~2^-9 per entry, far below the dampening), at ~9x the speed of an fp32 matmul on AMX CPUs.
    With `matmul_dtype` bf16 a wider x (an fp32 model under bf16 autocast, where an fp32 norm weight widens the
    linear's input) is rounded to bf16 first: that rounded x is what the autocast matmul multiplies.
    The products are added to the float64 sum as they are (no fp32 copy of a [in, in] product).
    """
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2.to(torch.bfloat16) if matmul_dtype == torch.bfloat16 else x2.float()
    parts = []
    for i0, i1 in hessian_blocks(x2.shape[-1]):
        part = x2[:, i0:i1].t() @ x2[:, i0:]
        # |xtx_ij| <= sqrt(xtx_ii xtx_jj): a finite diagonal bounds every entry, and any inf/NaN input reaches it.
        if not torch.isfinite(part[:, : i1 - i0].diagonal()).all():
            return False
        parts.append((i0, i1, part))
    for i0, i1, part in parts:
        h_sum[i0:i1, i0:].add_(part)
    return True


def complete_hessian(h: torch.Tensor) -> torch.Tensor:
    """Fill, in place, the blocks below the diagonal blocks of a sum made by accumulate_hessian from those above."""
    blocks = hessian_blocks(h.shape[-1])
    for a, (i0, i1) in enumerate(blocks):
        for j0, j1 in blocks[a + 1 :]:
            h[j0:j1, i0:i1] = h[i0:i1, j0:j1].t()
    return h
