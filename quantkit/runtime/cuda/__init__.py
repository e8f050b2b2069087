"""quantkit's bundled CUDA runtime (csrc/): NVRTC-compiled kernels behind the kernel protocol.

Optional: needs `pip install 'quantkit[cuda]'` (cuda-bindings and NVRTC / headers pinned to CUDA 13.0) and
a GPU from sm_80 on. Without them `availability()` says why in one line and everything runs on the
reference path. `register()` routes the quantised linears on CUDA devices to these kernels through
today's dispatch.register_kernel; QUANTKIT_REFERENCE=1 still forces the reference.
"""

from __future__ import annotations

from quantkit.runtime.cuda.runtime import availability, notice


def register() -> bool:
    """Register every CUDA linear kernel for device type "cuda"; False (and one line) when unavailable."""
    from quantkit.runtime import dispatch
    from quantkit.runtime.cuda.kernels import KERNELS, dispatch_fn

    ok, line = availability()
    if not ok:
        notice(line)
        return False
    for kind, kernel in KERNELS.items():
        dispatch.register_kernel(kind, "cuda", dispatch_fn(kernel))
    return True


__all__ = ["availability", "register"]
