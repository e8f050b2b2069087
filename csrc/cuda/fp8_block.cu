// FP8 e4m3 block-scaled linears (the DeepSeek-V3 recipe): 128 x 128 weight blocks, 1 x 128 activation groups,
// partial sums promoted to fp32 once per 128-wide K block.
//
// Paths (one entry name, chosen at compile time by the target):
//   sm_89 / sm_90a: mma.sync m16n8k32 e4m3 x e4m3 -> f32 (FP8 tensor cores; sm_90a runs the same mma.sync,
//                   a wgmma path is not written yet)
//   sm_80:          no FP8 tensor cores: the e4m3 bytes are widened to bf16 (exact) while building fragments
//                   and multiplied with mma.sync m16n8k16 bf16 -> f32; identical block-scale promotion.
#include "qk_device.cuh"

using namespace qk;

#define GROUP 128
#define BM 64
#define BN 64   // half a weight block: a tile never straddles two block rows of the scale matrix
#define BK 128  // one K block per step: one activation group, one weight block column
#define LDS8 (BK + 16)

// Per-group dynamic activation quantisation, including the ragged last group when K % 128 != 0 (its absmax
// and scale cover only the columns it has, as reference.quantize_activation).
// Launch: grid (ceil(G / 4), M), block 128 (one warp per group). x [M, K] T, q [M, K] e4m3 bytes,
// scale [M, G] fp32, G = ceil(K / 128).
template <typename T>
__device__ __forceinline__ void fp8_quant_group(const T* __restrict__ x, uint8_t* __restrict__ q,
                                                float* __restrict__ scale, int M, int K) {
  int G = num_groups(K, GROUP), gi = blockIdx.x * 4 + (threadIdx.x >> 5), m = blockIdx.y, lane = threadIdx.x & 31;
  if (gi >= G || m >= M) return;
  int len = group_len(gi, K, GROUP);
  const T* src = x + (size_t)m * K + (size_t)gi * GROUP;
  float v[GROUP / 32], amax = 0.0f;
#pragma unroll
  for (int j = 0; j < GROUP / 32; j++) {
    int c = lane + 32 * j;
    v[j] = c < len ? Act<T>::to_f(src[c]) : 0.0f;  // zeros never raise the absmax
    amax = fmaxf(amax, fabsf(v[j]));
  }
  float s = act_scale(warp_max(amax), 448.0f, Act<T>::dtype);
  if (lane == 0) scale[(size_t)m * G + gi] = s;
  uint8_t* dst = q + (size_t)m * K + (size_t)gi * GROUP;
#pragma unroll
  for (int j = 0; j < GROUP / 32; j++) {
    int c = lane + 32 * j;
    if (c < len) dst[c] = quant_e4m3(v[j], s, Act<T>::dtype);
  }
}

// Launch: grid (ceil(N / 64), ceil(M / 64)), block 128 (2 x 2 warps of 32 x 32).
// xq [M, K] e4m3, xs [M, G] fp32, w [N, K] e4m3 (weight as written), ws [ceil(N / 128), G] fp32.
// Any K (ragged last block zero-filled: a zero contributes nothing); rows 16-byte aligned when K % 16 == 0.
template <typename T>
__device__ __forceinline__ void fp8_gemm(const uint8_t* __restrict__ xq, const float* __restrict__ xs,
                                         const uint8_t* __restrict__ w, const float* __restrict__ ws,
                                         const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K) {
  __shared__ __align__(16) uint8_t As[BM * LDS8];
  __shared__ __align__(16) uint8_t Bs[BN * LDS8];
  __shared__ float xs_s[BM];
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN, G = num_groups(K, GROUP);
  bool vec = (K & 15) == 0;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;
  for (int kb = 0; kb < G; kb++) {
    int kt = kb * BK;
#pragma unroll
    for (int i = 0; i < 4; i++) {  // 64 rows x 8 chunks of 16 bytes, for A and for B
      int c = tid + i * 128, r = c >> 3, kc = (c & 7) * 16, k = kt + kc;
      uint4 va = make_uint4(0, 0, 0, 0), vb = make_uint4(0, 0, 0, 0);
      if (vec) {
        if (m0 + r < M && k < K) va = *(const uint4*)(xq + (size_t)(m0 + r) * K + k);
        if (n0 + r < N && k < K) vb = __ldg((const uint4*)(w + (size_t)(n0 + r) * K + k));
      } else {  // unaligned rows: byte by byte
        uint8_t* pa = (uint8_t*)&va;
        uint8_t* pb = (uint8_t*)&vb;
        for (int e = 0; e < 16; e++) {
          if (m0 + r < M && k + e < K) pa[e] = xq[(size_t)(m0 + r) * K + k + e];
          if (n0 + r < N && k + e < K) pb[e] = w[(size_t)(n0 + r) * K + k + e];
        }
      }
      *(uint4*)(As + r * LDS8 + kc) = va;
      *(uint4*)(Bs + r * LDS8 + kc) = vb;
    }
    if (tid < BM) xs_s[tid] = m0 + tid < M ? xs[(size_t)(m0 + tid) * G + kb] : 0.0f;
    __syncthreads();
    float part[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int c = 0; c < 4; c++) part[i][j][c] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 32) {
#if __CUDA_ARCH__ >= 890
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; i++) frag_a8(a[i], As, LDS8, wm * 32 + i * 16, kk, lane);
#pragma unroll
      for (int j = 0; j < 4; j++) frag_b8(b[j], Bs, LDS8, wn * 32 + j * 8, kk, lane);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) mma_e4m3_16832(part[i][j], a[i], b[j]);
#else
#pragma unroll
      for (int k16 = 0; k16 < 32; k16 += 16) {
        uint32_t a[2][4], b[4][2];
#pragma unroll
        for (int i = 0; i < 2; i++) frag_a_e4m3_as_bf16(a[i], As, LDS8, wm * 32 + i * 16, kk + k16, lane);
#pragma unroll
        for (int j = 0; j < 4; j++) frag_b_e4m3_as_bf16(b[j], Bs, LDS8, wn * 32 + j * 8, kk + k16, lane);
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
          for (int j = 0; j < 4; j++) mma_16816<__nv_bfloat16>(part[i][j], a[i], b[j]);
      }
#endif
    }
    // fp32 promotion: this K block's partial sums, scaled by its activation-group and weight-block scales.
    float sw = ws[(size_t)(n0 / GROUP) * G + kb];
    int g = lane >> 2;
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
      for (int h = 0; h < 2; h++) {
        float s = xs_s[wm * 32 + i * 16 + g + 8 * h] * sw;
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
          for (int e = 0; e < 2; e++) acc[i][j][2 * h + e] = fmaf(part[i][j][2 * h + e], s, acc[i][j][2 * h + e]);
      }
    __syncthreads();
  }
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int row = m0 + wm * 32 + i * 16 + g + 8 * h;
      if (row >= M) continue;
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          int col = n0 + wn * 32 + j * 8 + 2 * t + e;
          if (col >= N) continue;
          float v = acc[i][j][2 * h + e];
          if (bias) v += Act<T>::to_f(bias[col]);
          out[(size_t)row * N + col] = Act<T>::from_f(v);
        }
    }
}

#define FP8_ENTRIES(SUF, T)                                                                                   \
  extern "C" __global__ void __launch_bounds__(128) qk_fp8_quant_group_##SUF(const T* x, uint8_t* q,          \
                                                                             float* scale, int M, int K) {    \
    fp8_quant_group<T>(x, q, scale, M, K);                                                                    \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(128) qk_fp8_block_gemm_##SUF(                                  \
      const uint8_t* xq, const float* xs, const uint8_t* w, const float* ws, const T* bias, T* out, int M,    \
      int N, int K) {                                                                                         \
    fp8_gemm<T>(xq, xs, w, ws, bias, out, M, N, K);                                                           \
  }

FP8_ENTRIES(bf16, __nv_bfloat16)
FP8_ENTRIES(f16, __half)
