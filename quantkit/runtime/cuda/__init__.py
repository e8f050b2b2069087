"""quantkit's bundled CUDA runtime (csrc/): NVRTC-compiled kernels behind the kernel protocol.

Optional: needs `pip install 'quantkit-llm[cuda]'` (cuda-bindings and NVRTC / headers pinned to CUDA 13.0) and
a GPU from sm_80 on. Without them `availability()` says why in one line and everything runs on the
reference path. `register()` offers these kernels for CUDA devices at the dispatch point (the runtime calls it
the first time a model is loaded on a GPU); QUANTKIT_REFERENCE=1 / `--kernels reference` still force the reference.
"""

from __future__ import annotations

from quantkit.runtime.cuda.runtime import availability, notice


def register() -> bool:
    """Register every CUDA linear kernel for device type "cuda"; False (and one line) when unavailable."""
    from quantkit.runtime import dispatch
    from quantkit.runtime.cuda.kernels import linear_kernels
    from quantkit.runtime.cuda.runtime import DRIVER

    ok, line = availability()
    if not ok:
        notice(line)
        return False
    for kernel in linear_kernels(DRIVER):
        dispatch.register_kernel(kernel, "cuda", priority=10)
    return True


__all__ = ["availability", "register"]
