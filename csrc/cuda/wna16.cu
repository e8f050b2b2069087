// W4A16 / W8A16 weight-only linears (GEMV for M <= 16, mma.sync GEMM above) and the MoE grouped GEMM over
// W4A16 / W8A16 experts with its align/sort kernel.
//
// Weight tensors (quantkit/runtime/cuda/kernels.py, WNA16Kernel.prepare):
//   wq    int32 [N, KW]  compressed-tensors' weight_packed as written (KW = K * bits / 32; K % 8 == 0)
//   scale fp32  [N, G]   weight_scale converted once (exact from bf16/fp16)
//   zp    int8  [N, G]   weight_zero_point unpacked once from its output-dim packing; nullptr = symmetric
//   gidx  int32 [K]      weight_g_idx (act-order); nullptr = group k / group
//   group              columns per group (channel strategy: K, G = 1); a multiple of 32 / bits without gidx
// Activations x [M, K] and out [M, N] are bf16 or fp16 (the entry's suffix), row-major and 16-byte aligned.
#include "qk_device.cuh"

using namespace qk;

#define GEMV_MAX_M 16
#define GEMV_WARPS 4
#define BM 64
#define BN 64
#define BK 32
#define LDS (BK + 8)  // padded row (80 bytes): 16-byte aligned rows, fewer bank conflicts on fragment loads

template <int BITS> struct XVec;  // the x values that meet one weight word: 8 (int4) or 4 (int8) 16-bit values
template <> struct XVec<4> { typedef uint4 type; };
template <> struct XVec<8> { typedef uint2 type; };

// Dequantise the 32/BITS values of one word at columns k0.. of row n (fp32, not rounded).
template <int BITS>
__device__ __forceinline__ void dequant_word(float* wv, uint32_t word, int n, int k0, const float* scale,
                                             const int8_t* zp, const int32_t* gidx, int G, int group) {
  constexpr int VPW = 32 / BITS;
  if (gidx == nullptr) {  // the whole word lies in one group (launch contract: group % VPW == 0)
    int gi = n * G + k0 / group;
    float s = scale[gi];
    int z = zp ? (int)zp[gi] : 0;
#pragma unroll
    for (int v = 0; v < VPW; v++) wv[v] = dequant(word_field(word, v, BITS), z, s);
  } else {
#pragma unroll
    for (int v = 0; v < VPW; v++) {
      int gi = n * G + gidx[k0 + v];
      wv[v] = dequant(word_field(word, v, BITS), zp ? (int)zp[gi] : 0, scale[gi]);
    }
  }
}

// GEMV. Launch: grid (ceil(N / 4)), block 128 (4 warps, one output column n each); M <= 16.
// Each lane walks the row's words with stride 32 (coalesced), meets the M activation rows there and the
// warp reduces at the end: the weight is read exactly once, which is what bounds decode.
template <typename T, int BITS>
__device__ __forceinline__ void wna16_gemv(const T* __restrict__ x, const int32_t* __restrict__ wq,
                                           const float* __restrict__ scale, const int8_t* __restrict__ zp,
                                           const int32_t* __restrict__ gidx, const T* __restrict__ bias,
                                           T* __restrict__ out, int M, int N, int K, int KW, int G, int group) {
  constexpr int VPW = 32 / BITS;
  int lane = threadIdx.x & 31, n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  float acc[GEMV_MAX_M];
#pragma unroll
  for (int m = 0; m < GEMV_MAX_M; m++) acc[m] = 0.0f;
  const int32_t* wrow = wq + (size_t)n * KW;
  for (int w = lane; w < KW; w += 32) {
    float wv[VPW];
    dequant_word<BITS>(wv, (uint32_t)__ldg(wrow + w), n, w * VPW, scale, zp, gidx, G, group);
#pragma unroll
    for (int m = 0; m < GEMV_MAX_M; m++) {
      if (m < M) {
        typename XVec<BITS>::type raw = *(const typename XVec<BITS>::type*)(x + (size_t)m * K + w * VPW);
        const T* xv = (const T*)&raw;
#pragma unroll
        for (int v = 0; v < VPW; v++) acc[m] = fmaf(wv[v], Act<T>::to_f(xv[v]), acc[m]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < GEMV_MAX_M; m++) {
    if (m < M) {
      float s = warp_sum(acc[m]);
      if (lane == 0) out[(size_t)m * N + n] = Act<T>::from_f(s + (bias ? Act<T>::to_f(bias[n]) : 0.0f));
    }
  }
}

// GEMM tile: a 64 x 64 output tile per block of 128 threads (2 x 2 warps of 32 x 32), K in steps of 32.
// The weight tile is dequantised into shared memory in the activation dtype (rounded exactly as the
// reference's dense weight when the scale has that dtype) and multiplied with mma.sync m16n8k16, fp32
// accumulation. MoE (sorted != nullptr): row r of the tile is sorted[m0 + r] (token * top_k + k or the
// sentinel n_valid), it reads activation row sid / a_div and writes output row sid, scaled by row_w[sid].
template <typename T, int BITS>
__device__ __forceinline__ void wna16_gemm_tile(const T* __restrict__ x, const int32_t* __restrict__ wq,
                                                const float* __restrict__ scale, const int8_t* __restrict__ zp,
                                                const int32_t* __restrict__ gidx, const T* __restrict__ bias,
                                                T* __restrict__ out, int M, int N, int K, int KW, int G, int group,
                                                int m0, const int32_t* __restrict__ sorted, int a_div, int n_valid,
                                                const float* __restrict__ row_w) {
  constexpr int VPW = 32 / BITS, WPR = BK / VPW;  // words per tile row
  __shared__ __align__(16) uint16_t As[BM * LDS];
  __shared__ __align__(16) uint16_t Bs[BN * LDS];
  __shared__ int rows_a[BM], rows_o[BM];
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 1, wn = warp & 1;
  int n0 = blockIdx.x * BN;
  if (tid < BM) {
    if (sorted) {
      int sid = sorted[m0 + tid];
      bool ok = sid < n_valid;
      rows_a[tid] = ok ? sid / a_div : -1;
      rows_o[tid] = ok ? sid : -1;
    } else {
      int r = m0 + tid;
      rows_a[tid] = rows_o[tid] = r < M ? r : -1;
    }
  }
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[i][j][c] = 0.0f;
  __syncthreads();
  for (int kt = 0; kt < K; kt += BK) {
    // A: 64 rows x 32 columns = 256 chunks of 8 values; K % 8 == 0 so a chunk is all in or all out.
#pragma unroll
    for (int i = 0; i < 2; i++) {
      int c = tid + i * 128, r = c >> 2, kc = (c & 3) * 8, ra = rows_a[r], k = kt + kc;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (ra >= 0 && k < K) v = *(const uint4*)(x + (size_t)ra * K + k);
      *(uint4*)(As + r * LDS + kc) = v;
    }
    // B: 64 rows x WPR words, dequantised to T.
#pragma unroll
    for (int i = 0; i < BN * WPR / 128; i++) {
      int c = tid + i * 128, r = c / WPR, wc = c % WPR, n = n0 + r, k = kt + wc * VPW;
      uint16_t* dst = Bs + r * LDS + wc * VPW;
      if (n < N && k < K) {
        float wv[VPW];
        dequant_word<BITS>(wv, (uint32_t)__ldg(wq + (size_t)n * KW + k / VPW), n, k, scale, zp, gidx, G, group);
#pragma unroll
        for (int v = 0; v < VPW; v++) dst[v] = Act<T>::bits(Act<T>::from_f(wv[v]));
      } else {
#pragma unroll
        for (int v = 0; v < VPW; v++) dst[v] = 0;
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      uint32_t a[2][4], b[4][2];
#pragma unroll
      for (int i = 0; i < 2; i++) frag_a16(a[i], As, LDS, wm * 32 + i * 16, kk, lane);
#pragma unroll
      for (int j = 0; j < 4; j++) frag_b16(b[j], Bs, LDS, wn * 32 + j * 8, kk, lane);
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) mma_16816<T>(acc[i][j], a[i], b[j]);
    }
    __syncthreads();
  }
  int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int ro = rows_o[wm * 32 + i * 16 + g + 8 * h];
      if (ro < 0) continue;
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 2; e++) {
          int col = n0 + wn * 32 + j * 8 + 2 * t + e;
          if (col >= N) continue;
          float v = acc[i][j][2 * h + e];
          if (bias) v += Act<T>::to_f(bias[col]);
          if (row_w) v *= row_w[ro];
          out[(size_t)ro * N + col] = Act<T>::from_f(v);
        }
    }
}

#define WNA16_ENTRIES(SUF, T, BITS)                                                                          \
  extern "C" __global__ void __launch_bounds__(128) qk_w##BITS##a16_gemv_##SUF(                              \
      const T* x, const int32_t* wq, const float* scale, const int8_t* zp, const int32_t* gidx, const T* bias, \
      T* out, int M, int N, int K, int KW, int G, int group) {                                               \
    wna16_gemv<T, BITS>(x, wq, scale, zp, gidx, bias, out, M, N, K, KW, G, group);                          \
  }                                                                                                          \
  /* Launch: grid (ceil(N / 64), ceil(M / 64)), block 128. */                                                \
  extern "C" __global__ void __launch_bounds__(128) qk_w##BITS##a16_gemm_##SUF(                              \
      const T* x, const int32_t* wq, const float* scale, const int8_t* zp, const int32_t* gidx, const T* bias, \
      T* out, int M, int N, int K, int KW, int G, int group) {                                               \
    wna16_gemm_tile<T, BITS>(x, wq, scale, zp, gidx, bias, out, M, N, K, KW, G, group, blockIdx.y * BM,     \
                             nullptr, 1, 0, nullptr);                                                        \
  }                                                                                                          \
  /* MoE grouped GEMM, one launch per projection of a layer. Launch: grid (ceil(N / 64), max_blocks),       \
     block 128. Experts stacked: wq [E, N, KW], scale [E, N, G], zp [E, N, G] or nullptr (no act-order).    \
     Block y multiplies the 64 sorted rows sorted[64 y ..] with expert expert_ids[y] (-1: nothing to do). */ \
  extern "C" __global__ void __launch_bounds__(128) qk_moe_w##BITS##a16_gemm_##SUF(                          \
      const T* x, const int32_t* wq, const float* scale, const int8_t* zp, T* out, const int32_t* sorted,    \
      const int32_t* expert_ids, const float* row_w, int a_div, int n_valid, int N, int K, int KW, int G,    \
      int group) {                                                                                           \
    int e = expert_ids[blockIdx.y];                                                                          \
    if (e < 0) return;                                                                                       \
    size_t we = (size_t)e * N;                                                                               \
    wna16_gemm_tile<T, BITS>(x, wq + we * KW, scale + we * G, zp ? zp + we * G : nullptr, nullptr, nullptr, \
                             out, 0, N, K, KW, G, group, blockIdx.y * BM, sorted, a_div, n_valid, row_w);    \
  }

WNA16_ENTRIES(bf16, __nv_bfloat16, 4)
WNA16_ENTRIES(f16, __half, 4)
WNA16_ENTRIES(bf16, __nv_bfloat16, 8)
WNA16_ENTRIES(f16, __half, 8)

// MoE align/sort. Launch: grid (1), block 1024, E <= 1024 experts, block_m = 64 (the GEMM tile).
// topk_ids [numel] int32 (numel = tokens * top_k, flattened). Writes
//   sorted     [numel + E * (block_m - 1)]: for each expert in order, the indices i with topk_ids[i] == e,
//              padded with the sentinel `numel` to a multiple of block_m (order within an expert follows the
//              atomics, which changes nothing: each row is computed on its own);
//   expert_ids [max_blocks]: the expert of each block_m rows of `sorted`, -1 past the end;
//   total      [1]: the padded length.
extern "C" __global__ void __launch_bounds__(1024) qk_moe_align(const int32_t* topk_ids, int numel, int E,
                                                                int block_m, int max_blocks, int32_t* sorted,
                                                                int32_t* expert_ids, int32_t* total) {
  __shared__ int counts[1024], starts[1025];
  int tid = threadIdx.x;
  for (int e = tid; e < E; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int i = tid; i < numel; i += blockDim.x) atomicAdd(&counts[topk_ids[i]], 1);
  __syncthreads();
  if (tid == 0) {
    int s = 0;
    for (int e = 0; e < E; e++) {
      starts[e] = s;
      s += (counts[e] + block_m - 1) / block_m * block_m;
    }
    starts[E] = s;
    *total = s;
  }
  __syncthreads();
  int padded = starts[E];
  for (int i = tid; i < padded; i += blockDim.x) sorted[i] = numel;
  for (int b = tid; b < max_blocks; b += blockDim.x) expert_ids[b] = -1;
  __syncthreads();
  for (int e = tid; e < E; e += blockDim.x) {
    for (int b = starts[e] / block_m; b < starts[e + 1] / block_m; b++) expert_ids[b] = e;
    counts[e] = starts[e];  // reused as the write cursor
  }
  __syncthreads();
  for (int i = tid; i < numel; i += blockDim.x) sorted[atomicAdd(&counts[topk_ids[i]], 1)] = i;
}
