// Quantised-weight linear for CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, computed in fp32.
//
// W is stored as one byte stream per output row in one of three codes: two unsigned 4-bit values per byte
// (low nibble first, value - 8: compressed-tensors' pack-quantized bit stream read as bytes), signed int8,
// or float8 e4m3fn bytes. Each row r and column group g has an fp32 scale s and an optional int8 zero point
// zp, so w = (q - zp) * s; `row_block` rows share one scale row (128 for FP8 block scales, N for one
// tensor-wide scale, 1 otherwise). The weight is never expanded as a whole: small batches decode
// eight weights at a time straight into FMAs against every row of x (memory-bound decode, so reading 4 or 8
// bits per weight instead of 16 or 32 is what makes it fast); larger batches get the weight dequantised into their
// dtype for the BLAS GEMM (dq_weight whole; the tile kernels chunk by chunk, chunked_linear).
//
// Built with AVX2 + FMA + F16C as the baseline (every x86 server since 2013); a scalar path covers ragged
// tails and the build without AVX2.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QK_AVX2 1
#endif

namespace {

// How far ahead of the current step the tile GEMVs prefetch. Measured on 5632 x 2048 layers streaming from DRAM at
// batch 1 (AVX512, medians of 7): 2048 -> 8192 bytes gave int4 +12%, int8 +6%, FP8 +22%.
constexpr int64_t PREFETCH = 8192;

enum Code : int64_t { U4 = 0, I8 = 1, E4M3 = 2 };

struct Layout {
  const uint8_t* codes;
  int64_t row_bytes;
  const float* scale;
  const int8_t* zp;  // nullptr: symmetric
  int64_t n_groups, group, row_block, K;
  int64_t code;
};

float e4m3_table[256];

void init_e4m3_table() {
  for (int b = 0; b < 256; ++b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e == 0 ? std::ldexp(m / 8.0f, -6) : std::ldexp(1.0f + m / 8.0f, e - 7);
    if (e == 15 && m == 7) v = NAN;  // e4m3fn has no infinities; S.1111.111 is NaN
    e4m3_table[b] = (b & 128) ? -v : v;
  }
}

inline float decode1(const Layout& L, const uint8_t* row, int64_t k) {
  switch (L.code) {
    case U4: {
      uint8_t byte = row[k >> 1];
      return float(int((k & 1) ? (byte >> 4) : (byte & 15)) - 8);
    }
    case I8: return float(int8_t(row[k]));
    default: return e4m3_table[row[k]];
  }
}

#ifdef QK_AVX2
// Eight weights starting at column k, as fp32. U4 gives the unsigned nibble (value + 8: the caller folds the
// -8 into the zero), E4M3 the true value / 256 (the caller folds the 256 into the scale).
inline __m256 decode8(const Layout& L, const uint8_t* row, int64_t k) {
  if (L.code == U4) {
    uint32_t word;
    std::memcpy(&word, row + (k >> 1), 4);  // k is even: eight nibbles, four bytes
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts),
                                               _mm256_set1_epi32(15)));
  }
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
  if (L.code == I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  // e4m3 -> fp16 bit pattern: sign to bit 15, exponent and mantissa shifted into fp16's fields. Exponent bias
  // 7 against fp16's 15 makes every value (subnormals included) exactly 2^-8 times the e4m3 value; F16C
  // converts to fp32 exactly. e4m3 subnormals become fp16 subnormals, which F16C converts through a slow
  // microcode assist; they are |w| < 2^-6 / 448 of a scale group's absmax, ~1e-4 of a Gaussian weight, so
  // this beats a table gather (3x slower per weight, measured) on real checkpoints.
  __m128i h = _mm_cvtepu8_epi16(bytes);
  __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
  __m128i mag = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7F)), 7);
  return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
}

// Sixteen weights from column k (same conventions). U4 reads eight bytes once and interleaves low and high
// nibbles with 16-bit unpacks, cheaper than two shifted broadcasts.
inline void decode16(const Layout& L, const uint8_t* row, int64_t k, __m256& w0, __m256& w1) {
  if (L.code != U4) {
    w0 = decode8(L, row, k);
    w1 = decode8(L, row, k + 8);
    return;
  }
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k >> 1))));
  __m128i lo = _mm_and_si128(b, _mm_set1_epi16(15)), hi = _mm_srli_epi16(b, 4);
  w0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_unpacklo_epi16(lo, hi)));
  w1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_unpackhi_epi16(lo, hi)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// y[m, n] for MB rows of x (MB <= 8) and one output row n. U independent accumulator sets hide the FMA
// latency when MB alone gives too few chains (MB * U = 4..8 keeps them all in registers).
template <int MB, int U>
void row_dot(const Layout& L, int64_t n, const float* x, int64_t ldx, float* y, int64_t ldy) {
  const uint8_t* row = L.codes + n * L.row_bytes;
  const int64_t srow = (n / L.row_block) * L.n_groups;
  float tail[MB] = {0.0f};
#ifdef QK_AVX2
  __m256 acc[U][MB];
  for (int u = 0; u < U; ++u)
    for (int m = 0; m < MB; ++m) acc[u][m] = _mm256_setzero_ps();
  const bool vec = L.code != U4 || L.group % 2 == 0;  // nibble chunks must start on a byte
  const float unit = L.code == E4M3 ? 256.0f : 1.0f;
#endif
  for (int64_t g = 0; g < L.n_groups; ++g) {
    const int64_t k0 = g * L.group, k1 = std::min(L.K, k0 + L.group);
    const float s = L.scale[srow + g];
    const float z = L.zp ? -float(L.zp[srow + g]) * s : 0.0f;
    int64_t k = k0;
#ifdef QK_AVX2
    if (vec) {
      const __m256 vs = _mm256_set1_ps(s * unit), vz = _mm256_set1_ps(L.code == U4 ? z - 8.0f * s : z);
      constexpr int C = U < 2 ? 2 : U;  // 8-weight chunks per step: whole 16-weight decodes
      for (; k + 8 * C <= k1; k += 8 * C) {
        for (int c = 0; c < C; c += 2) {
          __m256 w[2];
          decode16(L, row, k + 8 * c, w[0], w[1]);
          for (int h = 0; h < 2; ++h) {
            const __m256 wv = _mm256_fmadd_ps(w[h], vs, vz);
            const int u = (c + h) % U;
            for (int m = 0; m < MB; ++m)
              acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k + 8 * (c + h)), acc[u][m]);
          }
        }
      }
      for (; k + 8 <= k1; k += 8) {
        const __m256 w = _mm256_fmadd_ps(decode8(L, row, k), vs, vz);
        for (int m = 0; m < MB; ++m) acc[0][m] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * ldx + k), acc[0][m]);
      }
    }
#endif
    for (; k < k1; ++k) {
      const float w = decode1(L, row, k) * s + z;
      for (int m = 0; m < MB; ++m) tail[m] += w * x[m * ldx + k];
    }
  }
  for (int m = 0; m < MB; ++m) {
#ifdef QK_AVX2
    __m256 total = acc[0][m];
    for (int u = 1; u < U; ++u) total = _mm256_add_ps(total, acc[u][m]);
    tail[m] += hsum(total);
#endif
    y[m * ldy + n] = tail[m];
  }
}

// f(std::integral_constant<int, MB>, m0) for each block of up to 8 rows of x (MB: the block's row count, a template
// argument of the kernels so their accumulators stay in registers).
template <typename F>
void for_row_blocks(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      case 4: f(std::integral_constant<int, 4>{}, m0); break;
      case 5: f(std::integral_constant<int, 5>{}, m0); break;
      case 6: f(std::integral_constant<int, 6>{}, m0); break;
      case 7: f(std::integral_constant<int, 7>{}, m0); break;
      default: f(std::integral_constant<int, 8>{}, m0); break;
    }
  }
}

template <int MB>
void gemv_block(const Layout& L, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    constexpr int U = MB >= 4 ? 1 : (MB >= 2 ? 2 : 4);
    for (int64_t n = n0; n < n1; ++n) row_dot<MB, U>(L, n, x, ldx, y, ldy);
  });
}

void gemv(const Layout& L, const float* x, int64_t M, float* y, int64_t N) {
  for_row_blocks(M, [&](auto mb, int64_t m0) {
    gemv_block<decltype(mb)::value>(L, x + m0 * L.K, L.K, y + m0 * N, N, N);
  });
}

// One dequantised row into out[K] (fp32): (q - zp) * s with one rounding, the reference's value exactly (the
// integer difference is exact in fp32, e4m3 / 256 times 256 * s is the same product).
void dequant_row(const Layout& L, int64_t n, float* out) {
  const uint8_t* row = L.codes + n * L.row_bytes;
  const int64_t srow = (n / L.row_block) * L.n_groups;
#ifdef QK_AVX2
  const bool vec = L.code != U4 || L.group % 2 == 0;
  const float unit = L.code == E4M3 ? 256.0f : 1.0f;
#endif
  for (int64_t g = 0; g < L.n_groups; ++g) {
    const int64_t k0 = g * L.group, k1 = std::min(L.K, k0 + L.group);
    const float s = L.scale[srow + g];
    const float zp = L.zp ? float(L.zp[srow + g]) : 0.0f;
    int64_t k = k0;
#ifdef QK_AVX2
    if (vec) {
      // decode8 gives U4 as the unsigned nibble (value + 8).
      const __m256 vs = _mm256_set1_ps(s * unit), voff = _mm256_set1_ps(L.code == U4 ? zp + 8.0f : zp);
      for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_sub_ps(decode8(L, row, k), voff), vs));
    }
#endif
    for (; k < k1; ++k) out[k] = (decode1(L, row, k) - zp) * s;
  }
}

// ---------------------------------------------------------------------------------------------------------
// Integer-dot GEMV for 4- and 8-bit weights (M <= 16 rows of x), on a tiled copy of the codes made once at load.
//
// Decode is memory-bound only if the arithmetic keeps up with the bytes; decoding nibbles to fp32 and
// FMA-ing them does not. Here x is quantised per block of 64 or 128 columns into 16-bit fixed point,
// x ~= c * (256 * hi + lo) with hi, lo int8 and c = absmax / (127 * 256): an error of at most absmax * 2^-16
// per element, ~100x below a bf16 input's own rounding of its largest element. Each block's dot product is
// then exact integer arithmetic on the stored nibbles, u8 x s8 multiply-adds (AVX512-VNNI vpdpbusd, 64 per
// instruction; AVX2 pmaddubsw), hi and lo combined as (sum u*hi) * 256 + sum u*lo in int32. The weight's
// offset (8 + zero point) is removed per block through the block sums of x.
//
// Tiles: 16 output rows each, streamed as one sequential run of bytes (several row-wise streams per core
// were latency-bound at half the bandwidth a single stream gets). Per 8-column step s, a 4-bit tile holds 64
// bytes: 4 per row j, the low nibble of byte t being u[j, 8s + t] and the high nibble u[j, 8s + 4 + t], so a
// 32-bit lane is one row's 4 consecutive columns and x's 4 matching bytes are broadcast to every lane. An 8-bit
// tile holds 4 columns per 64-byte step (byte 4j + t: u[j, 4s + t], u = q + 128), the same lanes.
// Scales come per tile and group as 16 consecutive fp32 values, so per-block scaling is one vector op.
// dot_linear_codes takes x as per-token int8 codes instead (hi = the code, lo = 0): the kernels then skip the lo
// half's multiply-adds.

constexpr int TILE = 16;

struct DotArgs {
  const uint8_t* tiles;           // [tiles, K * bits / 32, 64]
  const float* scale;             // [tiles, n_groups, 16]
  const float* zscale;            // [tiles, n_groups, 16]: scale * (offset + zp); nullptr when symmetric
  int64_t K, N, n_groups, block, n_blocks;
  int64_t bits;                   // 4: 8 columns per 64-byte step; 8: 4 columns (byte 4j + t: u[j, 4s + t])
  float offset;                   // what the stored unsigned values carry: 8 (4-bit) or 128 (8-bit)
  const int64_t* group_of_block;  // [n_blocks]
  const int8_t* xq;               // [M, 2K]: hi of every column, then lo
  const float* xc;                // [M, n_blocks]: c = absmax / (127 * 256)
  const float* xcs;               // [M, n_blocks]: c * (sum over the block of 256 * hi + lo)
  const int16_t* x16;             // [M, K]: 256 * hi + lo (the 8-bit AVX2 path's operand), else nullptr
  bool lo;                        // false: x is int8 codes (every lo is 0) and the kernels skip the lo products
};

inline int64_t block_width(const DotArgs& A, int64_t b) { return std::min(A.block, A.K - b * A.block); }

void quantize_x(const float* x, int64_t M, int64_t K, int64_t block, int64_t n_blocks, int8_t* xq, float* xc,
                float* xcs) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* hi_row = xq + m * 2 * K;
    int8_t* lo_row = hi_row + K;
    for (int64_t b = 0; b < n_blocks; ++b) {
      const int64_t k0 = b * block, k1 = std::min(K, k0 + block);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int64_t sum = 0;
      for (int64_t k = k0; k < k1; ++k) {
        const float v = xr[k] * inv;
        const float hi = std::nearbyint(v);
        const float lo = std::min(127.0f, std::max(-128.0f, std::nearbyint((v - hi) * 256.0f)));
        hi_row[k] = int8_t(hi);
        lo_row[k] = int8_t(lo);
        sum += 256 * int64_t(hi) + int64_t(lo);
      }
      const float c = amax / (127.0f * 256.0f);
      xc[m * n_blocks + b] = c;
      xcs[m * n_blocks + b] = c * float(sum);
    }
  }
}

inline int nibble(const uint8_t* step, int j, int64_t col) {  // col in 0..7 of the step
  const uint8_t byte = step[4 * j + (col & 3)];
  return col < 4 ? (byte & 15) : (byte >> 4);
}

inline int64_t step_bytes(const DotArgs& A) { return A.K * A.bits / 32 * 64; }  // one tile's bytes

// The stored unsigned value of row j, column k of a tile.
inline int tile_value(const DotArgs& A, const uint8_t* w, int j, int64_t k) {
  return A.bits == 4 ? nibble(w + (k / 8) * 64, j, k % 8) : w[(k / 4) * 64 + 4 * j + (k % 4)];
}

inline int64_t valid_rows(const DotArgs& A, int64_t t) { return std::min<int64_t>(TILE, A.N - t * TILE); }

template <int MB>
void dot_tile_scalar(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  for (int j = 0; j < valid_rows(A, t); ++j) {
    for (int m = 0; m < MB; ++m) {
      const int8_t* xh = A.xq + (m0 + m) * 2 * A.K;
      double total = 0.0;
      for (int64_t b = 0; b < A.n_blocks; ++b) {
        const int64_t k0 = b * A.block, g = A.group_of_block[b];
        int64_t hi = 0, lo = 0;
        for (int64_t k = k0; k < k0 + block_width(A, b); ++k) {
          const int u = tile_value(A, w, j, k);
          hi += u * xh[k];
          lo += u * xh[A.K + k];
        }
        const float s = A.scale[(t * A.n_groups + g) * TILE + j];
        const float sz = A.zscale ? A.zscale[(t * A.n_groups + g) * TILE + j] : A.offset * s;
        total += double(s) * A.xc[(m0 + m) * A.n_blocks + b] * double(256 * hi + lo) -
                 double(sz) * A.xcs[(m0 + m) * A.n_blocks + b];
      }
      y[(m0 + m) * ldy + t * TILE + j] = float(total);
    }
  }
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#ifdef QK_AVX2
// d[m][h]: the exact integer sums of rows 8h..8h+7 for x row m0 + m over block b, added to acc in fp32: the
// block's scale times c, minus (offset + zp) * scale times the block's sum of x.
template <int MB>
inline void add_blocks_avx2(const DotArgs& A, int64_t t, int64_t g, int64_t m0, int64_t b, const __m256i (&d)[MB][2],
                            __m256 (&acc)[MB][2]) {
  const float* st = A.scale + (t * A.n_groups + g) * TILE;
  const float* zt = A.zscale ? A.zscale + (t * A.n_groups + g) * TILE : nullptr;
  for (int h = 0; h < 2; ++h) {
    const __m256 sv = _mm256_loadu_ps(st + 8 * h);
    const __m256 zv = zt ? _mm256_loadu_ps(zt + 8 * h) : _mm256_mul_ps(sv, _mm256_set1_ps(A.offset));
    for (int m = 0; m < MB; ++m) {
      const float c = A.xc[(m0 + m) * A.n_blocks + b], cs = A.xcs[(m0 + m) * A.n_blocks + b];
      acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d[m][h]), _mm256_mul_ps(sv, _mm256_set1_ps(c)), acc[m][h]);
      acc[m][h] = _mm256_fnmadd_ps(zv, _mm256_set1_ps(cs), acc[m][h]);
    }
  }
}

template <int MB>
inline void store_avx2(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy, const __m256 (&acc)[MB][2]) {
  const int64_t rows = valid_rows(A, t);
  for (int m = 0; m < MB; ++m) {
    float out[TILE];
    _mm256_storeu_ps(out, acc[m][0]);
    _mm256_storeu_ps(out + 8, acc[m][1]);
    std::memcpy(y + (m0 + m) * ldy + t * TILE, out, rows * sizeof(float));
  }
}

// AVX2: a tile step is two 32-byte halves (rows 0-7, 8-15); pmaddubsw + pmaddwd per half.
template <int MB, bool LO>
void dot_tile_avx2(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w = A.tiles + t * (A.K / 8) * 64;
  const __m256i nib = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    __m256i d[MB][2];
    for (int m = 0; m < MB; ++m) d[m][0] = d[m][1] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 8) {
      const uint8_t* step = w + (k / 8) * 64;
      for (int h = 0; h < 2; ++h) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(step + 32 * h));
        const __m256i ue = _mm256_and_si256(bytes, nib), uo = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nib);
        for (int m = 0; m < MB; ++m) {
          const int8_t* xh = A.xq + (m0 + m) * 2 * A.K + k;
          const int8_t* xl = xh + A.K;
          // pmaddubsw: two u4 x s8 products per int16 (|.| <= 3840); two of them summed still fit.
          const __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_set1_epi32(load4(xh))),
                                              _mm256_maddubs_epi16(uo, _mm256_set1_epi32(load4(xh + 4))));
          if constexpr (LO) {
            const __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(ue, _mm256_set1_epi32(load4(xl))),
                                                _mm256_maddubs_epi16(uo, _mm256_set1_epi32(load4(xl + 4))));
            d[m][h] = _mm256_add_epi32(d[m][h], _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(ph, ones), 8),
                                                                 _mm256_madd_epi16(pl, ones)));
          } else {
            d[m][h] = _mm256_add_epi32(d[m][h], _mm256_slli_epi32(_mm256_madd_epi16(ph, ones), 8));
          }
        }
      }
    }
    add_blocks_avx2<MB>(A, t, g, m0, b, d, acc);
  }
  store_avx2<MB>(A, t, m0, y, ldy, acc);
}

// The 8-bit tiles on AVX2: each 16-byte quarter of a step (4 rows x 4 columns) widened to 16 bits and multiplied
// by x's 16-bit fixed point (256 * hi + lo, |.| <= 32640) with pmaddwd, two columns per int32 lane (pmaddubsw would
// saturate on u8 x s8 pairs). A 128-column block sums at most 32 * 2 * 255 * 32640 per lane: no overflow.
template <int MB>
void dot8_tile_avx2(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
  __m256 acc[MB][2];
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    __m256i p[MB][4];  // per quarter q (rows 4q..4q+3): lanes (row, columns 0-1), (row, columns 2-3)
    for (int m = 0; m < MB; ++m)
      for (int q = 0; q < 4; ++q) p[m][q] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 4) {
      const uint8_t* step = w + (k / 4) * 64;
      __m256i u[4];
      for (int q = 0; q < 4; ++q)
        u[q] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16 * q)));
      for (int m = 0; m < MB; ++m) {
        int64_t four;
        std::memcpy(&four, A.x16 + (m0 + m) * A.K + k, 8);
        const __m256i xv = _mm256_set1_epi64x(four);
        for (int q = 0; q < 4; ++q) p[m][q] = _mm256_add_epi32(p[m][q], _mm256_madd_epi16(u[q], xv));
      }
    }
    __m256i d[MB][2];
    for (int m = 0; m < MB; ++m)  // hadd pairs each row's two lanes; the permutation restores row order 0..7
      for (int h = 0; h < 2; ++h)
        d[m][h] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(p[m][2 * h], p[m][2 * h + 1]), order);
    add_blocks_avx2<MB>(A, t, g, m0, b, d, acc);
  }
  store_avx2<MB>(A, t, m0, y, ldy, acc);
}
#endif

#if defined(QK_AVX2) && defined(__GNUC__) && defined(__x86_64__)
#define QK_X86 1
#define QK_VNNI_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#define QK_BF16_TARGET __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512bf16")))
#if defined(__clang__) || __GNUC__ >= 10  // compilers that know AVX512-BF16's intrinsics
#define QK_BF16 1
#endif

// One block's integer sums (hi and lo halves of x) of tile t and x row `row` added to acc in fp32: the block's
// scale times c, minus (offset + zp) * scale times the block's sum of x.
QK_VNNI_TARGET inline __m512 add_block(const DotArgs& A, int64_t t, int64_t g, int64_t row, int64_t b, __m512i hi,
                                       __m512i lo, __m512 acc) {
  const __m512 sv = _mm512_loadu_ps(A.scale + (t * A.n_groups + g) * TILE);
  const __m512 zv = A.zscale ? _mm512_loadu_ps(A.zscale + (t * A.n_groups + g) * TILE)
                             : _mm512_mul_ps(sv, _mm512_set1_ps(A.offset));
  const __m512i d = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo);
  const float c = A.xc[row * A.n_blocks + b], cs = A.xcs[row * A.n_blocks + b];
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv, _mm512_set1_ps(c)), acc);
  return _mm512_fnmadd_ps(zv, _mm512_set1_ps(cs), acc);
}

// AVX512-VNNI: one 64-byte tile step per load, 16 rows per zmm lane set. For MB <= 2 the even and odd
// halves of each step accumulate separately (four dpbusd chains per x row instead of two: the chains'
// latency, not the throughput, bounds one-row decode).
template <int MB, bool LO>
QK_VNNI_TARGET void dot_tile_vnni(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  constexpr int C = MB <= 2 ? 2 : 1;
  const uint8_t* w = A.tiles + t * step_bytes(A);
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    __m512i dh[MB][C], dl[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) dh[m][c] = dl[m][c] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 8) {
      const uint8_t* step = w + (k / 8) * 64;
      _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH), _MM_HINT_T0);
      const __m512i bytes = _mm512_loadu_si512(step);
      const __m512i ue = _mm512_and_si512(bytes, nib), uo = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nib);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xh = A.xq + (m0 + m) * 2 * A.K + k;
        const int8_t* xl = xh + A.K;
        dh[m][0] = _mm512_dpbusd_epi32(dh[m][0], ue, _mm512_set1_epi32(load4(xh)));
        dh[m][C - 1] = _mm512_dpbusd_epi32(dh[m][C - 1], uo, _mm512_set1_epi32(load4(xh + 4)));
        if constexpr (LO) {
          dl[m][0] = _mm512_dpbusd_epi32(dl[m][0], ue, _mm512_set1_epi32(load4(xl)));
          dl[m][C - 1] = _mm512_dpbusd_epi32(dl[m][C - 1], uo, _mm512_set1_epi32(load4(xl + 4)));
        }
      }
    }
    for (int m = 0; m < MB; ++m) {
      __m512i hi = dh[m][0], lo = dl[m][0];
      if (C == 2) hi = _mm512_add_epi32(hi, dh[m][C - 1]), lo = _mm512_add_epi32(lo, dl[m][C - 1]);
      acc[m] = add_block(A, t, g, m0 + m, b, hi, lo, acc[m]);
    }
  }
  const __mmask16 mask = __mmask16((1u << valid_rows(A, t)) - 1u);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + t * TILE, mask, acc[m]);
}

// The 8-bit tiles: one 64-byte step is 4 columns of 16 rows, the stored bytes q + 128 (u8), so one dpbusd per
// half of x (hi, lo) covers the step; the 128 + zp offset is removed per block as above. Overflow: a 128-column
// block sums at most 128 * 255 * 128 per half, and hi * 256 + lo stays below 2^31. S tiles (ts) against MB rows of
// x from m0, C steps in flight; S = 2 at batch 1: two sequential streams per thread, which measured +12% over one
// (5632 x 2048 from DRAM; 3, 4 and 6 streams were no better, 6 worse).
template <int S, int MB, int C, bool LO>
QK_VNNI_TARGET void dot8_tiles_vnni(const DotArgs& A, const int64_t* ts, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w[S];
  for (int i = 0; i < S; ++i) w[i] = A.tiles + ts[i] * step_bytes(A);
  __m512 acc[S][MB];
  for (int i = 0; i < S; ++i)
    for (int m = 0; m < MB; ++m) acc[i][m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    __m512i dh[S][MB][C], dl[S][MB][C];
    for (int i = 0; i < S; ++i)
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < C; ++c) dh[i][m][c] = dl[i][m][c] = _mm512_setzero_si512();
    for (int64_t k = k0; k < k1; k += 4 * C) {
      for (int c = 0; c < C; ++c) {
        for (int i = 0; i < S; ++i) {
          const uint8_t* step = w[i] + (k / 4 + c) * 64;
          _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH), _MM_HINT_T0);
          const __m512i u = _mm512_loadu_si512(step);
          for (int m = 0; m < MB; ++m) {
            const int8_t* xh = A.xq + (m0 + m) * 2 * A.K + k + 4 * c;
            dh[i][m][c] = _mm512_dpbusd_epi32(dh[i][m][c], u, _mm512_set1_epi32(load4(xh)));
            if constexpr (LO) dl[i][m][c] = _mm512_dpbusd_epi32(dl[i][m][c], u, _mm512_set1_epi32(load4(xh + A.K)));
          }
        }
      }
    }
    for (int i = 0; i < S; ++i)
      for (int m = 0; m < MB; ++m) {
        __m512i hi = dh[i][m][0], lo = dl[i][m][0];
        for (int c = 1; c < C; ++c) hi = _mm512_add_epi32(hi, dh[i][m][c]), lo = _mm512_add_epi32(lo, dl[i][m][c]);
        acc[i][m] = add_block(A, ts[i], g, m0 + m, b, hi, lo, acc[i][m]);
      }
  }
  for (int i = 0; i < S; ++i) {
    const __mmask16 mask = __mmask16((1u << valid_rows(A, ts[i])) - 1u);
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + ts[i] * TILE, mask, acc[i][m]);
  }
}

template <int MB, bool LO>
QK_VNNI_TARGET void dot8_tile_vnni(const DotArgs& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  dot8_tiles_vnni<1, MB, (MB <= 2 ? 2 : 1), LO>(A, &t, m0, y, ldy);
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}
#else
bool cpu_has_vnni() { return false; }
#endif

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, VNNI512 = 2 };

template <int MB, bool LO>
void dot_tiles_of(const DotArgs& A, int64_t isa, int64_t m0, float* y, int64_t ldy) {
  const int64_t tiles = (A.N + TILE - 1) / TILE;
#ifdef QK_X86
  if (MB == 1 && A.bits == 8 && isa == VNNI512) {
    constexpr int S = 2;  // each thread's range in S parts, streamed side by side
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      const int64_t per = (t1 - t0) / S;
      for (int64_t i = 0; i < per; ++i) {
        int64_t ts[S];
        for (int j = 0; j < S; ++j) ts[j] = t0 + j * per + i;
        dot8_tiles_vnni<S, 1, 1, LO>(A, ts, m0, y, ldy);
      }
      for (int64_t t = t0 + S * per; t < t1; ++t) dot8_tile_vnni<1, LO>(A, t, m0, y, ldy);
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef QK_X86
      if (isa == VNNI512) {
        if (A.bits == 4) dot_tile_vnni<MB, LO>(A, t, m0, y, ldy);
        else dot8_tile_vnni<MB, LO>(A, t, m0, y, ldy);
        continue;
      }
#endif
#ifdef QK_AVX2
      if (isa == AVX2) {
        if (A.bits == 4) dot_tile_avx2<MB, LO>(A, t, m0, y, ldy);
        else dot8_tile_avx2<MB>(A, t, m0, y, ldy);  // 16-bit x either way (x16)
        continue;
      }
#endif
      dot_tile_scalar<MB>(A, t, m0, y, ldy);
    }
  });
}

template <int MB>
void dot_tiles(const DotArgs& A, int64_t isa, int64_t m0, float* y, int64_t ldy) {
  if (A.lo) dot_tiles_of<MB, true>(A, isa, m0, y, ldy);
  else dot_tiles_of<MB, false>(A, isa, m0, y, ldy);
}

// The 16 dense fp32 rows of tile t (padded rows included), for batches past the GEMV range.
void tile_rows(const DotArgs& A, int64_t t, float* out /* [16, K] */) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    const float* st = A.scale + (t * A.n_groups + g) * TILE;
    const float* zt = A.zscale ? A.zscale + (t * A.n_groups + g) * TILE : nullptr;
    for (int j = 0; j < TILE; ++j) {
      // (u - (offset + zp)) * s, one rounding: offset + zp (an integer) recovered from zscale = s * (offset + zp).
      const float s = st[j], off = zt ? (s != 0.0f ? std::nearbyint(zt[j] / s) : 0.0f) : A.offset;
      float* o = out + j * A.K;
      int64_t k = k0;
      if (A.bits == 8) {
        for (; k < k1; ++k) o[k] = (float(w[(k / 4) * 64 + 4 * j + (k % 4)]) - off) * s;
        continue;
      }
#ifdef QK_AVX2
      // Bytes c = 0..3 of the row's word: columns c (low nibble) and 4 + c (high).
      const __m256i shifts = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);
      const __m256 vs = _mm256_set1_ps(s), voff = _mm256_set1_ps(off);
      for (; k < k1; k += 8) {
        uint32_t word;
        std::memcpy(&word, w + (k / 8) * 64 + 4 * j, 4);
        const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32(15));
        _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(nib), voff), vs));
      }
#endif
      for (; k < k1; k += 8) {
        const uint8_t* q = w + (k / 8) * 64 + 4 * j;
        for (int c = 0; c < 4; ++c) {
          o[k + c] = (float(q[c] & 15) - off) * s;
          o[k + 4 + c] = (float(q[c] >> 4) - off) * s;
        }
      }
    }
  }
}

}  // namespace

// compressed-tensors' 4-bit rows (uint8 [N, >= K/2]: column 2j in the low nibble of byte j, 2j+1 in the high
// one, each value + 8) -> the dot kernel's tiles uint8 [ceil(N/16), K/8, 64] (see TILE), padded rows 0.
at::Tensor tile_u4(const at::Tensor& packed, int64_t K) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed must be uint8 [N, B]");
  TORCH_CHECK(K % 8 == 0 && packed.size(1) >= K / 2, "K must be a multiple of 8 within the rows");
  const int64_t N = packed.size(0), rb = packed.size(1), n_tiles = (N + TILE - 1) / TILE, steps = K / 8;
  at::Tensor tiles = at::zeros({n_tiles, steps, 64}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < std::min<int64_t>(TILE, N - t * TILE); ++j) {
        const uint8_t* row = src + (t * TILE + j) * rb;
        for (int64_t s = 0; s < steps; ++s) {
          // Row bytes 4s..4s+3 hold columns 8s..8s+7 as (8s, 8s+1), (8s+2, 8s+3), ...
          int u[8];
          for (int c = 0; c < 4; ++c) u[2 * c] = row[4 * s + c] & 15, u[2 * c + 1] = row[4 * s + c] >> 4;
          uint8_t* out = dst + (t * steps + s) * 64 + 4 * j;
          for (int c = 0; c < 4; ++c) out[c] = uint8_t(u[c] | (u[4 + c] << 4));
        }
      }
  });
  return tiles;
}

// The dot kernel's weight, checked: tiles uint8 [ceil(N / 16), K / 8, 64]; scale (and zscale, or empty) fp32
// [tiles, n_groups, 16]; K % 64 == 0, group a multiple of 64 or K. `group_of_block` receives the blocks' groups.
DotArgs dot_args(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& zscale, int64_t N, int64_t K,
                 int64_t group, int64_t bits, std::vector<int64_t>& group_of_block) {
  const int64_t n_tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(K % 64 == 0 && K > 0, "K must be a positive multiple of 64, got ", K);
  TORCH_CHECK(group == K || (group % 64 == 0 && group > 0), "group must be a multiple of 64 or K, got ", group);
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.numel() == n_tiles * (K * bits / 32) * 64,
              "tiles must be uint8 [", n_tiles, ", ", K * bits / 32, ", 64]");
  const int64_t n_groups = (K + group - 1) / group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_tiles * n_groups * TILE,
              "scale must be fp32 [tiles, groups, 16]");
  const bool has_z = zscale.numel() > 0;
  TORCH_CHECK(!has_z || (zscale.scalar_type() == at::kFloat && zscale.is_contiguous() && zscale.sizes() == scale.sizes()),
              "zscale must be empty or shaped like scale");
  const int64_t block = (group == K || group % 128 == 0) ? 128 : 64, n_blocks = (K + block - 1) / block;
  group_of_block.resize(n_blocks);
  for (int64_t b = 0; b < n_blocks; ++b) group_of_block[b] = (b * block) / group;
  return DotArgs{tiles.data_ptr<uint8_t>(), scale.data_ptr<float>(), has_z ? zscale.data_ptr<float>() : nullptr,
                 K, N, n_groups, block, n_blocks, bits, bits == 4 ? 8.0f : 128.0f, group_of_block.data(),
                 nullptr, nullptr, nullptr, nullptr, true};
}

// The GEMV over M rows of x once A's x fields are set: the ISA downgraded to what this CPU and build have, the 8-bit
// AVX2 path's 16-bit x formed, rows in blocks of up to 8. Returns fp32 [M, N].
at::Tensor dot_rows(DotArgs& A, int64_t M, int64_t isa) {
  const int64_t K = A.K, N = A.N;
  if (isa == VNNI512 && !cpu_has_vnni()) isa = AVX2;
#ifndef QK_AVX2
  if (isa == AVX2) isa = SCALAR;
#endif
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor x16;
  if (A.bits == 8 && isa == AVX2) {  // the 8-bit AVX2 path multiplies 16-bit x
    x16 = at::empty({M, K}, f32.dtype(at::kShort));
    int16_t* p = x16.data_ptr<int16_t>();
    const int8_t* q = A.xq;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) p[m * K + k] = int16_t(256 * q[m * 2 * K + k] + q[m * 2 * K + K + k]);
    A.x16 = p;
  }
  at::Tensor y = at::empty({M, N}, f32);
  float* yp = y.data_ptr<float>();
  for_row_blocks(M, [&](auto mb, int64_t m0) { dot_tiles<decltype(mb)::value>(A, isa, m0, yp, N); });
  return y;
}

// The integer-dot GEMV on the tiles made by quantkit.runtime.kernels.cpp (see dot_args): x [M, K] fp32, bf16 or
// fp16 with M <= gemv_max_rows (past it the caller dequantises with dot_weight for the BLAS). isa: 0 scalar,
// 1 AVX2, 2 AVX512-VNNI (downgraded to what this CPU and build have). Returns fp32 [M, N].
at::Tensor dot_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& zscale,
                      int64_t N, int64_t group, int64_t bits, int64_t isa, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
              x.scalar_type() == at::kHalf), "x must be contiguous [M, K] fp32/bf16/fp16");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= gemv_max_rows, "dot_linear serves up to ", gemv_max_rows, " rows; dequantise with dot_weight past it");
  std::vector<int64_t> group_of_block;
  DotArgs A = dot_args(tiles, scale, zscale, N, K, group, bits, group_of_block);
  const int64_t block = A.block, n_blocks = A.n_blocks;
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor xq = at::empty({M, 2 * K}, xf.options().dtype(at::kChar));
  at::Tensor xc = at::empty({M, n_blocks}, xf.options());
  at::Tensor xcs = at::empty({M, n_blocks}, xf.options());
  quantize_x(xf.data_ptr<float>(), M, K, block, n_blocks, xq.data_ptr<int8_t>(), xc.data_ptr<float>(),
             xcs.data_ptr<float>());
  A.xq = xq.data_ptr<int8_t>();
  A.xc = xc.data_ptr<float>();
  A.xcs = xcs.data_ptr<float>();
  return dot_rows(A, M, isa);
}

// x given as dynamic per-token int8 codes [M, K] with fp32 scales [M] (x = scale * code, as
// quantkit.quant.activations.token_codes makes them): x @ dequant(W)^T in fp32 [M, N] for any M. The integer sums
// are exact, so the result is the int8 x int4/int8 product an engine with int8 activations computes (QSPEC's
// W4A8 draft); the codes take the place of hi with every lo 0 (c = scale / 256), which the VNNI and 4-bit AVX2
// kernels skip: one multiply-add per weight byte instead of two.
at::Tensor dot_linear_codes(const at::Tensor& codes, const at::Tensor& xscale, const at::Tensor& tiles,
                            const at::Tensor& scale, const at::Tensor& zscale, int64_t N, int64_t group, int64_t bits,
                            int64_t isa) {
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && codes.scalar_type() == at::kChar,
              "codes must be contiguous int8 [M, K]");
  const int64_t M = codes.size(0), K = codes.size(1);
  TORCH_CHECK(xscale.scalar_type() == at::kFloat && xscale.is_contiguous() && xscale.numel() == M,
              "xscale must be fp32 [M]");
  std::vector<int64_t> group_of_block;
  DotArgs A = dot_args(tiles, scale, zscale, N, K, group, bits, group_of_block);
  const int64_t block = A.block, n_blocks = A.n_blocks;
  at::Tensor xq = at::zeros({M, 2 * K}, codes.options());
  at::Tensor xc = at::empty({M, n_blocks}, xscale.options());
  at::Tensor xcs = at::empty({M, n_blocks}, xscale.options());
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = xscale.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* cpf = xc.data_ptr<float>();
  float* csf = xcs.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(qp + m * 2 * K, cp + m * K, K);
    for (int64_t b = 0; b < n_blocks; ++b) {
      int64_t sum = 0;
      for (int64_t k = b * block; k < std::min(K, (b + 1) * block); ++k) sum += cp[m * K + k];
      cpf[m * n_blocks + b] = sp[m] / 256.0f;
      csf[m * n_blocks + b] = sp[m] * float(sum);  // |sum| <= 128 * 128: exact in fp32
    }
  }
  A.xq = qp;
  A.xc = cpf;
  A.xcs = csf;
  A.lo = false;
  return dot_rows(A, M, isa);
}

// codes: uint8 [N, row_bytes]; scale: fp32 [ceil(N / row_block), n_groups]; zp: int8 of the same shape or empty
// (symmetric); checked against K columns.
Layout dq_layout(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zp, int64_t code, int64_t group,
                 int64_t row_block, int64_t K) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be uint8 [N, B]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2, "scale must be fp32 2-D");
  TORCH_CHECK(code >= U4 && code <= E4M3, "unknown weight code");
  TORCH_CHECK(group >= 1 && row_block >= 1, "group and row_block must be positive");
  const int64_t N = codes.size(0), need = code == U4 ? (K + 1) / 2 : K;
  TORCH_CHECK(codes.size(1) >= need, "codes hold ", codes.size(1), " bytes per row, K=", K, " needs ", need);
  const int64_t n_groups = (K + group - 1) / group;
  TORCH_CHECK(scale.size(1) == n_groups && scale.size(0) == (N + row_block - 1) / row_block, "scale shape mismatch");
  const bool has_zp = zp.numel() > 0;
  TORCH_CHECK(!has_zp || (zp.sizes() == scale.sizes() && zp.scalar_type() == at::kChar && zp.is_contiguous()),
              "zero points must be int8 shaped like the scales");
  return Layout{codes.data_ptr<uint8_t>(), codes.size(1), scale.data_ptr<float>(),
                has_zp ? zp.data_ptr<int8_t>() : nullptr, n_groups, group, row_block, K, code};
}

// The GEMV: x fp32 [M, K] with M <= gemv_max_rows (past it the caller dequantises with dq_weight for the BLAS);
// the weight as dq_layout takes it; returns fp32 [M, N].
at::Tensor dq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zp,
                     int64_t code, int64_t group, int64_t row_block, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(M <= gemv_max_rows, "dq_linear serves up to ", gemv_max_rows, " rows; dequantise with dq_weight past it");
  Layout L = dq_layout(codes, scale, zp, code, group, row_block, K);
  at::Tensor y = at::empty({M, N}, x.options());
  gemv(L, x.data_ptr<float>(), M, y.data_ptr<float>(), N);
  return y;
}

// ---------------------------------------------------------------------------------------------------------
// Prefill: the whole weight dequantised once into the compute dtype, for one GEMM of the BLAS (oneDNN, AMX /
// AVX512-BF16 for bf16), instead of fp32 products or many small tile GEMMs. Each value is formed exactly in fp32
// ((q - zp) * s and q * s - (8 + zp) * s are exact there: small integers times a bf16/fp16/fp32 scale) and
// rounded once to the output dtype, round to nearest even: the same bits as the reference's dequantisation in
// the scale's dtype, so the product equals the reference's F.linear.

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

#ifdef QK_AVX2
// Eight fp32 -> eight bf16 (round to nearest even, NaN kept quiet), as to_bf16.
inline __m128i to_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
  r = _mm256_srli_epi32(r, 16);
  const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane: 4 values, twice
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

// `count` fp32 values -> out (fp32, bf16 or fp16 storage) at element offset `at`.
void store_row(const float* v, int64_t count, at::Tensor& out, int64_t at) {
  int64_t i = 0;
  switch (out.scalar_type()) {
    case at::kFloat: std::memcpy(out.data_ptr<float>() + at, v, count * 4); break;
    case at::kBFloat16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + at;
#ifdef QK_AVX2
      for (; i + 8 <= count; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), to_bf16x8(_mm256_loadu_ps(v + i)));
#endif
      for (; i < count; ++i) o[i] = to_bf16(v[i]);
      break;
    }
    default: {
      at::Half* o = out.data_ptr<at::Half>() + at;
#ifdef QK_AVX2
      for (; i + 8 <= count; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
#endif
      for (; i < count; ++i) o[i] = at::Half(v[i]);
    }
  }
}

void check_dense_out(const at::Tensor& out, int64_t N, int64_t K) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == N && out.size(1) == K && out.is_contiguous(),
              "out must be contiguous [", N, ", ", K, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf,
              "out must be fp32, bf16 or fp16");
}

// dq_linear's weight (same arguments) dequantised into out [N, K].
void dq_weight(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zp, int64_t code, int64_t group,
               int64_t row_block, at::Tensor out) {
  const int64_t N = codes.size(0), K = out.size(1);
  check_dense_out(out, N, K);
  Layout L = dq_layout(codes, scale, zp, code, group, row_block, K);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row(L, n, row.data());
      store_row(row.data(), K, out, n * K);
    }
  });
}

bool cpu_has_bf16();
#ifdef QK_BF16
QK_BF16_TARGET void tile8_rows_bf16(const DotArgs& A, int64_t t, int64_t rows, uint16_t* out);
QK_BF16_TARGET void tile4_rows_bf16(const DotArgs& A, int64_t t, int64_t rows, uint16_t* out);
QK_BF16_TARGET void tile8_rows_i8(const DotArgs& A, int64_t t, int64_t rows, int8_t* out);
#endif

// dot_linear's weight (tiles, scale, zscale as there) dequantised into out [N, K].
void dot_weight(const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& zscale, int64_t group,
                int64_t bits, at::Tensor out) {
  const int64_t N = out.size(0), K = out.size(1), n_tiles = (N + TILE - 1) / TILE;
  check_dense_out(out, N, K);
  std::vector<int64_t> group_of_block;
  const DotArgs A = dot_args(tiles, scale, zscale, N, K, group, bits, group_of_block);
  const bool fast = out.scalar_type() == at::kBFloat16 && cpu_has_bf16();
  at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> rows(fast ? 0 : TILE * K);
    for (int64_t t = t0; t < t1; ++t) {
#ifdef QK_BF16
      if (fast) {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * TILE * K;
        if (bits == 8) tile8_rows_bf16(A, t, std::min<int64_t>(TILE, N - t * TILE), o);
        else tile4_rows_bf16(A, t, std::min<int64_t>(TILE, N - t * TILE), o);
        continue;
      }
#endif
      tile_rows(A, t, rows.data());
      const int64_t keep = std::min<int64_t>(TILE, N - t * TILE);  // padded rows of the last tile are dropped
      store_row(rows.data(), keep * K, out, t * TILE * K);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// FP8 (e4m3) GEMV on bf16 activations (M <= 16 rows), on a tiled copy of the weight bytes made once at load.
//
// Every e4m3 value is exactly a bf16 (3 mantissa bits, exponents 2^-9..2^8), and a bf16 x bf16 product is exact in
// fp32, so AVX512-BF16's vdpbf16ps (two products and the fp32 sum per lane, 32 multiply-adds per instruction)
// computes the reference's products; only the fp32 summation order differs. The bytes are widened to 16 bits and
// mapped to bf16 by a 128-entry table of magnitudes (two vpermi2w over 64 entries each, blended on bit 6), the
// sign OR-ed in. vdpbf16ps treats bf16 subnormal inputs as zero: no e4m3 value is one, and an activation below
// 2^-126 contributes nothing measurable.
//
// Tiles: 16 output rows, one sequential run of bytes; per 2-column step 32 bytes, byte 2j + t holding row j's
// column 2s + t, so a 32-bit lane is one row's column pair and x's matching pair is broadcast to every lane.
// Scales per tile and group (channel: one group of K; FP8 block: groups of the block width) as 16 fp32 values.

struct Fp8Args {
  const uint8_t* tiles;  // [tiles, K / 2, 32]
  const float* scale;    // [tiles, n_groups, 16]
  int64_t K, N, n_groups, group;
  const uint16_t* x;     // bf16 bits [M, K]
};

inline float bf16_value(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int64_t fp8_tile_bytes(const Fp8Args& A) { return A.K / 2 * 32; }

template <int MB>
void fp8_tile_scalar(const Fp8Args& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w = A.tiles + t * fp8_tile_bytes(A);
  const int64_t rows = std::min<int64_t>(TILE, A.N - t * TILE);
  for (int j = 0; j < rows; ++j)
    for (int m = 0; m < MB; ++m) {
      const uint16_t* xr = A.x + (m0 + m) * A.K;
      double total = 0.0;
      for (int64_t g = 0; g < A.n_groups; ++g) {
        double part = 0.0;
        for (int64_t k = g * A.group; k < std::min(A.K, (g + 1) * A.group); ++k)
          part += double(e4m3_table[w[(k / 2) * 32 + 2 * j + (k % 2)]]) * double(bf16_value(xr[k]));
        total += part * double(A.scale[(t * A.n_groups + g) * TILE + j]);
      }
      y[(m0 + m) * ldy + t * TILE + j] = float(total);
    }
}

#ifdef QK_BF16
// bf16 bits of the e4m3 magnitudes 0..127 as four 32-entry tables.
alignas(64) uint16_t e4m3_bf16[128];

// e4m3 codes (one per 16-bit lane) -> their bf16 bits, through the magnitude table held in t[0..3].
QK_BF16_TARGET inline __m512i e4m3_to_bf16(__m512i b, const __m512i* t) {
  const __m512i lo = _mm512_permutex2var_epi16(t[0], b, t[1]), hi = _mm512_permutex2var_epi16(t[2], b, t[3]);
  const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, _mm512_set1_epi16(0x40)), lo, hi);
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8);  // | sign
}

QK_BF16_TARGET inline void load_e4m3_table(__m512i* t) {
  for (int i = 0; i < 4; ++i) t[i] = _mm512_load_si512(e4m3_bf16 + 32 * i);
}

// S tiles (ts) against MB rows of x from m0, C column-pair steps in flight per (tile, row): one vdpbf16ps chain per
// step (its latency, not its throughput, bounds a one-row GEMV). S = 2 at batch 1: two sequential streams per
// thread, as dot8_tiles_vnni.
template <int S, int MB, int C>
QK_BF16_TARGET void fp8_tiles_bf16(const Fp8Args& A, const int64_t* ts, int64_t m0, float* y, int64_t ldy) {
  const uint8_t* w[S];
  for (int i = 0; i < S; ++i) w[i] = A.tiles + ts[i] * fp8_tile_bytes(A);
  __m512i tab[4];
  load_e4m3_table(tab);
  __m512 out[S][MB];
  for (int i = 0; i < S; ++i)
    for (int m = 0; m < MB; ++m) out[i][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < A.n_groups; ++g) {
    const int64_t k0 = g * A.group, k1 = std::min(A.K, k0 + A.group);
    __m512 s[S][MB][C];
    for (int i = 0; i < S; ++i)
      for (int m = 0; m < MB; ++m)
        for (int c = 0; c < C; ++c) s[i][m][c] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2 * C) {
      for (int c = 0; c < C; ++c) {
        for (int i = 0; i < S; ++i) {
          const uint8_t* step = w[i] + (k / 2 + c) * 32;
          _mm_prefetch(reinterpret_cast<const char*>(step + PREFETCH), _MM_HINT_T0);
          const __m512i v = e4m3_to_bf16(
              _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step))), tab);
          for (int m = 0; m < MB; ++m) {
            uint32_t pair;
            std::memcpy(&pair, A.x + (m0 + m) * A.K + k + 2 * c, 4);
            s[i][m][c] = _mm512_dpbf16_ps(s[i][m][c], (__m512bh)v, (__m512bh)_mm512_set1_epi32(int(pair)));
          }
        }
      }
    }
    for (int i = 0; i < S; ++i) {
      const __m512 sv = _mm512_loadu_ps(A.scale + (ts[i] * A.n_groups + g) * TILE);
      for (int m = 0; m < MB; ++m) {
        __m512 total = s[i][m][0];
        for (int c = 1; c < C; ++c) total = _mm512_add_ps(total, s[i][m][c]);
        out[i][m] = _mm512_fmadd_ps(total, sv, out[i][m]);
      }
    }
  }
  for (int i = 0; i < S; ++i) {
    const __mmask16 mask = __mmask16((1u << std::min<int64_t>(TILE, A.N - ts[i] * TILE)) - 1u);
    for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * ldy + ts[i] * TILE, mask, out[i][m]);
  }
}

template <int MB>
QK_BF16_TARGET void fp8_tile_bf16(const Fp8Args& A, int64_t t, int64_t m0, float* y, int64_t ldy) {
  fp8_tiles_bf16<1, MB, MB == 1 ? 4 : (MB == 2 ? 2 : 1)>(A, &t, m0, y, ldy);
}

// The prefill dequantisations read 1 KB of tile bytes per step, sequentially; without a software prefetch the next
// step's lines arrive from memory while the shuffles wait (measured on 5632 x 2048 int8 layers streaming from DRAM:
// 0.68 ms, 0.46 ms with this prefetch, against 0.40 ms for the same layer in cache). The GEMVs' distance (16 KB
// measured the same).
QK_BF16_TARGET inline void prefetch_ahead(const uint8_t* p) {
  for (int i = 0; i < 1024; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + i), _MM_HINT_T0);
}

// Prefill's dequantisation into bf16 rows, vectorised (the scalar tile_rows / fp8 loops cost 3x the bf16 GEMM they
// feed at 128 rows). Row j of a tile is gathered from its 16 steps (one 4-byte lane per step), formed exactly in
// fp32 as the scalar paths do and rounded to bf16 by vcvtne2ps2bf16 (round to nearest even, as to_bf16; it
// treats fp32 subnormals as zero, which (q - zp) * s of a real scale never is).
// r[s] (lane j: dword (s, j)) -> r[j] (lane s: dword (s, j)), a 16 x 16 transpose of 32-bit values in registers.
QK_BF16_TARGET inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
  }
  for (int q = 0; q < 4; ++q) {
    u[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
    u[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
    u[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
  }
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_i32x4(u[8 * h + i], u[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_i32x4(u[8 * h + i], u[8 * h + 4 + i], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

QK_BF16_TARGET void tile8_rows_bf16(const DotArgs& A, int64_t t, int64_t rows, uint16_t* out) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  for (int64_t b = 0; b < A.n_blocks; ++b) {
    const int64_t k0 = b * A.block, k1 = k0 + block_width(A, b), g = A.group_of_block[b];
    for (int64_t k = k0; k < k1; k += 64) {  // blocks are multiples of 64 columns: 16 steps of 4
      __m512i r[16];
      prefetch_ahead(w + (k / 4) * 64);
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + (k / 4 + i) * 64);
      transpose16(r);  // r[j]: row j's 64 columns from k
      for (int j = 0; j < rows; ++j) {
        const float s = A.scale[(t * A.n_groups + g) * TILE + j];
        const float off = A.zscale ? (s != 0.0f ? std::nearbyint(A.zscale[(t * A.n_groups + g) * TILE + j] / s) : 0.0f)
                                   : A.offset;
        const __m512 vs = _mm512_set1_ps(s), voff = _mm512_set1_ps(off);
        __m512 f[4];
        f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r[j], 0)));
        f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r[j], 1)));
        f[2] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r[j], 2)));
        f[3] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(r[j], 3)));
        for (int q = 0; q < 4; ++q) f[q] = _mm512_mul_ps(_mm512_sub_ps(f[q], voff), vs);
        uint16_t* o = out + j * A.K + k;
        _mm512_storeu_si512(o, (__m512i)_mm512_cvtne2ps_pbh(f[1], f[0]));
        _mm512_storeu_si512(o + 32, (__m512i)_mm512_cvtne2ps_pbh(f[3], f[2]));
      }
    }
  }
}

// The 8-bit tiles back to int8 rows [rows, K] (q = u - 128: the top bit flipped), for the int8 x int8 GEMM.
QK_BF16_TARGET void tile8_rows_i8(const DotArgs& A, int64_t t, int64_t rows, int8_t* out) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  const __m512i flip = _mm512_set1_epi8(int8_t(0x80));
  for (int64_t k = 0; k < A.K; k += 64) {  // K is a multiple of 64: 16 steps of 4 columns
    __m512i r[16];
    prefetch_ahead(w + (k / 4) * 64);
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + (k / 4 + i) * 64);
    transpose16(r);  // r[j]: row j's 64 columns from k
    for (int j = 0; j < rows; ++j) _mm512_storeu_si512(out + j * A.K + k, _mm512_xor_si512(r[j], flip));
  }
}

// A 4-bit row of a scale group takes 16 values, so its bf16 values form a 16-entry table (built once per group and
// row, each value formed and rounded as above) and vpermw looks 32 of them up at once; the table is repeated in both
// halves so the high nibble's lowest bit, which lands in the 5-bit index of the low nibble's lookup, changes nothing.
QK_BF16_TARGET inline __m512i nibble_table(const DotArgs& A, int64_t t, int64_t g, int j) {
  const float s = A.scale[(t * A.n_groups + g) * TILE + j];
  const float off = A.zscale ? (s != 0.0f ? std::nearbyint(A.zscale[(t * A.n_groups + g) * TILE + j] / s) : 0.0f)
                             : A.offset;
  const __m512 u = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(u, _mm512_set1_ps(off)), _mm512_set1_ps(s)));
  return _mm512_broadcast_i64x4(v);
}

QK_BF16_TARGET void tile4_rows_bf16(const DotArgs& A, int64_t t, int64_t rows, uint16_t* out) {
  const uint8_t* w = A.tiles + t * step_bytes(A);
  // Per 128-bit lane, 2 steps of 8 columns each: lookups of the low nibbles give a step's columns 0-3, of the high
  // ones 4-7; 64-bit unpacks pair them, and these lane orders put the steps back in column order.
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  __m512i table[TILE];
  int64_t table_group = -1;
  for (int64_t k = 0; k < A.K; k += 128) {  // 16 steps of 8 columns (K is a multiple of 64: a 64-wide last chunk)
    const int n_steps = int(std::min<int64_t>(16, (A.K - k) / 8));
    __m512i r[16];
    prefetch_ahead(w + (k / 8) * 64);
    for (int i = 0; i < 16; ++i) r[i] = i < n_steps ? _mm512_loadu_si512(w + (k / 8 + i) * 64) : _mm512_setzero_si512();
    transpose16(r);  // r[j] lane i: row j's step i, byte c holding columns 8i + c (low nibble) and 8i + 4 + c (high)
    for (int h = 0; h < n_steps / 8; ++h) {  // 64 columns, inside one group (groups are multiples of 64)
      const int64_t g = A.group_of_block[(k + 64 * h) / A.block];
      if (g != table_group) {
        for (int j = 0; j < rows; ++j) table[j] = nibble_table(A, t, g, j);
        table_group = g;
      }
      for (int j = 0; j < rows; ++j) {
        const __m512i b = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(r[j], 1) : _mm512_castsi512_si256(r[j]));
        const __m512i lo = _mm512_permutexvar_epi16(b, table[j]);
        const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table[j]);
        const __m512i a = _mm512_unpacklo_epi64(lo, hi), c = _mm512_unpackhi_epi64(lo, hi);
        uint16_t* o = out + j * A.K + k + 64 * h;
        _mm512_storeu_si512(o, _mm512_permutex2var_epi64(a, first, c));
        _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi64(a, second, c));
      }
    }
  }
}

// Per group, each row's 128 e4m3 magnitudes times its scale, rounded once to bf16 (the reference's value; the sign is
// OR-ed in afterwards, as rounding to nearest even is symmetric and scales are positive), looked up 32 at a time with
// the GEMV's two-table vpermi2w: a third of the instructions per value of widening, multiplying and rounding each.
QK_BF16_TARGET void fp8_rows_bf16(const Fp8Args& A, int64_t t, int64_t rows, uint16_t* out) {
  const uint8_t* w = A.tiles + t * fp8_tile_bytes(A);
  alignas(64) uint16_t scaled[TILE][128];
  const __m512i sign = _mm512_set1_epi16(int16_t(0x8000)), bit6 = _mm512_set1_epi16(0x40);
  for (int64_t g = 0; g < A.n_groups; ++g) {
    const int64_t k0 = g * A.group, k1 = std::min(A.K, k0 + A.group);
    for (int j = 0; j < rows; ++j) {
      const __m512 vs = _mm512_set1_ps(A.scale[(t * A.n_groups + g) * TILE + j]);
      for (int i = 0; i < 8; ++i)
        _mm256_store_si256(reinterpret_cast<__m256i*>(scaled[j] + 16 * i),
                           (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(e4m3_table + 16 * i), vs)));
    }
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {  // 64 columns: 32 column-pair steps
      __m512i r[16];
      prefetch_ahead(w + (k / 2) * 32);
      for (int i = 0; i < 16; ++i) {
        // Steps 2i and 2i + 1 interleaved per row: lane j = row j's columns 4i..4i+3 (the 8-bit tiles' layout).
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k / 2 + 2 * i) * 32));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (k / 2 + 2 * i + 1) * 32));
        const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        r[i] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
                                  _mm256_permute2x128_si256(lo, hi, 0x31), 1);
      }
      transpose16(r);  // r[j]: row j's 64 codes from k
      for (int j = 0; j < rows; ++j) {
        const __m512i* tab = reinterpret_cast<const __m512i*>(scaled[j]);
        const __m512i t0 = _mm512_load_si512(tab), t1 = _mm512_load_si512(tab + 1);
        const __m512i t2 = _mm512_load_si512(tab + 2), t3 = _mm512_load_si512(tab + 3);
        for (int h = 0; h < 2; ++h) {
          const __m512i b = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(r[j], 1) : _mm512_castsi512_si256(r[j]));
          const __m512i lo = _mm512_permutex2var_epi16(t0, b, t1), hi = _mm512_permutex2var_epi16(t2, b, t3);
          const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(b, bit6), lo, hi);
          _mm512_storeu_si512(out + j * A.K + k + 32 * h, _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8), sign, 0xF8));
        }
      }
    }
    for (int j = 0; j < rows; ++j) {
      const float s = A.scale[(t * A.n_groups + g) * TILE + j];
      for (int64_t kk = k; kk < k1; ++kk) out[j * A.K + kk] = to_bf16(e4m3_table[w[(kk / 2) * 32 + 2 * j + (kk % 2)]] * s);
    }
  }
}

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}
#else
bool cpu_has_bf16() { return false; }
#endif

void init_e4m3_bf16() {
#ifdef QK_BF16
  for (int i = 0; i < 128; ++i) e4m3_bf16[i] = to_bf16(e4m3_table[i]);
#endif
}

enum Fp8Isa : int64_t { FP8_SCALAR = 0, FP8_BF16 = 3 };

template <int MB>
void fp8_tiles(const Fp8Args& A, int64_t isa, int64_t m0, float* y, int64_t ldy) {
  const int64_t tiles = (A.N + TILE - 1) / TILE;
#ifdef QK_BF16
  if (MB == 1 && isa == FP8_BF16) {  // measured +10% over one stream (5632 x 2048, batch 1)
    at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
      const int64_t per = (t1 - t0) / 2;
      for (int64_t i = 0; i < per; ++i) {
        const int64_t ts[2] = {t0 + i, t0 + per + i};
        fp8_tiles_bf16<2, 1, 2>(A, ts, m0, y, ldy);
      }
      for (int64_t t = t0 + 2 * per; t < t1; ++t) fp8_tile_bf16<1>(A, t, m0, y, ldy);
    });
    return;
  }
#endif
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
#ifdef QK_BF16
      if (isa == FP8_BF16) { fp8_tile_bf16<MB>(A, t, m0, y, ldy); continue; }
#endif
      fp8_tile_scalar<MB>(A, t, m0, y, ldy);
    }
  });
}

// The FP8 kernel's weight, checked: tiles uint8 [ceil(N / 16), K / 2, 32]; scale fp32 [tiles, n_groups, 16];
// K and the group even multiples of 4 (whole steps per chain).
Fp8Args fp8_args(const at::Tensor& tiles, const at::Tensor& scale, int64_t N, int64_t K, int64_t group) {
  const int64_t n_tiles = (N + TILE - 1) / TILE;
  TORCH_CHECK(K > 0 && K % 8 == 0, "K must be a positive multiple of 8, got ", K);
  TORCH_CHECK(group > 0 && (group == K || group % 8 == 0), "group must be a multiple of 8 or K, got ", group);
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.numel() == n_tiles * (K / 2) * 32,
              "tiles must be uint8 [", n_tiles, ", ", K / 2, ", 32]");
  const int64_t n_groups = (K + group - 1) / group;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n_tiles * n_groups * TILE,
              "scale must be fp32 [tiles, groups, 16]");
  return Fp8Args{tiles.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, N, n_groups, group, nullptr};
}

// x bf16 [M, K] with M <= gemv_max_rows; isa 0 scalar, 3 AVX512-BF16 (downgraded where this CPU lacks it).
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, int64_t N, int64_t group,
                      int64_t isa, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "x must be contiguous bf16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= gemv_max_rows, "fp8_linear serves up to ", gemv_max_rows, " rows; dequantise with fp8_weight past it");
  Fp8Args A = fp8_args(tiles, scale, N, K, group);
  A.x = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (isa == FP8_BF16 && !cpu_has_bf16()) isa = FP8_SCALAR;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  for_row_blocks(M, [&](auto mb, int64_t m0) { fp8_tiles<decltype(mb)::value>(A, isa, m0, yp, N); });
  return y;
}

// fp8_linear's weight dequantised into out [N, K] (e4m3 value * scale, exact in fp32, rounded once).
void fp8_weight(const at::Tensor& tiles, const at::Tensor& scale, int64_t group, at::Tensor out) {
  const int64_t N = out.size(0), K = out.size(1), n_tiles = (N + TILE - 1) / TILE;
  check_dense_out(out, N, K);
  const Fp8Args A = fp8_args(tiles, scale, N, K, group);
  const bool fast = out.scalar_type() == at::kBFloat16 && cpu_has_bf16();
  at::parallel_for(0, n_tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> rows(fast ? 0 : TILE * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t keep = std::min<int64_t>(TILE, N - t * TILE);
#ifdef QK_BF16
      if (fast) {
        fp8_rows_bf16(A, t, keep, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * TILE * K);
        continue;
      }
#endif
      const uint8_t* w = A.tiles + t * fp8_tile_bytes(A);
      for (int j = 0; j < TILE; ++j)
        for (int64_t g = 0; g < A.n_groups; ++g) {
          const float s = A.scale[(t * A.n_groups + g) * TILE + j];
          for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k)
            rows[j * K + k] = e4m3_table[w[(k / 2) * 32 + 2 * j + (k % 2)]] * s;
        }
      store_row(rows.data(), keep * K, out, t * TILE * K);
    }
  });
}

// Prefill (more rows than a GEMV serves): y = x @ dequant(W)^T + bias, the weight dequantised `buf` rows at a time
// (whole 16-row tiles) into a buffer that stays in cache until the GEMM reads it (the whole dequantised layer would go
// to memory and back: a 5632 x 2048 layer into bf16 took 0.60-0.93 ms whole, 0.32-0.41 ms in 1024-row chunks). Each
// chunk is one ATen GEMM (oneDNN) writing its columns of y in place (a strided output the BLAS takes as it is: no
// copy); the sums may run in another order than one F.linear over the whole weight (fp32 accumulation either way).
template <typename Dequant>
at::Tensor chunked_linear(const at::Tensor& x, const at::Tensor& bias, at::Tensor buf, int64_t N, Dequant dequant) {
  TORCH_CHECK(x.dim() == 2 && buf.dim() == 2 && buf.size(1) == x.size(1) && buf.size(0) % TILE == 0 &&
                  buf.size(0) > 0 && buf.scalar_type() == x.scalar_type() && buf.is_contiguous(),
              "buf must be contiguous [16 c, K] in x's dtype");
  const int64_t M = x.size(0), n_tiles = (N + TILE - 1) / TILE, chunk = buf.size(0) / TILE;
  const bool has_bias = bias.defined() && bias.numel();
  at::Tensor y = at::empty({M, N}, x.options());
  for (int64_t t0 = 0; t0 < n_tiles; t0 += chunk) {
    const int64_t t1 = std::min(n_tiles, t0 + chunk), r0 = t0 * TILE, rows = std::min(N, t1 * TILE) - r0;
    at::Tensor w = buf.narrow(0, 0, rows), out = y.narrow(1, r0, rows);
    dequant(t0, t1, w);
    if (has_bias) at::addmm_out(out, bias.narrow(0, r0, rows), x, w.t());
    else at::mm_out(out, x, w.t());
  }
  return y;
}

at::Tensor dot_prefill(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, const at::Tensor& zscale,
                       int64_t N, int64_t group, int64_t bits, const at::Tensor& bias, at::Tensor buf) {
  return chunked_linear(x, bias, buf, N, [&](int64_t t0, int64_t t1, at::Tensor w) {
    dot_weight(tiles.narrow(0, t0, t1 - t0), scale.narrow(0, t0, t1 - t0),
               zscale.numel() ? zscale.narrow(0, t0, t1 - t0) : zscale, group, bits, w);
  });
}

at::Tensor fp8_prefill(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scale, int64_t N, int64_t group,
                       const at::Tensor& bias, at::Tensor buf) {
  return chunked_linear(x, bias, buf, N, [&](int64_t t0, int64_t t1, at::Tensor w) {
    fp8_weight(tiles.narrow(0, t0, t1 - t0), scale.narrow(0, t0, t1 - t0), group, w);
  });
}

// W8A8 prefill: acc = xq @ W^T in int32 (int8 codes both sides, torch._int_mm: oneDNN's VNNI GEMM, measured 0.66x
// the time of the bf16 GEMM on the 1B Llama's layers), the 8-bit tiles turned back into int8 rows `buf` rows at a
// time as chunked_linear does. The caller scales acc as torch-int-mm does. AVX512 CPUs only (the tiles' transpose).
at::Tensor int8_prefill(const at::Tensor& xq, const at::Tensor& tiles, const at::Tensor& scale, int64_t N,
                        at::Tensor buf) {
#ifdef QK_BF16
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar && xq.is_contiguous(), "xq: contiguous int8 [M, K]");
  TORCH_CHECK(buf.dim() == 2 && buf.size(1) == xq.size(1) && buf.size(0) % TILE == 0 && buf.size(0) > 0 &&
                  buf.scalar_type() == at::kChar && buf.is_contiguous(),
              "buf must be contiguous int8 [16 c, K]");
  TORCH_CHECK(cpu_has_bf16(), "int8_prefill needs AVX512");
  const int64_t M = xq.size(0), K = xq.size(1), n_tiles = (N + TILE - 1) / TILE, chunk = buf.size(0) / TILE;
  at::Tensor acc = at::empty({M, N}, xq.options().dtype(at::kInt));
  const at::Tensor symmetric = at::empty({0}, scale.options());
  for (int64_t t0 = 0; t0 < n_tiles; t0 += chunk) {
    const int64_t t1 = std::min(n_tiles, t0 + chunk), r0 = t0 * TILE, rows = std::min(N, t1 * TILE) - r0;
    std::vector<int64_t> group_of_block;
    const DotArgs A = dot_args(tiles.narrow(0, t0, t1 - t0), scale.narrow(0, t0, t1 - t0), symmetric, rows, K, K, 8,
                               group_of_block);
    int8_t* w = buf.data_ptr<int8_t>();
    at::parallel_for(0, t1 - t0, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) tile8_rows_i8(A, t, std::min<int64_t>(TILE, rows - t * TILE), w + t * TILE * K);
    });
    acc.narrow(1, r0, rows).copy_(at::_int_mm(xq, buf.narrow(0, 0, rows).t()));
  }
  return acc;
#else
  TORCH_CHECK(false, "int8_prefill needs a compiler with AVX512 intrinsics");
#endif
}

bool has_avx2() {
#ifdef QK_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  init_e4m3_table();
  init_e4m3_bf16();
  m.def("dq_linear", &dq_linear, "x @ dequant(W)^T in fp32 (W: uint4 / int8 / e4m3 bytes with group scales)");
  m.def("has_avx2", &has_avx2, "built with the AVX2 + FMA + F16C path");
  m.def("dot_linear", &dot_linear, "x @ dequant(W)^T for 4- or 8-bit W in 16-row tiles (integer dot GEMV)");
  m.def("dot_linear_codes", &dot_linear_codes, "(scale * codes) @ dequant(W)^T for int8 per-token x (W4A8 / W8A8 GEMV)");
  m.def("has_vnni", &cpu_has_vnni, "this CPU runs the AVX512-VNNI path");
  m.def("dq_weight", &dq_weight, "dequant(W) of dq_linear's weight into out [N, K] (fp32 / bf16 / fp16)");
  m.def("dot_weight", &dot_weight, "dequant(W) of dot_linear's tiles into out [N, K] (fp32 / bf16 / fp16)");
  m.def("tile_u4", &tile_u4, "compressed-tensors 4-bit rows -> the dot kernel's tiles");
  m.def("fp8_linear", &fp8_linear, "x @ dequant(W)^T for e4m3 W in 16-row tiles (bf16 x, AVX512-BF16 GEMV)");
  m.def("int8_prefill", &int8_prefill, "int32 xq @ W^T for 8-bit tiles and int8 activation codes (chunked _int_mm)");
  m.def("dot_prefill", &dot_prefill, "x @ dequant(W)^T + bias for dot_linear's tiles past the GEMV rows (chunked)");
  m.def("fp8_prefill", &fp8_prefill, "x @ dequant(W)^T + bias for fp8_linear's tiles past the GEMV rows (chunked)");
  m.def("fp8_weight", &fp8_weight, "dequant(W) of fp8_linear's tiles into out [N, K] (fp32 / bf16 / fp16)");
  m.def("has_bf16", &cpu_has_bf16, "this CPU runs the AVX512-BF16 path");
}
