"""Hessian sums against a float64 product written in the test: the upper-block-triangle accumulation, the
mirrored completion, bad batches refused whole, and bf16 products of what an autocast matmul reads."""

from __future__ import annotations

import pytest
import torch

from quantkit.quant.hessian import accumulate_hessian, complete_hessian


@pytest.mark.parametrize("width", [96, 600, 1030])  # one block; 4 uneven blocks of the upper triangle; 8 of them
def test_hessian_sum_equals_the_full_product_and_skips_bad_batches(width):
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 40, width, generator=g) for _ in range(3)]
    bad = batches[1].clone()
    bad[0, 5, 7] = float("inf")
    h = torch.zeros(width, width, dtype=torch.float64)
    for x in batches:
        assert accumulate_hessian(h, x)
    assert not accumulate_hessian(h, bad)  # refused whole: nothing of it is added
    complete_hessian(h)
    xs = torch.cat([x.reshape(-1, width) for x in batches]).double()
    expected = xs.t() @ xs  # float64 reference; fp32 products differ from it by rounding only
    assert torch.allclose(h, expected, rtol=1e-5, atol=1e-3)
    assert torch.equal(h, h.t())
    # bf16 products: the same sum of what an autocast matmul reads (x rounded to bf16), outputs rounded to bf16
    hb = torch.zeros(width, width, dtype=torch.float64)
    for x in batches:
        assert accumulate_hessian(hb, x, torch.bfloat16)
    complete_hessian(hb)
    xb = torch.cat([x.reshape(-1, width) for x in batches]).bfloat16().double()
    ref = xb.t() @ xb
    assert (hb - ref).abs().max() <= 2**-7 * ref.diagonal().max()
