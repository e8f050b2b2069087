// Dynamic per-token activation fake-quantisation (W8A8 int8, FP8 e4m3), fused: quantkit/quant/activations.py's
// quantize_activation in one pass per row instead of eight ATen ops (measured 16-40 us per decode row and 0.3-1.5 ms
// per 128 x 5632 prefill block in eager torch, FP8's scalar float8 cast the largest part).
//
// Every value is the one the eager ops produce, op by op: x's dtype is bf16 or fp32, each ATen op computes in fp32
// and rounds its result to x's dtype (round to nearest even), so here each step is the fp32 operation followed by
// that rounding: scale = rnd(absmax / half_range) (eps where zero), v = rnd(x / scale), clamp, q = round-half-even
// to an integer or to the e4m3 grid (both exact in x's dtype), out = rnd(q * scale). Built without FMA contraction
// (EXACT_FP_CFLAGS) so no product is fused into a sum torch rounds separately, and with OpenMP, so rows split over
// torch's threads as the eager ops' elements do. bf16 rows run 16 lanes at a time on AVX-512 CPUs (chosen at run
// time), with the division replaced by an exact reciprocal product (below); fp32 rows and row tails run the scalar
// loop.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// fp32 -> bf16 -> fp32, round to nearest even (finite values; as torch's .to(torch.bfloat16)).
inline float round_bf16(float f) {
  uint32_t u = bits_of(f);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return float_of(u & 0xFFFF0000u);
}

template <bool BF16>
inline float rnd(float f) {
  return BF16 ? round_bf16(f) : f;
}

// Round to the nearest e4m3fn value, ties to even, for |v| <= 448 (the caller clamps): e4m3 has 3 mantissa bits and
// its subnormals share the exponent -6, so the grid spacing is 2^(max(e, -6) - 3) for v in [2^e, 2^(e+1)); scaling by
// a power of two is exact, so one nearbyint rounds exactly as torch's float -> float8_e4m3fn cast does.
inline float round_e4m3(float v) {
  int e = int((bits_of(v) >> 23) & 0xFFu) - 127;
  e = e < -6 ? -6 : e;
  const float up = float_of(uint32_t(127 + 3 - e) << 23), down = float_of(uint32_t(127 - 3 + e) << 23);
  return std::nearbyint(v * up) * down;
}

template <typename T, bool BF16>
inline float load(const T* p, int64_t k) {
  if constexpr (BF16) {
    uint16_t h;
    std::memcpy(&h, reinterpret_cast<const uint16_t*>(p) + k, 2);
    return float_of(uint32_t(h) << 16);
  } else {
    return p[k];
  }
}

template <typename T, bool BF16>
inline void store(T* p, int64_t k, float f) {  // f is already on T's grid
  if constexpr (BF16) {
    const uint16_t h = uint16_t(bits_of(f) >> 16);
    std::memcpy(reinterpret_cast<uint16_t*>(p) + k, &h, 2);
  } else {
    p[k] = f;
  }
}

// A row's scale: rnd(absmax / half_range), eps where that is zero (scale_from_absmax).
template <typename T, bool BF16>
inline float row_scale(const T* xr, int64_t K, float half_range, float eps) {
  float absmax = 0.0f;
#pragma omp simd reduction(max : absmax)
  for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(load<T, BF16>(xr, k)));
  const float scale = rnd<BF16>(absmax / half_range);
  return scale == 0.0f ? eps : scale;
}

// x / scale in x's dtype, clamped to [qmin, qmax]: the value the integer or e4m3 rounding takes.
template <typename T, bool BF16>
inline float scaled(const T* xr, int64_t k, float scale, float qmin, float qmax) {
  return std::min(std::max(rnd<BF16>(load<T, BF16>(xr, k) / scale), qmin), qmax);
}

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define AQ_AVX512 __attribute__((target("avx2,fma,avx512f")))
#define AQ_HAVE_AVX512 1

bool cpu_has_avx512f() { return __builtin_cpu_supports("avx512f"); }

// A bf16 row's quotients by a reciprocal product instead of a division (vdivps was the largest cost of the loop),
// exact after the rounding to bf16. x and scale are bf16 values a * 2^i and b * 2^j with integers a, b < 256; scaled
// into [1, 2), their quotient is a * 2^t / b (t = 0 or 1) and a bf16 rounding midpoint there is m / 256 with m odd and
// above 256. They never meet (a * 256 * 2^t = m * b fails on odd parts: m > a), and otherwise differ by at least
// 1 / (256 * b) > 2^-16, far more than the 2^-22 by which x * rnd(1 / scale) can miss rnd(x / scale). Quotients that
// leave fp32's normal range (|x| < 2^-126 with scale >= 2^-100) round to zero on both grids either way.
AQ_AVX512 inline __m512i round_bf16_bits(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return _mm512_and_si512(u, _mm512_set1_epi32(int(0xFFFF0000u)));
}

AQ_AVX512 inline __m512 load_bf16x16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// clamp(rnd_bf16(x / scale), lo, hi) for 16 lanes, r = 1 / scale (scaled() above, same NaN order).
AQ_AVX512 inline __m512 scaled16(__m512 x, __m512 r, __m512 lo, __m512 hi) {
  const __m512 v = _mm512_castsi512_ps(round_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(x, r))));
  return _mm512_min_ps(hi, _mm512_max_ps(lo, v));
}

// round_e4m3 for 16 lanes.
AQ_AVX512 inline __m512 round_e4m3_16(__m512 v) {
  __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), 23), _mm512_set1_epi32(0xFF)),
                               _mm512_set1_epi32(127));
  e = _mm512_max_epi32(e, _mm512_set1_epi32(-6));
  const __m512 up = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(130), e), 23));
  const __m512 down = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(124), e), 23));
  const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_mul_ps(t, down);
}

AQ_AVX512 inline void store_bf16x16(uint16_t* p, __m512 f) {  // f already on the bf16 grid
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f), 16)));
}

// Whether a row's scale takes the reciprocal path: 1 / scale finite and normal, products far from overflow.
inline bool reciprocal_ok(float scale) { return scale >= 0x1p-100f && scale <= 0x1p100f; }

// One bf16 row's fake quantisation (codes == nullptr) or int8 codes, 16 lanes at a time; returns the first column
// left to the scalar loop.
AQ_AVX512 int64_t row16(const uint16_t* xr, uint16_t* orow, int8_t* codes, int64_t K, float scale, bool fp8,
                        float qmin, float qmax) {
  const __m512 s = _mm512_set1_ps(scale), r = _mm512_set1_ps(1.0f / scale);
  const __m512 lo = _mm512_set1_ps(qmin), hi = _mm512_set1_ps(qmax);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = scaled16(load_bf16x16(xr + k), r, lo, hi);
    if (codes != nullptr) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm512_cvtepi32_epi8(q));
      continue;
    }
    const __m512 t = fp8 ? round_e4m3_16(v) : _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store_bf16x16(orow + k, _mm512_castsi512_ps(round_bf16_bits(_mm512_castps_si512(_mm512_mul_ps(t, s)))));
  }
  return k;
}
#else
#define AQ_HAVE_AVX512 0
#endif

// Columns [0, k0) of a bf16 row done by the AVX-512 path where this CPU has it; 0 where the scalar loop runs them all.
template <typename T, bool BF16>
inline int64_t fast_columns(const T* xr, T* orow, int8_t* codes, int64_t K, float scale, bool fp8, float qmin,
                            float qmax, bool avx512) {
#if AQ_HAVE_AVX512
  if constexpr (BF16) {
    if (avx512 && reciprocal_ok(scale))
      return row16(reinterpret_cast<const uint16_t*>(xr), reinterpret_cast<uint16_t*>(orow), codes, K, scale, fp8,
                   qmin, qmax);
  }
#endif
  return 0;
}

template <typename T, bool BF16>
void fake_quant_rows(const T* x, T* out, int64_t r0, int64_t r1, int64_t K, bool fp8, float qmin, float qmax,
                     float half_range, float eps, bool avx512) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * K;
    T* orow = out + r * K;
    const float scale = row_scale<T, BF16>(xr, K, half_range, eps);
    const int64_t k0 = fast_columns<T, BF16>(xr, orow, nullptr, K, scale, fp8, qmin, qmax, avx512);
    if (fp8) {
#pragma omp simd
      for (int64_t k = k0; k < K; ++k)
        store<T, BF16>(orow, k, rnd<BF16>(round_e4m3(scaled<T, BF16>(xr, k, scale, qmin, qmax)) * scale));
    } else {
#pragma omp simd
      for (int64_t k = k0; k < K; ++k)
        store<T, BF16>(orow, k, rnd<BF16>(std::nearbyint(scaled<T, BF16>(xr, k, scale, qmin, qmax)) * scale));
    }
  }
}

// The int8 codes and scales of the same quantisation (for an int8 x int8 GEMM): codes[r, k] = the q above, scale[r]
// the row's scale in x's dtype's values.
template <typename T, bool BF16>
void codes_rows(const T* x, int8_t* codes, float* scales, int64_t r0, int64_t r1, int64_t K, float qmin, float qmax,
                float half_range, float eps, bool avx512) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * K;
    int8_t* c = codes + r * K;
    const float scale = scales[r] = row_scale<T, BF16>(xr, K, half_range, eps);
    const int64_t k0 = fast_columns<T, BF16>(xr, static_cast<T*>(nullptr), c, K, scale, false, qmin, qmax, avx512);
#pragma omp simd
    for (int64_t k = k0; k < K; ++k) c[k] = int8_t(std::nearbyint(scaled<T, BF16>(xr, k, scale, qmin, qmax)));
  }
}

inline bool has_avx512() {
#if AQ_HAVE_AVX512
  static const bool yes = cpu_has_avx512f();
  return yes;
#else
  return false;
#endif
}

}  // namespace

// x [M, K] contiguous bf16 or fp32 -> (int8 codes [M, K], fp32 scales [M]) of the dynamic per-token int8 quantisation
// (qmin / qmax within -128..127).
std::vector<torch::Tensor> token_codes(const torch::Tensor& x, double qmin, double qmax, double half_range, double eps,
                                       bool vectorised) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32, "x: bf16 or fp32");
  TORCH_CHECK(qmin >= -128 && qmax <= 127, "codes must fit int8");
  const int64_t M = x.size(0), K = x.size(1);
  auto codes = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto scales = torch::empty({M}, x.options().dtype(torch::kFloat32));
  const float lo = float(qmin), hi = float(qmax), hr = float(half_range), e = float(eps);
  const bool avx512 = vectorised && has_avx512();
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == torch::kBFloat16) {
      codes_rows<at::BFloat16, true>(x.data_ptr<at::BFloat16>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                                     r0, r1, K, lo, hi, hr, e, avx512);
    } else {
      codes_rows<float, false>(x.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(), r0, r1, K,
                               lo, hi, hr, e, avx512);
    }
  });
  return {codes, scales};
}

// x [M, K] contiguous bf16 or fp32 -> its fake-quantised copy (same dtype). fp8: e4m3 grid (qmin/qmax +-448),
// else integers in [qmin, qmax]; half_range and eps as quantize_activation's scale_from_absmax uses them.
torch::Tensor fake_quant_token(const torch::Tensor& x, bool fp8, double qmin, double qmax, double half_range,
                               double eps, bool vectorised) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32, "x: bf16 or fp32");
  const int64_t M = x.size(0), K = x.size(1);
  auto out = torch::empty_like(x);
  const float lo = float(qmin), hi = float(qmax), hr = float(half_range), e = float(eps);
  const bool avx512 = vectorised && has_avx512();
  // Rows over torch's threads, at least 64K elements each (one decode row runs inline, without waking a team).
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    if (x.scalar_type() == torch::kBFloat16) {
      fake_quant_rows<at::BFloat16, true>(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), r0, r1, K, fp8,
                                          lo, hi, hr, e, avx512);
    } else {
      fake_quant_rows<float, false>(x.data_ptr<float>(), out.data_ptr<float>(), r0, r1, K, fp8, lo, hi, hr, e, avx512);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fake_quant_token", &fake_quant_token,
        "dynamic per-token int8 / fp8 e4m3 fake quantisation (quantkit.quant.activations.quantize_activation)",
        py::arg("x"), py::arg("fp8"), py::arg("qmin"), py::arg("qmax"), py::arg("half_range"), py::arg("eps"),
        py::arg("vectorised") = true);
  m.def("token_codes", &token_codes, "dynamic per-token int8 codes and scales (quantkit.quant.activations.token_codes)",
        py::arg("x"), py::arg("qmin"), py::arg("qmax"), py::arg("half_range"), py::arg("eps"),
        py::arg("vectorised") = true);
}
