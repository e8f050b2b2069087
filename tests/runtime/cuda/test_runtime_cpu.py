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


def test_gpu_kernels_refuse_cpu_tensors_and_formats_they_do_not_cover():
    """The driver's kernels take the protocol's four arguments and only CUDA tensors; format checks as listed."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    by_op = {k.op: k for k in K.linear_kernels(runtime.DRIVER)}
    layer = w4a16_layer()
    assert not by_op["w4a16"].supports(layer.fmt, cpu, (64, 128), torch.bfloat16)  # right format, CPU tensor
    assert by_op["w4a16"].covers(layer.fmt, (64, 128))
    assert not by_op["w8a16"].covers(layer.fmt, (64, 128))  # wrong bit width
    assert not by_op["fp8-block"].covers(layer.fmt, (64, 128))
    assert not by_op["w4a16"].covers(LinearFormat("pack-quantized", QuantArgs(group_size=30)), (64, 120))  # straddles
    assert not by_op["w4a16"].supports(layer.fmt, cuda, (64, 128), torch.float32)  # fp32 activations: no kernel


class _Broken:
    """An emulated launcher whose compile or launch fails, as a bad toolchain or driver would."""

    def __init__(self, fail: str):
        from quantkit.runtime.cuda.emulator import EmulatorLauncher

        self.inner, self.fail = EmulatorLauncher(), fail
        self.name, self.device_type = "cuda-broken", "cpu"

    def ready(self):
        return True, "sm_90a"

    def load(self, entry):
        if self.fail == "compile":
            raise runtime.CudaUnavailable(f"CUDA kernel {entry} did not compile: wna16.cu(12): error: boom")
        self.inner.load(entry)

    def launch(self, entry, *args):
        if self.fail == "launch":
            raise runtime.LaunchError(f"launching {entry} grid=(1, 1, 1) block=(128, 1, 1) failed: CUDA_ERROR_LAUNCH_FAILED")
        self.inner.launch(entry, *args)


@pytest.mark.parametrize("fail", ["compile", "launch"])
def test_a_kernel_that_fails_names_itself_in_one_line_and_the_reference_runs(monkeypatch, capsys, fail):
    monkeypatch.setattr(runtime, "_NOTICES", set())
    broken = _Broken(fail)
    monkeypatch.setattr(dispatch, "_BUILTIN", True)
    monkeypatch.setattr(dispatch, "_KERNELS", {"cuda-emulated": {}})
    for k in K.linear_kernels(broken):
        dispatch.register_kernel(k, "cuda-emulated")
    layer, ref_layer = w4a16_layer(), w4a16_layer()
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    name, why = dispatch.prepare_layer(layer, "cuda-emulated")
    if fail == "compile":
        assert name == "reference" and "cuda-broken-w4a16" in why and "did not compile" in why and "\n" not in why
        assert torch.equal(dispatch.linear(x, layer), reference.linear(x, ref_layer))
        return
    assert name == "cuda-broken-w4a16"
    out = dispatch.linear(x, layer)  # the launch fails: this layer (and every other of the kernel) -> reference
    assert torch.equal(out, reference.linear(x, ref_layer))
    err = [ln for ln in capsys.readouterr().err.splitlines() if "cuda-broken-w4a16" in ln]
    assert len(err) == 1 and "CUDA_ERROR_LAUNCH_FAILED" in err[0] and "reference" in err[0]
    assert torch.equal(dispatch.linear(x, layer), out)  # no second line, no second failed launch
    assert not [ln for ln in capsys.readouterr().err.splitlines() if ln]


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
