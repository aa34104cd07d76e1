// CUDA helpers shared by the kernels: CUDA_CHECK, dtype loads/stores, block sums and the
// block-over-segments walk used by the segmented kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "common.h"

// llm.c's CUDA_CHECK, but recorded for ortrain_last_error() and returned instead of
// exit(): the caller is a Python process that should get an exception.
#define CUDA_CHECK(call)                                                                   \
  do {                                                                                     \
    const cudaError_t err_ = (call);                                                       \
    if (err_ != cudaSuccess)                                                               \
      return ::ortrain::set_error(__FILE__, __LINE__, "CUDA error %s (%s) in %s",         \
                                  cudaGetErrorName(err_), cudaGetErrorString(err_), #call); \
  } while (0)

namespace ortrain {

constexpr int kThreads = 256;  // threads per block in every kernel
constexpr int kWarps = kThreads / 32;

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// The low-precision copy of an updated parameter; round to nearest even like torch.
__device__ __forceinline__ void store_half(void* out, int dtype, int64_t i, float x) {
  if (dtype == ORTRAIN_F16)
    static_cast<__half*>(out)[i] = __float2half_rn(x);
  else
    static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
}

__device__ __forceinline__ float load_scale(float grad_scale, const float* grad_scale_ptr) {
  return grad_scale_ptr != nullptr ? grad_scale * *grad_scale_ptr : grad_scale;
}

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// Sum over the block in a fixed order (deterministic), valid in thread 0. Every thread
// of the block must call it.
__device__ __forceinline__ float block_sum(float x) {
  __shared__ float warp_sums[kWarps];
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  __syncthreads();  // an earlier call may still be reading warp_sums
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = x;
  __syncthreads();
  x = threadIdx.x < kWarps ? warp_sums[threadIdx.x] : 0.0f;
  if (threadIdx.x < 32)
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The segment holding flat index i: the last s with off[s] <= i (empty segments at i are
// passed over). off has nseg + 1 entries, off[0] == 0 <= i < off[nseg].
__device__ __forceinline__ int64_t segment_of(const int64_t* off, int64_t nseg, int64_t i) {
  int64_t lo = 0, hi = nseg;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (off[mid] <= i) lo = mid; else hi = mid;
  }
  return lo;
}

// Segmented kernels give each block one chunk of kChunk consecutive elements. A block
// visits the segments overlapping its chunk in order; the pair (segment s, block b) owns
// slot s + b of a partial-sums array: the segments of block b + 1 start at the last
// segment of block b, so s + b grows strictly along blocks and no two pairs share a slot
// (nblocks + nseg slots suffice). A segment's blocks are off[s] / kChunk through
// (off[s + 1] - 1) / kChunk, which is how the partials are found again.
constexpr int64_t kChunk = kThreads * 16;

inline int64_t num_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

}  // namespace ortrain
