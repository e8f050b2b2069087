"""RTN scale searches: each is optimal over its grid for its own objective, and the activation-weighted one
lowers the error of the linear's outputs when inputs have the uneven channel scales real models have."""

import pytest
import torch
from torch import nn

from quantkit.errors import InputError
from quantkit.methods.base import LayerContext
from quantkit.methods.rtn import RTN
from quantkit.quant import QuantArgs, compute_qparams
from quantkit.quant.integer import dequantize_weight, group_view, mse_weight_qparams, quantize_weight
from quantkit.quant.schemes import get_scheme


def _grid_errors(w: torch.Tensor, args: QuantArgs, col_weight: torch.Tensor, grid: int = 20, max_shrink: float = 0.2):
    """Brute force: [n_factors, out, n_groups] weighted squared error of every shrink factor of the grid."""
    g = group_view(w, args)
    cw = col_weight.reshape(1, g.shape[1], g.shape[2])
    errs = []
    for k in range(grid + 1):
        p = 1.0 - max_shrink * k / grid
        scale, zp = compute_qparams(g.amin(-1) * p, g.amax(-1) * p, args)
        scale = scale.to(torch.bfloat16).float()
        q = torch.round(g / scale[..., None] + zp.float()[..., None]).clamp(args.qmin, args.qmax)
        d = (q - zp.float()[..., None]) * scale[..., None] - g
        errs.append((d.pow(2) * cw).sum(-1))
    return torch.stack(errs)


@pytest.mark.parametrize("args", [QuantArgs(4, True, "group", 16), QuantArgs(4, False, "group", 32),
                                  QuantArgs(8, True, "channel", None)], ids=["w4-sym-g16", "w4-asym-g32", "w8-channel"])
def test_weighted_search_is_the_grid_optimum(args):
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    importance = torch.rand(64) ** 4 * 50 + 1e-3
    scale, zp = mse_weight_qparams(w, args, torch.bfloat16, importance=importance)
    q, s, z = quantize_weight(w, args, scale, zp, scale_dtype=torch.bfloat16)
    deq = dequantize_weight(q, s.float(), None if args.symmetric else z, args, torch.float32)
    chosen = (group_view(deq - w, args).pow(2) * importance.reshape(1, *group_view(w, args).shape[1:])).sum(-1)
    best = _grid_errors(w, args, importance).amin(0)
    torch.testing.assert_close(chosen, best, rtol=1e-5, atol=1e-7)


def _rtn_output_error(scale_search: str, x: torch.Tensor, weight: torch.Tensor) -> float:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data.copy_(weight)
    ctx = LayerContext(index=0, layer=linear, targets={"proj": linear}, scheme=get_scheme("W4A16", 32),
                       checkpoint_names={"proj": "model.layers.0.proj"}, weight_dtype=torch.float32)
    method = RTN(ctx.scheme, scale_search=scale_search)
    hooks = method.attach(ctx)
    with torch.no_grad():
        for chunk in x.split(64):
            linear(chunk)
    for h in hooks:
        h.remove()
    method.apply(ctx)
    with torch.no_grad():
        return float((x @ (linear.weight - weight).T).pow(2).sum() / (x @ weight.T).pow(2).sum())


def test_activation_search_lowers_output_error_on_uneven_inputs():
    torch.manual_seed(1)
    weight = torch.randn(48, 128) * 0.05
    # A few input channels an order of magnitude louder than the rest, as in transformer residual streams.
    channel_scale = torch.ones(128)
    channel_scale[torch.randperm(128)[:6]] = 20.0
    x = torch.randn(512, 128) * channel_scale
    errors = {s: _rtn_output_error(s, x, weight) for s in ("minmax", "mse", "activation")}
    assert errors["activation"] < 0.9 * errors["mse"], errors
    assert errors["activation"] < 0.9 * errors["minmax"], errors


def test_statistics_only_when_weighting():
    assert RTN(get_scheme("W4A16", 32), scale_search="activation").uses_statistics
    assert not RTN(get_scheme("W4A16", 32), scale_search="mse").uses_statistics
    assert not RTN(get_scheme("W4A16", 32)).needs_calibration  # runs on the error-measuring samples only
    assert not RTN(get_scheme("FP8_DYNAMIC", None)).uses_statistics  # fp8 weights take their plain range


def test_unknown_scale_search_is_refused():
    with pytest.raises(InputError, match="minmax, mse, activation"):
        RTN(get_scheme("W4A16", 32), scale_search="best")


def test_unknown_option_is_refused_not_ignored():
    with pytest.raises(InputError, match="unknown rtn option.*scale_serch.*valid: scale_search"):
        RTN(get_scheme("W4A16", 32), scale_serch="minmax")


def test_linears_reading_one_input_share_its_statistics():
    """q/k/v (and gate/up) read the same tensor: one sum of squares serves them all, equal to each one's own."""
    gen = torch.Generator().manual_seed(7)
    q, k, other = (nn.Linear(32, 16, bias=False) for _ in range(3))
    targets = {"q": q, "k": k, "other": other}
    ctx = LayerContext(index=0, layer=nn.ModuleDict(targets), targets=targets, scheme=get_scheme("W4A16", 32),
                       checkpoint_names={n: n for n in targets})
    rtn = RTN(get_scheme("W4A16", 32))
    hooks = rtn.attach(ctx)
    xs = [torch.randn(3, 5, 32, generator=gen) * torch.linspace(0.1, 4, 32) for _ in range(2)]
    for x in xs:
        q(x), k(x), other(torch.randn(4, 32, generator=gen))
    for h in hooks:
        h.remove()
    assert set(rtn._square_sums) == {"q", "other"}  # k's input is q's: not summed twice
    x_all = torch.cat([x.reshape(-1, 32) for x in xs])
    mean_sq = x_all.pow(2).mean(0)
    expected = mean_sq + 0.01 * mean_sq.mean()
    assert torch.allclose(rtn.importance("k"), expected) and torch.allclose(rtn.importance("q"), expected)
    assert not torch.allclose(rtn.importance("other"), expected)
