/* ortrain.cpu::LayerNorm / Gelu / FastGelu: the forward kernels between a transformer's
 * products, fp32, for ONNX Runtime's CPU execution provider.
 *
 * Why: the products run on torch's OpenMP team (ortrain.blas), whose workers spin a while
 * after each one; ONNX Runtime's own LayerNormalization and Gelu run on its intra-op
 * threads, which then share the cores with the spinning workers (in GPT-2 small's
 * gradient graph: 0.25-0.3 ms per LayerNorm that takes 0.14 ms alone). These run on the
 * same team (kernel_util.h: for_blocks), and LayerNorm takes in the residual Add before
 * it: the sum is written once and normalized while its row is in cache
 * (graph_passes/targets/cpu/layer_norm.py, graph_passes/targets/cpu/gelu.py move the nodes here).
 *
 *   LayerNorm(X, scale [, bias] [, skip]) -> Y [, mean, inv_std] [, sum]   over the last axis:
 *     S = X + skip (or X), mean = avg(S), inv_std = 1 / sqrt(avg((S - mean)^2) + epsilon),
 *     Y = (S - mean) * inv_std * scale + bias; mean and inv_std have S's shape with a last
 *     axis of 1 (ONNX LayerNormalization's, axis = -1); sum is S (asked for with skip).
 *     epsilon: attribute (default 1e-5). out_transposed = 1: Y is stored [cols, rows],
 *     the transpose of S's 2-D view (kernel_util.h: TRANSPOSED_ROWS), for a weight gradient
 *     that reads it as a plain product's operand (graph_passes/targets/cpu/transposed_activations.py).
 *   Gelu(X) -> Y       Y = X Phi(X)                                  (erf GELU)
 *   FastGelu(X) -> Y   Y = X sigmoid(k X (1 + a X^2)), k = 2 sqrt(2/pi), a = 0.044715
 *     (both: out_transposed = 1 stores Y as the transpose of X's 2-D view)
 *
 * The variance is taken about the mean (two passes over a row held in cache), not as
 * E[S^2] - mean^2, which cancels where |mean| >> std.
 */
#include "kernel_util.h"

/* ------------------------------------------------------------------- LayerNorm */
typedef struct {
  const float *x, *skip, *scale, *bias; /* skip, bias: NULL where not given */
  float *y, *mean, *inv_std, *sum;      /* mean, inv_std, sum: NULL where not asked for */
  float epsilon;
  int64_t rows, cols, rows_per_block;
} Norm;

/* mean and 1 / std of the row S = x (+ skip) over n columns: two passes, in 16 running
 * sums (they vectorize) */
static inline void row_stats(const float* restrict x, const float* restrict skip, int64_t n,
                             float epsilon, float* mu_out, float* rs_out) {
  const float inv_n = 1.0f / (float)n;
  float acc[16] = {0};
  int64_t c = 0;
  if (skip != NULL) {
    for (; c + 16 <= n; c += 16)
      for (int j = 0; j < 16; ++j) acc[j] += x[c + j] + skip[c + j];
  } else {
    for (; c + 16 <= n; c += 16)
      for (int j = 0; j < 16; ++j) acc[j] += x[c + j];
  }
  float total = 0.0f;
  for (int j = 0; j < 16; ++j) total += acc[j];
  for (; c < n; ++c) total += skip != NULL ? x[c] + skip[c] : x[c];
  const float mu = total * inv_n;
  float sq[16] = {0};
  if (skip != NULL) {
    for (c = 0; c + 16 <= n; c += 16)
      for (int j = 0; j < 16; ++j) {
        float d = x[c + j] + skip[c + j] - mu;
        sq[j] += d * d;
      }
  } else {
    for (c = 0; c + 16 <= n; c += 16)
      for (int j = 0; j < 16; ++j) {
        float d = x[c + j] - mu;
        sq[j] += d * d;
      }
  }
  float var = 0.0f;
  for (int j = 0; j < 16; ++j) var += sq[j];
  for (; c < n; ++c) {
    const float d = (skip != NULL ? x[c] + skip[c] : x[c]) - mu;
    var += d * d;
  }
  *mu_out = mu;
  *rs_out = 1.0f / sqrtf(var * inv_n + epsilon);
}

/* y = (s - mu) * rs * scale + bias (bias NULL: none) over n columns; s may be y itself
 * (no restrict on either: the simd pragma vectorizes the loop anyway) */
static inline void norm_span(const float* s, float mu, float rs, const float* restrict scale,
                             const float* restrict bias, float* y, int64_t n) {
  if (bias != NULL) {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) y[c] = (s[c] - mu) * rs * scale[c] + bias[c];
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) y[c] = (s[c] - mu) * rs * scale[c];
  }
}

static void norm_block(void* work, size_t b) {
  const Norm* w = (const Norm*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  const int64_t n = w->cols;
  for (int64_t r = lo; r < hi; ++r) {
    const float* restrict x = w->x + r * n;
    float* restrict y = w->y + r * n;
    const float* s = x;
    if (w->skip != NULL) { /* S into the sum output, or into Y, which is overwritten below */
      const float* restrict skip = w->skip + r * n;
      float* restrict out = w->sum != NULL ? w->sum + r * n : y;
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) out[c] = x[c] + skip[c];
      s = out;
    }
    float mu, rs;
    row_stats(s, NULL, n, w->epsilon, &mu, &rs);
    norm_span(s, mu, rs, w->scale, w->bias, y, n);
    if (w->mean != NULL) w->mean[r] = mu;
    if (w->inv_std != NULL) w->inv_std[r] = rs;
  }
}

/* out_transposed = 1: Y is stored [cols, rows], the transpose of S's 2-D view (kernel_util.h:
 * TRANSPOSED_ROWS) */
static void norm_transposed_block(void* work, size_t b) {
  const Norm* w = (const Norm*)work;
  const int64_t n = w->cols, lo = (int64_t)b * TRANSPOSED_ROWS;
  const int64_t nr = w->rows - lo < TRANSPOSED_ROWS ? w->rows - lo : TRANSPOSED_ROWS;
  float mu[TRANSPOSED_ROWS], rs[TRANSPOSED_ROWS];
  for (int64_t r = 0; r < nr; ++r) {
    const int64_t at = (lo + r) * n;
    const float* skip = w->skip != NULL ? w->skip + at : NULL;
    if (skip != NULL && w->sum != NULL) {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) w->sum[at + c] = w->x[at + c] + skip[c];
    }
    row_stats(w->x + at, skip, n, w->epsilon, &mu[r], &rs[r]);
    if (w->mean != NULL) w->mean[lo + r] = mu[r];
    if (w->inv_std != NULL) w->inv_std[lo + r] = rs[r];
  }
  float tile[TRANSPOSED_ROWS * TILE_COLUMNS], s[TILE_COLUMNS];
  for (int64_t c0 = 0; c0 < n; c0 += TILE_COLUMNS) {
    const int64_t nc = n - c0 < TILE_COLUMNS ? n - c0 : TILE_COLUMNS;
    const float* bias = w->bias != NULL ? w->bias + c0 : NULL;
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t at = (lo + r) * n + c0;
      const float* row = w->x + at;
      if (w->skip != NULL) { /* S as the row path has it: x + skip, rounded once */
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) s[c] = w->x[at + c] + w->skip[at + c];
        row = s;
      }
      norm_span(row, mu[r], rs[r], w->scale + c0, bias, tile + r * TILE_COLUMNS, nc);
    }
    transpose_into(tile, TILE_COLUMNS, w->y + c0 * w->rows + lo, w->rows, nr, nc);
  }
}

OrtStatus* ortrain_layer_norm_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor x, scale, bias, skip;
  int has_bias = 0, has_skip = 0;
  size_t n_outputs = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetOutputCount, GetOutputCountFn)(ctx, &n_outputs);
  if (st || (st = input(k, ctx, 0, &x)) || (st = input(k, ctx, 1, &scale)) ||
      (st = optional_input(k, ctx, 2, &bias, &has_bias)) ||
      (st = optional_input(k, ctx, 3, &skip, &has_skip)))
    return st;
  if (x.rank < 1) return ort_invalid(k->api, "ortrain.cpu.LayerNorm: X is a scalar");
  const int64_t cols = x.dims[x.rank - 1], rows = cols ? x.count / cols : 0;
  if (scale.count != cols || (has_bias && bias.count != cols))
    return ort_invalid(k->api,
                       "ortrain.cpu.LayerNorm: scale / bias have %lld / %lld elements, X's last "
                       "axis %lld",
                       (long long)scale.count, (long long)(has_bias ? bias.count : cols),
                       (long long)cols);
  if (has_skip && (st = same_shape(k, &x, "X", &skip, "skip"))) return st;
  if (n_outputs > 3 && !has_skip)
    return ort_invalid(k->api, "ortrain.cpu.LayerNorm: the sum output needs a skip input");
  Norm w = {(const float*)x.data, has_skip ? (const float*)skip.data : NULL,
            (const float*)scale.data, has_bias ? (const float*)bias.data : NULL,
            NULL, NULL, NULL, NULL, k->epsilon, rows, cols, rows_per_block(cols)};
  int64_t stat[8];
  for (size_t d = 0; d < x.rank; ++d) stat[d] = x.dims[d];
  stat[x.rank - 1] = 1;
  const int64_t y_dims[2] = {cols, rows}; /* out_transposed: S's 2-D view, transposed */
  if ((k->out_transposed & 1)) st = output(k, ctx, 0, y_dims, 2, &w.y);
  else st = output(k, ctx, 0, x.dims, x.rank, &w.y);
  if (st) return st;
  if (n_outputs > 1 && (st = optional_output(k, ctx, 1, stat, x.rank, &w.mean))) return st;
  if (n_outputs > 2 && (st = optional_output(k, ctx, 2, stat, x.rank, &w.inv_std))) return st;
  if (n_outputs > 3 && (st = optional_output(k, ctx, 3, x.dims, x.rank, &w.sum))) return st;
  if ((k->out_transposed & 1))
    for_blocks(k, ctx, norm_transposed_block, div_up((size_t)rows, TRANSPOSED_ROWS), &w);
  else
    for_blocks(k, ctx, norm_block, div_up((size_t)rows, (size_t)w.rows_per_block), &w);
  return NULL;
}

/* ------------------------------------------------------------------------ GELU */
typedef struct {
  const float* x;
  float* y;
  int64_t n, rows, cols; /* rows x cols: X's 2-D view (out_transposed) */
} Map;

#define GELU_FORWARD(name, value)                                         \
  static void name(void* work, size_t b) {                                \
    const Map* w = (const Map*)work;                                      \
    int64_t lo = (int64_t)b * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK; \
    if (hi > w->n) hi = w->n;                                             \
    const float* restrict x = w->x;                                       \
    float* restrict y = w->y;                                             \
    for (int64_t i = lo; i < hi; ++i) y[i] = value(x[i]);                 \
  }
GELU_FORWARD(gelu_block, gelu_erf_value)
GELU_FORWARD(fast_gelu_block, gelu_tanh_value)

/* out_transposed = 1: Y stored [cols, rows], the transpose of X's 2-D view */
#define GELU_FORWARD_TRANSPOSED(name, value)                                                \
  static void name(void* work, size_t b) {                                                  \
    const Map* w = (const Map*)work;                                                        \
    const int64_t n = w->cols, lo = (int64_t)b * TRANSPOSED_ROWS;                           \
    const int64_t nr = w->rows - lo < TRANSPOSED_ROWS ? w->rows - lo : TRANSPOSED_ROWS;     \
    float tile[TRANSPOSED_ROWS * TILE_COLUMNS];                                             \
    for (int64_t c0 = 0; c0 < n; c0 += TILE_COLUMNS) {                                      \
      const int64_t nc = n - c0 < TILE_COLUMNS ? n - c0 : TILE_COLUMNS;                     \
      for (int64_t r = 0; r < nr; ++r) {                                                    \
        const float* restrict x = w->x + (lo + r) * n + c0;                                 \
        float* restrict t = tile + r * TILE_COLUMNS;                                        \
        for (int64_t i = 0; i < nc; ++i) t[i] = value(x[i]);                                \
      }                                                                                     \
      transpose_into(tile, TILE_COLUMNS, w->y + c0 * w->rows + lo, w->rows, nr, nc);        \
    }                                                                                       \
  }
GELU_FORWARD_TRANSPOSED(gelu_t_block, gelu_erf_value)
GELU_FORWARD_TRANSPOSED(fast_gelu_t_block, gelu_tanh_value)

static OrtStatus* map_compute(const Kernel* k, OrtKernelContext* ctx, BlockFn block,
                              BlockFn t_block) {
  Tensor x;
  OrtStatus* st = input(k, ctx, 0, &x);
  if (st) return st;
  const int64_t cols = x.rank ? x.dims[x.rank - 1] : 1, rows = cols ? x.count / cols : 0;
  Map w = {(const float*)x.data, NULL, x.count, rows, cols};
  const int64_t t_dims[2] = {cols, rows}; /* out_transposed: X's 2-D view, transposed */
  if (k->out_transposed & 1) {
    if ((st = output(k, ctx, 0, t_dims, 2, &w.y))) return st;
    for_blocks(k, ctx, t_block, div_up((size_t)rows, TRANSPOSED_ROWS), &w);
    return NULL;
  }
  if ((st = output(k, ctx, 0, x.dims, x.rank, &w.y))) return st;
  for_blocks(k, ctx, block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}

OrtStatus* ortrain_gelu_compute(void* kernel, OrtKernelContext* ctx) {
  return map_compute((const Kernel*)kernel, ctx, gelu_block, gelu_t_block);
}

OrtStatus* ortrain_fast_gelu_compute(void* kernel, OrtKernelContext* ctx) {
  return map_compute((const Kernel*)kernel, ctx, fast_gelu_block, fast_gelu_t_block);
}
