/* ortrain.cpu::Mul / Add / Sub (numpy broadcasting) and Sum (of same-shape tensors): fp32
 * element-wise arithmetic on the kernels' threads.
 *
 * Why: a Llama block's backward is mostly products of full-size activations (rotary
 * embeddings, RMSNorm and the SiLU gate: llama-tiny's gradient graph runs 141 Muls, 20
 * ms of 153). ONNX Runtime runs them on its intra-op threads, beside the BLAS products'
 * spinning OpenMP workers; these run on that team (kernel_util.h: for_blocks).
 * graph_passes/targets/cpu/elementwise.py moves the large ones here.
 *
 *   Mul / Add / Sub(A, B) -> Y: Y has the broadcast shape (numpy rules, rank <= 8)
 *   Sum(X0, ..., Xn-1) -> Y: 2..8 inputs of one shape, added left to right
 *
 * The output's rows (its last axis) are cut into blocks; each input's row is found from
 * its strides (0 along a broadcast axis), and an input broadcast along the last axis is
 * read as one value per row. Mul / Add / Sub with out_transposed = 1 store Y [cols, rows],
 * the transpose of its 2-D view (graph_passes/targets/cpu/transposed_activations.py).
 */
#include "kernel_util.h"

#define MAX_SUM 8

enum { OP_MUL, OP_ADD, OP_SUB };

typedef struct {
  const float *a, *b;
  float* y;
  int op;
  size_t rank;                      /* the output's */
  int64_t dims[8];                  /* the output's */
  int64_t sa[8], sb[8];             /* element strides of A and B along each output axis */
  int64_t rows, cols, rows_per_block;
} Binary;

/* y[i] = a[i * ia] op b[i * ib] over one row, ia / ib in {0, 1} */
#define ROW_LOOP(OPX)                                                        \
  if (ia && ib) {                                                            \
    for (int64_t i = 0; i < n; ++i) y[i] = OPX(a[i], b[i]);                  \
  } else if (ia) {                                                           \
    const float bv = b[0];                                                   \
    for (int64_t i = 0; i < n; ++i) y[i] = OPX(a[i], bv);                    \
  } else if (ib) {                                                           \
    const float av = a[0];                                                   \
    for (int64_t i = 0; i < n; ++i) y[i] = OPX(av, b[i]);                    \
  } else {                                                                   \
    const float v = OPX(a[0], b[0]);                                         \
    for (int64_t i = 0; i < n; ++i) y[i] = v;                                \
  }
#define MUL(x, z) ((x) * (z))
#define ADD(x, z) ((x) + (z))
#define SUB(x, z) ((x) - (z))

/* The row's offsets into A and B */
static inline void row_offsets(const Binary* w, int64_t r, int64_t* oa, int64_t* ob) {
  int64_t rest = r;
  *oa = 0, *ob = 0;
  for (size_t d = w->rank - 1; d-- > 0;) { /* the row's index along each leading axis */
    const int64_t i = rest % w->dims[d];
    rest /= w->dims[d];
    *oa += i * w->sa[d], *ob += i * w->sb[d];
  }
}

static void binary_block(void* work, size_t blk) {
  const Binary* w = (const Binary*)work;
  int64_t lo = (int64_t)blk * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  const int64_t n = w->cols;
  const size_t last = w->rank - 1;
  const int ia = w->sa[last] != 0, ib = w->sb[last] != 0;
  for (int64_t r = lo; r < hi; ++r) {
    int64_t oa, ob;
    row_offsets(w, r, &oa, &ob);
    const float* restrict a = w->a + oa;
    const float* restrict b = w->b + ob;
    float* restrict y = w->y + r * n;
    switch (w->op) {
      case OP_MUL: ROW_LOOP(MUL) break;
      case OP_ADD: ROW_LOOP(ADD) break;
      default: ROW_LOOP(SUB) break;
    }
  }
}

/* out_transposed = 1: Y stored [cols, rows], the transpose of its 2-D view (kernel_util.h:
 * TRANSPOSED_ROWS), for a weight gradient's plain product
 * (graph_passes/targets/cpu/transposed_activations.py) */
static void binary_transposed_block(void* work, size_t blk) {
  const Binary* w = (const Binary*)work;
  const int64_t lo = (int64_t)blk * TRANSPOSED_ROWS, cols = w->cols;
  const int64_t nr = w->rows - lo < TRANSPOSED_ROWS ? w->rows - lo : TRANSPOSED_ROWS;
  const size_t last = w->rank - 1;
  const int ia = w->sa[last] != 0, ib = w->sb[last] != 0;
  int64_t oa[TRANSPOSED_ROWS], ob[TRANSPOSED_ROWS];
  for (int64_t r = 0; r < nr; ++r) row_offsets(w, lo + r, &oa[r], &ob[r]);
  float tile[TRANSPOSED_ROWS * TILE_COLUMNS];
  for (int64_t c0 = 0; c0 < cols; c0 += TILE_COLUMNS) {
    const int64_t n = cols - c0 < TILE_COLUMNS ? cols - c0 : TILE_COLUMNS;
    for (int64_t r = 0; r < nr; ++r) {
      const float* restrict a = w->a + oa[r] + (ia ? c0 : 0);
      const float* restrict b = w->b + ob[r] + (ib ? c0 : 0);
      float* restrict y = tile + r * TILE_COLUMNS;
      switch (w->op) {
        case OP_MUL: ROW_LOOP(MUL) break;
        case OP_ADD: ROW_LOOP(ADD) break;
        default: ROW_LOOP(SUB) break;
      }
    }
    transpose_into(tile, TILE_COLUMNS, w->y + c0 * w->rows + lo, w->rows, nr, n);
  }
}

static OrtStatus* binary_compute(const Kernel* k, OrtKernelContext* ctx, int op) {
  Tensor a, b;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &a)) || (st = input(k, ctx, 1, &b))) return st;
  Binary w = {(const float*)a.data, (const float*)b.data, NULL, op, 0, {0}, {0}, {0}, 0, 0, 0};
  w.rank = a.rank > b.rank ? a.rank : b.rank;
  if (w.rank == 0) w.rank = 1; /* two scalars: one row of one */
  int64_t sa = 1, sb = 1;
  for (size_t d = w.rank; d-- > 0;) { /* right-aligned, as numpy */
    const size_t off_a = w.rank - a.rank, off_b = w.rank - b.rank;
    const int64_t da = d >= off_a && a.rank ? a.dims[d - off_a] : 1;
    const int64_t db = d >= off_b && b.rank ? b.dims[d - off_b] : 1;
    if (da != db && da != 1 && db != 1) {
      char s_a[128], s_b[128];
      shape_text(&a, s_a, sizeof s_a);
      shape_text(&b, s_b, sizeof s_b);
      return ort_invalid(k->api, "ortrain.cpu.%s: A %s and B %s do not broadcast", k->name, s_a,
                         s_b);
    }
    w.dims[d] = da > db ? da : db;
    if (da == 0 || db == 0) w.dims[d] = 0;
    w.sa[d] = da == 1 ? 0 : sa;
    w.sb[d] = db == 1 ? 0 : sb;
    sa *= da, sb *= db;
  }
  w.cols = w.dims[w.rank - 1];
  int64_t count = 1;
  for (size_t d = 0; d < w.rank; ++d) count *= w.dims[d];
  w.rows = w.cols ? count / w.cols : 0;
  w.rows_per_block = rows_per_block(w.cols);
  const size_t out_rank = a.rank > b.rank ? a.rank : b.rank;
  const int64_t y_dims[2] = {w.cols, w.rows}; /* out_transposed: the 2-D view, transposed */
  if ((k->out_transposed & 1)) st = output(k, ctx, 0, y_dims, 2, &w.y);
  else st = output(k, ctx, 0, w.dims, out_rank, &w.y);
  if (st) return st;
  if (count == 0) return NULL;
  if ((k->out_transposed & 1))
    for_blocks(k, ctx, binary_transposed_block, div_up((size_t)w.rows, TRANSPOSED_ROWS), &w);
  else
    for_blocks(k, ctx, binary_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}

OrtStatus* ortrain_mul_compute(void* kernel, OrtKernelContext* ctx) {
  return binary_compute((const Kernel*)kernel, ctx, OP_MUL);
}

OrtStatus* ortrain_add_compute(void* kernel, OrtKernelContext* ctx) {
  return binary_compute((const Kernel*)kernel, ctx, OP_ADD);
}

OrtStatus* ortrain_sub_compute(void* kernel, OrtKernelContext* ctx) {
  return binary_compute((const Kernel*)kernel, ctx, OP_SUB);
}

/* ---------------------------------------------------------------------------- Sum */
typedef struct {
  const float* x[MAX_SUM];
  float* y;
  int64_t parts, n;
} Sum;

static void sum_block(void* work, size_t blk) {
  const Sum* w = (const Sum*)work;
  int64_t lo = (int64_t)blk * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK;
  if (hi > w->n) hi = w->n;
  float* restrict y = w->y;
  const float* restrict x0 = w->x[0];
  const float* restrict x1 = w->x[1];
  for (int64_t i = lo; i < hi; ++i) y[i] = x0[i] + x1[i];
  for (int64_t p = 2; p < w->parts; ++p) {
    const float* restrict xp = w->x[p];
    for (int64_t i = lo; i < hi; ++i) y[i] += xp[i];
  }
}

OrtStatus* ortrain_sum_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  size_t n = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n);
  if (st) return st;
  if (n < 2 || n > MAX_SUM)
    return ort_invalid(k->api, "ortrain.cpu.Sum: %zu inputs; expected 2 to %d", n, MAX_SUM);
  Tensor x[MAX_SUM];
  Sum w = {{NULL}, NULL, (int64_t)n, 0};
  for (size_t p = 0; p < n; ++p) {
    if ((st = input(k, ctx, p, &x[p]))) return st;
    if (p > 0 && (st = same_shape(k, &x[p], "an input", &x[0], "input 0"))) return st;
    w.x[p] = (const float*)x[p].data;
  }
  w.n = x[0].count;
  if ((st = output(k, ctx, 0, x[0].dims, x[0].rank, &w.y))) return st;
  for_blocks(k, ctx, sum_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}
