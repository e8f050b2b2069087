"""The fused shrink-grid scale search (csrc/cpu/qparam_search.cpp) against the eager torch search it replaces."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from quantkit.quant import QuantArgs
from quantkit.quant.integer import group_qparams, group_qparams_eager, mse_weight_qparams, search_extension

pytestmark = pytest.mark.skipif(search_extension() is None, reason="the fused search cannot be built here")

INT4 = QuantArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=64)
INT4_ASYM = QuantArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
INT8_CHANNEL = QuantArgs(num_bits=8, type="int", symmetric=True, strategy="channel")


def _rows(kind: str, gen: torch.Generator) -> torch.Tensor:
    w = torch.randn(96, 64, generator=gen)
    if kind == "outliers":
        w[torch.rand(96, 64, generator=gen) < 0.02] *= 40
    elif kind == "zero rows":
        w[::7] = 0
    elif kind == "constant rows":  # every grid point of a constant row may tie
        w[::3] = w[::3, :1]
    elif kind == "one sign":
        w = w.abs()
    elif kind == "few levels":  # values already on a grid: many grid points give the same error
        w = torch.round(w * 2) / 2
    elif kind == "tiny":
        w = w * 1e-30
    return w


@pytest.mark.parametrize("kind", ["gaussian", "outliers", "zero rows", "constant rows", "one sign", "few levels",
                                  "tiny"])
@pytest.mark.parametrize("args", [INT4, INT4_ASYM, INT8_CHANNEL], ids=["int4", "int4-asym", "int8"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_search_equals_eager(kind, args, scale_dtype, weighted):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{args.num_bits}{args.symmetric}".encode()))
    w = _rows(kind, gen)
    imp = torch.rand(64, generator=gen) ** 4 if weighted else None  # a skewed importance, like inputs' mean square
    fused = group_qparams(w, args, scale_dtype, mse=True, importance=imp)
    eager = group_qparams_eager(w, args, scale_dtype, mse=True, importance=imp)
    assert torch.equal(fused[0], eager[0]) and torch.equal(fused[1], eager[1])


def test_fused_search_equals_eager_on_many_real_sized_rows():
    """A SmolLM2-sized projection (576 x 1536, groups of 64) with a per-column importance: every scale equal, except
    where two grid points' errors agree to fp32 summation noise (then either is as good: their errors, summed exactly,
    differ by less than 1e-6 relative)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(576, 1536, generator=gen) * (1 + 5 * torch.rand(1, 1536, generator=gen))
    imp = torch.rand(1536, generator=gen) ** 3
    fused = mse_weight_qparams(weight, INT4, torch.bfloat16, importance=imp)
    os.environ["QUANTKIT_EAGER_SEARCH"] = "1"
    try:
        eager = mse_weight_qparams(weight, INT4, torch.bfloat16, importance=imp)
    finally:
        del os.environ["QUANTKIT_EAGER_SEARCH"]
    differ = fused[0] != eager[0]
    assert differ.float().mean() < 1e-3
    if differ.any():  # near-ties only: compare both choices' exact (float64) errors
        g = weight.reshape(576, 24, 64)[differ].double()
        w_imp = imp.reshape(24, 64)[differ.nonzero()[:, 1]].double()

        def err(scale):
            s = scale[differ].double()[:, None]
            q = torch.round(g / s).clamp(-8, 7)
            return ((q * s - g) ** 2 * w_imp).sum(-1)

        assert torch.allclose(err(fused[0]), err(eager[0]), rtol=1e-6)


def test_non_finite_rows_keep_the_eager_result():
    w = torch.randn(8, 64)
    w[3, 5] = float("nan")
    fused = group_qparams(w, INT4, torch.bfloat16, mse=True)
    eager = group_qparams_eager(w, INT4, torch.bfloat16, mse=True)
    assert torch.equal(fused[0].nan_to_num(-1), eager[0].nan_to_num(-1))
