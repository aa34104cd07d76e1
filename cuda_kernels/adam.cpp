// CPU reference of adam.cu: the same C ABI, a plain loop over the shard.
#include "common.h"
#include "half_host.h"
#include "optim_math.h"

extern "C" int ortrain_adam(float* param, const void* grad, int grad_dtype, float* exp_avg,
                            float* exp_avg_sq, int64_t n, double lr, double beta1, double beta2,
                            double eps, double weight_decay, double step, int decoupled,
                            double grad_scale, const float* grad_scale_ptr,
                            const float* found_inf, void* half_param, int half_dtype,
                            void* /*stream*/) {
  KERNEL_CHECK(n >= 0, "n must be >= 0, got %lld", static_cast<long long>(n));
  CHECK_DTYPE(grad_dtype, "grad");
  CHECK_HALF_DTYPE(half_param, half_dtype);
  if (found_inf != nullptr && *found_inf != 0.0f) return 0;
  const auto c = ortrain::adam_coeffs(lr, beta1, beta2, eps, weight_decay, step, decoupled);
  float scale = static_cast<float>(grad_scale);
  if (grad_scale_ptr != nullptr) scale *= *grad_scale_ptr;
  for (int64_t i = 0; i < n; ++i) {
    const float g = ortrain::load_as_float(grad, grad_dtype, i) * scale;
    ortrain::adam_element(param[i], g, exp_avg[i], exp_avg_sq[i], c);
    if (half_param != nullptr) ortrain::store_half(half_param, half_dtype, i, param[i]);
  }
  return 0;
}
