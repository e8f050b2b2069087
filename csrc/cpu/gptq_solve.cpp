// The column loop of quantkit/methods/gptq.py::gptq_solve for one run of columns inside a block: quantise column i
// with its group's scale, divide its rounding error by U_ii and subtract error x U[i, i:] from the block's
// remaining columns. Rows are independent here (each row's update reads only its own values and U), so they run in
// parallel; each row's block stays in L1 while all its columns are processed.
//
// The arithmetic is the eager loop's, operation for operation in fp32 (compiled without FMA contraction), so a row's
// quantised values match it wherever its rank-1 update rounds each product before subtracting it.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>

namespace {

inline float round_to(float x, int64_t dtype) {
  if (dtype == 1) return static_cast<float>(c10::BFloat16(x));
  if (dtype == 2) return static_cast<float>(c10::Half(x));
  return x;
}

}  // namespace

// w1 [B, R, C] fp32 (updated in place), u1 [B, C, C] fp32 (the block's part of the upper factor), scale / zp
// [B, R, G] fp32, group [B, C] int64 (the group of each block column), err [B, R, C] fp32 (written for columns
// c0..c1), q [B, R, n] int8 (written at q_offset + c0 .. q_offset + c1). Columns c0..c1 of the block are processed.
void gptq_columns(torch::Tensor w1, torch::Tensor u1, torch::Tensor scale, torch::Tensor zp, torch::Tensor group,
                  torch::Tensor err, torch::Tensor q, int64_t c0, int64_t c1, int64_t q_offset, int64_t qmin_i,
                  int64_t qmax_i, bool symmetric, int64_t scale_dtype) {
  TORCH_CHECK(w1.is_contiguous() && u1.is_contiguous() && scale.is_contiguous() && zp.is_contiguous() &&
                  group.is_contiguous() && err.is_contiguous() && q.is_contiguous(),
              "gptq_columns: contiguous tensors");
  TORCH_CHECK(w1.scalar_type() == torch::kFloat32 && u1.scalar_type() == torch::kFloat32 &&
                  scale.scalar_type() == torch::kFloat32 && zp.scalar_type() == torch::kFloat32 &&
                  err.scalar_type() == torch::kFloat32 && group.scalar_type() == torch::kInt64 &&
                  q.scalar_type() == torch::kInt8,
              "gptq_columns: dtypes");
  const int64_t B = w1.size(0), R = w1.size(1), C = w1.size(2), G = scale.size(2), N = q.size(2);
  TORCH_CHECK(u1.size(1) == C && u1.size(2) == C && err.size(2) == C && 0 <= c0 && c0 <= c1 && c1 <= C &&
                  q_offset + c1 <= N,
              "gptq_columns: shapes");
  float* wp = w1.data_ptr<float>();
  const float* up = u1.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* zpp = zp.data_ptr<float>();
  const int64_t* gp = group.data_ptr<int64_t>();
  float* ep = err.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  const float qmin = static_cast<float>(qmin_i), qmax = static_cast<float>(qmax_i);

  at::parallel_for(0, B * R, 8, [&](int64_t begin, int64_t end) {
    for (int64_t br = begin; br < end; ++br) {
      const int64_t b = br / R;
      float* w = wp + br * C;
      float* e_row = ep + br * C;
      int8_t* q_row = qp + br * N + q_offset;
      const float* s_row = sp + br * G;
      const float* z_row = zpp + br * G;
      const float* u = up + b * C * C;
      const int64_t* grp = gp + b * C;
      for (int64_t i = c0; i < c1; ++i) {
        const float col = w[i];
        const float s = s_row[grp[i]];
        float qv, deq;
        if (symmetric) {
          qv = std::min(std::max(std::nearbyint(col / s), qmin), qmax);
          deq = qv * s;
        } else {
          const float z = z_row[grp[i]];
          qv = std::min(std::max(std::nearbyint(col / s + z), qmin), qmax);
          deq = (qv - z) * s;
        }
        deq = round_to(deq, scale_dtype);
        const float e = (col - deq) / u[i * C + i];
        const float* ui = u + i * C;
#pragma omp simd
        for (int64_t j = i; j < C; ++j) w[j] = w[j] - e * ui[j];
        e_row[i] = e;
        q_row[i] = static_cast<int8_t>(qv);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gptq_columns", &gptq_columns, "GPTQ's column loop over columns c0..c1 of one block (rows in parallel)");
}
