// The last error of each thread, read by ortrain_last_error(); compiled into both libraries.
#include <stdarg.h>
#include <stdio.h>

#include "common.h"

namespace {
thread_local char g_last_error[1024] = "";
}

int ortrain::set_error(const char* file, int line, const char* fmt, ...) {
  int used = snprintf(g_last_error, sizeof g_last_error, "%s:%d: ", file, line);
  if (used < 0 || used >= static_cast<int>(sizeof g_last_error)) used = 0;
  va_list args;
  va_start(args, fmt);
  vsnprintf(g_last_error + used, sizeof g_last_error - used, fmt, args);
  va_end(args);
  return 1;
}

extern "C" const char* ortrain_last_error(void) { return g_last_error; }
extern "C" int ortrain_kernels_abi_version(void) { return ORTRAIN_KERNELS_ABI_VERSION; }

// CMake compiles this file into each library, defining ORTRAIN_KERNELS_CUDA for the CUDA one.
extern "C" const char* ortrain_kernels_device(void) {
#ifdef ORTRAIN_KERNELS_CUDA
  return "cuda";
#else
  return "cpu";
#endif
}
