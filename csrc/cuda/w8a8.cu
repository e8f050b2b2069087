// W8A8 int8: dynamic per-token activation quantisation and the int8 GEMM with per-token x per-channel scales.
//
// The activation quantisation rounds exactly as reference.quantize_activation (qk::act_scale / quant_int8:
// scale = T(absmax / 127.5), eps(T) for an all-zero token, q = round-half-even(clamp(T(x / scale)))).
// The GEMM multiplies the int8 codes with int32 accumulation (exact) and applies scales once per output:
// out[m, n] = T(acc * x_scale[m] * w_scale[n] + bias[n]).
#include "qk_device.cuh"

using namespace qk;

#define BM 64
#define BN 64
#define BK 64
#define LDS8 (BK + 16)  // 80-byte rows: 16-byte aligned, conflict-free fragment loads

// Launch: grid (M), block 256. x [M, K] T, q [M, K] int8, scale [M] fp32.
template <typename T>
__device__ __forceinline__ void int8_quant_token(const T* __restrict__ x, int8_t* __restrict__ q,
                                                 float* __restrict__ scale, int K) {
  __shared__ float red[8];
  const T* row = x + (size_t)blockIdx.x * K;
  float amax = 0.0f;
  for (int k = threadIdx.x; k < K; k += blockDim.x) amax = fmaxf(amax, fabsf(Act<T>::to_f(row[k])));
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int w = 0; w < (int)(blockDim.x >> 5); w++) amax = fmaxf(amax, red[w]);
  float s = act_scale(amax, 127.5f, Act<T>::dtype);
  if (threadIdx.x == 0) scale[blockIdx.x] = s;
  for (int k = threadIdx.x; k < K; k += blockDim.x)
    q[(size_t)blockIdx.x * K + k] = quant_int8(Act<T>::to_f(row[k]), s, Act<T>::dtype);
}

// Launch: grid (ceil(N / 64), ceil(M / 64)), block 128; K % 16 == 0, all rows 16-byte aligned.
// xq [M, K] int8, xs [M] fp32, w [N, K] int8 (the checkpoint's weight as written), ws [N] fp32.
template <typename T>
__device__ __forceinline__ void int8_gemm(const int8_t* __restrict__ xq, const float* __restrict__ xs,
                                          const int8_t* __restrict__ w, const float* __restrict__ ws,
                                          const T* __restrict__ bias, T* __restrict__ out, int M, int N, int K) {
  __shared__ __align__(16) uint8_t As[BM * LDS8];
  __shared__ __align__(16) uint8_t Bs[BN * LDS8];
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  int acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[i][j][c] = 0;
  for (int kt = 0; kt < K; kt += BK) {
#pragma unroll
    for (int i = 0; i < 2; i++) {  // 64 rows x 4 chunks of 16 bytes, for A and for B
      int c = tid + i * 128, r = c >> 2, kc = (c & 3) * 16, k = kt + kc;
      uint4 va = make_uint4(0, 0, 0, 0), vb = make_uint4(0, 0, 0, 0);
      if (m0 + r < M && k < K) va = *(const uint4*)(xq + (size_t)(m0 + r) * K + k);
      if (n0 + r < N && k < K) vb = __ldg((const uint4*)(w + (size_t)(n0 + r) * K + k));
      *(uint4*)(As + r * LDS8 + kc) = va;
      *(uint4*)(Bs + r * LDS8 + kc) = vb;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 32) {
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; i++) frag_a8(a[i], As, LDS8, wm * 32 + i * 16, kk, lane);
#pragma unroll
      for (int j = 0; j < 4; j++) frag_b8(b[j], Bs, LDS8, wn * 32 + j * 8, kk, lane);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) mma_s8_16832(acc[i][j], a[i], b[j]);
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
      float sx = xs[row];
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          int col = n0 + wn * 32 + j * 8 + 2 * t + e;
          if (col >= N) continue;
          float v = (float)acc[i][j][2 * h + e] * sx * ws[col];
          if (bias) v += Act<T>::to_f(bias[col]);
          out[(size_t)row * N + col] = Act<T>::from_f(v);
        }
    }
}

#define W8A8_ENTRIES(SUF, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256) qk_int8_quant_token_##SUF(const T* x, int8_t* q,          \
                                                                              float* scale, int M, int K) {   \
    if ((int)blockIdx.x < M) int8_quant_token<T>(x, q, scale, K);                                             \
  }                                                                                                           \
  extern "C" __global__ void __launch_bounds__(128) qk_int8_gemm_##SUF(const int8_t* xq, const float* xs,     \
                                                                       const int8_t* w, const float* ws,      \
                                                                       const T* bias, T* out, int M, int N,   \
                                                                       int K) {                               \
    int8_gemm<T>(xq, xs, w, ws, bias, out, M, N, K);                                                          \
  }

W8A8_ENTRIES(bf16, __nv_bfloat16)
W8A8_ENTRIES(f16, __half)
