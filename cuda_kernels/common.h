// Shared by the CPU reference and the CUDA kernels: error reporting with file and line,
// and the marker for functions compiled for both host and device.
#pragma once
#include <stdint.h>

#include "ortrain_kernels.h"

#if defined(__CUDACC__)
#define ORT_HD __host__ __device__ __forceinline__
#else
#define ORT_HD inline
#endif

namespace ortrain {
// Records "file:line: message" for ortrain_last_error() and returns a non-zero code, so
// that a failure reaches Python as an exception rather than ending the process.
int set_error(const char* file, int line, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
}  // namespace ortrain

// Argument check at a C entry point: returns the error code from the enclosing function.
#define KERNEL_CHECK(cond, ...)                                          \
  do {                                                                   \
    if (!(cond)) return ::ortrain::set_error(__FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

#define CHECK_DTYPE(dtype, name)                                                     \
  KERNEL_CHECK((dtype) == ORTRAIN_F32 || (dtype) == ORTRAIN_F16 || (dtype) == ORTRAIN_BF16, \
               "%s: unknown dtype code %d", name, (int)(dtype))
#define CHECK_HALF_DTYPE(half_param, half_dtype)                                      \
  KERNEL_CHECK((half_param) == nullptr || (half_dtype) == ORTRAIN_F16 ||              \
                   (half_dtype) == ORTRAIN_BF16,                                      \
               "half_param: dtype code %d is not fp16 (1) or bf16 (2)", (int)(half_dtype))
