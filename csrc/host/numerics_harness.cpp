// Host-compiled entry points over csrc/include/qk_numerics.cuh for tests/runtime/cuda/test_numerics_host.py.
// Each function loops one header function over arrays so that Python (ctypes, torch tensors' pointers)
// can compare the header with quantkit's torch reference. No numerics of its own live here: the point is
// to exercise exactly the code the kernels run.
#include "../include/qk_numerics.cuh"

using namespace qk;

extern "C" {

void h_e4m3_decode(const uint8_t* c, float* out, int n) { for (int i = 0; i < n; i++) out[i] = e4m3_decode(c[i]); }
void h_e4m3_encode(const float* x, uint8_t* out, int n) { for (int i = 0; i < n; i++) out[i] = e4m3_encode(x[i]); }
void h_round(const float* x, float* out, int n, int dtype) { for (int i = 0; i < n; i++) out[i] = round_to(x[i], dtype); }

// [rows, n_words] packed rows -> [rows, n] signed values, element by element (unpack_bits) and, when
// 32 % bits == 0, word by word (word_field) into out2.
void h_unpack_rows(const int32_t* w, int rows, int n_words, int n, int bits, int8_t* out, int8_t* out2) {
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < n; i++) {
      out[(size_t)r * n + i] = (int8_t)unpack_bits(w + (size_t)r * n_words, i, bits);
      if (32 % bits == 0) {
        int per = 32 / bits;
        out2[(size_t)r * n + i] = (int8_t)word_field((uint32_t)w[(size_t)r * n_words + i / per], i % per, bits);
      }
    }
}
// Zero points: [n_words, cols] packed along dim 0 -> [n, cols].
void h_unpack_cols(const int32_t* w, int cols, int n, int bits, int8_t* out) {
  for (int i = 0; i < n; i++)
    for (int c = 0; c < cols; c++) out[(size_t)i * cols + c] = (int8_t)unpack_bits_strided(w, i, bits, cols, c);
}
// Elementwise (q - zp) * scale rounded to dtype.
void h_dequant(const int8_t* q, const int8_t* zp, const float* scale, float* out, int n, int dtype) {
  for (int i = 0; i < n; i++) out[i] = round_to(dequant(q[i], zp ? zp[i] : 0, scale[i]), dtype);
}
// Block-scale expansion of a [rows, cols] weight: index of every element's scale.
void h_block_index(int rows, int cols, int bh, int bw, int32_t* out) {
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) out[(size_t)r * cols + c] = block_scale_index(r, c, cols, bh, bw);
}
// Dynamic activation fake-quant of an [m, k] matrix whose values are already dtype values:
// group == 0 is per token. kind 0 = int8, 1 = fp8 e4m3. out = round_to(q * scale, dtype) (the
// reference's output), q_out the codes (int8 value or e4m3 byte), scales [m, n_groups].
void h_act_quant(const float* x, int m, int k, int group, int kind, int dtype, float* out, int32_t* q_out,
                 float* scales) {
  int g_size = group ? group : k, ng = num_groups(k, g_size);
  float half_range = kind ? 448.0f : 127.5f;
  for (int r = 0; r < m; r++)
    for (int g = 0; g < ng; g++) {
      const float* row = x + (size_t)r * k + (size_t)g * g_size;
      int len = group_len(g, k, g_size);
      float amax = 0.0f;
      for (int i = 0; i < len; i++) amax = fabsf(row[i]) > amax ? fabsf(row[i]) : amax;
      float s = act_scale(amax, half_range, dtype);
      scales[(size_t)r * ng + g] = s;
      for (int i = 0; i < len; i++) {
        size_t at = (size_t)r * k + (size_t)g * g_size + i;
        float qv;
        if (kind) { uint8_t c = quant_e4m3(row[i], s, dtype); q_out[at] = c; qv = e4m3_decode(c); }
        else { int8_t c = quant_int8(row[i], s, dtype); q_out[at] = c; qv = (float)c; }
        out[at] = round_to(qv * s, dtype);
      }
    }
}

}  // extern "C"
