// A small CUDA execution emulator for g++, so that CI without a GPU runs the kernels' own code (indexing,
// tiling, shared-memory staging, fragment loads, epilogues, reductions) on the CPU.
//
// One std::thread per CUDA thread, one block at a time (so `__shared__` = a function-local static is
// exactly block-shared), __syncthreads = a block barrier, warp collectives (__shfl_xor_sync, mma.sync) =
// per-warp barriers around a staging area. mma.sync is computed from the operand layout as the PTX ISA
// tables state it (lane owning A[r][k] / B[k][c]), written here independently of the kernels' fragment
// loaders, so a loader or epilogue that disagrees with the documented layout gives wrong results.
// Exited threads drop out of the barriers, as on a GPU. Slow, and meant for small shapes only.
#pragma once
#define QK_EMULATE 1
#include <atomic>
#include <barrier>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <thread>
#include <vector>
#include <algorithm>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3u { unsigned x = 1, y = 1, z = 1; };
inline thread_local dim3u threadIdx, blockIdx;
inline dim3u blockDim, gridDim;

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct float2 { float x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline float __expf(float x) { return expf(x); }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float2int_rn(float f) { return (int)nearbyintf(f); }
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }

#include "../include/qk_numerics.cuh"

struct __nv_bfloat16 { uint16_t x; };
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half { uint16_t x; };
inline float __bfloat162float(__nv_bfloat16 v) { return __uint_as_float((unsigned)v.x << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{(uint16_t)(__float_as_uint(qk::round_bf16(f)) >> 16)}; }
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 v) { return v.x; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return float2{__bfloat162float(v.x), __bfloat162float(v.y)}; }
inline float __half2float(__half v) { return qk::f16_bits_to_f32(v.x); }
inline __half __float2half_rn(float f) { return __half{qk::f32_to_f16_bits(f)}; }
inline uint16_t __half_as_ushort(__half v) { return v.x; }

namespace emu {
inline std::barrier<>* block_bar = nullptr;
inline std::vector<std::barrier<>*> warp_bar;
struct Stage { uint32_t a[32][4]; uint32_t b[32][2]; float f[32]; };
inline Stage stage[32];
inline int warp() { return threadIdx.x / 32; }
inline int lane() { return threadIdx.x % 32; }
inline void warp_sync() { warp_bar[warp()]->arrive_and_wait(); }

template <typename F> void launch(dim3u grid, dim3u block, F body) {
  gridDim = grid; blockDim = block;
  int n = block.x * block.y * block.z, warps = (n + 31) / 32;
  for (unsigned bz = 0; bz < grid.z; bz++)
    for (unsigned by = 0; by < grid.y; by++)
      for (unsigned bx = 0; bx < grid.x; bx++) {
        std::barrier<> bar(n);
        block_bar = &bar;
        std::vector<std::barrier<>*> wb;
        for (int w = 0; w < warps; w++) wb.push_back(new std::barrier<>(std::min(32, n - 32 * w)));
        warp_bar = wb;
        std::vector<std::thread> threads;
        for (int t = 0; t < n; t++)
          threads.emplace_back([&, t] {
            threadIdx = dim3u{(unsigned)t, 0, 0};
            blockIdx = dim3u{bx, by, bz};
            body();
            warp_bar[t / 32]->arrive_and_drop();  // an exited thread no longer holds anyone up
            block_bar->arrive_and_drop();
          });
        for (auto& th : threads) th.join();
        for (auto* b : wb) delete b;
      }
}
}  // namespace emu

inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  emu::stage[emu::warp()].f[emu::lane()] = v;
  emu::warp_sync();
  float r = emu::stage[emu::warp()].f[emu::lane() ^ o];
  emu::warp_sync();
  return r;
}

namespace emu {
// Element (r, k) of A / (k, c) of B from the staged registers, per the PTX ISA layouts (g = lane / 4, t = lane % 4).
inline uint32_t a16(int w, int r, int k) {  // m16 x k16, 16-bit
  uint32_t reg = stage[w].a[(r % 8) * 4 + (k % 8) / 2][(r >= 8) + 2 * (k >= 8)];
  return (reg >> (16 * (k % 2))) & 0xffffu;
}
inline uint32_t b16(int w, int k, int c) {  // k16 x n8, 16-bit
  uint32_t reg = stage[w].b[c * 4 + (k % 8) / 2][k >= 8];
  return (reg >> (16 * (k % 2))) & 0xffffu;
}
inline uint32_t a8(int w, int r, int k) {  // m16 x k32, 8-bit
  uint32_t reg = stage[w].a[(r % 8) * 4 + (k % 16) / 4][(r >= 8) + 2 * (k >= 16)];
  return (reg >> (8 * (k % 4))) & 0xffu;
}
inline uint32_t b8(int w, int k, int c) {  // k32 x n8, 8-bit
  uint32_t reg = stage[w].b[c * 4 + (k % 16) / 4][k >= 16];
  return (reg >> (8 * (k % 4))) & 0xffu;
}
template <typename Acc, typename FA, typename FB, typename FC>
inline void mma(Acc* d, const uint32_t* a, const uint32_t* b, int K, FA fa, FB fb, FC conv) {
  int w = warp(), l = lane(), g = l / 4, t = l % 4;
  for (int i = 0; i < 4; i++) stage[w].a[l][i] = a[i];
  for (int i = 0; i < 2; i++) stage[w].b[l][i] = b[i];
  warp_sync();
  for (int o = 0; o < 4; o++) {  // C/D: c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, ...)
    int r = g + 8 * (o / 2), c = 2 * t + (o % 2);
    Acc s = d[o];
    for (int k = 0; k < K; k++) s += conv(fa(w, r, k)) * conv(fb(w, k, c));
    d[o] = s;
  }
  warp_sync();
}
inline float bf16_bits(uint32_t h) { return __uint_as_float(h << 16); }
inline float f16_bits(uint32_t h) { return qk::f16_bits_to_f32((uint16_t)h); }
inline int s8_bits(uint32_t v) { return (int)(int8_t)(uint8_t)v; }
inline float e4m3_bits(uint32_t v) { return qk::e4m3_decode((uint8_t)v); }
}  // namespace emu

inline void emu_mma_bf16(float* d, const uint32_t* a, const uint32_t* b) { emu::mma(d, a, b, 16, emu::a16, emu::b16, emu::bf16_bits); }
inline void emu_mma_f16(float* d, const uint32_t* a, const uint32_t* b) { emu::mma(d, a, b, 16, emu::a16, emu::b16, emu::f16_bits); }
inline void emu_mma_s8(int* d, const uint32_t* a, const uint32_t* b) { emu::mma(d, a, b, 32, emu::a8, emu::b8, emu::s8_bits); }
inline void emu_mma_e4m3(float* d, const uint32_t* a, const uint32_t* b) { emu::mma(d, a, b, 32, emu::a8, emu::b8, emu::e4m3_bits); }
