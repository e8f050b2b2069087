"""quantkit's kernels, registered per device type in the order dispatch tries them (see `base.Kernel`).

CPU: torch's int4 matmul for W4A16 and int8 weight-only matmul for per-channel W8A16 (bf16/fp16 activations),
torch's int8 x int8 matmul for W8A8, and the C++ dequantising kernel (`cpp.DequantKernel`) for everything
else: fp32 activations, group-wise W8A16, shapes torch refuses, FP8.
CUDA: csrc/ through NVRTC (`quantkit.runtime.cuda`), offered only where a GPU, its driver and the pinned CUDA
Python set are present (else one line says why and the reference serves CUDA tensors).
"""


def register_builtin() -> None:
    from quantkit.runtime.dispatch import register_kernel
    from quantkit.runtime.kernels.cpp import DequantKernel
    from quantkit.runtime.kernels.torch_cpu import Int4PackKernel, Int8PackKernel, IntMMKernel

    register_kernel(Int4PackKernel(), "cpu", priority=10)
    register_kernel(Int8PackKernel(), "cpu", priority=10)
    register_kernel(IntMMKernel(), "cpu", priority=10)
    register_kernel(DequantKernel(), "cpu", priority=50)

    import torch

    if torch.cuda.is_available():
        from quantkit.runtime.cuda import register

        register()
