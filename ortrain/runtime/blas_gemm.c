/* ortrain.blas::Gemm, an ONNX Runtime custom op that runs fp32 matrix products on a
 * Fortran-interface BLAS sgemm (on x86, the MKL inside torch's own library).
 *
 * Why: on Intel CPUs ONNX Runtime's MLAS GEMMs run 1.1-2x slower than MKL on the very
 * products of a training step (benchmarks/bench_gemm.py), and GEMMs are 70-85% of a
 * transformer's gradient graph there. The graph pass graph_passes/targets/cpu/blas_gemm.py rewrites
 * eligible Gemm / MatMul / FusedMatMul nodes to this op; ortrain/runtime/blas_ops.py
 * compiles this file, hands it the sgemm to call and registers it on the session.
 *
 * Semantics (row-major, like ONNX): Y = alpha * op(A) @ op(B) + beta * C, where
 *   op(B) is B [K, N] or, transB = 1, B^T with B [N, K]: B is always 2-D;
 *   op(A) is A [..., K] (leading dimensions flattened into M; Y is [..., N]) or,
 *   transA = 1, A^T with A [K, M] (2-D);
 *   C (optional) has M*N elements (Y's shape), N elements (a row bias) or 1.
 *
 * The product runs on the calling thread with the BLAS's own threading (torch's OpenMP
 * team, torch.get_num_threads() threads), not on ONNX Runtime's intra-op threads.
 * The ONNX Runtime ABI it uses is declared in ort_abi.h; cpu_ops.c registers it.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

/* ------------------------------------------------------------------ the BLAS side */
typedef void (*SgemmFn)(const char* transa, const char* transb, const int* m, const int* n,
                        const int* k, const float* alpha, const float* a, const int* lda,
                        const float* b, const int* ldb, const float* beta, float* c,
                        const int* ldc);
static SgemmFn g_sgemm = NULL;

/* Set once from Python (ctypes) before the library is registered on a session: the
 * address of the BLAS's Fortran-interface sgemm. Returns 0, or -1 for a null address. */
int ortrain_blas_set_sgemm(void* sgemm) {
  if (sgemm == NULL) return -1;
  g_sgemm = (SgemmFn)sgemm;
  return 0;
}


/* --------------------------------------------------------------------- the kernel */
typedef struct {
  const OrtApi* api;
  float alpha, beta;
  int64_t trans_a, trans_b;
} Kernel;

static void* kernel_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info) {
  (void)op;
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (!k) return NULL;
  k->api = api;
  k->alpha = 1.0f;
  k->beta = 1.0f;
  OrtStatus* st;
  /* a missing attribute keeps its default (the status is an error we drop) */
  if ((st = API_FN(api, I_KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "alpha", &k->alpha)))
    API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->alpha = 1.0f;
  if ((st = API_FN(api, I_KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "beta", &k->beta)))
    API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->beta = 1.0f;
  if ((st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "transA", &k->trans_a)))
    API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->trans_a = 0;
  if ((st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "transB", &k->trans_b)))
    API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->trans_b = 0;
  return k;
}

static OrtStatus* kernel_create_v2(const OrtCustomOp* op, const OrtApi* api,
                                   const OrtKernelInfo* info, void** out) {
  *out = kernel_create(op, api, info);
  if (*out == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_FAIL, "ortrain.blas.Gemm: out of memory");
  return NULL;
}

static void kernel_destroy(void* kernel) { free(kernel); }

static OrtStatus* kernel_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  const OrtApi* api = k->api;
  if (g_sgemm == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(
        ORT_FAIL, "ortrain.blas.Gemm: no sgemm set (ortrain_blas_set_sgemm was not called)");
  size_t n_inputs = 0;
  OrtStatus* st = API_FN(api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n_inputs);
  if (st) return st;
  const OrtValue* in[3] = {NULL, NULL, NULL};
  for (size_t i = 0; i < n_inputs && i < 3; ++i)
    if ((st = API_FN(api, I_KernelContext_GetInput, GetInputFn)(ctx, i, &in[i]))) return st;
  int64_t da[8], db[8], dc[8];
  size_t ra = 0, rb = 0, rc = 0;
  int ea = 0, eb = 0, ec = ELEM_FLOAT;
  if ((st = ort_shape_of(api, in[0], da, &ra, &ea))) return st;
  if ((st = ort_shape_of(api, in[1], db, &rb, &eb))) return st;
  if (in[2] && (st = ort_shape_of(api, in[2], dc, &rc, &ec))) return st;
  if (ea != ELEM_FLOAT || eb != ELEM_FLOAT || ec != ELEM_FLOAT)
    return ort_invalid(api,
                 "ortrain.blas.Gemm: inputs must be float32, got element types A=%lld B=%lld C=%lld",
                 (long long)ea, (long long)eb, (long long)ec);
  if (rb != 2)
    return ort_invalid(api, "ortrain.blas.Gemm: B must be 2-D, got rank %lld",
                 (long long)rb);
  if (ra < 1 || (k->trans_a && ra != 2))
    return ort_invalid(api,
                 "ortrain.blas.Gemm: A must be 2-D with transA=1 (rank >= 1 otherwise), got rank %lld (transA=%lld)",
                 (long long)ra, (long long)k->trans_a);
  int64_t kk = k->trans_a ? da[0] : da[ra - 1];
  int64_t m = 1;
  if (k->trans_a) m = da[1];
  else for (size_t i = 0; i + 1 < ra; ++i) m *= da[i];
  int64_t kb = k->trans_b ? db[1] : db[0];
  int64_t n = k->trans_b ? db[0] : db[1];
  if (kb != kk)
    return ort_invalid(api,
                 "ortrain.blas.Gemm: inner dimensions differ: op(A) is [%lld, %lld], op(B) is [%lld, %lld]",
                 (long long)m, (long long)kk, (long long)kb, (long long)n);
  if (m > INT_MAX || n > INT_MAX || kk > INT_MAX)
    return ort_invalid(api,
                 "ortrain.blas.Gemm: [%lld, %lld] x [%lld, %lld] exceeds the BLAS's 32-bit sizes",
                 (long long)m, (long long)kk, (long long)kk, (long long)n);
  int64_t cn = 1;
  for (size_t i = 0; i < rc; ++i) cn *= dc[i];
  int c_full = in[2] && cn == m * n && (rc < 1 || dc[rc - 1] == n || m == 1);
  int c_row = in[2] && !c_full && cn == n && (rc < 1 || dc[rc - 1] == n);
  int c_one = in[2] && !c_full && !c_row && cn == 1;
  if (in[2] && !c_full && !c_row && !c_one)
    return ort_invalid(api,
                 "ortrain.blas.Gemm: C has %lld elements; expected %lld (Y's), %lld (a row) or 1",
                 (long long)cn, (long long)(m * n), (long long)n);

  int64_t dy[8];
  size_t ry = 0;
  if (k->trans_a) {
    dy[0] = m;
    ry = 1;
  } else {
    for (size_t i = 0; i + 1 < ra; ++i) dy[ry++] = da[i];
  }
  dy[ry++] = n;
  OrtValue* y = NULL;
  if ((st = API_FN(api, I_KernelContext_GetOutput, GetOutputFn)(ctx, 0, dy, ry, &y))) return st;
  if (m == 0 || n == 0) return NULL;
  void *pa = NULL, *pb = NULL, *pc = NULL, *py = NULL;
  GetTensorMutableDataFn data = API_FN(api, I_GetTensorMutableData, GetTensorMutableDataFn);
  if ((st = data((OrtValue*)in[0], &pa)) || (st = data((OrtValue*)in[1], &pb)) ||
      (st = data(y, &py)))
    return st;
  if (in[2] && (st = data((OrtValue*)in[2], &pc))) return st;
  float* out = (float*)py;
  float beta = 0.0f;
  if (in[2] && k->beta != 0.0f) {
    const float* c = (const float*)pc;
    if (c_full) memcpy(out, c, (size_t)(m * n) * sizeof(float));
    else if (c_row) {
      /* on the team the product runs on (its threads are about to be busy anyway) */
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (ortrain_omp_team && m * n >= 65536)
#endif
      for (int64_t i = 0; i < m; ++i) memcpy(out + i * n, c, (size_t)n * sizeof(float));
    }
    else for (int64_t i = 0; i < m * n; ++i) out[i] = c[0];
    beta = k->beta;
  }
  if (kk == 0) { /* an empty product: Y = beta * C, or zeros */
    if (beta == 0.0f) memset(out, 0, (size_t)(m * n) * sizeof(float));
    else for (int64_t i = 0; i < m * n; ++i) out[i] *= beta;
    return NULL;
  }
  /* Row-major Y [m, n] is column-major Y^T [n, m] = op(B)^T op(A)^T: B goes first. */
  const int M = (int)n, N = (int)m, K = (int)kk, ldc = (int)n;
  const int lda = k->trans_b ? (int)kk : (int)n; /* B as the column-major left operand */
  const int ldb = k->trans_a ? (int)m : (int)kk; /* A as the right operand */
  const char ta = k->trans_b ? 'T' : 'N', tb = k->trans_a ? 'T' : 'N';
  g_sgemm(&ta, &tb, &M, &N, &K, &k->alpha, (const float*)pb, &lda, (const float*)pa, &ldb, &beta,
          out, &ldc);
  return NULL;
}

/* ------------------------------------------------------------------ the op table */
static const char* op_name(const OrtCustomOp* op) { (void)op; return "Gemm"; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int op_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t op_input_count(const OrtCustomOp* op) { (void)op; return 3; }
static size_t op_output_count(const OrtCustomOp* op) { (void)op; return 1; }
static int op_input_characteristic(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 2 ? OPTIONAL : REQUIRED;
}
static int op_output_characteristic(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return REQUIRED; }

static const OrtCustomOp g_gemm_op = {
    .version = API_VERSION,
    .CreateKernel = kernel_create,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_type,
    .GetInputTypeCount = op_input_count,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_output_count,
    .KernelCompute = ort_op_compute_v1,
    .KernelDestroy = kernel_destroy,
    .GetInputCharacteristic = op_input_characteristic,
    .GetOutputCharacteristic = op_output_characteristic,
    .GetInputMemoryType = ort_op_memory_type,
    .GetVariadicInputMinArity = ort_op_zero,
    .GetVariadicInputHomogeneity = ort_op_zero,
    .GetVariadicOutputMinArity = ort_op_zero,
    .GetVariadicOutputHomogeneity = ort_op_zero,
    .CreateKernelV2 = kernel_create_v2,
    .KernelComputeV2 = kernel_compute,
};

const OrtCustomOp* ortrain_gemm_op(void) { return &g_gemm_op; }
int ortrain_have_sgemm(void) { return g_sgemm != NULL; }
SgemmFn ortrain_blas_sgemm(void) { return g_sgemm; }
