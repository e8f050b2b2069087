// Quantised-weight linear for CPU: y[M, N] = x[M, K] @ dequant(W)[N, K]^T, computed in fp32.
//
// W is stored as one byte stream per output row in one of three codes: two unsigned 4-bit values per byte
// (low nibble first, value - 8: compressed-tensors' pack-quantized bit stream read as bytes), signed int8,
// or float8 e4m3fn bytes. Each row r and column group g has an fp32 scale s and an optional int8 zero point
// zp, so w = (q - zp) * s; `row_block` rows share one scale row (128 for FP8 block scales, N for one
// tensor-wide scale, 1 otherwise). The weight is never expanded as a whole: small batches decode
// eight weights at a time straight into FMAs against every row of x (memory-bound decode, so reading 4 or 8
// bits per weight instead of 16 or 32 is what makes it fast); larger batches decode a tile of rows that fits
// in cache and hand it to the BLAS.
//
// Built with AVX2 + FMA + F16C as the baseline (every x86 server since 2013); a scalar path covers ragged
// tails and the build without AVX2.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QK_AVX2 1
#endif

namespace {

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

template <int MB>
void gemv_block(const Layout& L, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t N) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    constexpr int U = MB >= 4 ? 1 : (MB >= 2 ? 2 : 4);
    for (int64_t n = n0; n < n1; ++n) row_dot<MB, U>(L, n, x, ldx, y, ldy);
  });
}

void gemv(const Layout& L, const float* x, int64_t M, float* y, int64_t N) {
  const int64_t K = L.K;
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    const float* xb = x + m0 * K;
    float* yb = y + m0 * N;
    switch (std::min<int64_t>(8, M - m0)) {
      case 1: gemv_block<1>(L, xb, K, yb, N, N); break;
      case 2: gemv_block<2>(L, xb, K, yb, N, N); break;
      case 3: gemv_block<3>(L, xb, K, yb, N, N); break;
      case 4: gemv_block<4>(L, xb, K, yb, N, N); break;
      case 5: gemv_block<5>(L, xb, K, yb, N, N); break;
      case 6: gemv_block<6>(L, xb, K, yb, N, N); break;
      case 7: gemv_block<7>(L, xb, K, yb, N, N); break;
      default: gemv_block<8>(L, xb, K, yb, N, N); break;
    }
  }
}

// One dequantised row into out[K] (fp32).
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
    const float z = L.zp ? -float(L.zp[srow + g]) * s : 0.0f;
    int64_t k = k0;
#ifdef QK_AVX2
    if (vec) {
      const __m256 vs = _mm256_set1_ps(s * unit), vz = _mm256_set1_ps(L.code == U4 ? z - 8.0f * s : z);
      for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(out + k, _mm256_fmadd_ps(decode8(L, row, k), vs, vz));
    }
#endif
    for (; k < k1; ++k) out[k] = decode1(L, row, k) * s + z;
  }
}

// Batches past the GEMV range: dequantise ~1 MB of rows at a time and let the BLAS multiply it.
at::Tensor tiled(const Layout& L, const at::Tensor& x, int64_t N) {
  const int64_t K = L.K, M = x.size(0);
  const int64_t rows = std::max<int64_t>(16, std::min<int64_t>(N, (int64_t(1) << 18) / std::max<int64_t>(K, 1)));
  at::Tensor buf = at::empty({rows, K}, x.options());
  at::Tensor yt = at::empty({N, M}, x.options());
  at::Tensor xt = x.t();
  float* b = buf.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nb = std::min(rows, N - n0);
    at::parallel_for(0, nb, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) dequant_row(L, n0 + r, b + r * K);
    });
    at::Tensor out = yt.narrow(0, n0, nb);
    at::mm_out(out, buf.narrow(0, 0, nb), xt);
  }
  return yt.t().contiguous();
}

}  // namespace

// x: fp32 [M, K]; codes: uint8 [N, row_bytes]; scale: fp32 [ceil(N / row_block), n_groups]; zp: int8 of
// the same shape or empty (symmetric); returns fp32 [M, N].
at::Tensor dq_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zp,
                     int64_t code, int64_t group, int64_t row_block, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous fp32 [M, K]");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be uint8 [N, B]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2, "scale must be fp32 2-D");
  TORCH_CHECK(code >= U4 && code <= E4M3, "unknown weight code");
  TORCH_CHECK(group >= 1 && row_block >= 1, "group and row_block must be positive");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const int64_t need = code == U4 ? (K + 1) / 2 : K;
  TORCH_CHECK(codes.size(1) >= need, "codes hold ", codes.size(1), " bytes per row, K=", K, " needs ", need);
  const int64_t n_groups = (K + group - 1) / group;
  TORCH_CHECK(scale.size(1) == n_groups && scale.size(0) == (N + row_block - 1) / row_block, "scale shape mismatch");
  const bool has_zp = zp.numel() > 0;
  if (has_zp) {
    TORCH_CHECK(zp.sizes() == scale.sizes() && zp.scalar_type() == at::kChar && zp.is_contiguous(),
                "zero points must be int8 shaped like the scales");
  }
  Layout L{codes.data_ptr<uint8_t>(), codes.size(1), scale.data_ptr<float>(),
           has_zp ? zp.data_ptr<int8_t>() : nullptr, n_groups, group, row_block, K, code};
  if (M > gemv_max_rows) return tiled(L, x, N);
  at::Tensor y = at::empty({M, N}, x.options());
  gemv(L, x.data_ptr<float>(), M, y.data_ptr<float>(), N);
  return y;
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
  m.def("dq_linear", &dq_linear, "x @ dequant(W)^T in fp32 (W: uint4 / int8 / e4m3 bytes with group scales)");
  m.def("has_avx2", &has_avx2, "built with the AVX2 + FMA + F16C path");
}
