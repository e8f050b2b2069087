// The shrink-grid scale search of quantkit/quant/integer.py::group_qparams, fused: for each row, every grid point's
// scale, zero point and (importance-weighted) squared rounding error in one pass over the row while it sits in L1.
//
// Every per-element value is the fp32 value the eager torch code computes, op by op (compiled without FMA
// contraction or fast-math, so each product, quotient and difference is rounded as torch rounds it); the row's
// error is summed in double, where torch sums fp32 in its own order. So a grid point wins here exactly when it wins
// in eager unless two grid points' errors agree to fp32 summation noise; exact ties keep the first (least shrunk)
// point in both.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

inline float round_to(float x, int64_t dtype) {
  // The checkpoint's scale dtype: 0 fp32, 1 bf16, 2 fp16 (round to nearest even, as torch's .to()).
  if (dtype == 1) return static_cast<float>(c10::BFloat16(x));
  if (dtype == 2) return static_cast<float>(c10::Half(x));
  return x;
}

struct Params {
  float scale;
  float zp;
};

// compute_qparams for one row's shrunk range, then round_to_dtype: the same fp32 operations in the same order.
inline Params qparams(float lo, float hi, float qmin, float qmax, bool symmetric, int64_t dtype) {
  const float mn = std::min(lo, 0.0f), mx = std::max(hi, 0.0f);
  const float bit_range = qmax - qmin;
  float scale, zp = 0.0f;
  if (symmetric) {
    scale = std::max(std::fabs(mn), mx) / (bit_range / 2.0f);
  } else {
    scale = (mx - mn) / bit_range;
    zp = qmin - mn / (scale == 0.0f ? 1.0f : scale);
    zp = std::nearbyint(std::min(std::max(zp, qmin), qmax));
  }
  if (scale == 0.0f) scale = std::numeric_limits<float>::epsilon();
  return {round_to(scale, dtype), zp};
}

// Squared error of one row at one (scale, zp), each element's error weighted by imp (nullptr: 1), summed in double.
double row_error(const float* w, const float* imp, int64_t m, float scale, float zp, float qmin, float qmax) {
  double total = 0.0;
  if (imp == nullptr) {
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < m; ++j) {
      float q = std::nearbyint(w[j] / scale + zp);
      q = std::min(std::max(q, qmin), qmax);
      const float d = (q - zp) * scale - w[j];
      total += static_cast<double>(d * d);
    }
  } else {
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < m; ++j) {
      float q = std::nearbyint(w[j] / scale + zp);
      q = std::min(std::max(q, qmin), qmax);
      const float d = (q - zp) * scale - w[j];
      total += static_cast<double>((d * d) * imp[j]);
    }
  }
  return total;
}

}  // namespace

// w [R, m] fp32 contiguous; importance: empty, or [P, m] fp32 with row r weighted by importance[r % P].
// Returns (scale [R] fp32, rounded to scale_dtype; zero point [R] fp32).
std::vector<torch::Tensor> shrink_search(torch::Tensor w, torch::Tensor importance, int64_t qmin_i, int64_t qmax_i,
                                         bool symmetric, int64_t scale_dtype, int64_t grid, double max_shrink) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous(), "w: contiguous fp32 [R, m]");
  const int64_t rows = w.size(0), m = w.size(1);
  const bool weighted = importance.numel() > 0;
  if (weighted) {
    TORCH_CHECK(importance.dim() == 2 && importance.size(1) == m && importance.scalar_type() == torch::kFloat32 &&
                    importance.is_contiguous() && importance.size(0) > 0,
                "importance: contiguous fp32 [P, m]");
  }
  const int64_t periods = weighted ? importance.size(0) : 1;
  auto scale_out = torch::empty({rows}, w.options());
  auto zp_out = torch::empty({rows}, w.options());
  const float* wp = w.data_ptr<float>();
  const float* ip = weighted ? importance.data_ptr<float>() : nullptr;
  float* sp = scale_out.data_ptr<float>();
  float* zpp = zp_out.data_ptr<float>();
  const float qmin = static_cast<float>(qmin_i), qmax = static_cast<float>(qmax_i);
  // The grid's factors as group_qparams forms them: a Python float (double), applied to fp32 tensors as fp32.
  std::vector<float> factors(grid + 1);
  for (int64_t k = 0; k <= grid; ++k) factors[k] = static_cast<float>(1.0 - max_shrink * k / grid);

  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = wp + r * m;
      const float* imp = weighted ? ip + (r % periods) * m : nullptr;
      float lo = row[0], hi = row[0];
      for (int64_t j = 1; j < m; ++j) {
        lo = std::min(lo, row[j]);
        hi = std::max(hi, row[j]);
      }
      double best = std::numeric_limits<double>::infinity();
      Params chosen{1.0f, 0.0f};
      for (int64_t k = 0; k <= grid; ++k) {
        const Params p = qparams(lo * factors[k], hi * factors[k], qmin, qmax, symmetric, scale_dtype);
        const double err = row_error(row, imp, m, p.scale, p.zp, qmin, qmax);
        if (err < best) {
          best = err;
          chosen = p;
        }
      }
      sp[r] = chosen.scale;
      zpp[r] = chosen.zp;
    }
  });
  return {scale_out, zp_out};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shrink_search", &shrink_search, "per-row shrink-grid scale search (quantkit.quant.integer.group_qparams)");
}
