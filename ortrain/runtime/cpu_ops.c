/* RegisterCustomOps for ortrain's CPU custom-op library: the entry point ONNX Runtime's
 * register_custom_ops_library looks up. Two domains:
 *   ortrain.cpu   fused backward kernels (grad_kernels.c), always;
 *   ortrain.blas  the BLAS Gemm (blas_gemm.c), once ortrain_blas_set_sgemm was called.
 */
#include "ort_abi.h"

const OrtApi* ortrain_api17 = NULL;

int ortrain_cpu_ops_abi_version(void) { return 2; }

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
  size_t n_grad = 0;
  const OrtCustomOp* const* grad = ortrain_grad_ops(&n_grad);
  OrtStatus* st = add_domain(api, options, "ortrain.cpu", grad, n_grad);
  if (!st && ortrain_have_sgemm()) {
    const OrtCustomOp* gemm = ortrain_gemm_op();
    st = add_domain(api, options, "ortrain.blas", &gemm, 1);
  }
  return st;
}
