"""This process's resident memory: current, peak since start, and peak over a stretch of code.

The peak comes from /proc's VmHWM, which belongs to this process's own address space. `ru_maxrss` is not used
where VmHWM exists: on Linux it survives exec, so a process started from a large parent (a benchmark driver,
a test runner, a notebook) would report the parent's size as its own peak.
"""

from __future__ import annotations

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
