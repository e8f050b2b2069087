// MLA decode attention over the latent cache (weights absorbed: q already multiplied by W_UK, the output
// still to be multiplied by W_UV), split along the sequence (flash-decoding) and combined; and the tree-
// attention mask for speculative-decoding verification.
//
// Shapes: q [B, H, D] with D = kv_lora_rank + rope_dim (DeepSeek-V3: 512 + 64 = 576; convert-mla writes
// other ranks), cache [B, S_max, D] (row b at cache + b * cache_stride_b), the first DV = kv_lora_rank
// columns of a cached row being both key (with the rope tail) and value. seq_lens [B] int32. D <= 576,
// D % 8 == 0, DV <= 512, bf16 only. scale is the softmax scale (1.0 for convert-mla checkpoints, which
// absorb it into q_proj).
#include "qk_device.cuh"

using namespace qk;

#define MLA_MAX_D 576
#define MLA_MAX_DV 512
#define MLA_HEADS 16   // heads per block: the cache tile is read once for all of them
#define MLA_TOKENS 16  // cached tokens per tile
#define NEG_INF (-__int_as_float(0x7f800000))
#define MLA_LD (MLA_MAX_D + 2)  // odd number of words per row: the 16 per-token dot products hit 16 banks

// Launch: grid (splits, ceil(H / 16), B), block 256.
// Writes, per (b, h, split): o_part [B, H, splits, DV] fp32 (unnormalised sum of p * v), ml [B, H, splits, 2]
// (running max, sum of exp); qk_mla_decode_combine reduces them.
extern "C" __global__ void __launch_bounds__(256) qk_mla_decode_split(
    const __nv_bfloat16* q, const __nv_bfloat16* cache, const int32_t* seq_lens, float* o_part, float* ml,
    int H, int D, int DV, long long cache_stride_b, int splits, float scale) {
  __shared__ __align__(16) uint16_t qs[MLA_HEADS * MLA_LD];
  __shared__ __align__(16) uint16_t ks[MLA_TOKENS * MLA_LD];
  __shared__ float p[MLA_HEADS][MLA_TOKENS];
  __shared__ float m_s[MLA_HEADS], l_s[MLA_HEADS], alpha_s[MLA_HEADS];
  int split = blockIdx.x, h0 = blockIdx.y * MLA_HEADS, b = blockIdx.z, tid = threadIdx.x;
  int len = seq_lens[b], chunk = (len + splits - 1) / splits;
  int s_begin = split * chunk, s_end = min(len, s_begin + chunk);
  const uint16_t* qb = (const uint16_t*)q + (size_t)b * H * D;
  const uint16_t* cb = (const uint16_t*)cache + (size_t)b * cache_stride_b;
  for (int i = tid; i < MLA_HEADS * D / 2; i += blockDim.x) {
    int h = i / (D / 2), d = (i % (D / 2)) * 2;
    uint32_t v = h0 + h < H ? *(const uint32_t*)(qb + (size_t)(h0 + h) * D + d) : 0u;
    *(uint32_t*)(qs + h * MLA_LD + d) = v;
  }
  if (tid < MLA_HEADS) { m_s[tid] = NEG_INF; l_s[tid] = 0.0f; }
  // Output ownership: thread (h = tid / 16, c = tid % 16) accumulates columns c, c + 16, ... of head h.
  int oh = tid >> 4, oc = tid & 15;
  float acc[MLA_MAX_DV / 16];
#pragma unroll
  for (int j = 0; j < MLA_MAX_DV / 16; j++) acc[j] = 0.0f;
  __syncthreads();
  for (int s0 = s_begin; s0 < s_end; s0 += MLA_TOKENS) {
    for (int i = tid; i < MLA_TOKENS * D / 8; i += blockDim.x) {  // 16-byte loads of the cache tile
      int t = i / (D / 8), d = (i % (D / 8)) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (s0 + t < s_end) v = __ldg((const uint4*)(cb + (size_t)(s0 + t) * D + d));
      uint32_t* dst = (uint32_t*)(ks + t * MLA_LD + d);  // rows are only 4-byte aligned (padding)
      dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
    }
    __syncthreads();
    {  // scores: thread (h = tid / 16, t = tid % 16)
      int h = tid >> 4, t = tid & 15;
      const uint32_t* qa = (const uint32_t*)(qs + h * MLA_LD);
      const uint32_t* ka = (const uint32_t*)(ks + t * MLA_LD);
      float s = 0.0f;
      for (int d = 0; d < D / 2; d++) {
        __nv_bfloat162 qv = *(const __nv_bfloat162*)&qa[d], kv = *(const __nv_bfloat162*)&ka[d];
        float2 qf = __bfloat1622float2(qv), kf = __bfloat1622float2(kv);
        s = fmaf(qf.x, kf.x, fmaf(qf.y, kf.y, s));
      }
      p[h][t] = s0 + t < s_end ? s * scale : NEG_INF;
    }
    __syncthreads();
    if (tid < MLA_HEADS) {  // online softmax, one thread per head
      float mx = m_s[tid];
      for (int t = 0; t < MLA_TOKENS; t++) mx = fmaxf(mx, p[tid][t]);
      // mx is finite: the tile has at least one valid token.
      float alpha = __expf(m_s[tid] - mx), l = l_s[tid] * alpha;
      for (int t = 0; t < MLA_TOKENS; t++) { float e = __expf(p[tid][t] - mx); p[tid][t] = e; l += e; }
      m_s[tid] = mx; l_s[tid] = l; alpha_s[tid] = alpha;
    }
    __syncthreads();
    float alpha = alpha_s[oh];
#pragma unroll
    for (int j = 0; j < MLA_MAX_DV / 16; j++) {
      int d = oc + 16 * j;
      if (d < DV) {
        float a = acc[j] * alpha;
#pragma unroll
        for (int t = 0; t < MLA_TOKENS; t++)
          a = fmaf(p[oh][t], __uint_as_float((uint32_t)ks[t * MLA_LD + d] << 16), a);
        acc[j] = a;
      }
    }
    __syncthreads();
  }
  if (h0 + oh < H) {
    size_t base = (((size_t)b * H + h0 + oh) * splits + split);
#pragma unroll
    for (int j = 0; j < MLA_MAX_DV / 16; j++) {
      int d = oc + 16 * j;
      if (d < DV) o_part[base * DV + d] = acc[j];
    }
    if (oc == 0) { ml[base * 2] = m_s[oh]; ml[base * 2 + 1] = l_s[oh]; }
  }
}

// Launch: grid (B * H), block 128. out [B, H, DV] bf16 = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// An empty split (m = -inf, l = 0) weighs nothing; an empty sequence gives zeros.
extern "C" __global__ void __launch_bounds__(128) qk_mla_decode_combine(const float* o_part, const float* ml,
                                                                        __nv_bfloat16* out, int DV, int splits) {
  size_t bh = blockIdx.x;
  const float* mlb = ml + bh * splits * 2;
  float M = NEG_INF;
  for (int s = 0; s < splits; s++) M = fmaxf(M, mlb[2 * s]);
  float L = 0.0f;
  for (int s = 0; s < splits; s++) if (mlb[2 * s + 1] > 0.0f) L += mlb[2 * s + 1] * __expf(mlb[2 * s] - M);
  for (int d = threadIdx.x; d < DV; d += blockDim.x) {
    float o = 0.0f;
    for (int s = 0; s < splits; s++)
      if (mlb[2 * s + 1] > 0.0f) o += o_part[(bh * splits + s) * DV + d] * __expf(mlb[2 * s] - M);
    out[bh * DV + d] = __float2bfloat16_rn(L > 0.0f ? o / L : 0.0f);
  }
}

// Tree-attention verification mask. parents [T] int32: the parent draft token of each of the T draft tokens
// (-1: attached to the last prefix token); parents[i] < i. mask [T, P + T] uint8: 1 where draft token i may
// attend: every prefix position j < P, and draft position P + a for each ancestor a of i, i itself included.
// Launch: grid (T), block 128.
extern "C" __global__ void __launch_bounds__(128) qk_tree_mask(const int32_t* parents, int T, int P, uint8_t* mask) {
  __shared__ uint8_t anc[1024];  // anc[a] = 1 if a is an ancestor of row i (T <= 1024)
  int i = blockIdx.x;
  for (int a = threadIdx.x; a < T; a += blockDim.x) anc[a] = 0;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int a = i, steps = 0; a >= 0 && steps <= T; a = parents[a], steps++) anc[a] = 1;  // steps: cycle guard
  __syncthreads();
  uint8_t* row = mask + (size_t)i * (P + T);
  for (int j = threadIdx.x; j < P + T; j += blockDim.x) row[j] = j < P ? 1 : anc[j - P];
}
