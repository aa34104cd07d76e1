/* RegisterCustomOps for ortrain's CPU custom-op library: the entry point ONNX Runtime's
 * register_custom_ops_library looks up. Two domains:
 *   ortrain.cpu   fused fp32 kernels (grad_kernels.c: backwards; softmax.c), always;
 *   ortrain.blas  the BLAS Gemm (blas_gemm.c) and BatchMatMul (blas_batch.c), once
 *                 ortrain_blas_set_sgemm was called.
 */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include <dlfcn.h>

#include "kernel_util.h"

#ifndef ORTRAIN_CPU_ISA /* CMakeLists.txt / cpu_ops.py name the variant they build */
#define ORTRAIN_CPU_ISA "unknown"
#endif

const OrtApi* ortrain_api17 = NULL;
int ortrain_omp_team = 0;
long ortrain_team_runs = 0;

/* ortrain/runtime/cpu_ops.py: ABI_VERSION, checked before any other symbol is used */
int ortrain_cpu_ops_abi_version(void) { return 8; }
/* the instruction-set variant this file was compiled as: baseline, avx2 or avx512 */
const char* ortrain_cpu_ops_isa(void) { return ORTRAIN_CPU_ISA; }

int ortrain_blas_set_sgemm(void* sgemm);     /* blas_gemm.c */
int ortrain_blas_set_sgemm_batch(void* fn);  /* blas_batch.c */

/* Binds ortrain.blas to the Fortran-interface sgemm_ (and, where it has one, MKL's
 * sgemm_batch_) of the BLAS library at `path` (torch's libtorch_cpu: loaded already by
 * `import torch`, so RTLD_NOLOAD finds that copy and no second BLAS is loaded). Returns 0,
 * -1 when the library cannot be opened, -2 when it exports no sgemm_. */
int ortrain_blas_bind(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (lib == NULL) lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) return -1;
  void* sgemm = dlsym(lib, "sgemm_");
  if (sgemm == NULL) return -2;
  ortrain_blas_set_sgemm(sgemm);
  ortrain_blas_set_sgemm_batch(dlsym(lib, "sgemm_batch_")); /* NULL: one sgemm per matrix */
  return 0;
}

#ifdef _OPENMP
#include <omp.h>
/* the omp_get_max_threads this library calls: Python compares it with torch's to tell
 * whether both bind one OpenMP runtime (a second one would bring a second team) */
void* ortrain_omp_symbol(void) { return (void*)&omp_get_max_threads; }
#else
void* ortrain_omp_symbol(void) { return NULL; }
#endif

/* 1: run the kernels' blocks on the OpenMP team; 0: on ONNX Runtime's threads. Returns
 * the setting in force (0 where the library was built without OpenMP). */
int ortrain_use_omp_team(int on) {
#ifdef _OPENMP
  ortrain_omp_team = on != 0;
#else
  (void)on;
#endif
  return ortrain_omp_team;
}

/* ------------------------------------------------------- the ortrain.cpu op table */
typedef struct {
  OrtCustomOp op; /* first: ONNX Runtime hands back this address */
  const char* name;
  size_t inputs, outputs;
  size_t required_inputs, required_outputs; /* the rest may be left out */
  int int64_input;                          /* the index of an int64 input, or -1 */
  const int *in_types, *out_types;          /* each input's / output's element type, or
                                               NULL: float32 (but int64_input) */
} KernelOp;

#define KOP(op) ((const KernelOp*)(op))
static const char* op_name(const OrtCustomOp* op) { return KOP(op)->name; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int op_input_type(const OrtCustomOp* op, size_t i) {
  if (KOP(op)->in_types != NULL) return KOP(op)->in_types[i];
  return (int)i == KOP(op)->int64_input ? ELEM_INT64 : ELEM_FLOAT;
}
static int op_output_type(const OrtCustomOp* op, size_t i) {
  return KOP(op)->out_types != NULL ? KOP(op)->out_types[i] : ELEM_FLOAT;
}
static size_t op_inputs(const OrtCustomOp* op) { return KOP(op)->inputs; }
static size_t op_outputs(const OrtCustomOp* op) { return KOP(op)->outputs; }
static int op_input_kind(const OrtCustomOp* op, size_t i) {
  return i < KOP(op)->required_inputs ? REQUIRED : OPTIONAL;
}
static int op_output_kind(const OrtCustomOp* op, size_t i) {
  return i < KOP(op)->required_outputs ? REQUIRED : OPTIONAL;
}

static OrtStatus* create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                         void** out) {
  Kernel* k = (Kernel*)calloc(1, sizeof(Kernel));
  if (k == NULL) return API_FN(api, I_CreateStatus, CreateStatusFn)(ORT_FAIL, "out of memory");
  k->api = api;
  k->name = KOP(op)->name;
  k->epsilon = 1e-5f;
  OrtStatus* st = API_FN(api, I_KernelInfoGetAttribute_float, GetAttrFloatFn)(info, "epsilon",
                                                                            &k->epsilon);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->epsilon = 1e-5f; /* absent */
  int64_t team = 1;
  st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "omp_team", &team);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), team = 1; /* absent */
  k->omp_team = team != 0;
  int64_t transposed = 0;
  st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "grad_transposed",
                                                                  &transposed);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), transposed = 0; /* absent */
  k->grad_transposed = transposed != 0;
  transposed = 0;
  st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "out_transposed",
                                                                  &transposed);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), transposed = 0; /* absent */
  k->out_transposed = (int)transposed;
  st = API_FN(api, I_KernelInfoGetAttribute_int64, GetAttrInt64Fn)(info, "seed", &k->seed);
  if (st) API_FN(api, I_ReleaseStatus, ReleaseStatusFn)(st), k->seed = ortrain_dropout_default_seed(k);
  *out = k;
  return NULL;
}

static void destroy(void* kernel) { free(kernel); }

/* Output 0 may take input 0's buffer (ONNX Runtime's planner decides: when nothing reads
 * the input afterwards), as ONNX Runtime's own Softmax offers. For kernels that read each
 * element before writing it. */
static size_t x_to_y_inplace(int** input_index, int** output_index) {
  *input_index = (int*)calloc(1, sizeof(int));
  *output_index = (int*)calloc(1, sizeof(int));
  if (*input_index == NULL || *output_index == NULL) {
    free(*input_index), free(*output_index);
    *input_index = *output_index = NULL;
    return 0;
  }
  return 1;
}

static void release_inplace(int* input_index, int* output_index) {
  free(input_index), free(output_index);
}

/* name, inputs (required of them), outputs (required of them), compute, int64 input; the
 * op-table version, GetMayInplace / ReleaseMayInplace (NULL: none offered) and the element
 * types of the inputs and outputs (NULL: float32, but the int64 input) */
#define KERNEL_OP_T(name_, n_in, req_in, n_out, req_out, fn, int64_in, version_, inplace, release, \
                    in_types_, out_types_)                                                  \
  {                                                                          \
    .op =                                                                    \
        {                                                                    \
            .version = version_,                                             \
            .CreateKernel = ort_op_create_v1,                                \
            .GetName = op_name,                                              \
            .GetExecutionProviderType = op_provider,                         \
            .GetInputType = op_input_type,                                   \
            .GetInputTypeCount = op_inputs,                                  \
            .GetOutputType = op_output_type,                                 \
            .GetOutputTypeCount = op_outputs,                                \
            .KernelCompute = ort_op_compute_v1,                              \
            .KernelDestroy = destroy,                                        \
            .GetInputCharacteristic = op_input_kind,                         \
            .GetOutputCharacteristic = op_output_kind,                       \
            .GetInputMemoryType = ort_op_memory_type,                        \
            .GetVariadicInputMinArity = ort_op_zero,                         \
            .GetVariadicInputHomogeneity = ort_op_zero,                      \
            .GetVariadicOutputMinArity = ort_op_zero,                        \
            .GetVariadicOutputHomogeneity = ort_op_zero,                     \
            .CreateKernelV2 = create,                                        \
            .KernelComputeV2 = fn,                                           \
            .GetMayInplace = inplace,                                        \
            .ReleaseMayInplace = release,                                    \
        },                                                                   \
    .name = name_, .inputs = n_in, .outputs = n_out,                         \
    .required_inputs = req_in, .required_outputs = req_out,                  \
    .int64_input = int64_in, .in_types = in_types_, .out_types = out_types_ \
  }
#define KERNEL_OP_V(name_, n_in, req_in, n_out, req_out, fn, int64_in, version_, inplace, release) \
  KERNEL_OP_T(name_, n_in, req_in, n_out, req_out, fn, int64_in, version_, inplace, release, NULL, NULL)
#define KERNEL_OP(name_, n_in, req_in, n_out, req_out, fn, int64_in) \
  KERNEL_OP_V(name_, n_in, req_in, n_out, req_out, fn, int64_in, API_VERSION, NULL, NULL)
/* ... and output 0 may take input 0's buffer (op version 18: GetMayInplace) */
#define KERNEL_OP_INPLACE(name_, n_in, req_in, n_out, req_out, fn, int64_in)                  \
  KERNEL_OP_V(name_, n_in, req_in, n_out, req_out, fn, int64_in, INPLACE_API_VERSION,        \
              x_to_y_inplace, release_inplace)

/* Dropout's element types (dropout_kernels.c) */
static const int g_dropout_in[3] = {ELEM_FLOAT, ELEM_FLOAT, ELEM_BOOL};
static const int g_dropout_out[2] = {ELEM_FLOAT, ELEM_BOOL};
static const int g_dropout_grad_in[4] = {ELEM_FLOAT, ELEM_BOOL, ELEM_FLOAT, ELEM_BOOL};
static const int g_float_out[1] = {ELEM_FLOAT};

static const KernelOp g_ops[] = {
    /* GELU backwards: Y (the GELU itself) optional */
    KERNEL_OP("GeluGrad", 2, 2, 2, 1, ortrain_gelu_grad_compute, -1),
    KERNEL_OP("FastGeluGrad", 2, 2, 2, 1, ortrain_fast_gelu_grad_compute, -1),
    KERNEL_OP("SoftmaxGrad", 2, 2, 1, 1, ortrain_softmax_grad_compute, -1),
    KERNEL_OP("LayerNormGrad", 6, 5, 3, 3, ortrain_layer_norm_grad_compute, -1),
    KERNEL_OP("BatchNormGrad", 3, 3, 3, 3, ortrain_batch_norm_grad_compute, -1),
    KERNEL_OP("ReluGrad", 2, 2, 1, 1, ortrain_relu_grad_compute, -1),
    /* out may take base's buffer: a tied embedding's gradient, whose optimizer update runs
     * in the backward (update_in_backward.py), where no bound gradient buffer holds it */
    KERNEL_OP_INPLACE("ScatterAddRows", 3, 3, 1, 1, ortrain_scatter_add_rows_compute, 1),
    /* ... and the same into a table kept transposed (AdamStep's grad_transposed) */
    KERNEL_OP_INPLACE("ScatterAddColumns", 3, 3, 1, 1, ortrain_scatter_add_columns_compute, 1),
    /* bias optional; Y may take X's buffer (a loss head's [tokens, vocab] logits: without
     * it GPT-2 tiny's peak RSS grows by their 32 MiB, as ONNX Runtime's Softmax offers) */
    KERNEL_OP_INPLACE("Softmax", 2, 1, 1, 1, ortrain_softmax_compute, -1),
    /* forwards (forward_kernels.c): LayerNorm's bias and skip, and all but Y, optional */
    KERNEL_OP("LayerNorm", 4, 2, 4, 1, ortrain_layer_norm_compute, -1),
    KERNEL_OP("Gelu", 1, 1, 1, 1, ortrain_gelu_compute, -1),
    KERNEL_OP("FastGelu", 1, 1, 1, 1, ortrain_fast_gelu_compute, -1),
    /* last-axis copies (layout_kernels.c): up to 8 parts, as many as the node names */
    KERNEL_OP("SplitLast", 1, 1, 8, 1, ortrain_split_last_compute, -1),
    KERNEL_OP("ConcatLast", 8, 2, 1, 1, ortrain_concat_last_compute, -1),
    /* ScatterElements along the last axis (reduction none / add); out may take data's buffer */
    KERNEL_OP_INPLACE("ScatterLast", 3, 3, 1, 1, ortrain_scatter_last_compute, 1),
    KERNEL_OP_INPLACE("ScatterAddLast", 3, 3, 1, 1, ortrain_scatter_add_last_compute, 1),
    /* element-wise arithmetic (elementwise_kernels.c): Sum takes 2 to 8 inputs */
    KERNEL_OP("Mul", 2, 2, 1, 1, ortrain_mul_compute, -1),
    KERNEL_OP("Add", 2, 2, 1, 1, ortrain_add_compute, -1),
    KERNEL_OP("Sub", 2, 2, 1, 1, ortrain_sub_compute, -1),
    KERNEL_OP("Sum", 8, 2, 1, 1, ortrain_sum_compute, -1),
    /* the optimizer update in the backward (update_kernels.c): up to 8 ordering inputs */
    KERNEL_OP("AdamStep", 14, 6, 1, 1, ortrain_adam_step_compute, -1),
    /* dropout_kernels.c: X, ratio?, training_mode? -> Y, mask?; and its backward */
    KERNEL_OP_T("Dropout", 3, 1, 2, 1, ortrain_dropout_compute, -1, API_VERSION, NULL, NULL,
                g_dropout_in, g_dropout_out),
    KERNEL_OP_T("DropoutGrad", 4, 2, 1, 1, ortrain_dropout_grad_compute, -1, API_VERSION, NULL,
                NULL, g_dropout_grad_in, g_float_out),
};
#define N_OPS (sizeof g_ops / sizeof g_ops[0])

static OrtStatus* add_domain(const OrtApi* api, OrtSessionOptions* options, const char* name,
                             const OrtCustomOp* const* ops, size_t count) {
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* st = API_FN(api, I_CreateCustomOpDomain, CreateCustomOpDomainFn)(name, &domain);
  for (size_t i = 0; !st && i < count; ++i)
    st = API_FN(api, I_CustomOpDomain_Add, CustomOpDomainAddFn)(domain, ops[i]);
  if (!st) st = API_FN(api, I_AddCustomOpDomain, AddCustomOpDomainFn)(options, domain);
  /* the domain must outlive every session that uses it: it is never released */
  return st;
}

OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(API_VERSION);
  if (api == NULL) return NULL; /* cannot even report: this runtime predates API 16 */
  ortrain_api17 = base->GetApi(17); /* NULL before 1.17: the kernels run single-threaded */
  static const OrtCustomOp* table[N_OPS];
  for (size_t i = 0; i < N_OPS; ++i) table[i] = &g_ops[i].op;
  OrtStatus* st = add_domain(api, options, "ortrain.cpu", table, N_OPS);
  if (!st && ortrain_have_sgemm()) {
    const OrtCustomOp* blas[2] = {ortrain_gemm_op(), ortrain_batch_matmul_op()};
    st = add_domain(api, options, "ortrain.blas", blas, 2);
  }
  return st;
}
