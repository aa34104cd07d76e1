// LAMB over a flat fp32 shard cut into per-tensor segments (CPU reference: lamb.cpp).
// Phase 1: m, v, the update direction and deterministic per-segment partial squared
// norms of p and u (block partials, then one warp per segment sums them in a fixed order).
// Phase 2: p -= lr * trust(segment) * u. See cuda_common.cuh for the chunk/segment walk.
#include <algorithm>

#include "cuda_common.cuh"
#include "optim_math.h"

namespace ortrain {
namespace {

template <typename G>
__global__ void __launch_bounds__(kThreads)
    lamb_phase1_kernel(const float* __restrict__ param, const G* __restrict__ grad,
                       float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                       float* __restrict__ update, int64_t n, const int64_t* __restrict__ off,
                       int64_t nseg, LambCoeffs c, float grad_scale,
                       const float* grad_scale_ptr, const float* found_inf,
                       float2* __restrict__ partial) {
  const bool skip = skipped(found_inf);  // still writes zero partials: norms read 0
  const float scale = load_scale(grad_scale, grad_scale_ptr);
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t hi = min(lo + kChunk, n);
  // Every thread walks the same segments, so the block sums below are reached uniformly.
  for (int64_t s = segment_of(off, nseg, lo); s < nseg && off[s] < hi; ++s) {
    const int64_t end = min(hi, off[s + 1]);
    float p_acc = 0.0f, u_acc = 0.0f;
    for (int64_t i = max(lo, off[s]) + threadIdx.x; !skip && i < end; i += kThreads) {
      const float p = param[i];
      float m = exp_avg[i], v = exp_avg_sq[i];
      const float u = lamb_element(p, to_float(grad[i]) * scale, m, v, c);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
      update[i] = u;
      p_acc += p * p;
      u_acc += u * u;
    }
    p_acc = block_sum(p_acc);
    u_acc = block_sum(u_acc);
    if (threadIdx.x == 0) partial[s + blockIdx.x] = make_float2(p_acc, u_acc);
  }
}

// One warp per segment sums the partials of the blocks that covered it.
__global__ void __launch_bounds__(kThreads)
    lamb_segment_norms_kernel(const int64_t* __restrict__ off, int64_t nseg, int64_t n,
                              const float2* __restrict__ partial, float* __restrict__ param_sq,
                              float* __restrict__ update_sq) {
  const int64_t s = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (s >= nseg) return;  // whole warps leave: no block-wide sync follows
  const int lane = threadIdx.x & 31;
  // Clamped so that malformed offsets cannot index past the partials.
  const int64_t a = max(off[s], int64_t{0}), b = min(off[s + 1], n);
  float p = 0.0f, u = 0.0f;
  if (a < b) {
    for (int64_t blk = a / kChunk + lane; blk <= (b - 1) / kChunk; blk += 32) {
      const float2 x = partial[s + blk];
      p += x.x;
      u += x.y;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    p += __shfl_xor_sync(0xffffffffu, p, o);
    u += __shfl_xor_sync(0xffffffffu, u, o);
  }
  if (lane == 0) {
    param_sq[s] = p;
    update_sq[s] = u;
  }
}

__global__ void __launch_bounds__(kThreads)
    lamb_phase2_kernel(float* __restrict__ param, const float* __restrict__ update, int64_t n,
                       const int64_t* __restrict__ off, int64_t nseg,
                       const float* __restrict__ param_sq, const float* __restrict__ update_sq,
                       float lr, const float* found_inf, void* half_param, int half_dtype) {
  if (skipped(found_inf)) return;
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t hi = min(lo + kChunk, n);
  for (int64_t s = segment_of(off, nseg, lo); s < nseg && off[s] < hi; ++s) {
    const float coef = lamb_coef(lr, param_sq[s], update_sq[s]);
    const int64_t end = min(hi, off[s + 1]);
    for (int64_t i = max(lo, off[s]) + threadIdx.x; i < end; i += kThreads) {
      const float p = param[i] - update[i] * coef;
      param[i] = p;
      if (half_param != nullptr) store_half(half_param, half_dtype, i, p);
    }
  }
}

template <typename G>
void launch_phase1(const float* param, const void* grad, float* exp_avg, float* exp_avg_sq,
                   float* update, int64_t n, const int64_t* off, int64_t nseg,
                   const LambCoeffs& c, float grad_scale, const float* grad_scale_ptr,
                   const float* found_inf, float2* partial, cudaStream_t stream) {
  lamb_phase1_kernel<G><<<static_cast<unsigned>(num_chunks(n)), kThreads, 0, stream>>>(
      param, static_cast<const G*>(grad), exp_avg, exp_avg_sq, update, n, off, nseg, c,
      grad_scale, grad_scale_ptr, found_inf, partial);
}

}  // namespace
}  // namespace ortrain

extern "C" int64_t ortrain_lamb_workspace_floats(int64_t n, int64_t nseg) {
  return 2 * (ortrain::num_chunks(n) + nseg);  // one float2 per (segment, block) slot
}

extern "C" int ortrain_lamb_phase1(const float* param, const void* grad, int grad_dtype,
                                   float* exp_avg, float* exp_avg_sq, float* update, int64_t n,
                                   const int64_t* seg_offsets, int64_t nseg, double beta1,
                                   double beta2, double eps, double weight_decay, double step,
                                   int bias_correction, double grad_scale,
                                   const float* grad_scale_ptr, const float* found_inf,
                                   float* param_sq, float* update_sq, float* workspace,
                                   void* stream) {
  using namespace ortrain;
  KERNEL_CHECK(n >= 0 && nseg >= 0, "n and nseg must be >= 0");
  KERNEL_CHECK(n == 0 || nseg > 0, "a non-empty shard needs at least one segment");
  CHECK_DTYPE(grad_dtype, "grad");
  KERNEL_CHECK(reinterpret_cast<uintptr_t>(workspace) % alignof(float2) == 0,
               "workspace must be 8-byte aligned");
  if (nseg == 0) return 0;
  const LambCoeffs c = lamb_coeffs(beta1, beta2, eps, weight_decay, step, bias_correction);
  const float s = static_cast<float>(grad_scale);
  const cudaStream_t st = as_stream(stream);
  auto* partial = reinterpret_cast<float2*>(workspace);
  if (n > 0) {
    switch (grad_dtype) {
      case ORTRAIN_F16:
        launch_phase1<__half>(param, grad, exp_avg, exp_avg_sq, update, n, seg_offsets, nseg,
                              c, s, grad_scale_ptr, found_inf, partial, st);
        break;
      case ORTRAIN_BF16:
        launch_phase1<__nv_bfloat16>(param, grad, exp_avg, exp_avg_sq, update, n,
                                     seg_offsets, nseg, c, s, grad_scale_ptr, found_inf,
                                     partial, st);
        break;
      default:
        launch_phase1<float>(param, grad, exp_avg, exp_avg_sq, update, n, seg_offsets, nseg,
                             c, s, grad_scale_ptr, found_inf, partial, st);
    }
    CUDA_CHECK(cudaGetLastError());
  }
  const auto blocks = static_cast<unsigned>((nseg + kWarps - 1) / kWarps);
  lamb_segment_norms_kernel<<<blocks, kThreads, 0, st>>>(seg_offsets, nseg, n, partial,
                                                         param_sq, update_sq);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}

extern "C" int ortrain_lamb_phase2(float* param, const float* update, int64_t n,
                                   const int64_t* seg_offsets, int64_t nseg,
                                   const float* param_sq, const float* update_sq, double lr,
                                   const float* found_inf, void* half_param, int half_dtype,
                                   void* stream) {
  using namespace ortrain;
  KERNEL_CHECK(n >= 0 && nseg >= 0, "n and nseg must be >= 0");
  KERNEL_CHECK(n == 0 || nseg > 0, "a non-empty shard needs at least one segment");
  CHECK_HALF_DTYPE(half_param, half_dtype);
  if (n == 0) return 0;
  lamb_phase2_kernel<<<static_cast<unsigned>(num_chunks(n)), kThreads, 0, as_stream(stream)>>>(
      param, update, n, seg_offsets, nseg, param_sq, update_sq, static_cast<float>(lr),
      found_inf, half_param, half_dtype);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
