/* ortrain.cpu::SplitLast / ConcatLast: fp32 Split and Concat along the last axis, the
 * copies around attention's fused QKV product (its output split into Q, K and V; their
 * gradients concatenated back for the product's backward).
 *
 * Why: ONNX Runtime's CPU Split and Concat copy on one thread: 0.46-0.6 ms for GPT-2
 * small's [2, 256, 2304] <-> 3 x [2, 256, 768], ~16 GB/s, while the products around them
 * run on two. Here rows are cut into blocks run on the kernels' threads (kernel_util.h:
 * for_blocks, torch's OpenMP team), each copying its rows' segments
 * (graph_passes/cpu_split_concat.py moves the nodes here).
 *
 *   SplitLast(X [..., W]) -> Y0, ..., Yn-1 [..., W / n]   (n outputs, 1..8; W % n == 0)
 *   ConcatLast(X0 [..., w0], ..., Xn-1 [..., wn-1]) -> Y [..., sum w]   (2..8 inputs, one
 *     leading shape)
 */
#include "kernel_util.h"

#define MAX_PARTS 8

typedef struct {
  const float* src[MAX_PARTS]; /* Split: src[0] only */
  float* dst[MAX_PARTS];       /* Concat: dst[0] only */
  int64_t width[MAX_PARTS];    /* each part's last axis */
  int64_t parts, total, rows, rows_per_block;
} Parts;

static void split_block(void* work, size_t b) {
  const Parts* w = (const Parts*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  for (int64_t r = lo; r < hi; ++r) {
    const float* row = w->src[0] + r * w->total;
    for (int64_t p = 0; p < w->parts; ++p) {
      memcpy(w->dst[p] + r * w->width[p], row, (size_t)w->width[p] * sizeof(float));
      row += w->width[p];
    }
  }
}

static void concat_block(void* work, size_t b) {
  const Parts* w = (const Parts*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  for (int64_t r = lo; r < hi; ++r) {
    float* row = w->dst[0] + r * w->total;
    for (int64_t p = 0; p < w->parts; ++p) {
      memcpy(row, w->src[p] + r * w->width[p], (size_t)w->width[p] * sizeof(float));
      row += w->width[p];
    }
  }
}

OrtStatus* ortrain_split_last_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor x;
  size_t n = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetOutputCount, GetOutputCountFn)(ctx, &n);
  if (st || (st = input(k, ctx, 0, &x))) return st;
  if (x.rank < 1) return ort_invalid(k->api, "ortrain.cpu.SplitLast: X is a scalar");
  const int64_t total = x.dims[x.rank - 1];
  if (n < 1 || n > MAX_PARTS || total % (int64_t)n != 0) {
    char sx[128];
    shape_text(&x, sx, sizeof sx);
    return ort_invalid(k->api,
                       "ortrain.cpu.SplitLast: X %s does not split into %zu equal parts along "
                       "its last axis (1 to %d outputs)",
                       sx, n, MAX_PARTS);
  }
  Parts w = {{(const float*)x.data}, {NULL}, {0}, (int64_t)n, total, 0, 0};
  w.rows = total ? x.count / total : 0;
  w.rows_per_block = rows_per_block(total);
  int64_t dims[8];
  memcpy(dims, x.dims, x.rank * sizeof(int64_t));
  dims[x.rank - 1] = total / (int64_t)n;
  for (size_t p = 0; p < n; ++p) {
    w.width[p] = dims[x.rank - 1];
    if ((st = output(k, ctx, p, dims, x.rank, &w.dst[p]))) return st;
  }
  for_blocks(ctx, split_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}

OrtStatus* ortrain_concat_last_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  size_t n = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n);
  if (st) return st;
  if (n < 2 || n > MAX_PARTS)
    return ort_invalid(k->api, "ortrain.cpu.ConcatLast: %zu inputs; expected 2 to %d", n,
                       MAX_PARTS);
  Tensor x[MAX_PARTS];
  Parts w = {{NULL}, {NULL}, {0}, (int64_t)n, 0, 0, 0};
  for (size_t p = 0; p < n; ++p) {
    if ((st = input(k, ctx, p, &x[p]))) return st;
    int same = x[p].rank == x[0].rank && x[p].rank >= 1;
    for (size_t d = 0; same && d + 1 < x[0].rank; ++d) same = x[p].dims[d] == x[0].dims[d];
    if (!same) {
      char s0[128], sp[128];
      shape_text(&x[0], s0, sizeof s0);
      shape_text(&x[p], sp, sizeof sp);
      return ort_invalid(k->api,
                         "ortrain.cpu.ConcatLast: input %zu is %s, input 0 %s: all but the last "
                         "axis must agree",
                         p, sp, s0);
    }
    w.src[p] = (const float*)x[p].data;
    w.width[p] = x[p].dims[x[p].rank - 1];
    w.total += w.width[p];
  }
  int64_t dims[8];
  memcpy(dims, x[0].dims, x[0].rank * sizeof(int64_t));
  dims[x[0].rank - 1] = w.total;
  w.rows = w.width[0] ? x[0].count / w.width[0] : 1;
  for (size_t d = 0; d + 1 < x[0].rank && !w.width[0]; ++d) w.rows *= x[0].dims[d];
  w.rows_per_block = rows_per_block(w.total);
  if ((st = output(k, ctx, 0, dims, x[0].rank, &w.dst[0]))) return st;
  for_blocks(ctx, concat_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}
