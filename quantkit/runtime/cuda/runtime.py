"""Driver side: is there a usable GPU, which target does it need, load modules, launch entries.

Nothing here raises on a machine without CUDA: `availability()` answers (ok, one line) and callers fall
back to the CPU / reference path with that line. Launches use cuda.bindings.driver on torch's current
stream with torch tensors' data pointers, so they order correctly with torch's own work.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading

import torch

from quantkit.runtime.cuda.specs import ENTRIES

_NOTICES: set[str] = set()
_LOCK = threading.Lock()
_MODULES: dict[tuple[str, str, int], object] = {}  # (source, arch, device)
_FUNCS: dict[tuple[str, str, int], object] = {}
_BROKEN: dict[tuple[str, str, int], str] = {}  # (source, arch, device) -> the one-line reason it is not usable


class CudaUnavailable(RuntimeError):
    """The CUDA path cannot run here; the message is the one line to show."""


class LaunchError(RuntimeError):
    """A kernel launch failed; the message names the entry and the driver's error."""


def notice(line: str) -> None:
    """Print a line once per process (fallbacks are reported, never repeated per call)."""
    if line not in _NOTICES:
        _NOTICES.add(line)
        print(f"quantkit: {line}", file=sys.stderr)


def target_arch(capability: tuple[int, int]) -> str | None:
    """The NVRTC target for a device: sm_90a on Hopper (arch-specific features), the device's own sm_XY
    elsewhere from sm_80 on; None below sm_80 (no bf16 mma.sync: no kernels)."""
    major, minor = capability
    if major < 8:
        return None
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


@functools.lru_cache(maxsize=1)
def availability() -> tuple[bool, str]:
    """(True, target arch) or (False, one line saying why the CUDA kernels are off)."""
    tail = "using the CPU/reference path"
    try:
        from cuda.bindings import driver

        from quantkit.runtime.cuda.nvrtc import nvrtc_version
    except ImportError:
        return False, f"CUDA kernels off: cuda-bindings is not installed (pip install 'quantkit-llm[cuda]'); {tail}"
    if not torch.cuda.is_available():
        return False, f"CUDA kernels off: torch sees no CUDA device (CPU build of torch, or no GPU/driver); {tail}"
    try:
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False, f"CUDA kernels off: no usable NVIDIA driver (cuInit: {err.name}); {tail}"
        err, version = driver.cuDriverGetVersion()
        major, minor = nvrtc_version()
    except Exception as e:  # cuda-bindings raises (not returns) when libcuda cannot be loaded at all
        if "libcuda" in str(e):
            return False, f"CUDA kernels off: no NVIDIA driver (libcuda.so.1 cannot be loaded); {tail}"
        return False, f"CUDA kernels off: CUDA driver query failed ({type(e).__name__}: {e}); {tail}"
    # A driver runs PTX/cubins from NVRTCs up to its own CUDA version only.
    if version < major * 1000 + minor * 10:
        return False, (f"CUDA kernels off: the driver supports CUDA {version // 1000}.{version % 1000 // 10}, older "
                       f"than NVRTC {major}.{minor} that compiles the kernels (update the driver or pin an older "
                       f"quantkit-llm[cuda]); {tail}")
    cap = torch.cuda.get_device_capability()
    arch = target_arch(cap)
    if arch is None:
        return False, f"CUDA kernels off: sm_{cap[0]}{cap[1]} is older than sm_80, which the kernels need; {tail}"
    return True, arch


def _make_torch_context_current(device: int) -> None:
    """Modules and launches belong to a context: use the device's primary context, the one torch uses, and
    make it current on this thread (a thread that never touched CUDA through torch has none)."""
    from cuda.bindings import driver

    err, ctx = driver.cuCtxGetCurrent()
    if err == driver.CUresult.CUDA_SUCCESS and int(ctx) != 0:
        err, cur = driver.cuCtxGetDevice()
        if err == driver.CUresult.CUDA_SUCCESS and int(cur) == device:
            return
    err, dev = driver.cuDeviceGet(device)
    err, primary = driver.cuDevicePrimaryCtxRetain(dev)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable(f"CUDA primary context of device {device} unavailable ({err.name}); using the reference path")
    driver.cuCtxSetCurrent(primary)


def function(entry: str, device: int | None = None):
    """The CUfunction of `entry` for CUDA device `device` (default: torch's current), compiling and loading
    its source for that device's architecture at first use."""
    from cuda.bindings import driver

    from quantkit.runtime.cuda.nvrtc import CompileError, compile_source

    ok, arch = availability()
    if not ok:
        raise CudaUnavailable(arch)
    if device is None:
        device = torch.cuda.current_device()
    arch = target_arch(torch.cuda.get_device_capability(device)) or arch
    spec = ENTRIES[entry]
    key = (spec.source, arch, device)
    with _LOCK:
        if key in _BROKEN:
            raise CudaUnavailable(_BROKEN[key])
        f = _FUNCS.get((entry, arch, device))
        if f is not None:
            return f
        module = _MODULES.get(key)
        if module is None:
            try:
                compiled = compile_source(spec.source, arch)
            except CompileError as e:
                _BROKEN[key] = f"CUDA kernel {entry} did not compile: {e}; using the reference path"
                raise CudaUnavailable(_BROKEN[key]) from None
            torch.cuda.init()
            _make_torch_context_current(device)
            err, module = driver.cuModuleLoadData(compiled.cubin)
            if err != driver.CUresult.CUDA_SUCCESS:
                _BROKEN[key] = f"CUDA module {spec.source} did not load for {arch} ({err.name}); using the reference path"
                raise CudaUnavailable(_BROKEN[key])
            _MODULES[key] = module
        err, f = driver.cuModuleGetFunction(module, entry.encode())
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CudaUnavailable(f"CUDA entry {entry} missing from {spec.source} ({err.name}); using the reference path")
        _FUNCS[(entry, arch, device)] = f
        return f


_CTYPES = {"ptr": ctypes.c_void_p, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


def pack_args(entry: str, args: tuple) -> list:
    """ctypes values for `args`, checked against the entry's spec (count and kind)."""
    spec = ENTRIES[entry]
    if len(args) != len(spec.args):
        raise TypeError(f"{entry} takes {len(spec.args)} arguments ({', '.join(spec.args)}), got {len(args)}")
    out = []
    for i, (kind, value) in enumerate(zip(spec.args, args)):
        if kind == "ptr":
            if value is None:
                value = 0
            elif isinstance(value, torch.Tensor):
                if not value.is_cuda or not value.is_contiguous():
                    raise TypeError(f"{entry} argument {i}: needs a contiguous CUDA tensor")
                value = value.data_ptr()
            elif not isinstance(value, int):
                raise TypeError(f"{entry} argument {i}: expected a tensor, None or an address")
        elif kind in ("i32", "i64"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{entry} argument {i}: expected an int for {kind}")
        elif not isinstance(value, (int, float)):
            raise TypeError(f"{entry} argument {i}: expected a float")
        out.append(_CTYPES[kind](value))
    return out


def launch(entry: str, grid: tuple[int, int, int], block: tuple[int, int, int], *args, shared_bytes: int = 0) -> None:
    """Launch `entry` on torch's current CUDA stream."""
    from cuda.bindings import driver

    values = pack_args(entry, args)
    devices = {a.device.index for a in args if isinstance(a, torch.Tensor)}
    if len(devices) > 1:
        raise TypeError(f"{entry}: tensors on several devices {sorted(devices)}")
    device = devices.pop() if devices else torch.cuda.current_device()
    f = function(entry, device)
    _make_torch_context_current(device)
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    stream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    (err,) = driver.cuLaunchKernel(f, *grid, *block, shared_bytes, stream, ctypes.addressof(params), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise LaunchError(f"launching {entry} grid={grid} block={block} failed: {err.name}")


class DriverLauncher:
    """Kernels on a real GPU: NVRTC-compiled csrc/cuda, launched through the driver on torch's stream.

    The launcher protocol (shared with `emulator.EmulatorLauncher`): `name` (what kernel names start with),
    `device_type` (where the tensors live), `ready()` -> (ok, one line), `load(entry)` (compile and load the
    entry's source, raising CudaUnavailable with one line), `launch(entry, grid, block, *args)`,
    `multiprocessors(device)` (how many blocks fill the device once)."""

    name = "cuda"
    device_type = "cuda"

    def ready(self) -> tuple[bool, str]:
        return availability()

    def load(self, entry: str) -> None:
        function(entry)

    def launch(self, entry: str, grid, block, *args) -> None:
        launch(entry, grid, block, *args)

    def multiprocessors(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count


DRIVER = DriverLauncher()
