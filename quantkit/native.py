"""C++ extensions from csrc/cpu/, compiled at first use with torch.utils.cpp_extension into `<quantkit cache>/kernels/`.

One place for the build, shared by the runtime's kernels (runtime/kernels/cpp.py) and the calibration numerics
(quant/search.py): the build directory is keyed by the source's and torch's versions, a machine without a
compiler or AVX2 gets `None` (and the caller's one-line warning), never an exception.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
from contextlib import contextmanager
from pathlib import Path

import torch

# quantkit/_csrc is the repository's csrc/ (a symlink in the source tree, real files in a wheel).
CSRC = Path(__file__).parent / "_csrc"
# AVX2 + FMA + F16C: every x86 CPU since 2013.
CPU_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c"]
# For kernels whose at::parallel_for must run on torch's threads (the runtime's GEMVs): at::parallel_for is an inline
# OpenMP region, so an extension built without -fopenmp runs every one of them on one thread (measured: the 8-bit
# GEMV streamed 32 GB/s on one thread and on two; 47 GB/s with it). The OpenMP runtime it links is torch's own
# libgomp.so.1, already loaded under that soname. The calibration kernels stay serial per call: they run beside
# the pipeline's own batch threads.
OPENMP_CFLAGS = ("-fopenmp",)
# For kernels that must round each fp32 product and quotient as torch's eager ops do (the calibration kernels):
# no contraction into fused multiply-adds; vectorisable rounding and `#pragma omp simd`.
EXACT_FP_CFLAGS = ("-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd")


def cpu_has_avx2() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    have = set(flags.split(":", 1)[1].split())
    return {"avx2", "fma", "f16c"} <= have


@contextmanager
def _build_lock(build: Path):
    """One builder per build folder, by an flock the kernel releases when its holder dies. torch's own lock is a
    plain file (`build/lock`) that a process killed mid-compile leaves behind, and every later load then waits
    for it forever (measured: a release run hung silently after an earlier run was killed while compiling). Under
    this lock no other quantkit process is building here, so a leftover `lock` file is stale and removed."""
    import fcntl

    with open(build / ".quantkit-build.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_folder(path: Path, extra_cflags: tuple[str, ...] = (), source: bytes | None = None) -> Path:
    """Where the extension of the C++ source at `path` is built: one folder per source content, flags, torch
    version and torch installation. torch writes its own include paths into build.ninja, so two virtual
    environments sharing one folder would rebuild it in turn (measured: a 28 s rebuild inside `make demo` in a
    fresh clone, after runs from another checkout's venv)."""
    from quantkit.models.source import cache_dir

    key = b"\0".join([path.read_bytes() if source is None else source, torch.__version__.encode(),
                      os.path.dirname(torch.__file__).encode(), " ".join(extra_cflags).encode()])
    return cache_dir() / "kernels" / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


@functools.cache
def load_cpu_extension(path: Path, extra_cflags: tuple[str, ...] = ()):
    """(module, None), or (None, why) where the C++ source at `path` (one of csrc/cpu/) cannot be built or run."""
    if not cpu_has_avx2():
        return None, "this CPU has no AVX2/FMA/F16C"
    try:
        src = path.read_bytes()
        build = build_folder(path, extra_cflags, src)
    except OSError:
        return None, f"kernel source {path} is missing"
    stem, tag = path.stem, build.name.rpartition("-")[2]
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        with _build_lock(build):
            # torch rebuilds when the source's path changes (it is written into build.ninja), so every checkout
            # and install of the same source would recompile in turn (measured: 25-50 s inside a calibration run
            # that followed one from another checkout); a copy inside the build folder keeps the path fixed.
            local = build / path.name
            if not local.is_file() or local.read_bytes() != src:
                tmp = build / f".{path.name}.{os.getpid()}.tmp"
                tmp.write_bytes(src)
                tmp.replace(local)
            module = load(name=f"quantkit_{stem}_{tag}", sources=[str(local)], build_directory=str(build),
                          extra_cflags=CPU_FLAGS + list(extra_cflags),
                          extra_ldflags=["-fopenmp"] if "-fopenmp" in extra_cflags else [], verbose=False)
        return module, None
    except Exception as exc:  # a missing compiler, headers or ninja: the eager code still runs everything
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return None, f"could not build the CPU kernel {path.name} ({first})"
