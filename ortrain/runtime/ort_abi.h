/* The pieces of ONNX Runtime's C ABI that ortrain's CPU custom ops use, declared by hand.
 *
 * No ONNX Runtime header ships in its Python wheel. The OrtApi function table is
 * append-only: an entry's index never moves between releases (onnxruntime_c_api.h), so
 * the indices below are those of the API-16 table, which every runtime >= 1.16 serves
 * (GetApi(16)); KernelContext_ParallelFor is an API-17 entry, fetched with GetApi(17).
 */
#ifndef ORTRAIN_ORT_ABI_H
#define ORTRAIN_ORT_ABI_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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
enum { INPLACE_API_VERSION = 18 };   /* GetMayInplace: ops that offer their output in place */
enum { ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum { ELEM_FLOAT = 1, ELEM_INT64 = 7, ELEM_BOOL = 9 }; /* ONNX_TENSOR_ELEMENT_DATA_TYPE_* */
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
  I_KernelContext_GetOutputCount = 89,
  I_KernelContext_GetInput = 90,
  I_KernelContext_GetOutput = 91,
  I_ReleaseStatus = 93,
  I_ReleaseTensorTypeAndShapeInfo = 99,
  I_KernelContext_ParallelFor = 274, /* API 17 */
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
typedef OrtStatus* (*GetOutputCountFn)(const OrtKernelContext* ctx, size_t* out);
typedef OrtStatus* (*GetInputFn)(const OrtKernelContext* ctx, size_t index, const OrtValue** out);
typedef OrtStatus* (*GetOutputFn)(OrtKernelContext* ctx, size_t index, const int64_t* dims,
                                  size_t n, OrtValue** out);
typedef void (*ReleaseStatusFn)(OrtStatus* status);
typedef void (*ReleaseTensorInfoFn)(OrtTensorInfo* info);
typedef OrtStatus* (*ParallelForFn)(const OrtKernelContext* ctx, void (*fn)(void*, size_t),
                                    size_t total, size_t num_batch, void* usr_data);

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
  /* version >= 17 / 18 (NULL: not offered; ONNX Runtime checks) */
  OrtStatus* (*InferOutputShapeFn)(const struct OrtCustomOp* op, void* context);
  int (*GetStartVersion)(const struct OrtCustomOp* op);
  int (*GetEndVersion)(const struct OrtCustomOp* op);
  size_t (*GetMayInplace)(int** input_index, int** output_index);
  void (*ReleaseMayInplace)(int* input_index, int* output_index);
  size_t (*GetAliasMap)(int** input_index, int** output_index);
  void (*ReleaseAliasMap)(int* input_index, int* output_index);
} OrtCustomOp;

/* Op-table callbacks every ortrain op shares: inputs in CPU memory, no variadic inputs or
 * outputs, and the API-1 entry points, never called (with version >= 16 ONNX Runtime calls
 * CreateKernelV2 / KernelComputeV2). */
static inline int ort_op_memory_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static inline int ort_op_zero(const OrtCustomOp* op) { (void)op; return 0; }
static inline void ort_op_compute_v1(void* kernel, OrtKernelContext* ctx) { (void)kernel; (void)ctx; }
static inline void* ort_op_create_v1(const OrtCustomOp* op, const OrtApi* api,
                                     const OrtKernelInfo* info) {
  (void)op; (void)api; (void)info;
  return NULL;
}

/* An ORT_INVALID_ARGUMENT status with a printf-formatted message. */
static inline OrtStatus* ort_invalid(const OrtApi* api, const char* fmt, ...) {
  char msg[384];
  va_list args;
  va_start(args, fmt);
  vsnprintf(msg, sizeof msg, fmt, args);
  va_end(args);
  return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_INVALID_ARGUMENT, msg);
}

/* dims of a tensor (up to 8) and its element type; NULL on success */
static inline OrtStatus* ort_shape_of(const OrtApi* api, const OrtValue* v, int64_t* dims, size_t* rank,
                           int* elem) {
  OrtTensorInfo* info = NULL;
  OrtStatus* st = API_FN(api, I_GetTensorTypeAndShape, GetTensorTypeAndShapeFn)(v, &info);
  if (st) return st;
  st = API_FN(api, I_GetDimensionsCount, GetDimensionsCountFn)(info, rank);
  if (!st && *rank > 8) st = ort_invalid(api, "ortrain: tensor rank %lld > 8", (long long)*rank);
  if (!st) st = API_FN(api, I_GetDimensions, GetDimensionsFn)(info, dims, *rank);
  if (!st) st = API_FN(api, I_GetTensorElementType, GetTensorElementTypeFn)(info, elem);
  API_FN(api, I_ReleaseTensorTypeAndShapeInfo, ReleaseTensorInfoFn)(info);
  return st;
}

/* ops each source file defines; RegisterCustomOps (cpu_ops.c) adds them to their domains */
const OrtCustomOp* ortrain_gemm_op(void);
const OrtCustomOp* ortrain_batch_matmul_op(void);
int ortrain_have_sgemm(void);
/* the API-17 table (for KernelContext_ParallelFor), or NULL on an older runtime */
extern const OrtApi* ortrain_api17;
/* nonzero: the kernels' blocks run on the OpenMP team (kernel_util.h: for_blocks) */
extern int ortrain_omp_team;
/* how many kernel calls ran their blocks on the team (tests read it) */
extern long ortrain_team_runs;

#endif
