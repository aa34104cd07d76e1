/* ortrain.cpu::GeluGrad / FastGeluGrad / LayerNormGrad / SoftmaxGrad: fused fp32 backward
 * kernels for ONNX Runtime's CPU execution provider.
 *
 * Why: stock onnxruntime ships no training kernels, so the gradient rules spell these
 * backwards in standard element-wise ops (graph_passes/autodiff/rules/nn.py): 12 ops and
 * a dozen full-size temporaries for a tanh-GELU, 14 for a LayerNorm. Each op reads and
 * writes the whole tensor, so on a CPU these chains cost several times one fused pass
 * (the role ORT's training build gives GeluGrad, LayerNormalizationGrad, SoftmaxGrad).
 * The rules emit these ops instead when a build runs on the CPU with this library
 * (GradContext.cpu_kernels); the standard spelling stays the reference the tests hold
 * them to.
 *
 *   GeluGrad(dY, X) -> dX [, Y]      dX = dY * (Phi(X) + X * phi(X)), Y = X Phi(X)  (erf GELU)
 *   FastGeluGrad(dY, X) -> dX [, Y]  dX = dY * (s + X s (1 - s) k (1 + 3a X^2)), Y = X s,
 *                                s = sigmoid(k X (1 + a X^2)), k = 2 sqrt(2/pi), a = 0.044715
 *     (Y, optional: the GELU itself, which the backward would otherwise recompute for the
 *     next layer's weight gradient; graph_passes/targets/cpu/gelu_value.py asks for it)
 *     out_transposed (bit 0: dX, bit 1: Y): that output stored [cols, rows], the transpose
 *     of X's 2-D view, for the products that read it (graph_passes/targets/cpu/transposed_activations.py)
 *   SoftmaxGrad(dY, Y) -> dX     dX = Y * (dY - sum(dY * Y)) over the last axis
 *   LayerNormGrad(dY, X, scale, mean, inv_std [, dsum]) -> dX, dscale, dbias   over the
 *     last axis: xhat = (X - mean) * inv_std, g = dY * scale,
 *     dX = inv_std * (g - mean(g) - xhat * mean(g * xhat)) (+ dsum: the gradient X's other
 *     readers sent, added in the same pass; graph_passes/targets/cpu/layer_norm_grad_sum.py),
 *     dscale = sum over rows of dY * xhat, dbias = sum over rows of dY.
 *   BatchNormGrad(dY, X, scale) -> dX, dscale, dbias   training-mode BatchNorm over X
 *     [N, C, ...] (channel axis 1): the batch statistics recomputed per channel (mean,
 *     biased variance, ``epsilon``), xhat = (X - mean) * inv_std,
 *     dX = scale * inv_std * (dY - mean(dY) - xhat * mean(dY * xhat)),
 *     dscale = sum of dY * xhat, dbias = sum of dY over every axis but the channel's.
 *     One block per channel, whose N rows of X and dY stay in cache across its passes.
 *   ScatterAddRows(base, rows, updates) -> out   out = base; out[rows[i]] += updates[i]
 *     (base [V, ...], rows int64 [N] (or [N, 1]), updates [N, ...]; an embedding's
 *     gradient: ScatterElements(add) with the row index expanded over each row, one
 *     index per element, runs 10x slower; graph_passes/targets/cpu/scatter_rows.py moves those here)
 *   ScatterAddColumns(base, cols, updates) -> out   out = base; out[:, cols[i]] += updates[i]
 *     (base [W, V], cols int64 [N] (or [N, 1]), updates [N, W]: the same sum where the
 *     table's gradient is kept transposed; graph_passes/targets/cpu/transposed_weight_grad.py)
 *
 * Work is cut into fixed blocks (of elements or rows) run on the session's intra-op
 * threads (KernelContext_ParallelFor); the row sums of LayerNormGrad are per-block
 * partials added in block order, so results do not depend on the thread count.
 */
#include "kernel_util.h"

/* --------------------------------------------------------------- GELU backward */
typedef struct {
  const float* dy;
  const float* x;
  float* dx;
  float* y; /* NULL: not asked for */
  int64_t n, rows, cols; /* rows x cols: X's 2-D view (out_transposed) */
  int dx_t, y_t;         /* out_transposed's bits: dX, Y stored transposed */
} Pointwise;

/* dx = dy * slope(x) (and y = gelu(x)) over n elements; one function per slope and output
 * set, so each loop inlines it and vectorizes (an unused value is never computed) */
#define GELU_SPAN(name, slope, with_y)                                                   \
  static inline void name(const float* restrict dy, const float* restrict x,             \
                          float* restrict dx, float* restrict y, int64_t n) {            \
    for (int64_t i = 0; i < n; ++i) {                                                    \
      float value;                                                                       \
      dx[i] = dy[i] * slope(x[i], &value);                                               \
      if (with_y) y[i] = value;                                                          \
    }                                                                                    \
  }
GELU_SPAN(gelu_erf_span, gelu_erf_slope, 0)
GELU_SPAN(gelu_tanh_span, gelu_tanh_slope, 0)
GELU_SPAN(gelu_erf_y_span, gelu_erf_slope, 1)
GELU_SPAN(gelu_tanh_y_span, gelu_tanh_slope, 1)

#define GELU_BLOCK(name, span)                                            \
  static void name(void* work, size_t b) {                                \
    const Pointwise* w = (const Pointwise*)work;                          \
    int64_t lo = (int64_t)b * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK; \
    if (hi > w->n) hi = w->n;                                             \
    span(w->dy + lo, w->x + lo, w->dx + lo, w->y ? w->y + lo : NULL, hi - lo); \
  }
GELU_BLOCK(gelu_erf_block, gelu_erf_span)
GELU_BLOCK(gelu_tanh_block, gelu_tanh_span)
GELU_BLOCK(gelu_erf_y_block, gelu_erf_y_span)
GELU_BLOCK(gelu_tanh_y_block, gelu_tanh_y_span)

/* out_transposed: dX (bit 0) and / or Y (bit 1) stored [cols, rows], the transpose of X's
 * 2-D view (kernel_util.h: TRANSPOSED_ROWS); a transposed output goes through a tile */
#define GELU_TRANSPOSED_BLOCK(name, span)                                                    \
  static void name(void* work, size_t b) {                                                   \
    const Pointwise* w = (const Pointwise*)work;                                             \
    const int64_t n = w->cols, lo = (int64_t)b * TRANSPOSED_ROWS;                            \
    const int64_t nr = w->rows - lo < TRANSPOSED_ROWS ? w->rows - lo : TRANSPOSED_ROWS;      \
    float dx_tile[TRANSPOSED_ROWS * TILE_COLUMNS], y_tile[TRANSPOSED_ROWS * TILE_COLUMNS];   \
    for (int64_t c0 = 0; c0 < n; c0 += TILE_COLUMNS) {                                       \
      const int64_t nc = n - c0 < TILE_COLUMNS ? n - c0 : TILE_COLUMNS;                      \
      for (int64_t r = 0; r < nr; ++r) {                                                     \
        const int64_t at = (lo + r) * n + c0;                                                \
        float* dx = w->dx_t ? dx_tile + r * TILE_COLUMNS : w->dx + at;                       \
        float* y = w->y_t ? y_tile + r * TILE_COLUMNS : (w->y ? w->y + at : NULL);           \
        span(w->dy + at, w->x + at, dx, y, nc);                                              \
      }                                                                                      \
      if (w->dx_t)                                                                           \
        transpose_into(dx_tile, TILE_COLUMNS, w->dx + c0 * w->rows + lo, w->rows, nr, nc);   \
      if (w->y_t)                                                                            \
        transpose_into(y_tile, TILE_COLUMNS, w->y + c0 * w->rows + lo, w->rows, nr, nc);     \
    }                                                                                        \
  }
GELU_TRANSPOSED_BLOCK(gelu_erf_t_block, gelu_erf_span)
GELU_TRANSPOSED_BLOCK(gelu_tanh_t_block, gelu_tanh_span)
GELU_TRANSPOSED_BLOCK(gelu_erf_y_t_block, gelu_erf_y_span)
GELU_TRANSPOSED_BLOCK(gelu_tanh_y_t_block, gelu_tanh_y_span)

static OrtStatus* gelu_compute(const Kernel* k, OrtKernelContext* ctx, BlockFn block,
                               BlockFn y_block, BlockFn t_block, BlockFn y_t_block) {
  Tensor dy, x;
  size_t n_outputs = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetOutputCount, GetOutputCountFn)(ctx, &n_outputs);
  if (st || (st = input(k, ctx, 0, &dy)) || (st = input(k, ctx, 1, &x))) return st;
  if ((st = same_shape(k, &dy, "dY", &x, "X"))) return st;
  const int64_t cols = x.rank ? x.dims[x.rank - 1] : 1, rows = cols ? x.count / cols : 0;
  Pointwise w = {(const float*)dy.data, (const float*)x.data, NULL, NULL, x.count, rows, cols,
                 k->out_transposed & 1, (k->out_transposed >> 1) & 1};
  if (w.y_t && n_outputs < 2)
    return ort_invalid(k->api, "ortrain.cpu.%s: out_transposed marks Y, which is not asked for",
                       k->name);
  const int64_t t_dims[2] = {cols, rows}; /* X's 2-D view, transposed */
  if (w.dx_t) st = output(k, ctx, 0, t_dims, 2, &w.dx);
  else st = output(k, ctx, 0, x.dims, x.rank, &w.dx);
  if (st) return st;
  if (n_outputs > 1) {
    if (w.y_t) st = output(k, ctx, 1, t_dims, 2, &w.y);
    else st = output(k, ctx, 1, x.dims, x.rank, &w.y);
    if (st) return st;
  }
  if (w.dx_t || w.y_t) {
    for_blocks(k, ctx, w.y != NULL ? y_t_block : t_block, div_up((size_t)rows, TRANSPOSED_ROWS), &w);
    return NULL;
  }
  for_blocks(k, ctx, w.y != NULL ? y_block : block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}

OrtStatus* ortrain_gelu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  return gelu_compute((const Kernel*)kernel, ctx, gelu_erf_block, gelu_erf_y_block,
                      gelu_erf_t_block, gelu_erf_y_t_block);
}

OrtStatus* ortrain_fast_gelu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  return gelu_compute((const Kernel*)kernel, ctx, gelu_tanh_block, gelu_tanh_y_block,
                      gelu_tanh_t_block, gelu_tanh_y_t_block);
}

/* ------------------------------------------------------------ Softmax backward */
typedef struct {
  const float* dy;
  const float* y;
  float* dx;
  int64_t rows, cols, rows_per_block;
} Rows;

static void softmax_block(void* work, size_t b) {
  const Rows* w = (const Rows*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  const int64_t n = w->cols;
  for (int64_t r = lo; r < hi; ++r) {
    const float* restrict dy = w->dy + r * n;
    const float* restrict y = w->y + r * n;
    float* restrict dx = w->dx + r * n;
    const float s = dot(dy, y, n);
    for (int64_t i = 0; i < n; ++i) dx[i] = y[i] * (dy[i] - s);
  }
}

OrtStatus* ortrain_softmax_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor dy, y;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &dy)) || (st = input(k, ctx, 1, &y))) return st;
  if ((st = same_shape(k, &dy, "dY", &y, "Y"))) return st;
  if (y.rank < 1) return ort_invalid(k->api, "ortrain.cpu.SoftmaxGrad: Y is a scalar");
  Rows w = {(const float*)dy.data, (const float*)y.data, NULL, 0, y.dims[y.rank - 1], 0};
  w.rows = w.cols ? y.count / w.cols : 0;
  w.rows_per_block = rows_per_block(w.cols);
  if ((st = output(k, ctx, 0, y.dims, y.rank, &w.dx))) return st;
  for_blocks(k, ctx, softmax_block, div_up((size_t)w.rows, (size_t)w.rows_per_block), &w);
  return NULL;
}

/* ---------------------------------------------------------- LayerNorm backward */
typedef struct {
  const float *dy, *x, *scale, *mean, *inv_std;
  const float* dsum; /* NULL, or a gradient added to dX (the residual stream's) */
  float* dx;
  float* partial; /* [blocks][2][cols]: per-block sums of dY * xhat and of dY */
  int64_t rows, cols, rows_per_block;
} LayerNorm;

static void layer_norm_block(void* work, size_t b) {
  const LayerNorm* w = (const LayerNorm*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->rows) hi = w->rows;
  const int64_t n = w->cols;
  const float inv_n = 1.0f / (float)n;
  const float* restrict scale = w->scale;
  float* restrict dscale = w->partial + (size_t)b * 2 * (size_t)n;
  float* restrict dbias = dscale + n;
  for (int64_t i = 0; i < n; ++i) dscale[i] = dbias[i] = 0.0f;
  for (int64_t r = lo; r < hi; ++r) {
    const float* restrict dy = w->dy + r * n;
    const float* restrict x = w->x + r * n;
    float* restrict dx = w->dx + r * n;
    const float mu = w->mean[r], rs = w->inv_std[r];
    float a1[16] = {0}, a2[16] = {0}; /* sum g, sum g * xhat */
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
      for (int j = 0; j < 16; ++j) {
        float g = dy[i + j] * scale[i + j];
        a1[j] += g;
        a2[j] += g * ((x[i + j] - mu) * rs);
      }
    float s1 = 0.0f, s2 = 0.0f;
    for (int j = 0; j < 16; ++j) s1 += a1[j], s2 += a2[j];
    for (; i < n; ++i) {
      float g = dy[i] * scale[i];
      s1 += g;
      s2 += g * ((x[i] - mu) * rs);
    }
    const float m1 = s1 * inv_n, m2 = s2 * inv_n;
    if (w->dsum != NULL) {
      const float* restrict add = w->dsum + r * n;
#pragma omp simd /* GCC otherwise leaves this loop scalar (the partials' stores) */
      for (int64_t c = 0; c < n; ++c) {
        float xhat = (x[c] - mu) * rs;
        dx[c] = add[c] + rs * (dy[c] * scale[c] - m1 - xhat * m2);
        dscale[c] += dy[c] * xhat;
        dbias[c] += dy[c];
      }
    } else {
#pragma omp simd
      for (int64_t c = 0; c < n; ++c) {
        float xhat = (x[c] - mu) * rs;
        dx[c] = rs * (dy[c] * scale[c] - m1 - xhat * m2);
        dscale[c] += dy[c] * xhat;
        dbias[c] += dy[c];
      }
    }
  }
}

OrtStatus* ortrain_layer_norm_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor dy, x, scale, mean, inv_std;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &dy)) || (st = input(k, ctx, 1, &x)) ||
      (st = input(k, ctx, 2, &scale)) || (st = input(k, ctx, 3, &mean)) ||
      (st = input(k, ctx, 4, &inv_std)))
    return st;
  if ((st = same_shape(k, &dy, "dY", &x, "X"))) return st;
  if (x.rank < 1) return ort_invalid(k->api, "ortrain.cpu.LayerNormGrad: X is a scalar");
  const int64_t cols = x.dims[x.rank - 1], rows = cols ? x.count / cols : 0;
  if (scale.count != cols)
    return ort_invalid(k->api,
                       "ortrain.cpu.LayerNormGrad: scale has %lld elements, X's last axis %lld",
                       (long long)scale.count, (long long)cols);
  if (mean.count != rows || inv_std.count != rows)
    return ort_invalid(k->api,
                       "ortrain.cpu.LayerNormGrad: mean / inv_std have %lld / %lld elements, "
                       "expected one per row of X (%lld)",
                       (long long)mean.count, (long long)inv_std.count, (long long)rows);
  Tensor dsum;
  int has_dsum = 0;
  if ((st = optional_input(k, ctx, 5, &dsum, &has_dsum))) return st;
  if (has_dsum && (st = same_shape(k, &dsum, "dsum", &x, "X"))) return st;
  LayerNorm w = {(const float*)dy.data, (const float*)x.data, (const float*)scale.data,
                 (const float*)mean.data, (const float*)inv_std.data,
                 has_dsum ? (const float*)dsum.data : NULL, NULL, NULL, rows, cols,
                 rows_per_block(cols)};
  float *dscale = NULL, *dbias = NULL;
  const int64_t vec[1] = {cols};
  if ((st = output(k, ctx, 0, x.dims, x.rank, &w.dx)) || (st = output(k, ctx, 1, vec, 1, &dscale)) ||
      (st = output(k, ctx, 2, vec, 1, &dbias)))
    return st;
  const size_t blocks = div_up((size_t)rows, (size_t)w.rows_per_block);
  w.partial = (float*)malloc((blocks ? blocks : 1) * 2 * (size_t)cols * sizeof(float));
  if (w.partial == NULL)
    return API_FN(k->api, I_CreateStatus, CreateStatusFn)(
        ORT_FAIL, "ortrain.cpu.LayerNormGrad: out of memory for the row-sum partials");
  for_blocks(k, ctx, layer_norm_block, blocks, &w);
  for (int64_t c = 0; c < cols; ++c) dscale[c] = dbias[c] = 0.0f;
  for (size_t b = 0; b < blocks; ++b) { /* in block order: independent of the threads */
    const float* p = w.partial + b * 2 * (size_t)cols;
    for (int64_t c = 0; c < cols; ++c) dscale[c] += p[c], dbias[c] += p[cols + c];
  }
  free(w.partial);
  return NULL;
}

/* ----------------------------------------------------------- row scatter-add */
typedef struct {
  const float* base;
  const float* updates;
  float* out;
  const int64_t* start; /* [n_base + 1]: row v's updates are order[start[v] .. start[v+1]) */
  const int64_t* order; /* update indices grouped by row, ascending within a row */
  int64_t n_base, width, rows_per_block;
} Scatter;

/* Output rows [lo, hi): base's row plus that row's updates in index order, so each
 * element's sum has the same order at any thread count and no two blocks share a row. */
static void scatter_block(void* work, size_t b) {
  const Scatter* w = (const Scatter*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->n_base) hi = w->n_base;
  const int64_t n = w->width;
  for (int64_t v = lo; v < hi; ++v) {
    float* restrict dst = w->out + v * n;
    if (w->out != w->base) memcpy(dst, w->base + v * n, (size_t)n * sizeof(float));
    for (int64_t j = w->start[v]; j < w->start[v + 1]; ++j) {
      const float* restrict src = w->updates + w->order[j] * n;
      for (int64_t c = 0; c < n; ++c) dst[c] += src[c];
    }
  }
}

/* A counting sort of the updates by destination (stable: index order kept within one):
 * destination v's updates are order[start[v] .. start[v+1]). Both arrays are the caller's
 * to free; NULL status on success. */
static OrtStatus* sort_by_destination(const Kernel* k, const int64_t* r, int64_t count,
                                      int64_t n_dest, int64_t** start_out, int64_t** order_out) {
  int64_t* start = (int64_t*)calloc((size_t)n_dest + 1, sizeof(int64_t));
  int64_t* order = (int64_t*)malloc((count ? (size_t)count : 1) * sizeof(int64_t));
  if (start == NULL || order == NULL) {
    free(start);
    free(order);
    char msg[128];
    snprintf(msg, sizeof msg, "ortrain.cpu.%s: out of memory for the update order", k->name);
    return API_FN(k->api, I_CreateStatus, CreateStatusFn)(ORT_FAIL, msg);
  }
  for (int64_t i = 0; i < count; ++i) ++start[(r[i] < 0 ? r[i] + n_dest : r[i]) + 1];
  for (int64_t v = 0; v < n_dest; ++v) start[v + 1] += start[v];
  for (int64_t i = 0; i < count; ++i) {
    int64_t v = r[i] < 0 ? r[i] + n_dest : r[i];
    order[start[v]++] = i; /* start[v] runs up to v+1's start ... */
  }
  for (int64_t v = n_dest; v > 0; --v) start[v] = start[v - 1]; /* ... shifted back */
  start[0] = 0;
  *start_out = start;
  *order_out = order;
  return NULL;
}

/* Every index in [-n, n), or an error naming the entry */
static OrtStatus* check_indices(const Kernel* k, const int64_t* r, int64_t count, int64_t n,
                                const char* what) {
  for (int64_t i = 0; i < count; ++i)
    if (r[i] < -n || r[i] >= n)
      return ort_invalid(k->api,
                         "ortrain.cpu.%s: index %lld (entry %lld) is out of range for %lld %s",
                         k->name, (long long)r[i], (long long)i, (long long)n, what);
  return NULL;
}

OrtStatus* ortrain_scatter_add_rows_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor base, rows, updates;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &base)) || (st = input_typed(k, ctx, 1, &rows, ELEM_INT64)) ||
      (st = input(k, ctx, 2, &updates)))
    return st;
  if (base.rank < 1) return ort_invalid(k->api, "ortrain.cpu.ScatterAddRows: base is a scalar");
  const int64_t n_base = base.dims[0], width = n_base ? base.count / n_base : 0;
  if (updates.count != rows.count * width) {
    char sb[128], su[128], sr[128];
    shape_text(&base, sb, sizeof sb);
    shape_text(&updates, su, sizeof su);
    shape_text(&rows, sr, sizeof sr);
    return ort_invalid(k->api,
                       "ortrain.cpu.ScatterAddRows: updates %s do not hold one row of base %s "
                       "per index (rows %s)",
                       su, sb, sr);
  }
  const int64_t* r = (const int64_t*)rows.data;
  if ((st = check_indices(k, r, rows.count, n_base, "rows"))) return st;
  Scatter w = {(const float*)base.data, (const float*)updates.data, NULL, NULL, NULL,
               n_base, width, rows_per_block(width)};
  if ((st = output(k, ctx, 0, base.dims, base.rank, &w.out))) return st;
  int64_t *start, *order;
  if ((st = sort_by_destination(k, r, rows.count, n_base, &start, &order))) return st;
  w.start = start;
  w.order = order;
  for_blocks(k, ctx, scatter_block, div_up((size_t)n_base, (size_t)w.rows_per_block), &w);
  free(start);
  free(order);
  return NULL;
}

/* -------------------------------------------------------- column scatter-add */
typedef struct {
  const float* base;
  const float* updates;
  float* out;
  const int64_t* order; /* update indices grouped by column, ascending within a column */
  const int64_t* cols;  /* the destination column of each entry of order */
  int64_t n_rows, n_cols, count, rows_per_block;
} ColumnScatter;

/* Output rows [lo, hi): base's row plus, at each update's column, that update's element
 * for the row, the updates in the row scatter's order (so the sums are bit for bit the
 * row scatter's of the transposed table) */
static void column_scatter_block(void* work, size_t b) {
  const ColumnScatter* w = (const ColumnScatter*)work;
  int64_t lo = (int64_t)b * w->rows_per_block, hi = lo + w->rows_per_block;
  if (hi > w->n_rows) hi = w->n_rows;
  const int64_t n = w->n_cols;
  if (w->out != w->base)
    memcpy(w->out + lo * n, w->base + lo * n, (size_t)((hi - lo) * n) * sizeof(float));
  for (int64_t j = 0; j < w->count; ++j) {
    const float* restrict src = w->updates + w->order[j] * w->n_rows;
    float* restrict dst = w->out + w->cols[j];
    for (int64_t r = lo; r < hi; ++r) dst[r * n] += src[r];
  }
}

OrtStatus* ortrain_scatter_add_columns_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor base, cols, updates;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &base)) || (st = input_typed(k, ctx, 1, &cols, ELEM_INT64)) ||
      (st = input(k, ctx, 2, &updates)))
    return st;
  if (base.rank != 2) {
    char sb[128];
    shape_text(&base, sb, sizeof sb);
    return ort_invalid(k->api, "ortrain.cpu.ScatterAddColumns: base is %s; expected 2-D", sb);
  }
  const int64_t n_rows = base.dims[0], n_cols = base.dims[1];
  if (updates.count != cols.count * n_rows) {
    char sb[128], su[128], sc[128];
    shape_text(&base, sb, sizeof sb);
    shape_text(&updates, su, sizeof su);
    shape_text(&cols, sc, sizeof sc);
    return ort_invalid(k->api,
                       "ortrain.cpu.ScatterAddColumns: updates %s do not hold one column of "
                       "base %s per index (cols %s)",
                       su, sb, sc);
  }
  const int64_t* c = (const int64_t*)cols.data;
  if ((st = check_indices(k, c, cols.count, n_cols, "columns"))) return st;
  ColumnScatter w = {(const float*)base.data, (const float*)updates.data, NULL, NULL, NULL,
                     n_rows, n_cols, cols.count, 16};
  if ((st = output(k, ctx, 0, base.dims, base.rank, &w.out))) return st;
  int64_t *start, *order;
  if ((st = sort_by_destination(k, c, cols.count, n_cols, &start, &order))) return st;
  int64_t* dest = (int64_t*)malloc((cols.count ? (size_t)cols.count : 1) * sizeof(int64_t));
  if (dest == NULL) {
    free(start);
    free(order);
    return API_FN(k->api, I_CreateStatus, CreateStatusFn)(
        ORT_FAIL, "ortrain.cpu.ScatterAddColumns: out of memory for the update order");
  }
  for (int64_t v = 0; v < n_cols; ++v)
    for (int64_t j = start[v]; j < start[v + 1]; ++j) dest[j] = v;
  w.order = order;
  w.cols = dest;
  for_blocks(k, ctx, column_scatter_block, div_up((size_t)n_rows, (size_t)w.rows_per_block),
             &w);
  free(start);
  free(order);
  free(dest);
  return NULL;
}

/* ------------------------------------------------------- BatchNorm backward */
typedef struct {
  const float *dy, *x, *scale;
  float *dx, *dscale, *dbias;
  int64_t n, c, inner; /* X is [n, c, inner] */
  float epsilon;
} BatchNorm;

/* sum of a[i] - shift, and of its square (16 lanes: the loops vectorize) */
static void shifted_sums(const float* restrict a, int64_t len, float shift, double* sum,
                         double* sq) {
  float s[16] = {0}, q[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    for (int j = 0; j < 16; ++j) {
      float d = a[i + j] - shift;
      s[j] += d;
      q[j] += d * d;
    }
  for (int j = 0; j < 16; ++j) *sum += s[j], *sq += q[j];
  for (; i < len; ++i) {
    float d = a[i] - shift;
    *sum += d;
    *sq += (double)d * d;
  }
}

/* sum of g, and of g * (x - mean) * rs */
static void grad_sums(const float* restrict g, const float* restrict x, int64_t len, float mean,
                      float rs, double* s1, double* s2) {
  float a[16] = {0}, b[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= len; i += 16)
    for (int j = 0; j < 16; ++j) {
      a[j] += g[i + j];
      b[j] += g[i + j] * ((x[i + j] - mean) * rs);
    }
  for (int j = 0; j < 16; ++j) *s1 += a[j], *s2 += b[j];
  for (; i < len; ++i) {
    *s1 += g[i];
    *s2 += g[i] * ((x[i] - mean) * rs);
  }
}

static void batch_norm_block(void* work, size_t b) {
  const BatchNorm* w = (const BatchNorm*)work;
  const int64_t inner = w->inner, stride = w->c * inner, ch = (int64_t)b;
  const double count = (double)w->n * (double)inner;
  const float* x = w->x + ch * inner; /* sample i's row: x + i * stride */
  const float* dy = w->dy + ch * inner;
  float* dx = w->dx + ch * inner;
  double sum = 0.0, sq = 0.0;
  for (int64_t i = 0; i < w->n; ++i) shifted_sums(x + i * stride, inner, 0.0f, &sum, &sq);
  const float mean = (float)(sum / count);
  sum = sq = 0.0; /* the variance from the centered values: no cancellation */
  for (int64_t i = 0; i < w->n; ++i) shifted_sums(x + i * stride, inner, mean, &sum, &sq);
  const float rs = (float)(1.0 / sqrt(sq / count + (double)w->epsilon));
  double s1 = 0.0, s2 = 0.0;
  for (int64_t i = 0; i < w->n; ++i)
    grad_sums(dy + i * stride, x + i * stride, inner, mean, rs, &s1, &s2);
  const float m1 = (float)(s1 / count), m2 = (float)(s2 / count), k = w->scale[ch] * rs;
  for (int64_t i = 0; i < w->n; ++i) {
    const float* restrict xr = x + i * stride;
    const float* restrict gr = dy + i * stride;
    float* restrict out = dx + i * stride;
#pragma omp simd
    for (int64_t j = 0; j < inner; ++j) out[j] = k * (gr[j] - m1 - (xr[j] - mean) * rs * m2);
  }
  w->dscale[ch] = (float)s2;
  w->dbias[ch] = (float)s1;
}

OrtStatus* ortrain_batch_norm_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor dy, x, scale;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &dy)) || (st = input(k, ctx, 1, &x)) ||
      (st = input(k, ctx, 2, &scale)))
    return st;
  if ((st = same_shape(k, &dy, "dY", &x, "X"))) return st;
  if (x.rank < 2)
    return ort_invalid(k->api, "ortrain.cpu.BatchNormGrad: X has rank %lld, expected [N, C, ...]",
                       (long long)x.rank);
  const int64_t n = x.dims[0], c = x.dims[1];
  if (scale.count != c)
    return ort_invalid(k->api,
                       "ortrain.cpu.BatchNormGrad: scale has %lld elements, X's channels %lld",
                       (long long)scale.count, (long long)c);
  BatchNorm w = {(const float*)dy.data, (const float*)x.data, (const float*)scale.data,
                 NULL, NULL, NULL, n, c, (n && c) ? x.count / (n * c) : 0, k->epsilon};
  const int64_t vec[1] = {c};
  if ((st = output(k, ctx, 0, x.dims, x.rank, &w.dx)) ||
      (st = output(k, ctx, 1, vec, 1, &w.dscale)) || (st = output(k, ctx, 2, vec, 1, &w.dbias)))
    return st;
  if (x.count == 0) {
    for (int64_t i = 0; i < c; ++i) w.dscale[i] = w.dbias[i] = 0.0f;
    return NULL;
  }
  for_blocks(k, ctx, batch_norm_block, (size_t)c, &w);
  return NULL;
}

/* ---------------------------------------------------------------- ReluGrad
 * ReluGrad(dY, Y) -> dX = Y > 0 ? dY : 0: a ReLU's backward read from its output, as the
 * standard spelling's Where(X > 0, dY, 0) (Y > 0 exactly where X > 0, NaN included). One
 * pass where ONNX Runtime ran a Greater and a broadcasting Where (a residual CNN's ReLU
 * backwards: 21 ms of its step); reading Y, not X, lets the memory plan free X when
 * nothing else reads it. */
typedef struct {
  const float *dy, *y;
  float* dx;
  int64_t n;
} ReluGrad;

static void relu_grad_block(void* work, size_t b) {
  const ReluGrad* w = (const ReluGrad*)work;
  const int64_t lo = (int64_t)b * ELEMS_PER_BLOCK;
  const int64_t hi = lo + ELEMS_PER_BLOCK < w->n ? lo + ELEMS_PER_BLOCK : w->n;
  const float* restrict dy = w->dy;
  const float* restrict y = w->y;
  float* restrict dx = w->dx;
  for (int64_t i = lo; i < hi; ++i) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

OrtStatus* ortrain_relu_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor dy, y;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &dy)) || (st = input(k, ctx, 1, &y))) return st;
  if ((st = same_shape(k, &dy, "dY", &y, "Y"))) return st;
  ReluGrad w = {(const float*)dy.data, (const float*)y.data, NULL, y.count};
  if ((st = output(k, ctx, 0, y.dims, y.rank, &w.dx))) return st;
  for_blocks(k, ctx, relu_grad_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}
