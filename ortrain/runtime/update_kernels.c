/* The optimizer update inside the training graph (graph_passes/targets/cpu/update_in_backward.py):
 *
 *   AdamStep(P, G, M, V, H, L[, after0 .. after7]) -> done
 *
 * updates parameter P and its Adam moments M (exp_avg) and V (exp_avg_sq) IN PLACE from
 * gradient G, as torch's fused Adam / AdamW kernels do (torch._fused_adamw_), with the
 * element function the CUDA kernel and its CPU reference share (adam_math.h):
 *
 *   AdamW  p *= 1 - lr wd          Adam  g += wd p
 *   m = lerp(m, g, 1 - beta1);     v = beta2 v + (1 - beta2) g^2
 *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 *
 * H = [lr, beta1, beta2, eps, weight_decay, t, decoupled]: the group's hyperparameters,
 * the 1-based step and 1 for AdamW's decoupled weight decay. L is the loss: where it is
 * not finite nothing changes and done is 0 (1 when applied), so a step whose loss
 * overflowed leaves parameters and moments as they were. The optional inputs are only
 * read by ONNX Runtime's ordering: the nodes that read P (other than through the gradient
 * and the loss) must have run before P changes, and an edge from each of them says so.
 *
 * P, M and V are graph inputs, bound to the trainer's buffers; writing through their
 * const-qualified pointers is what makes the update in place (ONNX Runtime never hands a
 * kernel a copy of a bound input on the CPU). Blocks touch disjoint elements, once each.
 *
 * Attribute grad_transposed = 1: P is [R, C] and G its transpose [C, R], a weight gradient
 * made in the product's faster orientation (graph_passes/targets/cpu/transposed_weight_grad.py). A
 * block is then a run of TILE_ROWS rows of P; each tile of G^T is gathered first (one
 * cache line of G per column) and the same element loop runs on it: the same results.
 */
#include <math.h>
#include "adam_math.h"
#include "kernel_util.h"

enum { H_LR, H_BETA1, H_BETA2, H_EPS, H_WD, H_STEP, H_DECOUPLED, H_COUNT };

typedef struct {
  float *p, *m, *v;
  const float* g;
  int64_t n, rows; /* rows: P's first dim, where G is P's transpose */
  ortrain_adam_coeffs c;
} Adam;

/* One loop for Adam and AdamW; it vectorizes (the library is built with -fno-math-errno:
 * sqrtf is then a vector square root, as in torch's kernel). */
static inline void adam_span(const Adam* w, float* restrict p, float* restrict m,
                             float* restrict v, const float* restrict g, int64_t n) {
  const ortrain_adam_coeffs c = w->c;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) ortrain_adam_element(p + i, g[i], m + i, v + i, &c);
}

static void adam_block(void* work, size_t blk) {
  const Adam* w = (const Adam*)work;
  int64_t lo = (int64_t)blk * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK;
  if (hi > w->n) hi = w->n;
  adam_span(w, w->p + lo, w->m + lo, w->v + lo, w->g + lo, hi - lo);
}

enum { TILE_ROWS = 64, TILE_COLS = 64 }; /* 16 KiB: each column of G read 256 B at a time */

/* Rows [lo, lo + TILE_ROWS) of P [rows, cols] from G [cols, rows], in column tiles */
static void adam_transposed_block(void* work, size_t blk) {
  const Adam* w = (const Adam*)work;
  const int64_t rows = w->rows, cols = w->n / w->rows;
  const int64_t lo = (int64_t)blk * TILE_ROWS, nr = rows - lo < TILE_ROWS ? rows - lo : TILE_ROWS;
  float tile[TILE_ROWS * TILE_COLS];
  for (int64_t c0 = 0; c0 < cols; c0 += TILE_COLS) {
    const int64_t nc = cols - c0 < TILE_COLS ? cols - c0 : TILE_COLS;
    /* tile[r * TILE_COLS + c] = G[c0 + c, lo + r] */
    transpose_into(w->g + c0 * rows + lo, rows, tile, TILE_COLS, nc, nr);
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t at = (lo + r) * cols + c0;
      adam_span(w, w->p + at, w->m + at, w->v + at, tile + r * TILE_COLS, nc);
    }
  }
}

OrtStatus* ortrain_adam_step_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor p, g, m, v, h, loss;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &p)) || (st = input(k, ctx, 1, &g)) || (st = input(k, ctx, 2, &m)) ||
      (st = input(k, ctx, 3, &v)) || (st = input(k, ctx, 4, &h)) || (st = input(k, ctx, 5, &loss)))
    return st;
  if (k->grad_transposed) {
    if (p.rank != 2 || g.rank != 2 || g.dims[0] != p.dims[1] || g.dims[1] != p.dims[0]) {
      char sg[128], sp[128];
      shape_text(&g, sg, sizeof sg);
      shape_text(&p, sp, sizeof sp);
      return ort_invalid(k->api,
                         "ortrain.cpu.AdamStep: gradient G is %s but parameter P is %s "
                         "(grad_transposed: G must be P's transpose, both 2-D)",
                         sg, sp);
    }
  } else if ((st = same_shape(k, &g, "gradient G", &p, "parameter P"))) {
    return st;
  }
  if ((st = same_shape(k, &m, "exp_avg M", &p, "parameter P")) ||
      (st = same_shape(k, &v, "exp_avg_sq V", &p, "parameter P")))
    return st;
  if (h.count != H_COUNT)
    return ort_invalid(k->api,
                       "ortrain.cpu.AdamStep: hyperparameters H hold %lld values; expected %d "
                       "(lr, beta1, beta2, eps, weight_decay, step, decoupled)",
                       (long long)h.count, H_COUNT);
  if (loss.count != 1)
    return ort_invalid(k->api, "ortrain.cpu.AdamStep: loss L holds %lld values; expected 1",
                       (long long)loss.count);
  float* done = NULL;
  if ((st = output(k, ctx, 0, NULL, 0, &done))) return st;
  const float* hv = (const float*)h.data;
  if (!isfinite(*(const float*)loss.data)) {
    *done = 0.0f;
    return NULL;
  }
  /* torch's kernels take the bias corrections in double, then the step in float */
  Adam w = {(float*)p.data, (float*)m.data, (float*)v.data, (const float*)g.data, p.count,
            p.rank ? p.dims[0] : 1,
            ortrain_adam_coeffs_of(hv[H_LR], hv[H_BETA1], hv[H_BETA2], hv[H_EPS], hv[H_WD],
                                   hv[H_STEP], hv[H_DECOUPLED] != 0.0f)};
  if (k->grad_transposed && w.n > 0)
    for_blocks(k, ctx, adam_transposed_block, div_up((size_t)w.rows, TILE_ROWS), &w);
  else
    for_blocks(k, ctx, adam_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  *done = 1.0f;
  return NULL;
}
