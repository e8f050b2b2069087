// Per-element numerics shared by every quantkit CUDA kernel and by the CPU test harness.
//
// Everything here is a plain function of scalars, marked QK_HD: __host__ __device__ under nvcc / NVRTC, a
// plain inline function under g++ (tests/runtime/cuda/test_numerics_host.py compiles this header with the
// host compiler and compares it, exhaustively where the domain is small, with quantkit's torch reference).
// The rules are those of compressed-tensors as quantkit/runtime/reference.py implements them:
//   * int weights: q + 2^(bits-1) stored as an LSB-first bit stream per row of int32 words; zero points
//     packed the same way along the OUTPUT dimension ([ceil(out*bits/32), n_groups] words).
//   * dequant: (q - zp) * scale.
//   * fp8 e4m3fn: 1-4-3, bias 7, no infinities, 0x7f/0xff NaN, max 448; encode = clamp to +-448 then round
//     to nearest even (what torch.clamp(...).to(torch.float8_e4m3fn) does).
//   * dynamic activation quant (reference.quantize_activation): computed in the activation dtype T, i.e.
//     every torch op is done in fp32 and rounded to T: scale = T(absmax / half_range) (int8 127.5, fp8 448),
//     a zero scale becomes eps(T); q = round-half-even(clamp(T(x / scale))) for int8 and
//     e4m3(clamp(T(x / scale))) for fp8.
#pragma once

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
#include <cuda/std/cstdint>
#define QK_HD __host__ __device__ __forceinline__
namespace qk { using cuda::std::int8_t; using cuda::std::uint8_t; using cuda::std::int32_t;
               using cuda::std::uint32_t; using cuda::std::uint16_t; }
#else
#include <stdint.h>
#include <string.h>
#include <math.h>
#define QK_HD inline
namespace qk { using ::int8_t; using ::uint8_t; using ::int32_t; using ::uint32_t; using ::uint16_t; }
#endif

namespace qk {

// ---- bit casts (memcpy on the host, intrinsics on the device: both are exact reinterpretations) ----
QK_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; memcpy(&u, &f, 4); return u;
#endif
}
QK_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; memcpy(&f, &u, 4); return f;
#endif
}
QK_HD bool is_nan(float f) { return (f32_bits(f) & 0x7fffffffu) > 0x7f800000u; }

// ---- activation dtypes, emulated bit-exactly so host and device agree with torch's rounding ----
enum Dtype { F32 = 0, BF16 = 1, F16 = 2 };

// fp32 -> bf16 -> fp32, round to nearest even (NaN kept quiet).
QK_HD float round_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bits_f32(u | 0x00400000u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return bits_f32(u & 0xffff0000u);
}

// fp32 -> IEEE half bits, round to nearest even, overflow to inf, subnormals kept.
QK_HD uint16_t f32_to_f16_bits(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);           // NaN
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          // >= 65520 rounds to inf
  if (a < 0x38800000u) {                                            // below 2^-14: half subnormal / zero
    // Value in units of 2^-24 (the half subnormal step), rounded to nearest even.
    uint32_t exp = a >> 23, mant = (a & 0x7fffffu) | 0x800000u;
    if (exp < 102) return (uint16_t)sign;                           // < 2^-25: rounds to zero
    uint32_t shift = 126 - exp;                                     // mant * 2^(exp-150) / 2^-24
    uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = a + 0x0fffu + ((a >> 13) & 1u);                      // RNE on the 13 dropped bits
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
QK_HD float f16_bits_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return bits_f32(sign | 0x7f800000u | (m << 13));
  if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}
QK_HD float round_f16(float f) { return f16_bits_to_f32(f32_to_f16_bits(f)); }

QK_HD float round_to(float f, int dtype) {
  return dtype == BF16 ? round_bf16(f) : dtype == F16 ? round_f16(f) : f;
}
// torch.finfo(dtype).eps: the scale used for an all-zero row / group.
QK_HD float dtype_eps(int dtype) {
  return dtype == BF16 ? 0.0078125f : dtype == F16 ? 0.0009765625f : 1.1920928955078125e-07f;
}

// ---- packed integer weights ----
// Signed value `idx` of a row stored as a bit stream in int32 words (words[0] holds elements 0.. LSB
// first). Values may straddle two words when 32 % bits != 0, so both are read in that case.
QK_HD int unpack_bits(const int32_t* words, int idx, int bits) {
  uint32_t pos = (uint32_t)idx * (uint32_t)bits, w = pos >> 5, shift = pos & 31u;
  uint32_t v = (uint32_t)words[w] >> shift;
  if (shift + (uint32_t)bits > 32u) v |= (uint32_t)words[w + 1] << (32u - shift);
  return (int)(v & ((1u << bits) - 1u)) - (1 << (bits - 1));
}
// The same along a column of a row-major [n_words, stride] word matrix (zero points: packed along the
// output dimension, one column per group).
QK_HD int unpack_bits_strided(const int32_t* words, int idx, int bits, int stride, int col) {
  uint32_t pos = (uint32_t)idx * (uint32_t)bits, w = pos >> 5, shift = pos & 31u;
  uint32_t v = (uint32_t)words[(size_t)w * stride + col] >> shift;
  if (shift + (uint32_t)bits > 32u) v |= (uint32_t)words[(size_t)(w + 1) * stride + col] << (32u - shift);
  return (int)(v & ((1u << bits) - 1u)) - (1 << (bits - 1));
}
// All 32/bits values of one word at once (bits in {2, 4, 8}: no straddling). v-th value = field v.
QK_HD int word_field(uint32_t word, int v, int bits) {
  return (int)((word >> (v * bits)) & ((1u << bits) - 1u)) - (1 << (bits - 1));
}

// (q - zp) * scale in fp32. (q - zp) is a small integer and the product of it with a bf16/fp16 scale is
// exact in fp32, so rounding this to the scale's dtype gives exactly torch's dequantize() in that dtype.
QK_HD float dequant(int q, int zp, float scale) { return (float)(q - zp) * scale; }

// ---- fp8 e4m3fn ----
QK_HD float e4m3_decode(uint8_t c) {
  uint32_t sign = (uint32_t)(c & 0x80u) << 24, e = (c >> 3) & 0xfu, m = c & 7u;
  if (e == 15 && m == 7) return bits_f32(sign | 0x7fc00000u);
  if (e == 0) return bits_f32(sign | f32_bits((float)m * 0.001953125f));  // m * 2^-9, exact
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// Saturating encode: |x| > 448 -> 448 (the reference clamps before its cast), NaN -> 0x7f | sign.
QK_HD uint8_t e4m3_encode(float x) {
  uint32_t u = f32_bits(x);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7f);
  if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7e);              // >= 448 (incl. inf): saturate
  if (a < 0x3c800000u) {                                            // below 2^-6: subnormal grid 2^-9
    // a * 2^9 rounded to nearest even integer in 0..8 (8 = the smallest normal, code 0x08).
    float scaled = bits_f32(a) * 512.0f;                            // exact (power of two)
    uint32_t q = (uint32_t)scaled;
    float rem = scaled - (float)q;
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
    return (uint8_t)(sign | q);
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);                     // RNE on the 20 dropped bits
  uint32_t code = (r >> 20) - (120u << 3);                          // rebias 127 -> 7
  if (code > 0x7eu) code = 0x7eu;                                   // 448 < x < 480 rounding up
  return (uint8_t)(sign | code);
}

// ---- block / group indexing ----
// Index of the [bh, bw] block scale of weight element (row, col) in a row-major
// [ceil(rows/bh), ceil(cols/bw)] scale matrix; edge blocks are ragged (cover fewer elements).
QK_HD int block_scale_index(int row, int col, int cols, int bh, int bw) {
  return (row / bh) * ((cols + bw - 1) / bw) + col / bw;
}
QK_HD int num_groups(int k, int group) { return (k + group - 1) / group; }
// Columns covered by group g of a K-long row: the last one is ragged when K % group != 0.
QK_HD int group_len(int g, int k, int group) {
  int start = g * group; return (k - start < group) ? (k - start) : group;
}

// ---- dynamic activation quantisation (one token or one group) ----
// scale from the absmax of the (dtype-valued) inputs, as reference._dynamic_scale in dtype.
QK_HD float act_scale(float absmax, float half_range, int dtype) {
  float s = round_to(absmax / half_range, dtype);
  return s == 0.0f ? dtype_eps(dtype) : s;
}
// x / scale, as torch computes it in the activation dtype (fp32 division, then rounded to the dtype).
QK_HD float act_scaled(float x, float scale, int dtype) { return round_to(x / scale, dtype); }

QK_HD int8_t quant_int8(float x, float scale, int dtype) {
  float v = act_scaled(x, scale, dtype);
  v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
#if defined(__CUDA_ARCH__)
  return (int8_t)__float2int_rn(v);
#else
  return (int8_t)nearbyintf(v);                                      // default FE_TONEAREST: half to even
#endif
}
QK_HD uint8_t quant_e4m3(float x, float scale, int dtype) {
  // Clamping in the dtype first changes nothing (448 is representable in bf16/fp16); encode saturates.
  return e4m3_encode(act_scaled(x, scale, dtype));
}

}  // namespace qk
