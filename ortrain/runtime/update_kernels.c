/* The optimizer update inside the training graph (graph_passes/update_in_backward.py):
 *
 *   AdamStep(P, G, M, V, H, L[, after0 .. after7]) -> done
 *
 * updates parameter P and its Adam moments M (exp_avg) and V (exp_avg_sq) IN PLACE from
 * gradient G, as torch's fused Adam / AdamW kernels do (torch._fused_adamw_):
 *
 *   AdamW  p *= 1 - lr wd          Adam  g += wd p
 *   m = m + (1 - beta1) (g - m);   v = beta2 v + (1 - beta2) g^2
 *   p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 *
 * H = [lr, beta1, beta2, eps, weight_decay, t, decoupled]: the group's hyperparameters,
 * the 1-based step and 1 for AdamW's decoupled weight decay. L is the loss: where it is
 * not finite nothing changes and done is 0 (1 when applied), so a step whose loss
 * overflowed leaves parameters and moments as they were. The optional inputs are only
 * read by ONNX Runtime's ordering: the nodes that read P (other than through the gradient
 * and the loss) must have run before P changes, and an edge from each of them says so.
 *
 * P, M and V are graph inputs, bound to the trainer's buffers; writing through their
 * const-qualified pointers is what makes the update in place (ONNX Runtime never hands a
 * kernel a copy of a bound input on the CPU). Blocks touch disjoint elements, once each.
 */
#include <math.h>

#include "kernel_util.h"

enum { H_LR, H_BETA1, H_BETA2, H_EPS, H_WD, H_STEP, H_DECOUPLED, H_COUNT };

typedef struct {
  float *p, *m, *v;
  const float* g;
  int64_t n;
  float lr, beta1, beta2, eps, wd, step_size, bc2_sqrt;
  int decoupled;
} Adam;

/* decay: the decoupled weight decay factor (1 - lr wd; 1 without); l2: Adam's wd (0 for
 * AdamW). One loop for both, branch-free, so it vectorizes (the library is built with
 * -fno-math-errno: sqrtf is then a vector square root, as in torch's kernel). */
static void adam_block(void* work, size_t blk) {
  const Adam* w = (const Adam*)work;
  int64_t lo = (int64_t)blk * ELEMS_PER_BLOCK, hi = lo + ELEMS_PER_BLOCK;
  if (hi > w->n) hi = w->n;
  float* restrict p = w->p;
  float* restrict m = w->m;
  float* restrict v = w->v;
  const float* restrict g = w->g;
  const float one_minus_b1 = 1.0f - w->beta1, one_minus_b2 = 1.0f - w->beta2, beta2 = w->beta2;
  const float decay = w->decoupled ? 1.0f - w->lr * w->wd : 1.0f;
  const float l2 = w->decoupled ? 0.0f : w->wd;
  const float step_size = w->step_size, bc2_sqrt = w->bc2_sqrt, eps = w->eps;
#pragma omp simd
  for (int64_t i = lo; i < hi; ++i) {
    const float pi = p[i] * decay;
    const float gi = g[i] + l2 * p[i];
    const float mi = m[i] + one_minus_b1 * (gi - m[i]);
    const float vi = beta2 * v[i] + one_minus_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
  }
}

OrtStatus* ortrain_adam_step_compute(void* kernel, OrtKernelContext* ctx) {
  const Kernel* k = (const Kernel*)kernel;
  Tensor p, g, m, v, h, loss;
  OrtStatus* st;
  if ((st = input(k, ctx, 0, &p)) || (st = input(k, ctx, 1, &g)) || (st = input(k, ctx, 2, &m)) ||
      (st = input(k, ctx, 3, &v)) || (st = input(k, ctx, 4, &h)) || (st = input(k, ctx, 5, &loss)))
    return st;
  if ((st = same_shape(k, &g, "gradient G", &p, "parameter P")) ||
      (st = same_shape(k, &m, "exp_avg M", &p, "parameter P")) ||
      (st = same_shape(k, &v, "exp_avg_sq V", &p, "parameter P")))
    return st;
  if (h.count != H_COUNT)
    return ort_invalid(k->api,
                       "ortrain.cpu.AdamStep: hyperparameters H hold %lld values; expected %d "
                       "(lr, beta1, beta2, eps, weight_decay, step, decoupled)",
                       (long long)h.count, H_COUNT);
  if (loss.count != 1)
    return ort_invalid(k->api, "ortrain.cpu.AdamStep: loss L holds %lld values; expected 1",
                       (long long)loss.count);
  float* done = NULL;
  if ((st = output(k, ctx, 0, NULL, 0, &done))) return st;
  const float* hv = (const float*)h.data;
  if (!isfinite(*(const float*)loss.data)) {
    *done = 0.0f;
    return NULL;
  }
  /* torch's kernels take the bias corrections in double, then the step in float */
  double t = hv[H_STEP];
  double bc1 = 1.0 - pow((double)hv[H_BETA1], t), bc2 = 1.0 - pow((double)hv[H_BETA2], t);
  Adam w = {(float*)p.data, (float*)m.data, (float*)v.data, (const float*)g.data, p.count,
            hv[H_LR], hv[H_BETA1], hv[H_BETA2], hv[H_EPS], hv[H_WD],
            (float)((double)hv[H_LR] / bc1), (float)sqrt(bc2), hv[H_DECOUPLED] != 0.0f};
  for_blocks(k, ctx, adam_block, div_up((size_t)w.n, ELEMS_PER_BLOCK), &w);
  *done = 1.0f;
  return NULL;
}
