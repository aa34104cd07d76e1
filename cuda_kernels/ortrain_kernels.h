// The C ABI of ortrain's fused optimizer kernels, loaded by ctypes
// (ortrain/runtime/kernels.py). Two libraries export it with identical signatures:
//   libortrain_kernels_cpu.so   the CPU reference (*.cpp), pointers are host memory
//   libortrain_kernels_cuda.so  the CUDA kernels (*.cu), pointers are device memory and
//                               work is queued on `stream` (a cudaStream_t; NULL: default)
//
// Conventions shared by every entry point:
// - Tensors are flat, contiguous fp32 unless a `*_dtype` argument says otherwise
//   (ORTRAIN_F32 / ORTRAIN_F16 / ORTRAIN_BF16).
// - Hyperparameters arrive as double, the way torch receives Python floats: derived
//   scalars (1 - lr*wd, bias corrections 1 - beta^t with t = `step`) are computed in double
//   on the host and rounded to float once, as torch does before its fp32 kernels.
// - Gradients are multiplied in-kernel by grad_scale * (*grad_scale_ptr if not NULL):
//   1/(loss_scale * accumulation * world) times the clipping coefficient, so no separate
//   unscale pass runs. grad_scale_ptr lets that coefficient stay on the device.
// - found_inf (NULL: never skip) is a one-element fp32 flag: when non-zero, the update
//   is skipped and every output keeps its bit pattern (norm outputs are written as 0).
// - half_param (NULL: none) receives the updated parameter rounded to half_dtype
//   (fp16 or bf16, round to nearest even) - the low-precision copy the forward reads.
// - Return 0 on success; otherwise ortrain_last_error() describes the failure with the
//   file and line that detected it.
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ORTRAIN_KERNELS_ABI_VERSION 1
enum { ORTRAIN_F32 = 0, ORTRAIN_F16 = 1, ORTRAIN_BF16 = 2 };

int ortrain_kernels_abi_version(void);
const char* ortrain_kernels_device(void);  // "cpu" or "cuda"
const char* ortrain_last_error(void);      // this thread's last failure message

// Adam / AdamW over one flat shard of n elements (torch.optim single-tensor semantics).
// decoupled != 0: AdamW (p *= 1 - lr*wd); decoupled == 0: Adam with L2 (g += wd*p).
int ortrain_adam(float* param, const void* grad, int grad_dtype, float* exp_avg,
                 float* exp_avg_sq, int64_t n, double lr, double beta1, double beta2,
                 double eps, double weight_decay, double step, int decoupled,
                 double grad_scale, const float* grad_scale_ptr, const float* found_inf,
                 void* half_param, int half_dtype, void* stream);

// LAMB (ortrain.optim.Lamb) over a flat shard cut into nseg segments by seg_offsets
// (nseg + 1 ascending int64, seg_offsets[0] == 0, seg_offsets[nseg] == n; device memory
// for CUDA). A segment is the part of one parameter tensor inside this shard.
// Phase 1 writes m, v, the update direction `update` and, per segment, the partial
// squared norms of the parameter (param_sq) and of the update (update_sq). The caller may
// sum the partial norms of a tensor split across shards before phase 2.
// `workspace` holds ortrain_lamb_workspace_floats(n, nseg) floats (CPU: may be NULL).
int64_t ortrain_lamb_workspace_floats(int64_t n, int64_t nseg);
int ortrain_lamb_phase1(const float* param, const void* grad, int grad_dtype, float* exp_avg,
                        float* exp_avg_sq, float* update, int64_t n,
                        const int64_t* seg_offsets, int64_t nseg, double beta1, double beta2,
                        double eps, double weight_decay, double step, int bias_correction,
                        double grad_scale, const float* grad_scale_ptr,
                        const float* found_inf, float* param_sq, float* update_sq,
                        float* workspace, void* stream);
// Phase 2: p -= lr * trust * update per segment, trust = ||p|| / ||update|| when both
// are > 0, else 1 (norms from the squared norms given).
int ortrain_lamb_phase2(float* param, const float* update, int64_t n,
                        const int64_t* seg_offsets, int64_t nseg, const float* param_sq,
                        const float* update_sq, double lr, const float* found_inf,
                        void* half_param, int half_dtype, void* stream);

// One pass over ntensors buffers of one dtype (ptrs[i] holds lens[i] elements; the two
// arrays are host memory in both libraries): *sq_norm = sum of squares (fp32),
// *found_inf = 1 if an element or the sum is not finite, else 0.
// `workspace` holds ortrain_sq_norm_workspace_floats(ntensors) floats (CPU: may be NULL).
int64_t ortrain_sq_norm_workspace_floats(int64_t ntensors);
int ortrain_all_finite_sq_norm(const void* const* ptrs, const int64_t* lens, int64_t ntensors,
                               int dtype, float* sq_norm, float* found_inf, float* workspace,
                               void* stream);

#ifdef __cplusplus
}
#endif
