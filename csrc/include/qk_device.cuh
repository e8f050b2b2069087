// Device-only helpers: activation dtype traits, warp reductions and the mma.sync wrappers with their
// fragment layouts (PTX ISA "Matrix fragments for mma.m16n8k16 / mma.m16n8k32"), shared by every GEMM.
//
// Fragment layouts used throughout (lane = 4 * g + t, g = lane / 4, t = lane % 4):
//   16-bit A (m16 x k16, row-major):  r0 = A[g][2t..2t+1]   r1 = A[g+8][2t..]   r2 = A[g][2t+8..]   r3 = A[g+8][2t+8..]
//   16-bit B (k16 x n8, "col" = stored as B^T[n][k]): r0 = Bt[g][2t..2t+1]   r1 = Bt[g][2t+8..]
//   8-bit  A (m16 x k32):  r0 = A[g][4t..4t+3]  r1 = A[g+8][4t..]  r2 = A[g][4t+16..]  r3 = A[g+8][4t+16..]
//   8-bit  B (k32 x n8):   r0 = Bt[g][4t..4t+3]  r1 = Bt[g][4t+16..]
//   C/D (m16 x n8, f32 or s32): c0,c1 = C[g][2t], C[g][2t+1]   c2,c3 = C[g+8][2t], C[g+8][2t+1]
// The lower-indexed element of a pair / quad sits in the low bits of its register. (Cross-checked by hand
// against the PTX ISA tables and CuTe's published SM80 / SM89 MMA_Traits layouts, and run against an
// independent statement of these layouts by csrc/host/cuda_emu.h; no GPU has run them yet.)
#pragma once
#ifndef QK_EMULATE  // csrc/host/cuda_emu.h provides these types when the kernels run on the CPU emulator
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif
#include "qk_numerics.cuh"

namespace qk {

template <typename T> struct Act;
template <> struct Act<__nv_bfloat16> {
  static constexpr int dtype = BF16;
  static __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16_rn(v); }
  static __device__ __forceinline__ uint16_t bits(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
};
template <> struct Act<__half> {
  static constexpr int dtype = F16;
  static __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_f(float v) { return __float2half_rn(v); }
  static __device__ __forceinline__ uint16_t bits(__half v) { return __half_as_ushort(v); }
};

// Two floats -> one register of the 16-bit type T (lo = first element).
template <typename T> __device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return (uint32_t)Act<T>::bits(Act<T>::from_f(lo)) | ((uint32_t)Act<T>::bits(Act<T>::from_f(hi)) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T> __device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b);
#ifdef QK_EMULATE
template <> inline void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, const uint32_t* b) { emu_mma_bf16(d, a, b); }
template <> inline void mma_16816<__half>(float* d, const uint32_t* a, const uint32_t* b) { emu_mma_f16(d, a, b); }
inline void mma_s8_16832(int* d, const uint32_t* a, const uint32_t* b) { emu_mma_s8(d, a, b); }
#if __CUDA_ARCH__ >= 890
inline void mma_e4m3_16832(float* d, const uint32_t* a, const uint32_t* b) { emu_mma_e4m3(d, a, b); }
#endif
#else
template <> __device__ __forceinline__ void mma_16816<__nv_bfloat16>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <> __device__ __forceinline__ void mma_16816<__half>(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_s8_16832(int* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// FP8 tensor-core mma exists from sm_89 (Ada) on.
__device__ __forceinline__ void mma_e4m3_16832(float* d, const uint32_t* a, const uint32_t* b) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif
#endif  // QK_EMULATE

// Fragment loads from shared memory tiles stored row-major with leading dimension ld (in elements).
// 16-bit elements: A tile [m][k], B stored transposed [n][k]; row0/k0 are the fragment's origin.
__device__ __forceinline__ void frag_a16(uint32_t* a, const uint16_t* s, int ld, int row0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint16_t* p = s + (row0 + g) * ld + k0 + 2 * t;
  a[0] = *(const uint32_t*)p;
  a[1] = *(const uint32_t*)(p + 8 * ld);
  a[2] = *(const uint32_t*)(p + 8);
  a[3] = *(const uint32_t*)(p + 8 * ld + 8);
}
__device__ __forceinline__ void frag_b16(uint32_t* b, const uint16_t* s, int ld, int n0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint16_t* p = s + (n0 + g) * ld + k0 + 2 * t;
  b[0] = *(const uint32_t*)p;
  b[1] = *(const uint32_t*)(p + 8);
}
// 8-bit elements (int8 or e4m3 bytes).
__device__ __forceinline__ void frag_a8(uint32_t* a, const uint8_t* s, int ld, int row0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint8_t* p = s + (row0 + g) * ld + k0 + 4 * t;
  a[0] = *(const uint32_t*)p;
  a[1] = *(const uint32_t*)(p + 8 * ld);
  a[2] = *(const uint32_t*)(p + 16);
  a[3] = *(const uint32_t*)(p + 8 * ld + 16);
}
__device__ __forceinline__ void frag_b8(uint32_t* b, const uint8_t* s, int ld, int n0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint8_t* p = s + (n0 + g) * ld + k0 + 4 * t;
  b[0] = *(const uint32_t*)p;
  b[1] = *(const uint32_t*)(p + 16);
}
// Two e4m3 bytes at p -> a bf16x2 register (exact: every e4m3 value is a bf16 value).
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(const uint8_t* p) {
  return pack2<__nv_bfloat16>(e4m3_decode(p[0]), e4m3_decode(p[1]));
}
// 16-bit-layout fragments built from an e4m3 tile (the sm_80 path of the FP8 GEMM).
__device__ __forceinline__ void frag_a_e4m3_as_bf16(uint32_t* a, const uint8_t* s, int ld, int row0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint8_t* p = s + (row0 + g) * ld + k0 + 2 * t;
  a[0] = e4m3x2_to_bf16x2(p);
  a[1] = e4m3x2_to_bf16x2(p + 8 * ld);
  a[2] = e4m3x2_to_bf16x2(p + 8);
  a[3] = e4m3x2_to_bf16x2(p + 8 * ld + 8);
}
__device__ __forceinline__ void frag_b_e4m3_as_bf16(uint32_t* b, const uint8_t* s, int ld, int n0, int k0, int lane) {
  int g = lane >> 2, t = lane & 3;
  const uint8_t* p = s + (n0 + g) * ld + k0 + 2 * t;
  b[0] = e4m3x2_to_bf16x2(p);
  b[1] = e4m3x2_to_bf16x2(p + 8);
}

}  // namespace qk
