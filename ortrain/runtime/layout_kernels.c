/* ortrain.cpu::SplitLast / ConcatLast: fp32 Split and Concat along the last axis, the
 * copies around attention's fused QKV product (its output split into Q, K and V; their
 * gradients concatenated back for the product's backward).
 *
 * Why: ONNX Runtime's CPU Split and Concat copy on one thread: 0.46-0.6 ms for GPT-2
 * small's [2, 256, 2304] <-> 3 x [2, 256, 768], ~16 GB/s, while the products around them
 * run on two. Here rows are cut into blocks run on the kernels' threads (kernel_util.h:
 * for_blocks, torch's OpenMP team), each copying its rows' segments
 * (graph_passes/targets/cpu/split_concat.py moves the nodes here).
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
  for_blocks(k, ctx, split_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
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
  for_blocks(k, ctx, concat_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}

/* ------------------------------------------------------------------ ScatterLast */
/* ScatterLast / ScatterAddLast(data, indices, updates) -> out: ONNX ScatterElements
 * along the last axis, reduction "none" / "add", with indices and updates of data's shape
 * but for the last axis: out = data; out[..., indices[..., j]] = (or +=) updates[..., j],
 * in index order. Output 0 may take data's buffer (GetMayInplace): the cross-entropy
 * gradient (the probabilities with -1 added at each row's label) then writes its few
 * entries into the probabilities instead of copying [tokens x vocab] floats (GPT-2 small:
 * 98 MiB, 14.7 ms a step). Every index is checked before anything is written. */
typedef struct {
  const float* src;
  float* dst;
  int64_t n;
} Copy;

static void copy_block(void* work, size_t blk) {
  const Copy* w = (const Copy*)work;
  int64_t lo = (int64_t)blk * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK;
  if (hi > w->n) hi = w->n;
  memcpy(w->dst + lo, w->src + lo, (size_t)(hi - lo) * sizeof(float));
}

static OrtStatus* scatter_last(const Kernel* k, OrtKernelContext* ctx, int add) {
  Tensor data, idx, upd;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &data)) || (st = input_typed(k, ctx, 1, &idx, ELEM_INT64)) ||
      (st = input(k, ctx, 2, &upd)))
    return st;
  if ((st = same_shape(k, &upd, "updates", &idx, "indices"))) return st;
  int same = data.rank >= 1 && idx.rank == data.rank;
  for (size_t d = 0; same && d + 1 < data.rank; ++d) same = idx.dims[d] == data.dims[d];
  if (!same) {
    char sd[128], si[128];
    shape_text(&data, sd, sizeof sd);
    shape_text(&idx, si, sizeof si);
    return ort_invalid(k->api,
                       "ortrain.cpu.%s: indices %s must match data %s but for the last axis",
                       k->name, si, sd);
  }
  const int64_t n = data.dims[data.rank - 1], per_row = idx.dims[idx.rank - 1];
  const int64_t* ind = (const int64_t*)idx.data;
  for (int64_t i = 0; i < idx.count; ++i)
    if (ind[i] < -n || ind[i] >= n)
      return ort_invalid(k->api,
                         "ortrain.cpu.%s: index %lld (entry %lld) is out of range for a last "
                         "axis of %lld",
                         k->name, (long long)ind[i], (long long)i, (long long)n);
  float* out = NULL;
  if ((st = output(k, ctx, 0, data.dims, data.rank, &out))) return st;
  if (out != (float*)data.data) {
    Copy w = {(const float*)data.data, out, data.count};
    for_blocks(k, ctx, copy_block, div_up((size_t)data.count, ELEMS_PER_BLOCK), &w);
  }
  const float* u = (const float*)upd.data;
  for (int64_t i = 0; i < idx.count; ++i) {
    const int64_t row = i / per_row, col = ind[i] < 0 ? ind[i] + n : ind[i];
    if (add)
      out[row * n + col] += u[i];
    else
      out[row * n + col] = u[i];
  }
  return NULL;
}

OrtStatus* ortrain_scatter_last_compute(void* kernel, OrtKernelContext* ctx) {
  return scatter_last((const Kernel*)kernel, ctx, 0);
}

OrtStatus* ortrain_scatter_add_last_compute(void* kernel, OrtKernelContext* ctx) {
  return scatter_last((const Kernel*)kernel, ctx, 1);
}
