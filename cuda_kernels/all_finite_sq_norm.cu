// All-finite check and global squared L2 norm in one read of the gradients
// (CPU reference: all_finite_sq_norm.cpp). Tensors travel in the kernel's arguments,
// kMaxTensors per launch, so no pointer table is copied to the device; each launch writes
// one partial sum per block and a last one-block kernel adds them in a fixed order.
#include <algorithm>

#include "cuda_common.cuh"

namespace ortrain {
namespace {

constexpr int kMaxTensors = 64;   // per launch: 1 KiB of kernel arguments
constexpr int kMaxBlocks = 1024;  // per launch; blocks stride over the chunks beyond

struct TensorBatch {
  const void* ptr[kMaxTensors];
  int64_t off[kMaxTensors + 1];  // offsets of the tensors in their concatenation
  int64_t count;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    sq_norm_partial_kernel(const TensorBatch batch, float* __restrict__ partial,
                           float* __restrict__ found_inf) {
  const int64_t total = batch.off[batch.count];
  double acc = 0.0;  // a thread may sum thousands of squares: double keeps fp32 accuracy
  int bad = 0;
  for (int64_t lo = static_cast<int64_t>(blockIdx.x) * kChunk; lo < total;
       lo += static_cast<int64_t>(gridDim.x) * kChunk) {
    const int64_t hi = min(lo + kChunk, total);
    for (int64_t s = segment_of(batch.off, batch.count, lo); s < batch.count && batch.off[s] < hi;
         ++s) {
      const T* x = static_cast<const T*>(batch.ptr[s]);
      const int64_t base = batch.off[s], end = min(hi, batch.off[s + 1]);
      for (int64_t i = max(lo, base) + threadIdx.x; i < end; i += kThreads) {
        const float v = to_float(x[i - base]);
        bad |= !isfinite(v);
        acc += static_cast<double>(v) * v;
      }
    }
  }
  const float sum = block_sum(static_cast<float>(acc));
  // All threads write the same 1.0f: the race is benign and needs no atomic.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found_inf = 1.0f;
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

__global__ void __launch_bounds__(kThreads)
    sq_norm_final_kernel(const float* __restrict__ partial, int64_t count,
                         float* __restrict__ sq_norm, float* __restrict__ found_inf) {
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) acc += partial[i];
  acc = block_sum(acc);
  if (threadIdx.x == 0) {
    *sq_norm = acc;
    if (!isfinite(acc)) *found_inf = 1.0f;  // an overflowing norm counts, as in the graph
  }
}

template <typename T>
void launch_partial(const TensorBatch& batch, unsigned blocks, float* partial,
                    float* found_inf, cudaStream_t stream) {
  sq_norm_partial_kernel<T><<<blocks, kThreads, 0, stream>>>(batch, partial, found_inf);
}

}  // namespace
}  // namespace ortrain

extern "C" int64_t ortrain_sq_norm_workspace_floats(int64_t ntensors) {
  using namespace ortrain;
  return std::max<int64_t>(1, (ntensors + kMaxTensors - 1) / kMaxTensors) * kMaxBlocks;
}

extern "C" int ortrain_all_finite_sq_norm(const void* const* ptrs, const int64_t* lens,
                                          int64_t ntensors, int dtype, float* sq_norm,
                                          float* found_inf, float* workspace, void* stream) {
  using namespace ortrain;
  CHECK_DTYPE(dtype, "tensors");
  KERNEL_CHECK(ntensors >= 0, "ntensors must be >= 0");
  const cudaStream_t st = as_stream(stream);
  CUDA_CHECK(cudaMemsetAsync(found_inf, 0, sizeof(float), st));
  int64_t used = 0;  // partials written so far, packed at the front of the workspace
  for (int64_t t0 = 0; t0 < ntensors; t0 += kMaxTensors) {
    TensorBatch batch{};
    batch.count = std::min<int64_t>(kMaxTensors, ntensors - t0);
    for (int64_t j = 0; j < batch.count; ++j) {
      KERNEL_CHECK(lens[t0 + j] >= 0, "lens[%lld] < 0", static_cast<long long>(t0 + j));
      batch.ptr[j] = ptrs[t0 + j];
      batch.off[j + 1] = batch.off[j] + lens[t0 + j];
    }
    const int64_t chunks = num_chunks(batch.off[batch.count]);
    if (chunks == 0) continue;
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(chunks, kMaxBlocks));
    switch (dtype) {
      case ORTRAIN_F16: launch_partial<__half>(batch, blocks, workspace + used, found_inf, st); break;
      case ORTRAIN_BF16:
        launch_partial<__nv_bfloat16>(batch, blocks, workspace + used, found_inf, st);
        break;
      default: launch_partial<float>(batch, blocks, workspace + used, found_inf, st);
    }
    CUDA_CHECK(cudaGetLastError());
    used += blocks;
  }
  sq_norm_final_kernel<<<1, kThreads, 0, st>>>(workspace, used, sq_norm, found_inf);
  CUDA_CHECK(cudaGetLastError());
  return 0;
}
