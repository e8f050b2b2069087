"""The CUDA kernels themselves, run on the CPU by csrc/host/cuda_emu.h (g++, one std::thread per CUDA thread),
driven by the real Python side (the kernel classes' prepare, argument order and grids over the emulator launcher),
and compared with the torch reference.

What this proves without a GPU: tiling, bounds (ragged M / N / K, partial head groups), shared-memory
staging, fragment loads and epilogues against the PTX-documented mma layouts, reductions, the MoE
align/sort, split-sequence softmax combine. What it cannot: anything the emulator does not model (memory
coalescing, bank conflicts, races the sequential block order hides, the real mma hardware).
"""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import reference
from quantkit.runtime.cuda import emulator
from quantkit.runtime.cuda import kernels as K
from quantkit.runtime.cuda.synthetic import make_layer

@pytest.fixture(scope="module")
def launchers():
    if emulator.compiler() is None:
        pytest.skip("no g++ on PATH")
    # The emulated sm_90a device (e4m3 mma), and an sm_80 build of the same sources (FP8 widened to bf16).
    return {"fp8_sm89": emulator.EmulatorLauncher(), "fp8_sm80": emulator.EmulatorLauncher(defines=())}


@pytest.fixture()
def emu(launchers):
    return launchers["fp8_sm89"]


def rel_err(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_linear(launcher, kind, layer, x):
    kern = {k.op: k for k in K.linear_kernels(launcher)}[kind]
    shape = (layer.out_features, layer.in_features)
    assert kern.supports(layer.fmt, "cpu", shape, x.dtype)
    return kern.run(x, kern.prepare(layer))


KIND = {"w4a16": "w4a16", "w8a16": "w8a16", "int8": "w8a8-int8", "fp8": "fp8-block"}


@pytest.mark.parametrize("kind", ["w4a16", "w8a16"])
@pytest.mark.parametrize("m,kw,dtype", [
    (3, dict(sym=False, group=64), torch.bfloat16),       # GEMV, asymmetric, N not a multiple of 4 warps
    (16, dict(actorder=True, group=32), torch.float16),   # GEMV at its M limit, act-order g_idx
    (70, dict(group=32), torch.bfloat16),                 # GEMM: partial M and N tiles, 3 K steps
    (33, dict(sym=False, actorder=True, group=32), torch.float16),
    (20, dict(strategy="channel"), torch.bfloat16),
])
def test_wna16(emu, kind, m, kw, dtype):
    n, k = 72, 96
    layer = make_layer(kind, n, k, "cpu", seed=m, **kw)
    ref = reference.linear(x := torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype), layer)
    gemv = f"qk_{kind}_gemv_{K.ACT_DTYPES[dtype]}"
    before = emu.launched[gemv]
    out = run_linear(emu, kind, layer, x)
    assert (emu.launched[gemv] - before == 1) == (m <= 16)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("m", [5, 70])
def test_int8(emu, m):
    layer = make_layer("int8", 72, 96, "cpu", seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = reference.linear(x, layer)
    assert rel_err(run_linear(emu, "w8a8-int8", layer, x), ref) < 2e-2


@pytest.mark.parametrize("variant", ["fp8_sm80", "fp8_sm89"])
@pytest.mark.parametrize("m,n,k", [(20, 136, 300), (66, 72, 288)])  # ragged K (byte path / vector path), N over a block
def test_fp8_block(launchers, variant, m, n, k):
    layer = make_layer("fp8", n, k, "cpu", seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref = reference.linear(x, layer)
    assert rel_err(run_linear(launchers[variant], "fp8-block", layer, x), ref) < 2e-2


def test_moe_align_and_grouped_gemm(emu):
    experts = [make_layer("w4a16", 72, 64, "cpu", sym=e % 2 == 0, group=32, seed=e) for e in range(4)]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    ids[0] = torch.tensor([3, 3 - 1])
    sorted_ids, expert_ids, total = K.moe_align(emu, ids, 4)
    numel, t = ids.numel(), int(total)
    # Every (token, choice) exactly once, grouped by expert in 64-row blocks, padding = numel.
    real = sorted_ids[:t][sorted_ids[:t] < numel]
    assert sorted(real.tolist()) == list(range(numel))
    assert t % 64 == 0 and (expert_ids[t // 64:] == -1).all()
    for b in range(t // 64):
        rows = sorted_ids[64 * b: 64 * (b + 1)]
        rows = rows[rows < numel]
        assert (ids.reshape(-1)[rows] == expert_ids[b]).all()
    dense = [reference.dequantize_weight(l) for l in experts]
    kern = K.WNA16Kernel(4, emu)
    prep = K.stack_experts([kern.prepare(l) for l in experts], 4)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    assert rel_err(K.moe_gemm(emu, x, prep, ids), K.moe_gemm_reference(x, dense, ids)) < 1e-2
    down_in = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(5, 2, generator=g)
    out = K.moe_gemm(emu, down_in, prep, ids, w, rows_per_token=1)
    assert rel_err(out, K.moe_gemm_reference(down_in, dense, ids, w)) < 1e-2


@pytest.mark.parametrize("b,h,d,dv,lens,splits", [
    (2, 18, 128, 96, [5, 40], 2),   # convert-mla-like rank, partial head group, a split with 3 tokens
    (1, 16, 576, 512, [20], 3),     # DeepSeek-V3 latent
    (2, 4, 64, 32, [0, 17], 4),     # an empty sequence and empty splits
])
def test_mla_decode(emu, b, h, d, dv, lens, splits):
    g = torch.Generator().manual_seed(d)
    q = (torch.randn(b, h, d, generator=g) * 0.3).to(torch.bfloat16)
    cache = torch.randn(b, max(max(lens), 1), d, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = K.mla_decode(emu, q, cache, sl, dv, scale=d ** -0.5, splits=splits)
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all()
        else:
            ref = K.mla_decode_reference(q[i:i + 1], cache[i:i + 1], sl[i:i + 1], dv, scale=d ** -0.5)
            assert rel_err(out[i:i + 1], ref) < 1e-2


def test_tree_mask(emu):
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 7, 3])
    assert torch.equal(K.tree_mask(emu, parents, 7), K.tree_mask_reference(parents, 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,k", [("int8", 300), ("fp8", 300), ("fp8", 512)])
def test_activation_quant_kernels_bit_exact(emu, dtype, kind, k):
    """The quantisation kernels' codes and scales reproduce reference.quantize_activation exactly (K = 300: a
    ragged last group of 44 for fp8; a zero token; an outlier)."""
    from quantkit.quant.args import QuantArgs
    from quantkit.runtime.reference import quantize_activation

    m = 6
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.logspace(-2, 2, m)[:, None])
    x[1] = 0
    x[2, 7] = 3e3
    x = x.to(dtype)
    suf = K.ACT_DTYPES[dtype]
    if kind == "int8":
        q, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m)
        emu.launch(f"qk_int8_quant_token_{suf}", (m, 1, 1), (256, 1, 1), x, q, s, m, k)
        fake = (q.to(dtype) * s[:, None].to(dtype)).to(dtype)  # reference: q in x's dtype times its scale
        args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    else:
        g = -(-k // 128)
        q, s = torch.empty(m, k, dtype=torch.uint8), torch.empty(m, g)
        emu.launch(f"qk_fp8_quant_group_{suf}", (-(-g // 4), m, 1), (128, 1, 1), x, q, s, m, k)
        scale = s.repeat_interleave(128, dim=1)[:, :k].to(dtype)
        fake = (q.view(torch.float8_e4m3fn).to(dtype) * scale).to(dtype)
        args = QuantArgs(num_bits=8, type="float", dynamic=True)
    ref = quantize_activation(x, args)
    assert torch.equal(fake, ref)
