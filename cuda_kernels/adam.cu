// Fused Adam / AdamW over a flat fp32 shard: unscale, update, optional half copy-out, in
// one pass over the parameters and both moments (CPU reference: adam.cpp).
#include <algorithm>

#include "cuda_common.cuh"
#include "optim_math.h"

namespace ortrain {
namespace {

template <typename G>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(float* __restrict__ param, const G* __restrict__ grad,
                float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq, int64_t n,
                AdamCoeffs c, float grad_scale, const float* grad_scale_ptr,
                const float* found_inf, void* half_param, int half_dtype) {
  // Read on the device, so a skipped step costs no host synchronisation.
  if (skipped(found_inf)) return;
  const float scale = load_scale(grad_scale, grad_scale_ptr);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += stride) {
    float p = param[i], m = exp_avg[i], v = exp_avg_sq[i];
    adam_element(p, to_float(grad[i]) * scale, m, v, c);
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (half_param != nullptr) store_half(half_param, half_dtype, i, p);
  }
}

template <typename G>
int launch(float* param, const void* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
           const AdamCoeffs& c, float grad_scale, const float* grad_scale_ptr,
           const float* found_inf, void* half_param, int half_dtype, cudaStream_t stream) {
  // A grid-stride loop: past 2^20 blocks each thread takes several elements.
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 20);
  adam_kernel<G><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      param, static_cast<const G*>(grad), exp_avg, exp_avg_sq, n, c, grad_scale,
      grad_scale_ptr, found_inf, half_param, half_dtype);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

}  // namespace
}  // namespace ortrain

extern "C" int ortrain_adam(float* param, const void* grad, int grad_dtype, float* exp_avg,
                            float* exp_avg_sq, int64_t n, double lr, double beta1, double beta2,
                            double eps, double weight_decay, double step, int decoupled,
                            double grad_scale, const float* grad_scale_ptr,
                            const float* found_inf, void* half_param, int half_dtype,
                            void* stream) {
  using namespace ortrain;
  KERNEL_CHECK(n >= 0, "n must be >= 0, got %lld", static_cast<long long>(n));
  CHECK_DTYPE(grad_dtype, "grad");
  CHECK_HALF_DTYPE(half_param, half_dtype);
  if (n == 0) return 0;
  const AdamCoeffs c = adam_coeffs(lr, beta1, beta2, eps, weight_decay, step, decoupled);
  const float s = static_cast<float>(grad_scale);
  const cudaStream_t st = as_stream(stream);
  switch (grad_dtype) {
    case ORTRAIN_F16:
      return launch<__half>(param, grad, exp_avg, exp_avg_sq, n, c, s, grad_scale_ptr,
                            found_inf, half_param, half_dtype, st);
    case ORTRAIN_BF16:
      return launch<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, n, c, s, grad_scale_ptr,
                                   found_inf, half_param, half_dtype, st);
    default:
      return launch<float>(param, grad, exp_avg, exp_avg_sq, n, c, s, grad_scale_ptr,
                           found_inf, half_param, half_dtype, st);
  }
}
