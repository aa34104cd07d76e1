/* ortrain.cpu::Softmax(X [, bias]) -> Y: Y = softmax(X + bias) over the last axis, fp32.
 *
 * Why: ONNX Runtime's CPU Softmax runs 5x slower on rows that hold masked logits (the
 * finfo.min a causal or padding mask adds, or anything below ~-88): 0.73 ms instead of
 * 0.15 ms for GPT-2 tiny's [8, 4, 128, 128] attention probabilities, 3.5 ms of a 155 ms
 * step. Here exp is the branch-free exp_approx (0 below -87), as fast on masked rows as on
 * any. The optional bias is the mask: adding it here saves the separate Add's full pass
 * and its temporary (graph_passes/targets/cpu/softmax.py moves Add -> Softmax pairs here).
 *
 * bias broadcasts to X by numpy rules, except on the last axis (it has X's length there).
 * A row whose values are all -inf (or hold a NaN, or +inf) gives NaN, as ONNX's Softmax.
 * Y may be X's buffer (cpu_ops.c offers it, as ONNX Runtime's Softmax does): each row reads
 * an element before it writes it.
 */
#include "kernel_util.h"

typedef struct {
  const float* x;
  const float* bias; /* NULL: none */
  float* y;
  int64_t rows, cols, rows_per_block;
  size_t lead;        /* X's leading axes: all but the last */
  int64_t dims[8];    /* their lengths */
  int64_t bstride[8]; /* the bias's row stride along each (0 where it broadcasts) */
} Softmax;

static const float* bias_row(const Softmax* w, int64_t r) {
  int64_t row = 0;
  for (size_t d = w->lead; d-- > 0;) {
    row += (r % w->dims[d]) * w->bstride[d];
    r /= w->dims[d];
  }
  return w->bias + row * w->cols;
}

/* One row, y = softmax(x + bias). Inlined twice with has_bias constant, so each copy's
 * loops vectorize; the bias is added where x is read (no pass of its own). */
static inline void softmax_row(const float* restrict x, const float* restrict bias,
                               float* restrict y, int64_t n, const int has_bias) {
#define AT(i) (has_bias ? x[i] + bias[i] : x[i])
  float m = -INFINITY; /* omp simd (-fopenmp-simd): GCC vectorizes a float max only so */
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = AT(i) > m ? AT(i) : m;
  if (!(m > -INFINITY && m < INFINITY)) m = NAN; /* all -inf, or +inf: NaN, as ONNX */
  float acc[16] = {0}; /* 16 running sums: they vectorize, one would not */
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      float e = exp_approx(AT(i + j) - m);
      y[i + j] = e;
      acc[j] += e;
    }
  float s = 0.0f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) {
    float e = exp_approx(AT(i) - m);
    y[i] = e;
    s += e;
  }
#undef AT
  const float inv = 1.0f / s;
  for (i = 0; i < n; ++i) y[i] *= inv;
}

static void softmax_block(void* work, size_t b) {
  const Softmax* w = (const Softmax*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  const int64_t n = w->cols;
  for (int64_t r = lo; r < hi; ++r) {
    if (w->bias != NULL)
      softmax_row(w->x + r * n, bias_row(w, r), w->y + r * n, n, 1);
    else
      softmax_row(w->x + r * n, NULL, w->y + r * n, n, 0);
  }
}

OrtStatus* ortrain_softmax_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor x, bias;
  size_t n_inputs = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_inputs);
  if (st || (st = input(k, ctx, 0, &x))) return st;
  if (x.rank < 1) return ort_invalid(k->api, "ortrain.cpu.Softmax: X is a scalar");
  Softmax w = {(const float*)x.data, NULL, NULL, 0, x.dims[x.rank - 1], 0, x.rank - 1, {0}, {0}};
  w.rows = w.cols ? x.count / w.cols : 0;
  w.rows_per_block = rows_per_block(w.cols);
  for (size_t d = 0; d < w.lead; ++d) w.dims[d] = x.dims[d];
  const OrtValue* given = NULL;
  if (n_inputs > 1 &&
      (st = API_FN(k->api, I_KernelContext_GetInput, GetInputFn)(ctx, 1, &given)))
    return st;
  if (given != NULL) {
    if ((st = input(k, ctx, 1, &bias))) return st;
    int fits = bias.rank >= 1 && bias.rank <= x.rank && bias.dims[bias.rank - 1] == w.cols;
    int64_t run = 1; /* bias rows per step along axis d */
    for (size_t d = w.lead; fits && d-- > 0;) {
      size_t off = x.rank - bias.rank;
      int64_t bd = d >= off ? bias.dims[d - off] : 1;
      fits = bd == 1 || bd == x.dims[d];
      w.bstride[d] = bd == 1 ? 0 : run;
      run *= bd;
    }
    if (!fits) {
      char sx[128], sb[128];
      shape_text(&x, sx, sizeof sx);
      shape_text(&bias, sb, sizeof sb);
      return ort_invalid(k->api,
                         "ortrain.cpu.Softmax: bias %s does not broadcast to X %s with X's "
                         "last axis",
                         sb, sx);
    }
    w.bias = (const float*)bias.data;
  }
  if ((st = output(k, ctx, 0, x.dims, x.rank, &w.y))) return st;
  for_blocks(k, ctx, softmax_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}
