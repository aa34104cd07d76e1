/* ortrain.blas::Gemm, an ONNX Runtime custom op that runs fp32 matrix products on a
 * Fortran-interface BLAS sgemm (on x86, the MKL inside torch's own library).
 *
 * Why: on Intel CPUs ONNX Runtime's MLAS GEMMs run 1.1-2x slower than MKL on the very
 * products of a training step (benchmarks/bench_gemm.py), and GEMMs are 70-85% of a
 * transformer's gradient graph there. The graph pass graph_passes/blas_gemm.py rewrites
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
 *
 * No ONNX Runtime header ships in its Python wheel, so the few pieces of its C ABI used
 * here are declared below: the OrtApi function table is append-only, an entry's index
 * never moves between releases (onnxruntime_c_api.h); the indices are those of the
 * API-16 table and every runtime >= 1.16 serves it (GetApi(16)).
 */
#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ ONNX Runtime C ABI */
typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorInfo;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

enum { API_VERSION = 16 };           /* CreateKernelV2 / KernelComputeV2 */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ELEM_FLOAT = 1 };             /* ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT */
enum { REQUIRED = 0, OPTIONAL = 1 }; /* OrtCustomOpInputOutputCharacteristic */

/* Indices into the OrtApi table (one function pointer each). */
enum {
  I_CreateStatus = 0,
  I_CreateCustomOpDomain = 26,
  I_CustomOpDomain_Add = 27,
  I_AddCustomOpDomain = 28,
  I_GetTensorMutableData = 51,
  I_GetTensorElementType = 60,
  I_GetDimensionsCount = 61,
  I_GetDimensions = 62,
  I_GetTensorTypeAndShape = 65,
  I_KernelInfoGetAttribute_float = 85,
  I_KernelInfoGetAttribute_int64 = 86,
  I_KernelContext_GetInputCount = 88,
  I_KernelContext_GetInput = 90,
  I_KernelContext_GetOutput = 91,
  I_ReleaseStatus = 93,
  I_ReleaseTensorTypeAndShapeInfo = 99,
};

typedef void (*AnyFn)(void);
#define API_FN(api, index, type) ((type)(((const AnyFn*)(api))[index]))

typedef OrtStatus* (*CreateStatusFn)(int code, const char* msg);
typedef OrtStatus* (*CreateCustomOpDomainFn)(const char* domain, OrtCustomOpDomain** out);
typedef OrtStatus* (*CustomOpDomainAddFn)(OrtCustomOpDomain* domain, const void* op);
typedef OrtStatus* (*AddCustomOpDomainFn)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
typedef OrtStatus* (*GetTensorMutableDataFn)(OrtValue* value, void** out);
typedef OrtStatus* (*GetTensorElementTypeFn)(const OrtTensorInfo* info, int* out);
typedef OrtStatus* (*GetDimensionsCountFn)(const OrtTensorInfo* info, size_t* out);
typedef OrtStatus* (*GetDimensionsFn)(const OrtTensorInfo* info, int64_t* dims, size_t n);
typedef OrtStatus* (*GetTensorTypeAndShapeFn)(const OrtValue* value, OrtTensorInfo** out);
typedef OrtStatus* (*GetAttrFloatFn)(const OrtKernelInfo* info, const char* name, float* out);
typedef OrtStatus* (*GetAttrInt64Fn)(const OrtKernelInfo* info, const char* name, int64_t* out);
typedef OrtStatus* (*GetInputCountFn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext* ctx, size_t index, const int64_t* dims,
                                  size_t n, OrtValue** out);
typedef void (*ReleaseStatusFn)(OrtStatus* status);
typedef void (*ReleaseTensorInfoFn)(OrtTensorInfo* info);

/* OrtCustomOp up to the API-16 fields: ONNX Runtime reads no field past those of the
 * version the op declares. */
typedef struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const struct OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const struct OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const struct OrtCustomOp* op);
  int (*GetInputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp* op);
  int (*GetOutputType)(const struct OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const struct OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const struct OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const struct OrtCustomOp* op, const OrtApi* api,
                               const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
} OrtCustomOp;

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

int ortrain_blas_abi_version(void) { return 1; }

/* --------------------------------------------------------------------- the kernel */
typedef struct {
  const OrtApi* api;
  float alpha, beta;
  int64_t trans_a, trans_b;
} Kernel;

/* An ORT_INVALID_ARGUMENT status with a printf-formatted message. */
static OrtStatus* invalid(const OrtApi* api, const char* fmt, ...) {
  char msg[384];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
}

/* dims of a tensor (up to 8) and its element type; NULL on success */
static OrtStatus* shape_of(const OrtApi* api, const OrtValue* v, int64_t* dims, size_t* rank,
                           int* elem) {
  OrtTensorInfo* info = NULL;
  OrtStatus* st = API_FN(api, I_GetTensorTypeAndShape, GetTensorTypeAndShapeFn)(v, &info);
  if (st) return st;
  st = API_FN(api, I_GetDimensionsCount, GetDimensionsCountFn)(info, rank);
  if (!st && *rank > 8) st = invalid(api,
                                   "ortrain.blas.Gemm: rank %lld > 8",
                                   (long long)*rank);
  if (!st) st = API_FN(api, I_GetDimensions, GetDimensionsFn)(info, dims, *rank);
  if (!st) st = API_FN(api, I_GetTensorElementType, GetTensorElementTypeFn)(info, elem);
  API_FN(api, I_ReleaseTensorTypeAndShapeInfo, ReleaseTensorInfoFn)(info);
  return st;
}

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
  if ((st = shape_of(api, in[0], da, &ra, &ea))) return st;
  if ((st = shape_of(api, in[1], db, &rb, &eb))) return st;
  if (in[2] && (st = shape_of(api, in[2], dc, &rc, &ec))) return st;
  if (ea != ELEM_FLOAT || eb != ELEM_FLOAT || ec != ELEM_FLOAT)
    return invalid(api,
                 "ortrain.blas.Gemm: inputs must be float32, got element types A=%lld B=%lld C=%lld",
                 (long long)ea, (long long)eb, (long long)ec);
  if (rb != 2)
    return invalid(api, "ortrain.blas.Gemm: B must be 2-D, got rank %lld",
                 (long long)rb);
  if (ra < 1 || (k->trans_a && ra != 2))
    return invalid(api,
                 "ortrain.blas.Gemm: A must be 2-D with transA=1 (rank >= 1 otherwise), got rank %lld (transA=%lld)",
                 (long long)ra, (long long)k->trans_a);
  int64_t kk = k->trans_a ? da[0] : da[ra - 1];
  int64_t m = 1;
  if (k->trans_a) m = da[1];
  else for (size_t i = 0; i + 1 < ra; ++i) m *= da[i];
  int64_t kb = k->trans_b ? db[1] : db[0];
  int64_t n = k->trans_b ? db[0] : db[1];
  if (kb != kk)
    return invalid(api,
                 "ortrain.blas.Gemm: inner dimensions differ: op(A) is [%lld, %lld], op(B) is [%lld, %lld]",
                 (long long)m, (long long)kk, (long long)kb, (long long)n);
  if (m > INT_MAX || n > INT_MAX || kk > INT_MAX)
    return invalid(api,
                 "ortrain.blas.Gemm: [%lld, %lld] x [%lld, %lld] exceeds the BLAS's 32-bit sizes",
                 (long long)m, (long long)kk, (long long)kk, (long long)n);
  int64_t cn = 1;
  for (size_t i = 0; i < rc; ++i) cn *= dc[i];
  int c_full = in[2] && cn == m * n && (rc < 1 || dc[rc - 1] == n || m == 1);
  int c_row = in[2] && !c_full && cn == n && (rc < 1 || dc[rc - 1] == n);
  int c_one = in[2] && !c_full && !c_row && cn == 1;
  if (in[2] && !c_full && !c_row && !c_one)
    return invalid(api,
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
    else if (c_row) for (int64_t i = 0; i < m; ++i) memcpy(out + i * n, c, (size_t)n * sizeof(float));
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
static int op_memory_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int op_zero(const OrtCustomOp* op) { (void)op; return 0; }
/* The API-1 entry point; never called: with version >= 16 ONNX Runtime calls KernelComputeV2. */
static void kernel_compute_v1(void* kernel, OrtKernelContext* ctx) { (void)kernel; (void)ctx; }

static OrtCustomOp g_gemm_op = {
    .version = API_VERSION,
    .CreateKernel = kernel_create,
    .GetName = op_name,
    .GetExecutionProviderType = op_provider,
    .GetInputType = op_type,
    .GetInputTypeCount = op_input_count,
    .GetOutputType = op_type,
    .GetOutputTypeCount = op_output_count,
    .KernelCompute = kernel_compute_v1,
    .KernelDestroy = kernel_destroy,
    .GetInputCharacteristic = op_input_characteristic,
    .GetOutputCharacteristic = op_output_characteristic,
    .GetInputMemoryType = op_memory_type,
    .GetVariadicInputMinArity = op_zero,
    .GetVariadicInputHomogeneity = op_zero,
    .GetVariadicOutputMinArity = op_zero,
    .GetVariadicOutputHomogeneity = op_zero,
    .CreateKernelV2 = kernel_create_v2,
    .KernelComputeV2 = kernel_compute,
};

/* The entry point ONNX Runtime's register_custom_ops_library looks up. */
OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(API_VERSION);
  if (api == NULL) return NULL; /* cannot even report: this runtime predates API 16 */
  if (g_sgemm == NULL)
    return API_FN(api, I_CreateStatus, CreateStatusFn)(
        ORT_FAIL, "ortrain.blas: no sgemm set: load the library through ortrain.runtime.blas_ops");
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = API_FN(api, I_CreateCustomOpDomain, CreateCustomOpDomainFn)("ortrain.blas", &domain);
  if (!st) st = API_FN(api, I_CustomOpDomain_Add, CustomOpDomainAddFn)(domain, &g_gemm_op);
  if (!st) st = API_FN(api, I_AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
  /* the domain must outlive every session that uses it: it is never released */
  return st;
}
