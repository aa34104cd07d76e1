// CPU reference of lamb.cu: the same C ABI; partial norms accumulate in double.
#include <math.h>

#include "common.h"
#include "half_host.h"
#include "optim_math.h"

namespace {
int check_segments(const int64_t* off, int64_t nseg, int64_t n) {
  KERNEL_CHECK(n >= 0 && nseg >= 0, "n and nseg must be >= 0");
  KERNEL_CHECK(off[0] == 0 && off[nseg] == n, "seg_offsets must run from 0 to n = %lld",
               static_cast<long long>(n));
  for (int64_t s = 0; s < nseg; ++s)
    KERNEL_CHECK(off[s] <= off[s + 1], "seg_offsets must be ascending (at %lld)",
                 static_cast<long long>(s));
  return 0;
}
}  // namespace

extern "C" int64_t ortrain_lamb_workspace_floats(int64_t, int64_t) { return 0; }

extern "C" int ortrain_lamb_phase1(const float* param, const void* grad, int grad_dtype,
                                   float* exp_avg, float* exp_avg_sq, float* update, int64_t n,
                                   const int64_t* seg_offsets, int64_t nseg, double beta1,
                                   double beta2, double eps, double weight_decay, double step,
                                   int bias_correction, double grad_scale,
                                   const float* grad_scale_ptr, const float* found_inf,
                                   float* param_sq, float* update_sq, float* /*workspace*/,
                                   void* /*stream*/) {
  CHECK_DTYPE(grad_dtype, "grad");
  if (int err = check_segments(seg_offsets, nseg, n)) return err;
  const bool skip = found_inf != nullptr && *found_inf != 0.0f;
  const auto c = ortrain::lamb_coeffs(beta1, beta2, eps, weight_decay, step, bias_correction);
  float scale = static_cast<float>(grad_scale);
  if (grad_scale_ptr != nullptr) scale *= *grad_scale_ptr;
  for (int64_t s = 0; s < nseg; ++s) {
    double p_acc = 0.0, u_acc = 0.0;
    for (int64_t i = seg_offsets[s]; !skip && i < seg_offsets[s + 1]; ++i) {
      const float g = ortrain::load_as_float(grad, grad_dtype, i) * scale;
      const float u = ortrain::lamb_element(param[i], g, exp_avg[i], exp_avg_sq[i], c);
      update[i] = u;
      p_acc += static_cast<double>(param[i]) * param[i];
      u_acc += static_cast<double>(u) * u;
    }
    param_sq[s] = static_cast<float>(p_acc);
    update_sq[s] = static_cast<float>(u_acc);
  }
  return 0;
}

extern "C" int ortrain_lamb_phase2(float* param, const float* update, int64_t n,
                                   const int64_t* seg_offsets, int64_t nseg,
                                   const float* param_sq, const float* update_sq, double lr,
                                   const float* found_inf, void* half_param, int half_dtype,
                                   void* /*stream*/) {
  CHECK_HALF_DTYPE(half_param, half_dtype);
  if (int err = check_segments(seg_offsets, nseg, n)) return err;
  if (found_inf != nullptr && *found_inf != 0.0f) return 0;
  for (int64_t s = 0; s < nseg; ++s) {
    const float coef = ortrain::lamb_coef(static_cast<float>(lr), param_sq[s], update_sq[s]);
    for (int64_t i = seg_offsets[s]; i < seg_offsets[s + 1]; ++i) {
      param[i] = param[i] - update[i] * coef;
      if (half_param != nullptr) ortrain::store_half(half_param, half_dtype, i, param[i]);
    }
  }
  return 0;
}
