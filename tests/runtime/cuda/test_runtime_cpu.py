"""The CUDA runtime's behaviour where it cannot run: one line, never a traceback, and the reference path.

Runs everywhere (no GPU, with or without cuda-bindings)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from quantkit.quant.packing import pack_int32
from quantkit.runtime import dispatch, reference
from quantkit.runtime.cuda import kernels as K
from quantkit.runtime.cuda import runtime
from quantkit.quant.args import QuantArgs
from quantkit.runtime.formats import LinearFormat
from quantkit.runtime.linear import QuantLinear


@pytest.fixture(autouse=True)
def fresh_availability():
    runtime.availability.cache_clear()
    yield
    runtime.availability.cache_clear()


def w4a16_layer(n=64, k=128) -> QuantLinear:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    fmt = LinearFormat("pack-quantized", QuantArgs(group_size=32))
    tensors = {"weight_packed": pack_int32(q, 4), "weight_scale": torch.rand(n, k // 32, generator=g).to(torch.bfloat16)}
    return QuantLinear(fmt, tensors, k, n)


def _one_line(line: str) -> None:
    assert "\n" not in line and "Traceback" not in line and "reference path" in line


def test_no_cuda_device_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, line = runtime.availability()
    assert not ok and "no CUDA device" in line
    _one_line(line)


def test_missing_cuda_bindings_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes the import fail as if not installed
    ok, line = runtime.availability()
    assert not ok and "quantkit-llm[cuda]" in line
    _one_line(line)


def _fake_driver(version: int, init_ok: bool = True):
    class R:
        CUDA_SUCCESS = "ok"
        CUDA_ERROR_NO_DEVICE = types.SimpleNamespace(name="CUDA_ERROR_NO_DEVICE")

    drv = types.SimpleNamespace(CUresult=R)
    drv.cuInit = lambda flags: ((R.CUDA_SUCCESS if init_ok else R.CUDA_ERROR_NO_DEVICE),)
    drv.cuDriverGetVersion = lambda: (R.CUDA_SUCCESS, version)
    return drv


@pytest.fixture()
def fake_cuda(monkeypatch):
    pytest.importorskip("cuda.bindings", reason="cuda-bindings not installed")
    import cuda.bindings
    import quantkit.runtime.cuda.nvrtc as nv

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(nv, "nvrtc_version", lambda: (13, 0))

    def install(drv):
        monkeypatch.setattr(cuda.bindings, "driver", drv)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", drv)
    return install


def test_old_driver_is_one_line(fake_cuda):
    fake_cuda(_fake_driver(12080))
    ok, line = runtime.availability()
    assert not ok and "CUDA 12.8, older than NVRTC 13.0" in line
    _one_line(line)


def test_no_driver_is_one_line(fake_cuda):
    fake_cuda(_fake_driver(13000, init_ok=False))
    ok, line = runtime.availability()
    assert not ok and "no usable NVIDIA driver" in line and "CUDA_ERROR_NO_DEVICE" in line
    _one_line(line)


def test_matching_driver_picks_the_target(fake_cuda):
    fake_cuda(_fake_driver(13000))
    assert runtime.availability() == (True, "sm_90a")


def test_real_bindings_without_libcuda_is_one_line(monkeypatch):
    pytest.importorskip("cuda.bindings", reason="cuda-bindings not installed")
    import ctypes.util

    if ctypes.util.find_library("cuda"):
        pytest.skip("this machine has libcuda: the no-driver path cannot be exercised for real")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if torch believed there were a GPU
    ok, line = runtime.availability()
    assert not ok and "libcuda" in line
    _one_line(line)


def test_old_gpu_is_one_line(fake_cuda, monkeypatch):
    fake_cuda(_fake_driver(13000))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    ok, line = runtime.availability()
    assert not ok and "sm_75" in line
    _one_line(line)


def test_real_machine_without_gpu_answers_without_raising():
    ok, line = runtime.availability()  # whatever this machine has: must not raise
    if not ok:
        _one_line(line)


def test_register_without_cuda_leaves_dispatch_alone(monkeypatch, capsys):
    import quantkit.runtime.cuda as qc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "_NOTICES", set())
    before = dict(dispatch._KERNELS)
    assert qc.register() is False
    assert dispatch._KERNELS == before
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quantkit: CUDA kernels off")


def test_dispatch_adapter_on_cpu_is_the_reference():
    layer = w4a16_layer()
    x = torch.randn(3, 128).to(torch.bfloat16)
    out = K.dispatch_fn(K.KERNELS["w4a16"])(x, layer)
    assert torch.equal(out, reference.linear(x, layer))


def test_supports_matches_formats_only():
    cpu = torch.device("cpu")
    layer = w4a16_layer()
    assert not K.KERNELS["w4a16"].supports(layer.fmt, cpu, (64, 128))  # right format, no GPU
    assert not K.KERNELS["w8a16"].supports(layer.fmt, torch.device("cuda"), (64, 128))  # wrong bit width
    assert not K.KERNELS["fp8"].supports(layer.fmt, torch.device("cuda"), (64, 128))
    odd = LinearFormat("pack-quantized", QuantArgs(group_size=30))
    assert not K.KERNELS["w4a16"].supports(odd, torch.device("cuda"), (64, 120))  # group not a word multiple


def test_tree_mask_reference_on_a_hand_checked_tree():
    # 0 and 4 hang off the prefix; 1, 2 are children of 0; 3 of 1.
    parents = torch.tensor([-1, 0, 0, 1, -1])
    expected = torch.tensor([
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1],
    ], dtype=torch.uint8)
    assert torch.equal(K.tree_mask_reference(parents, 2), expected)
