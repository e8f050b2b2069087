"""NVRTC compilation of csrc/cuda/*.cu through cuda-bindings, with an on-disk cubin cache.

The cache key covers everything that changes the binary: the source and every header under csrc/include,
the target architecture, NVRTC's version and the options. A cached entry holds the cubin, the PTX (for
the entry-signature check) and the compile log (ptxas -v: registers and spills). Compiling needs no GPU
and no driver, so CI compiles every kernel for every target.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

# The repository's csrc/, shipped in the package as quantkit/_csrc (a symlink in the source tree); QUANTKIT_CSRC
# points elsewhere.
CSRC = Path(os.environ.get("QUANTKIT_CSRC") or Path(__file__).parents[2] / "_csrc")
ARCHS = ("sm_80", "sm_89", "sm_90a")
BASE_OPTIONS = ("--std=c++17", "-default-device", "-Xptxas", "-v", "-lineinfo")


class CompileError(RuntimeError):
    """A kernel source did not compile: the message names the source and its first compiler error."""


@dataclass(frozen=True)
class Compiled:
    source: str
    arch: str
    cubin: bytes
    ptx: str
    log: str


def cache_dir() -> Path:
    if os.environ.get("QUANTKIT_CUDA_CACHE"):
        return Path(os.environ["QUANTKIT_CUDA_CACHE"])
    quantkit_cache = os.environ.get("QUANTKIT_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quantkit"
    return Path(quantkit_cache) / "cubin"


def include_dirs() -> list[str]:
    """csrc/include, then the pinned wheels' CUDA headers (cuda_bf16.h from the runtime wheel, <cuda/std/...>
    from CCCL), found by cuda.pathfinder; never the system toolkit, whose version may differ from NVRTC's."""
    import cuda.pathfinder as pf

    dirs = [str(CSRC / "include")]
    for lib in ("cudart", "cccl"):
        d = pf.find_nvidia_header_directory(lib)
        if d is None:
            raise CompileError(f"CUDA headers for {lib} not found (install quantkit-llm[cuda])")
        dirs.append(str(d))
    return dirs


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def _check(err, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


def _sources_digest(text: bytes) -> str:
    h = hashlib.sha256(text)
    for hdr in sorted((CSRC / "include").glob("*.cuh")):
        h.update(hdr.name.encode() + hdr.read_bytes())
    return h.hexdigest()


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()
    return (log.strip().splitlines() or ["(no compiler log)"])[0]


def compile_source(source: str, arch: str, extra_options: tuple[str, ...] = ()) -> Compiled:
    """Compile csrc/cuda/<source> for `arch` (e.g. "sm_90a"), from the cache when the key matches."""
    return compile_text(source, (CSRC / "cuda" / source).read_bytes(), arch, extra_options)


def compile_text(source: str, text: bytes, arch: str, extra_options: tuple[str, ...] = ()) -> Compiled:
    """Compile `text` (named `source` in messages) with csrc/include on the include path."""
    from cuda.bindings import nvrtc

    options = (*BASE_OPTIONS, f"--gpu-architecture={arch}", *extra_options)
    key_src = json.dumps({"src": _sources_digest(text), "arch": arch, "nvrtc": nvrtc_version(),
                          "options": options}, sort_keys=True)
    key = hashlib.sha256(key_src.encode()).hexdigest()[:24]
    entry = cache_dir() / f"{Path(source).stem}-{arch}-{key}"
    if (entry / "kernel.cubin").exists():
        return Compiled(source, arch, (entry / "kernel.cubin").read_bytes(), (entry / "kernel.ptx").read_text(),
                        (entry / "log.txt").read_text())
    err, prog = nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        opts = [o.encode() for o in options] + [f"-I{d}".encode() for d in include_dirs()]
        (res,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err, size = nvrtc.nvrtcGetProgramLogSize(prog)
        buf = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = buf.rstrip(b"\x00 ").decode(errors="replace")
        if res != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{source} ({arch}): {_first_error(log)}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize")
        ptx = b" " * size
        _check(nvrtc.nvrtcGetPTX(prog, ptx)[0], "nvrtcGetPTX")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    ptx_text = ptx.rstrip(b"\x00").decode()
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kernel.cubin").write_bytes(cubin)
    (tmp / "kernel.ptx").write_text(ptx_text)
    (tmp / "log.txt").write_text(log)
    try:
        tmp.rename(entry)  # atomic publish; a concurrent writer that won leaves an identical entry
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return Compiled(source, arch, cubin, ptx_text, log)
