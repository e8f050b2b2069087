"""This process's resident memory: current, peak since start, and peak over a stretch of code.

The peak comes from /proc's VmHWM, which belongs to this process's own address space. `ru_maxrss` is not used
where VmHWM exists: on Linux it survives exec, so a process started from a large parent (a benchmark driver,
a test runner, a notebook) would report the parent's size as its own peak.
"""

from __future__ import annotations

import ctypes
import functools
import resource


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """Peak resident set of this process (VmHWM; ru_maxrss where /proc is missing)."""
    value = _status("VmHWM")
    return value if value is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class HighWaterMark:
    """Peak resident memory over a stretch of code: Linux resets VmHWM through /proc/self/clear_refs;
    elsewhere the process's peak so far is the best available (an upper bound)."""

    def __init__(self):
        self.resettable = False
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            self.resettable = True
        except OSError:
            pass

    def current(self) -> int:
        value = _status("VmRSS")
        if value is None:
            import psutil

            value = psutil.Process().memory_info().rss
        return value

    def peak(self) -> int:
        return peak_rss_bytes()


class DevicePeak:
    """Peak memory torch allocated on a CUDA device (`torch.cuda.max_memory_allocated`: tensors, not the caching
    allocator's reserve), over the run and per layer. On CPU every figure is None: the process's RSS covers it.

    The counter is reset when this is created, so the run's figure is the run's own, not what the process (a
    test session, a benchmark driver) allocated before."""

    def __init__(self, device: str | object):
        import torch

        self.device = torch.device(device)
        self.active = self.device.type == "cuda"
        self._run = 0
        if self.active:
            torch.cuda.reset_peak_memory_stats(self.device)

    def layer(self) -> int | None:
        """Peak since the previous call (or the start), then a fresh count for the next layer."""
        if not self.active:
            return None
        import torch

        peak = int(torch.cuda.max_memory_allocated(self.device))
        self._run = max(self._run, peak)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak

    def run(self) -> int | None:
        """Peak since the start."""
        if not self.active:
            return None
        import torch

        return max(self._run, int(torch.cuda.max_memory_allocated(self.device)))


# A GPU run keeps the calibration activations on the device while one generation of them fits in this share
# of the device memory left free beside the layer's working set; the rest covers each batch's temporaries (the
# MLP intermediate, attention), the unquantised reference outputs of the error-measuring batches and the
# one-pass schedule's paused batches (which the schedule checks itself against the free memory).
DEVICE_ACTIVATION_SHARE = 0.5
PLACEMENTS = ("device", "host")


def layer_working_bytes(shapes: list[tuple[int, int]], element_size: int) -> int:
    """Device bytes a layer's calibration holds besides the activations, estimated from its quantised linears'
    (out, in) shapes: the weights in the compute dtype plus two fp32 working copies (the solve's, the error
    report's), and per linear a float64 Hessian sum with two fp32 n x n factors (an upper bound: linears reading
    the same input, q/k/v or gate/up, share one)."""
    weights = sum(o * i for o, i in shapes)
    return weights * (element_size + 8) + sum(i * i for _, i in shapes) * 16


def activation_placement(device: str | object, generation_bytes: int, working_bytes: int,
                         free_bytes: int | None, forced: str | None = None) -> str:
    """Where a run keeps its calibration activations: "device" (the compute device; always on CPU) or "host"
    (CPU memory, each batch moved to the GPU when a layer runs it: slower, but the activations no longer
    compete with the layer for device memory). `forced` (QUANTKIT_DEVICE_ACTIVATIONS) overrides the estimate
    on a GPU."""
    import torch

    if torch.device(device).type == "cpu":
        return "device"
    if forced:
        if forced not in PLACEMENTS:
            from quantkit.errors import InputError

            raise InputError(f"QUANTKIT_DEVICE_ACTIVATIONS={forced!r}: use {' or '.join(PLACEMENTS)}")
        return forced
    if free_bytes is None:
        return "device"
    room = max(free_bytes - working_bytes, 0)
    return "device" if generation_bytes <= DEVICE_ACTIVATION_SHARE * room else "host"


MMAP_THRESHOLD = 8 << 20
# Free memory glibc may keep at the top of the heap before handing it back. Pinning M_MMAP_THRESHOLD also pins this at
# its 128 KB default, so every freed 2-8 MB activation at the top went back to the OS and the next one page-faulted
# afresh. Measured on SmolLM2 GPTQ 64 x 512 together with no malloc_trim between layers: 3.26 M -> 0.33 M minor page
# faults, system time 10.3 -> 4.2 s, peak RSS unchanged (1011 vs 1005 MB).
HEAP_TRIM_THRESHOLD = 64 << 20


def return_large_frees_to_os() -> None:
    """Serve every allocation above 8 MB with its own mapping (glibc's mallopt M_MMAP_THRESHOLD, pinned), so a
    freed weight or activation buffer leaves the process at once instead of staying resident in the heap.

    Measured: 1 MB (the first setting) and 8 MB give the same peak on the 0.7B fp32 memory benchmark (904 vs
    911 MB); glibc's adaptive default (up to 32 MB, only ever rising) kept ~1.3 GB. Below the threshold
    temporaries reuse heap pages; above it each one is a fresh mapping that page-faults on first touch, and
    at 1 MB that made AWQ on SmolLM2 37% slower (169 s vs 107 s)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, MMAP_THRESHOLD)  # -3 = M_MMAP_THRESHOLD
        libc.mallopt(-1, HEAP_TRIM_THRESHOLD)  # -1 = M_TRIM_THRESHOLD
        # One heap for every thread: with an arena per thread, each thread that allocates activations keeps its
        # freed ones resident. Measured when the one-pass schedule ran a thread per batch (SmolLM2 GPTQ 64 x 512:
        # peak RSS 1292 -> 1099 MB, wall 60.5 -> 54.5 s); its batches now share one thread, the FP8 stream's
        # readers and the offload prefetch still allocate on threads of their own.
        libc.mallopt(-8, 1)  # -8 = M_ARENA_MAX
    except (OSError, AttributeError):  # not glibc
        pass


# Between layers, the freed heap is handed back only where that is cheap against the layer: the next layer reuses
# most of it, and each 4 KB page handed back costs a page fault when it does (~2.1 us measured: SmolLM2 GPTQ 64 x 512
# trimmed every layer took 2.9 M more faults and 6.1 s more system time). On a 0.7B model a layer takes ~30 s and the
# trim holds the one-pass GPTQ peak down (3945 MB trimmed every layer, 4132 MB never, 4017 MB under this rule, which
# trims each of its layers); on SmolLM2 a layer takes ~1.7 s and the peak did not move (1011 vs 1005 MB).
PAGE_FAULT_SECONDS = 2.1e-6
TRIM_TIME_SHARE = 0.05


class _MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


@functools.cache
def _mallinfo2():
    """glibc's mallinfo2, typed once; None where there is none (not glibc, or older than 2.33)."""
    try:
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def _free_heap_bytes() -> int | None:
    """Free bytes inside glibc's heap (mallinfo2's fordblks), None where unknown."""
    fn = _mallinfo2()
    return None if fn is None else int(fn().fordblks)


def release_freed_memory_between_layers(layer_seconds: float) -> bool:
    """gc, then release_freed_memory where re-faulting the freed heap would cost under TRIM_TIME_SHARE of a layer's
    `layer_seconds`. Returns whether it trimmed."""
    import gc

    gc.collect()  # first: what the collection frees is part of the heap the rule weighs
    free = _free_heap_bytes()
    if free is not None and free / 4096 * PAGE_FAULT_SECONDS > TRIM_TIME_SHARE * layer_seconds:
        return False
    _trim_heap()  # the collection above already ran
    return True


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS. glibc keeps freed blocks below its (adaptive, up to 32 MB) mmap
    threshold in the heap, so per-layer tensors of that size would otherwise pile up as resident memory."""
    import gc

    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
