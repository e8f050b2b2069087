"""The CUDA kernels themselves, run on the CPU by csrc/host/cuda_emu.h (g++, one std::thread per CUDA thread),
driven by the real Python side (prepare, argument order, grids) with runtime.launch pointed at the emulator,
and compared with the torch reference.

What this proves without a GPU: tiling, bounds (ragged M / N / K, partial head groups), shared-memory
staging, fragment loads and epilogues against the PTX-documented mma layouts, reductions, the MoE
align/sort, split-sequence softmax combine. What it cannot: anything the emulator does not model (memory
coalescing, bank conflicts, races the sequential block order hides, the real mma hardware).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from quantkit.runtime import reference
from quantkit.runtime.cuda import kernels as K
from quantkit.runtime.cuda import runtime
from quantkit.runtime.cuda.specs import ENTRIES
from quantkit.runtime.cuda.synthetic import make_layer

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
# (source, variant): fp8_block.cu twice, as sm_80 (bf16 widening) and as sm_89+ (e4m3 mma).
BUILDS = {"wna16": ("wna16.cu", []), "w8a8": ("w8a8.cu", []), "mla": ("mla_decode.cu", []),
          "fp8_sm80": ("fp8_block.cu", []), "fp8_sm89": ("fp8_block.cu", ["-D__CUDA_ARCH__=890"])}


def _build(name: str) -> ctypes.CDLL:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ on PATH")
    source, flags = BUILDS[name]
    entries = [e.name for e in ENTRIES.values() if e.source == source]
    tu = (f'#include "cuda_emu.h"\n#include "../cuda/{source}"\n#include "emu_invoke.h"\n'
          + "".join(f"EMU_ENTRY({e})\n" for e in entries))
    h = hashlib.sha256(tu.encode() + " ".join(flags).encode() + cxx.encode())
    for p in sorted([*CSRC.glob("include/*.cuh"), *CSRC.glob("host/*.h"), CSRC / "cuda" / source]):
        h.update(p.read_bytes())
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantkit" / "cuda-emu"
    so = cache / f"{name}-{h.hexdigest()[:16]}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cpp = so.with_suffix(f".{os.getpid()}.cpp")
        cpp.write_text(tu)
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        r = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-ffp-contract=off",
                            "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function", f"-I{CSRC / 'host'}",
                            f"-I{CSRC / 'include'}", *flags, "-o", str(tmp), "-x", "c++", str(cpp)],
                           capture_output=True, text=True)
        cpp.unlink()
        if r.returncode:
            pytest.fail(f"emulator build of {source} failed: {r.stderr[:2000]}")
        tmp.replace(so)
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def libs():
    return {}


@pytest.fixture()
def emulate(libs, monkeypatch):
    """runtime.launch -> the emulator; `fp8_variant` picks which FP8 path runs."""
    state = {"fp8": "fp8_sm89", "launched": []}

    def launch(entry, grid, block, *args, shared_bytes=0):
        spec = ENTRIES[entry]
        name = {"wna16.cu": "wna16", "w8a8.cu": "w8a8", "mla_decode.cu": "mla"}.get(spec.source, state["fp8"])
        if name not in libs:
            libs[name] = _build(name)
        lib = libs[name]
        assert getattr(lib, f"emu_arity_{entry}")() == len(spec.args) == len(args), entry
        slots = (ctypes.c_uint64 * len(args))()
        for i, (kind, v) in enumerate(zip(spec.args, args)):
            if kind == "ptr":
                assert v is None or (isinstance(v, torch.Tensor) and v.is_contiguous()), (entry, i)
                slots[i] = 0 if v is None else v.data_ptr()
            elif kind == "f32":
                slots[i] = struct.unpack("<I", struct.pack("<f", float(v)))[0]
            else:
                assert isinstance(v, int), (entry, i)
                slots[i] = v & 0xFFFFFFFFFFFFFFFF
        assert block[1] == block[2] == 1
        fn = getattr(lib, f"emu_{entry}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        fn(*grid, block[0], slots)
        state["launched"].append(entry)

    monkeypatch.setattr(runtime, "launch", launch)
    return state


def rel_err(out, ref):
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def run_linear(kind, layer, x):
    kern = K.KERNELS[kind]
    return kern.run(x, kern.prepare(layer))


@pytest.mark.parametrize("kind", ["w4a16", "w8a16"])
@pytest.mark.parametrize("m,kw,dtype", [
    (3, dict(sym=False, group=64), torch.bfloat16),       # GEMV, asymmetric, N not a multiple of 4 warps
    (16, dict(actorder=True, group=32), torch.float16),   # GEMV at its M limit, act-order g_idx
    (70, dict(group=32), torch.bfloat16),                 # GEMM: partial M and N tiles, 3 K steps
    (33, dict(sym=False, actorder=True, group=32), torch.float16),
    (20, dict(strategy="channel"), torch.bfloat16),
])
def test_wna16(emulate, kind, m, kw, dtype):
    n, k = 72, 96
    layer = make_layer(kind, n, k, "cpu", seed=m, **kw)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = run_linear(kind, layer, x)
    assert emulate["launched"][-1].endswith("gemv_" + K.ACT_DTYPES[dtype]) == (m <= 16)
    assert rel_err(out, reference.linear(x, layer)) < 1e-2


@pytest.mark.parametrize("m", [5, 70])
def test_int8(emulate, m):
    layer = make_layer("int8", 72, 96, "cpu", seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    assert rel_err(run_linear("int8", layer, x), reference.linear(x, layer)) < 2e-2


@pytest.mark.parametrize("variant", ["fp8_sm80", "fp8_sm89"])
@pytest.mark.parametrize("m,n,k", [(20, 136, 300), (66, 72, 288)])  # ragged K (byte path / vector path), N over a block
def test_fp8_block(emulate, variant, m, n, k):
    emulate["fp8"] = variant
    layer = make_layer("fp8", n, k, "cpu", seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    assert rel_err(run_linear("fp8", layer, x), reference.linear(x, layer)) < 2e-2


def test_moe_align_and_grouped_gemm(emulate):
    experts = [make_layer("w4a16", 72, 64, "cpu", sym=e % 2 == 0, group=32, seed=e) for e in range(4)]
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    ids[0] = torch.tensor([3, 3 - 1])
    sorted_ids, expert_ids, total = K.moe_align(ids, 4)
    numel, t = ids.numel(), int(total)
    # Every (token, choice) exactly once, grouped by expert in 64-row blocks, padding = numel.
    real = sorted_ids[:t][sorted_ids[:t] < numel]
    assert sorted(real.tolist()) == list(range(numel))
    assert t % 64 == 0 and (expert_ids[t // 64:] == -1).all()
    for b in range(t // 64):
        rows = sorted_ids[64 * b: 64 * (b + 1)]
        rows = rows[rows < numel]
        assert (ids.reshape(-1)[rows] == expert_ids[b]).all()
    prep = K.prepare_moe_experts(experts, 4)
    dense = [reference.dequantize_weight(l) for l in experts]
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    assert rel_err(K.moe_gemm(x, prep, ids), K.moe_gemm_reference(x, dense, ids)) < 1e-2
    down_in = torch.randn(10, 64, generator=g).to(torch.bfloat16)
    w = torch.rand(5, 2, generator=g)
    out = K.moe_gemm(down_in, prep, ids, w, rows_per_token=1)
    assert rel_err(out, K.moe_gemm_reference(down_in, dense, ids, w)) < 1e-2


@pytest.mark.parametrize("b,h,d,dv,lens,splits", [
    (2, 18, 128, 96, [5, 40], 2),   # convert-mla-like rank, partial head group, a split with 3 tokens
    (1, 16, 576, 512, [20], 3),     # DeepSeek-V3 latent
    (2, 4, 64, 32, [0, 17], 4),     # an empty sequence and empty splits
])
def test_mla_decode(emulate, b, h, d, dv, lens, splits):
    g = torch.Generator().manual_seed(d)
    q = (torch.randn(b, h, d, generator=g) * 0.3).to(torch.bfloat16)
    cache = torch.randn(b, max(max(lens), 1), d, generator=g).to(torch.bfloat16)
    sl = torch.tensor(lens, dtype=torch.int32)
    out = K.mla_decode(q, cache, sl, dv, scale=d ** -0.5, splits=splits)
    for i, n in enumerate(lens):
        if n == 0:
            assert (out[i] == 0).all()
        else:
            ref = K.mla_decode_reference(q[i:i + 1], cache[i:i + 1], sl[i:i + 1], dv, scale=d ** -0.5)
            assert rel_err(out[i:i + 1], ref) < 1e-2


def test_tree_mask(emulate):
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 7, 3])
    assert torch.equal(K.tree_mask(parents, 7), K.tree_mask_reference(parents, 7))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind,k", [("int8", 300), ("fp8", 300), ("fp8", 512)])
def test_activation_quant_kernels_bit_exact(emulate, dtype, kind, k):
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
        runtime.launch(f"qk_int8_quant_token_{suf}", (m, 1, 1), (256, 1, 1), x, q, s, m, k)
        fake = (q.to(dtype) * s[:, None].to(dtype)).to(dtype)  # reference: q in x's dtype times its scale
        args = QuantArgs(num_bits=8, strategy="token", dynamic=True)
    else:
        g = -(-k // 128)
        q, s = torch.empty(m, k, dtype=torch.uint8), torch.empty(m, g)
        runtime.launch(f"qk_fp8_quant_group_{suf}", (-(-g // 4), m, 1), (128, 1, 1), x, q, s, m, k)
        scale = s.repeat_interleave(128, dim=1)[:, :k].to(dtype)
        fake = (q.view(torch.float8_e4m3fn).to(dtype) * scale).to(dtype)
        args = QuantArgs(num_bits=8, type="float", dynamic=True)
    ref = quantize_activation(x, args)
    assert torch.equal(fake, ref)
