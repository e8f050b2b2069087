"""csrc/include/qk_numerics.cuh compiled with the host compiler, compared with quantkit's torch reference.

The kernels call these functions per element, so agreement here (exhaustive where the domain is small)
means the kernels' unpacking, dequantisation, fp8 rounding, block indexing and activation-quantisation
rounding agree with reference.py bit for bit; what is left for a GPU to check is the data movement.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from quantkit.quant.fp8 import expand_block_scale
from quantkit.quant.integer import dequantize
from quantkit.quant.packing import pack_int32, unpack_int32
from quantkit.quant.args import QuantArgs
from quantkit.runtime.reference import quantize_activation

ROOT = Path(__file__).resolve().parents[3]
SOURCES = [ROOT / "csrc/host/numerics_harness.cpp", ROOT / "csrc/include/qk_numerics.cuh"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@pytest.fixture(scope="module")
def lib():
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler (g++/c++) on PATH")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + cxx.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantkit" / "host-numerics"
    so = cache / f"numerics-{digest}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        # -ffp-contract=off: no fused multiply-adds the reference does not do either.
        subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-Wall", "-Werror",
                        "-o", str(tmp), str(SOURCES[0])], check=True, capture_output=True, text=True)
        tmp.replace(so)  # atomic: concurrent test runs never load a half-written library
    return ctypes.CDLL(str(so))


def p(t: torch.Tensor):
    assert t.is_contiguous()
    return ctypes.c_void_p(t.data_ptr())


def test_e4m3_decode_all_256_codes(lib):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256)
    lib.h_e4m3_decode(p(codes), p(out), 256)
    ref = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.isnan(), ref.isnan()) and ref.isnan().sum() == 2
    finite = ~ref.isnan()
    # Bitwise, so -0.0 (code 0x80) is checked as well.
    assert torch.equal(out[finite].view(torch.int32), ref[finite].view(torch.int32))


def _encode_sweep() -> torch.Tensor:
    # Every e4m3 value, the midpoints between neighbours (ties) and one fp32 ulp either side of them,
    # fp32 subnormal/near-zero values, and a dense log sweep from 2^-12 to well past 480 (overflow).
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)),
                      torch.nextafter(mids, torch.full_like(mids, -1e9))])
    dense = torch.logspace(-12, 10, 200_000, base=2.0)
    small = torch.tensor([0.0, 1e-45, 1e-40, 2.0 ** -10, 2.0 ** -10 * 1.0000001, 2.0 ** -9 * 0.75, 2.0 ** -6,
                          447.9, 448.0, 448.1, 463.9, 464.0, 464.1, 479.99, 480.0, 481.0, 1e6, 3e38])
    pos = torch.cat([grid, near, dense, small, torch.tensor([float("inf")])])
    return torch.cat([pos, -pos]).contiguous()


def test_e4m3_encode_matches_clamp_then_cast(lib):
    x = _encode_sweep()
    out = torch.empty(x.numel(), dtype=torch.uint8)
    lib.h_e4m3_encode(p(x), p(out), x.numel())
    ref = torch.clamp(x, -448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} mismatches, e.g. x={x[bad[:5]].tolist()} got {out[bad[:5]].tolist()} want {ref[bad[:5]].tolist()}"


def test_e4m3_encode_nan(lib):
    x = torch.tensor([float("nan"), -float("nan")])
    out = torch.empty(2, dtype=torch.uint8)
    lib.h_e4m3_encode(p(x), p(out), 2)
    assert (out & 0x7F).tolist() == [0x7F, 0x7F]
    assert out.view(torch.float8_e4m3fn).float().isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_dtype_matches_torch_cast(lib, dtype):
    # Random bit patterns cover every exponent (incl. fp16 subnormals, overflow to inf and NaN); the
    # dtype's own neighbours' midpoints are the ties.
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (400_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    grid = torch.randn(20_000, generator=g).to(dtype)
    ties = ((grid.float() + torch.nextafter(grid, torch.full_like(grid, 1e4)).float()) / 2)
    sub = torch.linspace(-2.0 ** -13, 2.0 ** -13, 20_001)
    x = torch.cat([x, ties, sub, torch.tensor([65504.0, 65519.99, 65520.0, 1e5, -0.0])]).contiguous()
    out = torch.empty_like(x)
    lib.h_round(p(x), p(out), x.numel(), DTYPES[dtype])
    ref = x.to(dtype).float()
    nan = ref.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_unpack_rows_all_codes(lib, bits):
    # Every code at every position of the word cycle (straddling words when 32 % bits != 0), n not a
    # multiple of the values per word.
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1))
    n = 3 * 32 + 5
    codes = torch.arange(lo, hi, dtype=torch.int32)
    rows = torch.stack([torch.roll(codes.repeat(-(-n // codes.numel())), s)[:n] for s in range(codes.numel())])
    values = rows.to(torch.int8).contiguous()
    packed = pack_int32(values, bits)
    out, out2 = torch.empty_like(values), torch.empty_like(values)
    lib.h_unpack_rows(p(packed), values.shape[0], packed.shape[1], n, bits, p(out), p(out2))
    assert torch.equal(out, unpack_int32(packed, bits, n)) and torch.equal(out, values)
    if 32 % bits == 0:
        assert torch.equal(out2, values)


@pytest.mark.parametrize("bits", [4, 8])
def test_unpack_zero_points_along_output_dim(lib, bits):
    g = torch.Generator().manual_seed(1)
    out_features, groups = 37, 5  # not a multiple of the values per word
    zp = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (out_features, groups), generator=g).to(torch.int8)
    packed = pack_int32(zp, bits, packed_dim=0)
    out = torch.empty_like(zp)
    lib.h_unpack_cols(p(packed), groups, out_features, bits, p(out))
    assert torch.equal(out, unpack_int32(packed, bits, out_features, packed_dim=0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
def test_dequant_every_code_and_zero_point(lib, bits, dtype):
    # All q x all zp (int4: 16 x 16, int8: 256 x 256) against a spread of scales.
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    q, zp = torch.meshgrid(torch.arange(lo, hi), torch.arange(lo, hi), indexing="ij")
    scales = torch.tensor([1e-4, 3.1e-3, 0.0173, 0.5, 1.0, 7.3, 123.4]).to(dtype)
    q = q.reshape(-1, 1).expand(-1, scales.numel()).to(torch.int8).contiguous()
    zp = zp.reshape(-1, 1).expand(-1, scales.numel()).to(torch.int8).contiguous()
    s = scales.reshape(1, -1).expand_as(q).contiguous()
    out, s32 = torch.empty(q.shape), s.float().contiguous()  # s32 named: p() must not see a freed temporary
    lib.h_dequant(p(q), p(zp), p(s32), p(out), q.numel(), DTYPES[dtype])
    ref = dequantize(q, s, zp).float()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("shape", [(256, 256), (300, 200), (129, 1), (1, 385)])
def test_block_scale_index(lib, shape):
    rows, cols = shape
    n_blocks = (-(-rows // 128), -(-cols // 128))
    ids = torch.arange(n_blocks[0] * n_blocks[1], dtype=torch.float64).reshape(n_blocks)
    ref = expand_block_scale(ids, shape, (128, 128)).to(torch.int32)
    out = torch.empty(shape, dtype=torch.int32)
    lib.h_block_index(rows, cols, 128, 128, p(out))
    assert torch.equal(out, ref)


def _activations(dtype, m, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 2, m).reshape(-1, 1)
    x[0] = 0  # an all-zero token: eps scale
    x[1, : min(k, 130)] = 0  # an all-zero group
    x[2, 3] = 1e4  # an outlier dominating its token / group
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind,strategy,k", [
    ("int", "token", 300), ("float", "token", 300),
    ("float", "group", 512), ("float", "group", 300),  # 300: a ragged last group of 44 columns
    ("int", "group", 200),
])
def test_activation_quant_matches_reference(lib, dtype, kind, strategy, k):
    m = 16
    args = QuantArgs(num_bits=8, strategy=strategy, group_size=128, type=kind, dynamic=True)
    x = _activations(dtype, m, k, seed=k)
    ref = quantize_activation(x, args).float()
    xf = x.float().contiguous()
    out, q, ng = torch.empty(m, k), torch.empty(m, k, dtype=torch.int32), -(-k // 128) if strategy == "group" else 1
    scales = torch.empty(m, ng)
    lib.h_act_quant(p(xf), m, k, 128 if strategy == "group" else 0, 1 if kind == "float" else 0,
                    DTYPES[dtype], p(out), p(q), p(scales))
    bad = ~((out == ref) | (out.isnan() & ref.isnan()))
    assert not bad.any(), f"{int(bad.sum())} mismatches, first at {bad.nonzero()[0].tolist()}"
    # The codes themselves (what the kernels feed to the GEMM) are in range and reproduce the output.
    if kind == "int":
        assert q.min() >= -128 and q.max() <= 127
    else:
        assert ((q & 0x7F) != 0x7F).all()  # never NaN: finite inputs saturate
