"""The CUDA kernels on the CPU: csrc/cuda compiled by g++ against csrc/host/cuda_emu.h, as a launcher.

`--kernels cuda-emulated` (a developer check, slow) serves a model on CPU tensors with the same kernel sources,
the same prepare / launch code and the same dispatch as a GPU, so every CI run proves the CUDA path end to end
without a GPU. The emulator runs one std::thread per CUDA thread and one block at a time, with mma.sync, warp
shuffles and barriers computed from the PTX-documented layouts (see cuda_emu.h): it checks indexing, tiling,
fragment layouts, epilogues and the Python side's arguments and grids; it cannot check speed, coalescing or races
that the sequential block order hides.

The emulated device is an sm_90a: FP8 block GEMMs take the e4m3 mma path (`__CUDA_ARCH__` 900).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import struct
import subprocess
import threading
from collections import Counter
from pathlib import Path

import torch

from quantkit.native import CSRC, _build_lock
from quantkit.runtime.cuda.runtime import CudaUnavailable, LaunchError
from quantkit.runtime.cuda.specs import ENTRIES

ARCH_DEFINE = "-D__CUDA_ARCH__=900"
FLAGS = ("-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas",
         "-Wno-unused-function")


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++")


def build(source: str, defines: tuple[str, ...] = (ARCH_DEFINE,)) -> Path:
    """The emulator library of csrc/cuda/<source> (every entry of its spec exported as emu_<entry>), built at
    first use into the quantkit cache, keyed by the sources, the defines and the compiler."""
    from quantkit.models.source import cache_dir

    cxx = compiler()
    if cxx is None:
        raise CudaUnavailable("the CUDA emulator needs a C++20 compiler (g++, or $CXX); none on PATH")
    entries = [e.name for e in ENTRIES.values() if e.source == source]
    tu = (f'#include "cuda_emu.h"\n#include "../cuda/{source}"\n#include "emu_invoke.h"\n'
          + "".join(f"EMU_ENTRY({e})\n" for e in entries))
    h = hashlib.sha256((tu + " ".join((*FLAGS, *defines, cxx))).encode())
    for p in sorted([*CSRC.glob("include/*.cuh"), *CSRC.glob("host/*.h"), CSRC / "cuda" / source]):
        h.update(p.read_bytes())
    folder = cache_dir() / "cuda-emu"
    folder.mkdir(parents=True, exist_ok=True)
    so = folder / f"{Path(source).stem}-{h.hexdigest()[:16]}.so"
    with _build_lock(folder):
        if so.exists():
            return so
        cpp = so.with_suffix(f".{os.getpid()}.cpp")
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        cpp.write_text(tu)
        try:
            r = subprocess.run([cxx, *FLAGS, f"-I{CSRC / 'host'}", f"-I{CSRC / 'include'}", *defines, "-o", str(tmp),
                                "-x", "c++", str(cpp)], capture_output=True, text=True)
        finally:
            cpp.unlink(missing_ok=True)
        if r.returncode:
            first = next((ln for ln in r.stderr.splitlines() if "error" in ln), r.stderr.strip()[:200])
            raise CudaUnavailable(f"CUDA kernel source {source} did not build for the emulator: {first.strip()}")
        tmp.replace(so)
    return so


class EmulatorLauncher:
    """The launcher protocol (see runtime.DriverLauncher) over the CPU emulator; tensors stay on the CPU.

    `launched` counts the launches per entry, so a test (or a developer) sees which kernels a model ran."""

    name = "cuda-emulated"
    device_type = "cpu"

    def __init__(self, defines: tuple[str, ...] = (ARCH_DEFINE,)):
        self.defines = defines
        self.launched: Counter = Counter()
        self._libs: dict[str, ctypes.CDLL] = {}
        self._lock = threading.Lock()
        self._run = threading.Lock()  # the emulator's grid state is process-global: one launch at a time

    def ready(self) -> tuple[bool, str]:
        if compiler() is None:
            return False, "CUDA emulator off: no C++ compiler (g++ or $CXX) on PATH; using the reference path"
        return True, "emulated sm_90a"

    def _lib(self, source: str) -> ctypes.CDLL:
        with self._lock:
            lib = self._libs.get(source)
            if lib is None:
                lib = self._libs[source] = ctypes.CDLL(str(build(source, self.defines)))
            return lib

    def load(self, entry: str) -> None:
        self._lib(ENTRIES[entry].source)

    def launch(self, entry: str, grid, block, *args) -> None:
        spec = ENTRIES[entry]
        if len(args) != len(spec.args):
            raise TypeError(f"{entry} takes {len(spec.args)} arguments ({', '.join(spec.args)}), got {len(args)}")
        if block[1] != 1 or block[2] != 1:
            raise LaunchError(f"launching {entry}: the emulator takes 1-D blocks, got {block}")
        lib = self._lib(spec.source)
        if lib[f"emu_arity_{entry}"]() != len(spec.args):
            raise LaunchError(f"launching {entry}: the source takes {lib[f'emu_arity_{entry}']()} arguments, the spec "
                              f"{len(spec.args)}")
        slots = (ctypes.c_uint64 * max(1, len(args)))()
        for i, (kind, v) in enumerate(zip(spec.args, args)):
            if kind == "ptr":
                if v is not None and not (isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.is_contiguous()):
                    raise TypeError(f"{entry} argument {i}: needs a contiguous CPU tensor (emulated device) or None")
                slots[i] = 0 if v is None else v.data_ptr()
            elif kind == "f32":
                slots[i] = struct.unpack("<I", struct.pack("<f", float(v)))[0]
            else:
                if not isinstance(v, int) or isinstance(v, bool):
                    raise TypeError(f"{entry} argument {i}: expected an int for {kind}")
                slots[i] = v & 0xFFFFFFFFFFFFFFFF
        fn = lib[f"emu_{entry}"]
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
        fn.restype = None
        with self._run:
            fn(*grid, block[0], slots)
        self.launched[entry] += 1

    def multiprocessors(self, device) -> int:
        return 4  # small grids: the emulator runs blocks one after another


@functools.cache
def emulator() -> EmulatorLauncher:
    return EmulatorLauncher()
