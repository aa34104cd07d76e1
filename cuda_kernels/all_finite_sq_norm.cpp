// CPU reference of all_finite_sq_norm.cu: the same C ABI; the sum accumulates in double.
#include <math.h>

#include "common.h"
#include "half_host.h"

extern "C" int64_t ortrain_sq_norm_workspace_floats(int64_t) { return 0; }

extern "C" int ortrain_all_finite_sq_norm(const void* const* ptrs, const int64_t* lens,
                                          int64_t ntensors, int dtype, float* sq_norm,
                                          float* found_inf, float* /*workspace*/,
                                          void* /*stream*/) {
  CHECK_DTYPE(dtype, "tensors");
  KERNEL_CHECK(ntensors >= 0, "ntensors must be >= 0");
  double acc = 0.0;
  bool finite = true;
  for (int64_t t = 0; t < ntensors; ++t) {
    KERNEL_CHECK(lens[t] >= 0, "lens[%lld] < 0", static_cast<long long>(t));
    for (int64_t i = 0; i < lens[t]; ++i) {
      const float x = ortrain::load_as_float(ptrs[t], dtype, i);
      finite = finite && isfinite(x);
      acc += static_cast<double>(x) * x;
    }
  }
  *sq_norm = static_cast<float>(acc);
  // As the update graph does, a sum that overflows fp32 also counts as an overflow.
  *found_inf = (finite && isfinite(*sq_norm)) ? 0.0f : 1.0f;
  return 0;
}
