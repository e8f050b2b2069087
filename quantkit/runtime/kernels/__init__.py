"""quantkit's kernels, registered per device type in the order dispatch tries them (see `base.Kernel`).

CPU: the C++ integer-dot kernel for 4-bit weights in 64-column groups (`cpp.Int4DotKernel`: as fast as torch's
int4 matmul on AVX512, up to 1.6x on AVX2-only CPUs at batch 1, and within bf16 rounding of the exact product;
benchmarks/results/int4_kernels.md) and its 8-bit twin (`cpp.Int8DotKernel`: W8A16 / W8A8 on bf16/fp16
activations, AVX512-VNNI or AVX2), the AVX512-BF16 FP8 GEMV (`cpp.Fp8DotKernel`; per-format bandwidths in
benchmarks/results/gemv_kernels.md), torch's int4 matmul for the other W4A16 shapes it takes and
int8 weight-only matmul for per-channel W8A16 (bf16/fp16 activations), torch's int8 x int8 matmul for W8A8,
and the C++ dequantising kernel (`cpp.DequantKernel`) for everything else: fp32 activations, shapes the tiles
and torch refuse, FP8 on CPUs without AVX512-BF16. Where several serve a layer, the measured choice decides
(`choice.py`).
CUDA: csrc/ through NVRTC (`quantkit.runtime.cuda`), offered only where a GPU, its driver and the pinned CUDA
Python set are present (else one line says why and the reference serves CUDA tensors). The same kernel classes
over the CPU emulator serve `kernels="cuda-emulated"` (key "cuda-emulated").
"""


def register_builtin() -> None:
    from quantkit.runtime.dispatch import register_kernel
    from quantkit.runtime.kernels.cpp import DequantKernel, Fp8DotKernel, Int4DotKernel, Int8DotKernel
    from quantkit.runtime.kernels.torch_cpu import Int4PackKernel, Int8PackKernel, IntMMKernel

    register_kernel(Int4DotKernel(), "cpu", priority=5)
    register_kernel(Int8DotKernel(), "cpu", priority=5)
    register_kernel(Fp8DotKernel(), "cpu", priority=5)
    register_kernel(Int4PackKernel(), "cpu", priority=10)
    register_kernel(Int8PackKernel(), "cpu", priority=10)
    register_kernel(IntMMKernel(), "cpu", priority=10)
    register_kernel(DequantKernel(), "cpu", priority=50)

    import torch

    from quantkit.runtime.cuda.emulator import emulator
    from quantkit.runtime.cuda.kernels import linear_kernels

    for kernel in linear_kernels(emulator()):
        register_kernel(kernel, "cuda-emulated", priority=10)
    if torch.cuda.is_available():
        from quantkit.runtime.cuda import register

        register()
