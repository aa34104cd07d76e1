/* ortrain.blas::BatchMatMul, batched fp32 matrix products on the BLAS torch loaded (MKL's
 * sgemm_batch where it has one, else one sgemm per matrix), reading and writing attention
 * heads in place.
 *
 * Why: attention's per-head products (GPT-2 tiny: [8, 4, 128, 64] operands) run on ONNX
 * Runtime's MLAS at half MKL's rate there, and every head split and merge around them is
 * a Transpose (0, 2, 1, 3) that ONNX Runtime copies in 0.12 ms: 32 per step, 11 ms of
 * products and 4 ms of copies. A head of [B, S, H, D] is a row-major [S, D] matrix with
 * leading dimension H*D, which a BLAS reads as is, so graph_passes/targets/cpu/blas_batch_matmul.py
 * folds those Transposes into this op's operands and output.
 *
 *   Y = alpha * op(A) @ op(B), batched over the leading axes (A's and B's must agree):
 *   A [..., M, K] (transA = 1: [..., K, M]), B [..., K, N] (transB = 1: [..., N, K]),
 *   Y [..., M, N]. swapA / swapB / swapY = 1 (rank 4 only): the tensor is stored with
 *   axes 1 and 2 exchanged, i.e. A is Transpose(A_stored, perm=(0, 2, 1, 3)) and the
 *   stored Y is Transpose(Y, perm=(0, 2, 1, 3)).
 *
 *   triA = 1 / 2 (square op(A), M = K): op(A) is lower / upper triangular (zero above / below
 *   the diagonal). Causal attention's products (graph_passes/targets/cpu/causal_products.py): the
 *   probabilities P and their gradient are lower triangular, so half of P @ V, P^T @ dO,
 *   dS @ K and dS^T @ Q multiplies zeros. The rows of Y are cut into blocks of TRI_BLOCK,
 *   each run over the part of K the triangle leaves: (1 + 1/n) / 2 of the work for n
 *   blocks (GPT-2 small's [24, 256, 256] @ [24, 256, 64]: 0.65 -> 0.46 ms, 0.68 -> 0.52 ms
 *   transposed). Y's triangle alone (the scores) measured no faster: with K = 64 the
 *   blocks run below the BLAS's rate, and the unread part must still be written.
 *
 * The products run on the calling thread with the BLAS's own threading, as ortrain.blas.Gemm.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

typedef void (*SgemmFn)(const char* transa, const char* transb, const int* m, const int* n,
                        const int* k, const float* alpha, const float* a, const int* lda,
                        const float* b, const int* ldb, const float* beta, float* c,
                        const int* ldc);
typedef void (*SgemmBatchFn)(const char* transa, const char* transb, const int* m, const int* n,
                             const int* k, const float* alpha, const float** a, const int* lda,
                             const float** b, const int* ldb, const float* beta, float** c,
                             const int* ldc, const int* group_count, const int* group_size);
SgemmFn ortrain_blas_sgemm(void); /* blas_gemm.c */
static SgemmBatchFn g_sgemm_batch = NULL;

/* The address of MKL's Fortran-interface sgemm_batch (optional): one call for all the
 * matrices, which MKL spreads over its threads; without it, one sgemm per matrix. */
int ortrain_blas_set_sgemm_batch(void* fn) {
  g_sgemm_batch = (SgemmBatchFn)fn;
  return 0;
}

typedef struct {
  const OrtApi* api;
  float alpha;
  int64_t trans_a, trans_b, swap_a, swap_b, swap_y, tri_a;
} Kernel;

#define TRI_BLOCK 64 /* rows per block of a triangular product */

static int64_t int_attr(const OrtApi* api, const OrtKernelInfo* info, const char* name) {
  int64_t v = 0;
  OrtStatus* st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, name, &v);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), v = 0; /* missing: 0 */
  return v;
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                         void** out) {
  (void)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (k == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_FAIL,
                                                       "ortrain.blas.BatchMatMul: out of memory");
  k->api = api;
  k->alpha = 1.0f;
  OrtStatus* st = API_FN(api, I_KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "alpha", &k->alpha);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->alpha = 1.0f;
  k->trans_a = int_attr(api, info, "transA");
  k->trans_b = int_attr(api, info, "transB");
  k->swap_a = int_attr(api, info, "swapA");
  k->swap_b = int_attr(api, info, "swapB");
  k->swap_y = int_attr(api, info, "swapY");
  k->tri_a = int_attr(api, info, "triA");
  if (k->tri_a < 0 || k->tri_a > 2) {
    const long long tri = (long long)k->tri_a;
    free(k);
    return ort_invalid(api, "ortrain.blas.BatchMatMul: triA must be 0, 1 or 2, got %lld", tri);
  }
  *out = k;
  return NULL;
}

/* A stored operand as a batch of row-major matrices: logical dims (after the swap) and
 * element strides of the two batch axes, and the leading dimension of each matrix. */
typedef struct {
  int64_t dims[8]; /* logical */
  size_t rank;
  int64_t batch_stride[2]; /* rank 4: axes 0 and 1; rank 3: axis 0 (and 0) */
  int64_t ld;
} Batched;

static void layout(const int64_t* stored, size_t rank, int swap, Batched* out) {
  out->rank = rank;
  memcpy(out->dims, stored, rank * sizeof(int64_t));
  int64_t rows = stored[rank - 2], cols = stored[rank - 1];
  if (swap) { /* stored [B0, R, B1, C] holds logical [B0, B1, R, C] */
    out->dims[1] = stored[2];
    out->dims[2] = stored[1];
    rows = stored[1];
    out->batch_stride[0] = rows * stored[2] * cols;
    out->batch_stride[1] = cols;
    out->ld = stored[2] * cols;
    return;
  }
  out->ld = cols;
  int64_t inner = rows * cols;
  if (rank == 4) {
    out->batch_stride[1] = inner;
    out->batch_stride[0] = inner * stored[1];
  } else { /* rank 3 */
    out->batch_stride[1] = 0;
    out->batch_stride[0] = inner;
  }
}

static void dims_text(const int64_t* d, size_t rank, char* out, size_t size) {
  size_t used = (size_t)snprintf(out, size, "[");
  for (size_t i = 0; i < rank && used < size; ++i)
    used += (size_t)snprintf(out + used, size - used, i ? ", %lld" : "%lld", (long long)d[i]);
  if (used < size) snprintf(out + used, size - used, "]");
}

/* Y = alpha op(A) op(B) with a triangular op(A): row block r (rows [r0, r1)) is one group
 * of sgemm_batch (all matrices of the batch), over K in [0, r1) (triA = 1) or [r0, K)
 * (triA = 2). */
static OrtStatus* triangular(const Kernel* k, const Batched* a, const Batched* b, const float* pa,
                             const float* pb, float* y, int64_t m, int64_t n, int64_t b1,
                             int64_t count, int64_t ys0, int64_t ys1, int ldy) {
  const OrtApi* api = k->api;
  const int64_t blocks = (m + TRI_BLOCK - 1) / TRI_BLOCK;
  const size_t total = (size_t)(blocks * count);
  const float** ap = (const float**)malloc(total * 3 * sizeof(float*));
  int* sizes = (int*)malloc((size_t)blocks * 9 * sizeof(int));
  char* trans = (char*)malloc((size_t)blocks * 2);
  if (ap == NULL || sizes == NULL || trans == NULL) {
    free(ap), free(sizes), free(trans);
    return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_FAIL,
                                                       "ortrain.blas.BatchMatMul: out of memory");
  }
  const float** bp = ap + total;
  float** yp = (float**)(ap + 2 * total);
  int *gm = sizes, *gn = sizes + blocks, *gk = sizes + 2 * blocks, *glda = sizes + 3 * blocks;
  int *gldb = sizes + 4 * blocks, *gldy = sizes + 5 * blocks, *gsize = sizes + 6 * blocks;
  float* galpha = (float*)(sizes + 7 * blocks);
  float* gbeta = (float*)(sizes + 8 * blocks);
  char *gta = trans, *gtb = trans + blocks;
  /* Column-major view, as in compute(): Y^T [n, m] = op(B)^T op(A)^T, B's pointer first. */
  for (int64_t r = 0; r < blocks; ++r) {
    const int64_t r0 = r * TRI_BLOCK, r1 = r0 + TRI_BLOCK < m ? r0 + TRI_BLOCK : m;
    const int64_t k0 = k->tri_a == 2 ? r0 : 0, k1 = k->tri_a == 1 ? r1 : m; /* K = M */
    gm[r] = (int)n, gn[r] = (int)(r1 - r0), gk[r] = (int)(k1 - k0);
    glda[r] = (int)b->ld, gldb[r] = (int)a->ld, gldy[r] = ldy, gsize[r] = (int)count;
    galpha[r] = k->alpha, gbeta[r] = 0.0f;
    gta[r] = k->trans_b ? 'T' : 'N', gtb[r] = k->trans_a ? 'T' : 'N';
    /* op(A)[r0.., k0..] and op(B)[k0.., 0..] as offsets into the stored matrices */
    const int64_t a_off = k->trans_a ? k0 * a->ld + r0 : r0 * a->ld + k0;
    const int64_t b_off = k->trans_b ? k0 : k0 * b->ld;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t i0 = i / b1, i1 = i % b1, j = r * count + i;
      ap[j] = pb + i0 * b->batch_stride[0] + i1 * b->batch_stride[1] + b_off;
      bp[j] = pa + i0 * a->batch_stride[0] + i1 * a->batch_stride[1] + a_off;
      yp[j] = y + i0 * ys0 + i1 * ys1 + r0 * ldy;
    }
  }
  if (g_sgemm_batch != NULL) {
    const int groups = (int)blocks;
    g_sgemm_batch(gta, gtb, gm, gn, gk, galpha, ap, glda, bp, gldb, gbeta, yp, gldy, &groups,
                  gsize);
  } else {
    SgemmFn sgemm = ortrain_blas_sgemm();
    for (int64_t r = 0; r < blocks; ++r)
      for (int64_t i = 0; i < count; ++i) {
        const int64_t j = r * count + i;
        sgemm(&gta[r], &gtb[r], &gm[r], &gn[r], &gk[r], &galpha[r], ap[j], &glda[r], bp[j],
              &gldb[r], &gbeta[r], yp[j], &gldy[r]);
      }
  }
  free(ap), free(sizes), free(trans);
  return NULL;
}

static OrtStatus* compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  const OrtApi* api = k->api;
  SgemmFn sgemm = ortrain_blas_sgemm();
  if (sgemm == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(
        ORT_FAIL, "ortrain.blas.BatchMatMul: no sgemm set (ortrain_blas_set_sgemm was not called)");
  const OrtValue *va = NULL, *vb = NULL;
  OrtStatus* st;
  if ((st = API_FN(api, I_KernelContext_GetInput, GetInputFn)(ctx, 0, &va)) ||
      (st = API_FN(api, I_KernelContext_GetInput, GetInputFn)(ctx, 1, &vb)))
    return st;
  int64_t da[8], db[8];
  size_t ra = 0, rb = 0;
  int ea = 0, eb = 0;
  if ((st = ort_shape_of(api, va, da, &ra, &ea)) || (st = ort_shape_of(api, vb, db, &rb, &eb)))
    return st;
  if (ea != ELEM_FLOAT || eb != ELEM_FLOAT)
    return ort_invalid(api, "ortrain.blas.BatchMatMul: A and B must be float32, got types %d, %d",
                       ea, eb);
  if (ra != rb || ra < 3 || ra > 4 || ((k->swap_a || k->swap_b || k->swap_y) && ra != 4))
    return ort_invalid(api,
                       "ortrain.blas.BatchMatMul: A and B must both be 3-D or 4-D (4-D with a "
                       "swap), got ranks %zu and %zu",
                       ra, rb);
  Batched a, b;
  layout(da, ra, (int)k->swap_a, &a);
  layout(db, rb, (int)k->swap_b, &b);
  const size_t r = ra;
  const int64_t m = k->trans_a ? a.dims[r - 1] : a.dims[r - 2];
  const int64_t kk = k->trans_a ? a.dims[r - 2] : a.dims[r - 1];
  const int64_t kb = k->trans_b ? b.dims[r - 1] : b.dims[r - 2];
  const int64_t n = k->trans_b ? b.dims[r - 2] : b.dims[r - 1];
  int same_batch = 1;
  for (size_t d = 0; d + 2 < r; ++d) same_batch &= a.dims[d] == b.dims[d];
  if (!same_batch || kb != kk) {
    char sa[128], sb[128];
    dims_text(a.dims, r, sa, sizeof sa);
    dims_text(b.dims, r, sb, sizeof sb);
    return ort_invalid(api,
                       "ortrain.blas.BatchMatMul: A %s (transA=%lld) and B %s (transB=%lld) "
                       "do not multiply: batch axes must be equal and inner sizes agree",
                       sa, (long long)k->trans_a, sb, (long long)k->trans_b);
  }
  if (m > INT_MAX || n > INT_MAX || kk > INT_MAX || a.ld > INT_MAX || b.ld > INT_MAX)
    return ort_invalid(api, "ortrain.blas.BatchMatMul: sizes exceed the BLAS's 32-bit ints");
  const int64_t b0 = a.dims[0], b1 = r == 4 ? a.dims[1] : 1;
  /* Y: logical [b0, (b1,) m, n]; stored with axes 1 and 2 exchanged when swapY */
  int64_t dy[4];
  if (r == 3) {
    dy[0] = b0, dy[1] = m, dy[2] = n;
  } else if (k->swap_y) {
    dy[0] = b0, dy[1] = m, dy[2] = b1, dy[3] = n;
  } else {
    dy[0] = b0, dy[1] = b1, dy[2] = m, dy[3] = n;
  }
  OrtValue* vy = NULL;
  if ((st = API_FN(api, I_KernelContext_GetOutput, GetOutputFn)(ctx, 0, dy, r, &vy))) return st;
  const int64_t count = b0 * b1;
  if (count == 0 || m == 0 || n == 0) return NULL;
  void *pa = NULL, *pb = NULL, *py = NULL;
  GetTensorMutableDataFn data = API_FN(api, I_GetTensorMutableData, GetTensorMutableDataFn);
  if ((st = data((OrtValue*)va, &pa)) || (st = data((OrtValue*)vb, &pb)) || (st = data(vy, &py)))
    return st;
  float* y = (float*)py;
  const int64_t ys0 = k->swap_y ? m * b1 * n : b1 * m * n, ys1 = k->swap_y ? n : m * n;
  const int ldy = (int)(k->swap_y ? b1 * n : n);
  if (kk == 0) { /* an empty product: zeros */
    for (int64_t i = 0; i < count; ++i)
      for (int64_t row = 0; row < m; ++row)
        memset(y + (i / b1) * ys0 + (i % b1) * ys1 + row * ldy, 0, (size_t)n * sizeof(float));
    return NULL;
  }
  if (count > INT_MAX) return ort_invalid(api, "ortrain.blas.BatchMatMul: too many matrices");
  if (k->tri_a && m != kk)
    return ort_invalid(api, "ortrain.blas.BatchMatMul: triA=%lld needs a square op(A), got %lld x %lld",
                       (long long)k->tri_a, (long long)m, (long long)kk);
  if (k->tri_a && m > TRI_BLOCK)
    return triangular(k, &a, &b, (const float*)pa, (const float*)pb, y, m, n, b1, count, ys0,
                      ys1, ldy);
  /* Row-major Y [m, n] is column-major Y^T [n, m] = op(B)^T op(A)^T: B goes first. */
  const int M = (int)n, N = (int)m, K = (int)kk, lda = (int)b.ld, ldb = (int)a.ld;
  const char ta = k->trans_b ? 'T' : 'N', tb = k->trans_a ? 'T' : 'N';
  const float beta = 0.0f;
  const float** ap = (const float**)malloc((size_t)count * 3 * sizeof(float*));
  if (ap == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_FAIL,
                                                       "ortrain.blas.BatchMatMul: out of memory");
  const float** bp = ap + count;
  float** yp = (float**)(ap + 2 * count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t i0 = i / b1, i1 = i % b1;
    ap[i] = (const float*)pb + i0 * b.batch_stride[0] + i1 * b.batch_stride[1];
    bp[i] = (const float*)pa + i0 * a.batch_stride[0] + i1 * a.batch_stride[1];
    yp[i] = y + i0 * ys0 + i1 * ys1;
  }
  if (g_sgemm_batch != NULL) {
    const int groups = 1, size = (int)count;
    g_sgemm_batch(&ta, &tb, &M, &N, &K, &k->alpha, ap, &lda, bp, &ldb, &beta, yp, &ldy, &groups,
                  &size);
  } else {
    for (int64_t i = 0; i < count; ++i)
      sgemm(&ta, &tb, &M, &N, &K, &k->alpha, ap[i], &lda, bp[i], &ldb, &beta, yp[i], &ldy);
  }
  free(ap);
  return NULL;
}

/* ------------------------------------------------------------------ the op table */
static const char* op_name(const OrtCustomOp* op) { (void)op; return "BatchMatMul"; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int op_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t op_inputs(const OrtCustomOp* op) { (void)op; return 2; }
static size_t op_outputs(const OrtCustomOp* op) { (void)op; return 1; }
static int op_required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return REQUIRED; }
static void destroy(void* kernel) { free(kernel); }

static const OrtCustomOp g_batch_op = {
    .version = API_VERSION,
    .CreateKernel = ort_op_create_v1,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_type,
    .GetInputTypeCount = op_inputs,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_outputs,
    .KernelCompute = ort_op_compute_v1,
    .KernelDestroy = destroy,
    .GetInputCharacteristic = op_required,
    .GetOutputCharacteristic = op_required,
    .GetInputMemoryType = ort_op_memory_type,
    .GetVariadicInputMinArity = ort_op_zero,
    .GetVariadicInputHomogeneity = ort_op_zero,
    .GetVariadicOutputMinArity = ort_op_zero,
    .GetVariadicOutputHomogeneity = ort_op_zero,
    .CreateKernelV2 = create,
    .KernelComputeV2 = compute,
};

const OrtCustomOp* ortrain_batch_matmul_op(void) { return &g_batch_op; }
