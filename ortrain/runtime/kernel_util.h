/* Helpers shared by ortrain's fused fp32 CPU kernels (grad_kernels.c, softmax.c): a
 * vectorizable exp, the hand-off to ONNX Runtime's intra-op threads, operand access with
 * errors that name the op and operand, and the op-kernel state cpu_ops.c creates.
 */
#ifndef ORTRAIN_KERNEL_UTIL_H
#define ORTRAIN_KERNEL_UTIL_H

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#ifdef __AVX__
#include <immintrin.h>
#endif

#define ELEMS_PER_BLOCK 16384 /* 64 KiB of each operand per block */

/* ------------------------------------------------------------------------- math */
/* exp(x) for x in [-87, 88] (0 below, exp(88) above): 2^n * p(r), r = x - n ln2, |r| <= ln2/2,
 * p the degree-7 Taylor polynomial (relative error < 2e-7). Branch-free, so the element
 * loops vectorize; libm's expf does not. */
static inline float exp_approx(float x) {
  const int underflow = x < -87.0f; /* exp < 2^-125: 0, as a masked (-inf) logit needs */
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return underflow ? 0.0f : p * scale;
}

/* GELU (grad_kernels.c: backwards; forward_kernels.c: forwards) */
/* Phi(x), from erfc's Chebyshev fit (Numerical Recipes erfcc, relative error < 1.2e-7) */
static inline float gelu_erf_cdf(float x) {
  float z = fabsf(x) * 0.70710678118654752f;
  float t = 1.0f / (1.0f + 0.5f * z);
  float q = 0.17087277f;
  q = q * t - 0.82215223f;
  q = q * t + 1.48851587f;
  q = q * t - 1.13520398f;
  q = q * t + 0.27886807f;
  q = q * t - 0.18628806f;
  q = q * t + 0.09678418f;
  q = q * t + 0.37409196f;
  q = q * t + 1.00002368f;
  q = q * t - 1.26551223f;
  float erfc_z = t * exp_approx(q - z * z);
  return x >= 0.0f ? 1.0f - 0.5f * erfc_z : 0.5f * erfc_z;
}

static inline float gelu_erf_value(float x) { return x * gelu_erf_cdf(x); }

/* d/dx [x Phi(x)] = Phi(x) + x phi(x), and x Phi(x) in *value */
static inline float gelu_erf_slope(float x, float* value) {
  float cdf = gelu_erf_cdf(x);
  float pdf = 0.3989422804014327f * exp_approx(-0.5f * x * x);
  *value = x * cdf;
  return cdf + x * pdf;
}

#define GELU_K 1.5957691216057308f /* 2 sqrt(2/pi) */
#define GELU_A 0.044715f

/* gelu_tanh(x) = x s, s = 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (x + a x^3) */
static inline float gelu_tanh_value(float x) {
  float x2 = x * x; /* as gelu_tanh_slope groups it: the same value, bit for bit */
  float e = exp_approx(-x * (GELU_K + GELU_A * GELU_K * x2));
  return x * (1.0f / (1.0f + e));
}

/* d/dx gelu_tanh(x), and gelu_tanh(x) in *value */
static inline float gelu_tanh_slope(float x, float* value) {
  float x2 = x * x;
  float e = exp_approx(-x * (GELU_K + GELU_A * GELU_K * x2));
  float s = 1.0f / (1.0f + e);
  *value = x * s;
  /* 1 - s as e * s: no cancellation where s rounds to 1 (x > ~4) */
  return s + x * s * (e * s) * (GELU_K + 3.0f * GELU_A * GELU_K * x2);
}

/* ------------------------------------------------------------------- transposes */
/* dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols: 8 x 8 blocks in AVX
 * registers where the compiler targets AVX (a scalar loop transposes at a third of the
 * speed), the edges one element at a time. Pure data movement: bit-exact. */
static inline void transpose_into(const float* restrict src, int64_t lds, float* restrict dst,
                                  int64_t ldd, int64_t rows, int64_t cols) {
  int64_t r8 = 0, c8 = 0;
#ifdef __AVX__
  r8 = rows & ~(int64_t)7, c8 = cols & ~(int64_t)7;
  for (int64_t c = 0; c < c8; c += 8) /* a column's rows in turn: its lines fill at once */
    for (int64_t r = 0; r < r8; r += 8) {
      __m256 x[8], t[8];
      for (int i = 0; i < 8; ++i) x[i] = _mm256_loadu_ps(src + (r + i) * lds + c);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(x[i], x[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(x[i], x[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        x[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        x[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        x[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        x[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {
        t[i] = _mm256_permute2f128_ps(x[i], x[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(x[i], x[i + 4], 0x31);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (c + j) * ldd + r, t[j]);
    }
#endif
  for (int64_t r = 0; r < rows; ++r) { /* what the blocks left: right columns, bottom rows */
    const float* row = src + r * lds;
    for (int64_t c = r < r8 ? c8 : 0; c < cols; ++c) dst[c * ldd + r] = row[c];
  }
}

/* An output marked in out_transposed is stored [cols, rows], the transpose of its 2-D
 * view [rows, cols], for a weight gradient that reads it as a plain product's left operand
 * (graph_passes/targets/cpu/transposed_activations.py). Its kernels take TRANSPOSED_ROWS rows a block:
 * their values go to a tile of TILE_COLUMNS columns, then into Y's columns (16 rows: one
 * cache line of each). */
enum { TRANSPOSED_ROWS = 16, TILE_COLUMNS = 256 };

/* ------------------------------------------------------------------ kernels */
typedef struct {
  const OrtApi* api;
  const char* name; /* the op's name, for messages */
  float epsilon;    /* the "epsilon" attribute (LayerNorm, BatchNormGrad), default 1e-5 */
  int omp_team;     /* the "omp_team" attribute, default 1: 0 keeps this node's blocks on
                       ONNX Runtime's threads (graph_passes/targets/cpu/kernel_threads.py) */
  int grad_transposed; /* AdamStep's "grad_transposed" attribute, default 0 */
  int out_transposed;  /* the "out_transposed" attribute, default 0: bit i set, output i is
                          stored as its 2-D view's transpose (below) */
  int64_t seed;        /* Dropout's "seed" attribute (dropout_kernels.c) */
  uint64_t runs;       /* Dropout: the runs so far, each its own draws */
} Kernel;

/* ------------------------------------------------------------------- threading */
typedef void (*BlockFn)(void* work, size_t block);

/* fn(work, b) for every block b. On torch's OpenMP team when the library was built with
 * OpenMP, Python checked that it binds torch's own runtime (ortrain_use_omp_team) and the
 * node's omp_team attribute leaves it there: the BLAS products run on that team, whose
 * workers spin a while after each product, so a kernel run on ONNX Runtime's threads
 * instead shares their cores with the spinning ones (FastGeluGrad between two products:
 * 1.1 -> 0.87 ms on the team). Where the products are ONNX Runtime's own (MLAS, on its
 * intra-op threads), the team's spinning would slow them instead (gpt2-tiny's step 255 ->
 * 348 ms on an AMD EPYC): those graphs say omp_team = 0. Else on the session's intra-op
 * threads when the runtime offers them (API 17), else on this thread. The order blocks
 * run in never changes a result. A refused hand-off (ParallelFor checks its arguments
 * before it runs anything) runs every block here instead. */
static inline void for_blocks(const Kernel* k, const OrtKernelContext* ctx, BlockFn fn,
                              size_t n_blocks, void* work) {
#ifdef _OPENMP
  if (ortrain_omp_team && k->omp_team && n_blocks > 1) {
    const long n = (long)n_blocks;
    __atomic_add_fetch(&ortrain_team_runs, 1, __ATOMIC_RELAXED);
#pragma omp parallel for schedule(dynamic, 1)
    for (long b = 0; b < n; ++b) fn(work, (size_t)b);
    return;
  }
#endif
  if (ortrain_api17 != NULL && n_blocks > 1) {
    OrtStatus* st = API_FN(ortrain_api17, I_KernelContext_ParallelFor, ParallelForFn)(
        ctx, fn, n_blocks, 0, work);
    if (st == NULL) return;
    API_FN(ortrain_api17, I_ReleaseStatus, ReleaseStatusFn)(st);
  }
  for (size_t b = 0; b < n_blocks; ++b) fn(work, b);
}

static inline size_t div_up(size_t a, size_t b) { return (a + b - 1) / b; }

/* ------------------------------------------------------------------ operands */
typedef struct {
  int64_t dims[8];
  size_t rank;
  int64_t count; /* elements */
  void* data;
} Tensor;

static inline OrtStatus* input_typed(const Kernel* k, OrtKernelContext* ctx, size_t i, Tensor* t,
                              int type) {
  const OrtApi* api = k->api;
  const OrtValue* v = NULL;
  int elem = 0;
  OrtStatus* st = API_FN(api, I_KernelContext_GetInput, GetInputFn)(ctx, i, &v);
  if (st) return st;
  if (v == NULL) return ort_invalid(api, "ortrain.cpu.%s: input %zu is missing", k->name, i);
  if ((st = ort_shape_of(api, v, t->dims, &t->rank, &elem))) return st;
  if (elem != type)
    return ort_invalid(api, "ortrain.cpu.%s: input %zu must be %s, got element type %d", k->name,
                       i, type == ELEM_INT64 ? "int64" : type == ELEM_BOOL ? "bool" : "float32", elem);
  t->count = 1;
  for (size_t d = 0; d < t->rank; ++d) t->count *= t->dims[d];
  return API_FN(api, I_GetTensorMutableData, GetTensorMutableDataFn)((OrtValue*)v, &t->data);
}

static inline OrtStatus* input(const Kernel* k, OrtKernelContext* ctx, size_t i, Tensor* t) {
  return input_typed(k, ctx, i, t, ELEM_FLOAT);
}

static inline OrtStatus* output(const Kernel* k, OrtKernelContext* ctx, size_t i, const int64_t* dims,
                         size_t rank, float** data) {
  OrtValue* v = NULL;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetOutput, GetOutputFn)(ctx, i, dims, rank, &v);
  if (st) return st;
  return API_FN(k->api, I_GetTensorMutableData, GetTensorMutableDataFn)(v, (void**)data);
}

/* input i when the node gives it (an optional input may be absent or left out) */
static inline OrtStatus* optional_input(const Kernel* k, OrtKernelContext* ctx, size_t i, Tensor* t,
                                 int* given) {
  size_t n = 0;
  const OrtValue* v = NULL;
  *given = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n);
  if (st || i >= n) return st;
  if ((st = API_FN(k->api, I_KernelContext_GetInput, GetInputFn)(ctx, i, &v)) || v == NULL)
    return st;
  *given = 1;
  return input(k, ctx, i, t);
}

/* output i, or *data = NULL where the node leaves that (optional) output out */
static inline OrtStatus* optional_output(const Kernel* k, OrtKernelContext* ctx, size_t i,
                                         const int64_t* dims, size_t rank, float** data) {
  OrtValue* v = NULL;
  *data = NULL;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetOutput, GetOutputFn)(ctx, i, dims, rank, &v);
  if (st || v == NULL) return st;
  return API_FN(k->api, I_GetTensorMutableData, GetTensorMutableDataFn)(v, (void**)data);
}

static inline void shape_text(const Tensor* t, char* out, size_t size) {
  size_t used = (size_t)snprintf(out, size, "[");
  for (size_t d = 0; d < t->rank && used < size; ++d)
    used += (size_t)snprintf(out + used, size - used, d ? ", %lld" : "%lld", (long long)t->dims[d]);
  if (used < size) snprintf(out + used, size - used, "]");
}

static inline OrtStatus* same_shape(const Kernel* k, const Tensor* a, const char* a_name, const Tensor* b,
                             const char* b_name) {
  int same = a->rank == b->rank;
  for (size_t d = 0; same && d < a->rank; ++d) same = a->dims[d] == b->dims[d];
  if (same) return NULL;
  char sa[128], sb[128];
  shape_text(a, sa, sizeof sa);
  shape_text(b, sb, sizeof sb);
  return ort_invalid(k->api, "ortrain.cpu.%s: %s is %s but %s is %s", k->name, a_name, sa, b_name,
                     sb);
}

/* ------------------------------------------------------------------- rows */
static inline int64_t rows_per_block(int64_t cols) {
  int64_t r = cols > 0 ? ELEMS_PER_BLOCK / cols : 1;
  return r < 1 ? 1 : r;
}

/* sum of a[i] * b[i] with 16 running partial sums (they vectorize; one would not) */
static inline float dot(const float* restrict a, const float* restrict b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

/* ----------------------------------------------------------- the ops' kernels */
/* KernelComputeV2 of each ortrain.cpu op; cpu_ops.c lists them in the domain's table */
OrtStatus* ortrain_gelu_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_fast_gelu_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_softmax_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_layer_norm_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_batch_norm_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_relu_grad_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_scatter_add_rows_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_scatter_add_columns_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_softmax_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_layer_norm_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_gelu_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_fast_gelu_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_split_last_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_concat_last_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_mul_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_add_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_sub_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_sum_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_adam_step_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_scatter_last_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_scatter_add_last_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_dropout_compute(void* kernel, OrtKernelContext* ctx);
OrtStatus* ortrain_dropout_grad_compute(void* kernel, OrtKernelContext* ctx);
int64_t ortrain_dropout_default_seed(const void* kernel);

#endif
