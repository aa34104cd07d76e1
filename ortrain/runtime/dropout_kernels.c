/* ortrain.cpu::Dropout: ONNX Dropout (opset 12 and later) on fp32, its draws counter-based.
 *
 * Why: ONNX Runtime's CPU Dropout draws one number at a time from a Mersenne twister on
 * one thread (about 5 ns an element: a 4-layer transformer encoder's twelve Dropouts took
 * a quarter of its forward graph). Here each element's draw is a hash of (the node's seed,
 * the run, the element's index): SplitMix64's output function over a Weyl sequence, whose
 * outputs pass BigCrush. Any block can be drawn on any thread and the masks do not depend
 * on the thread count.
 *
 *   Dropout(X, ratio?, training_mode?) -> Y, mask?
 *   training_mode true:  mask[i] = u[i] >= ratio (u uniform in [0, 1) from 24 bits),
 *                        Y[i] = mask[i] ? X[i] / (1 - ratio) : 0
 *   otherwise (absent, false) or ratio 0: Y = X, mask all true
 *
 *   DropoutGrad(dY, mask, ratio?, training_mode?) -> dX: the backward in one pass,
 *   dX[i] = mask[i] ? dY[i] / (1 - ratio) : 0 where the forward drew, else dY
 *   (graph_passes/autodiff/rules/nn.py emits it for fp32 CPU builds with the library)
 *
 * ratio absent: 0.5, as ONNX says. The "seed" attribute (graph_passes/prepare/dropout_seed.py
 * gives every node one) and the kernel's run count pick the stream: two sessions of one
 * graph draw the same masks run by run, as ONNX Runtime's kernel with a seed does.
 */
#include <string.h>
#include <time.h>

#include "kernel_util.h"

#define GOLDEN_GAMMA 0x9e3779b97f4a7c15ULL

typedef struct {
  const float* x;
  float* y;
  uint8_t* mask; /* NULL: the node leaves it out */
  int64_t n;
  uint64_t key;       /* this run's stream */
  uint32_t threshold; /* ratio in 24-bit units: drawn values below it are dropped */
  float scale;
} DropWork;

static inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static void dropout_block(void* work, size_t block) {
  const DropWork* w = (const DropWork*)work;
  const int64_t lo = (int64_t)block * ELEMS_PER_BLOCK;
  const int64_t hi = lo + ELEMS_PER_BLOCK < w->n ? lo + ELEMS_PER_BLOCK : w->n;
  const float* x = w->x;
  float* y = w->y;
  const uint64_t key = w->key;
  const uint32_t threshold = w->threshold;
  const float scale = w->scale;
  if (w->mask != NULL) {
    uint8_t* mask = w->mask;
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t u = (uint32_t)(mix64(key + (uint64_t)i * GOLDEN_GAMMA) >> 40);
      const int keep = u >= threshold;
      mask[i] = (uint8_t)keep;
      y[i] = keep ? x[i] * scale : 0.0f;
    }
  } else {
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t u = (uint32_t)(mix64(key + (uint64_t)i * GOLDEN_GAMMA) >> 40);
      y[i] = u >= threshold ? x[i] * scale : 0.0f;
    }
  }
}

/* input i's single value as a float (ratio) or truth (training_mode), if the node gives it */
static OrtStatus* scalar(const Kernel* k, OrtKernelContext* ctx, size_t i, int type, void* out,
                         int* given) {
  size_t n = 0;
  const OrtValue* v = NULL;
  *given = 0;
  OrtStatus* st = API_FN(k->api, I_KernelContext_GetInputCount, GetInputCountFn)(ctx, &n);
  if (st || i >= n) return st;
  if ((st = API_FN(k->api, I_KernelContext_GetInput, GetInputFn)(ctx, i, &v)) || v == NULL)
    return st;
  Tensor t;
  if ((st = input_typed(k, ctx, i, &t, type))) return st;
  if (t.count != 1)
    return ort_invalid(k->api, "ortrain.cpu.%s: input %zu must hold one value, got %lld",
                       k->name, i, (long long)t.count);
  memcpy(out, t.data, type == ELEM_BOOL ? 1 : sizeof(float));
  *given = 1;
  return NULL;
}

OrtStatus* ortrain_dropout_compute(void* kernel, OrtKernelContext* ctx) {
  Kernel* k = (Kernel*)kernel;
  Tensor x;
  OrtStatus* st = input(k, ctx, 0, &x);
  if (st) return st;
  float ratio = 0.5f;
  uint8_t training = 0;
  int given = 0;
  if ((st = scalar(k, ctx, 1, ELEM_FLOAT, &ratio, &given))) return st;
  if ((st = scalar(k, ctx, 2, ELEM_BOOL, &training, &given))) return st;
  if (!(ratio >= 0.0f && ratio < 1.0f))
    return ort_invalid(k->api, "ortrain.cpu.%s: ratio must be in [0, 1), got %g", k->name,
                       (double)ratio);
  DropWork w = {(const float*)x.data, NULL, NULL, x.count, 0, 0, 1.0f};
  if ((st = output(k, ctx, 0, x.dims, x.rank, &w.y))) return st;
  float* mask = NULL;
  if ((st = optional_output(k, ctx, 1, x.dims, x.rank, &mask))) return st;
  w.mask = (uint8_t*)mask;
  /* every run advances the stream, as ONNX Runtime's generator does, drawn or not */
  const uint64_t run = __atomic_fetch_add(&k->runs, 1, __ATOMIC_RELAXED);
  if (!training || ratio == 0.0f) {
    if (w.y != x.data) memcpy(w.y, x.data, (size_t)x.count * sizeof(float));
    if (w.mask != NULL) memset(w.mask, 1, (size_t)x.count);
    return NULL;
  }
  w.key = mix64((uint64_t)k->seed ^ mix64((run + 1) * GOLDEN_GAMMA));
  const double units = (double)ratio * 16777216.0; /* 2^24 */
  w.threshold = (uint32_t)(units + 0.5);
  w.scale = 1.0f / (1.0f - ratio);
  for_blocks(k, ctx, dropout_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}

typedef struct {
  const float* dy;
  const uint8_t* mask;
  float* dx;
  int64_t n;
  float scale;
} DropGradWork;

static void dropout_grad_block(void* work, size_t block) {
  const DropGradWork* w = (const DropGradWork*)work;
  const int64_t lo = (int64_t)block * ELEMS_PER_BLOCK;
  const int64_t hi = lo + ELEMS_PER_BLOCK < w->n ? lo + ELEMS_PER_BLOCK : w->n;
  const float scale = w->scale;
  for (int64_t i = lo; i < hi; ++i) w->dx[i] = w->mask[i] ? w->dy[i] * scale : 0.0f;
}

OrtStatus* ortrain_dropout_grad_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor dy, mask;
  OrtStatus* st = input(k, ctx, 0, &dy);
  if (st || (st = input_typed(k, ctx, 1, &mask, ELEM_BOOL))) return st;
  if ((st = same_shape(k, &dy, "dY", &mask, "mask"))) return st;
  float ratio = 0.5f;
  uint8_t training = 0;
  int given = 0;
  if ((st = scalar(k, ctx, 2, ELEM_FLOAT, &ratio, &given))) return st;
  if ((st = scalar(k, ctx, 3, ELEM_BOOL, &training, &given))) return st;
  if (!(ratio >= 0.0f && ratio < 1.0f))
    return ort_invalid(k->api, "ortrain.cpu.%s: ratio must be in [0, 1), got %g", k->name,
                       (double)ratio);
  DropGradWork w = {(const float*)dy.data, (const uint8_t*)mask.data, NULL, dy.count, 1.0f};
  if ((st = output(k, ctx, 0, dy.dims, dy.rank, &w.dx))) return st;
  if (!training || ratio == 0.0f) { /* the forward drew nothing: dX = dY */
    if (w.dx != w.dy) memcpy(w.dx, w.dy, (size_t)dy.count * sizeof(float));
    return NULL;
  }
  w.scale = 1.0f / (1.0f - ratio);
  for_blocks(k, ctx, dropout_grad_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  return NULL;
}

/* a node without a seed attribute draws from a stream of its own (ONNX Runtime's kernel
 * seeds such a node from the clock too) */
int64_t ortrain_dropout_default_seed(const void* kernel) {
  return (int64_t)mix64((uint64_t)(uintptr_t)kernel ^ (uint64_t)time(NULL));
}
