/* One Adam / AdamW element update, in plain C so that every kernel compiles the same one:
 * the update in the backward (update_kernels.c, C), and through cuda_kernels/optim_math.h
 * the CUDA kernel (adam.cu) and its CPU reference (adam.cpp). It follows torch's operation
 * order (torch/optim/adam.py and its fused kernels, noted on each line):
 *
 *   Adam   g = g + wd p                    AdamW  p = p (1 - lr wd)
 *   m = lerp(m, g, 1 - beta1);  v = beta2 v + (1 - beta2) g^2
 *   p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 *
 * The loop-invariant scalars are prepared on the host in double and rounded to float once
 * (ortrain_adam_coeffs_of), the way torch turns its optimizers' Python floats into fp32
 * kernel scalars. A vectorizing loop takes the one test (on a loop-invariant flag) as a
 * select; AdamW without weight decay and Adam have decay 1 (p * 1 is exact).
 * The graph's update (graph_passes/training/optimizer/adam.py) is ONNX, not this code.
 */
#ifndef ORTRAIN_ADAM_MATH_H
#define ORTRAIN_ADAM_MATH_H
#include <math.h>

#if defined(__CUDACC__)
#define ORTRAIN_ELEMENT static __host__ __device__ __forceinline__
#else
#define ORTRAIN_ELEMENT static inline
#endif

typedef struct {
  int l2_on;           /* Adam with weight decay: g + wd p (skipped otherwise: 0 inf is NaN) */
  float l2;            /* Adam's weight decay */
  float decay;         /* AdamW's 1 - lr wd; 1 for Adam */
  float one_minus_b1;  /* the lerp weight of exp_avg */
  float beta2, one_minus_b2;
  float bc2_sqrt;      /* sqrt(1 - beta2^t) */
  float eps;
  float step_size;     /* lr / (1 - beta1^t) */
} ortrain_adam_coeffs;

/* t: the 1-based step; decoupled: AdamW's weight decay */
static inline ortrain_adam_coeffs ortrain_adam_coeffs_of(double lr, double beta1, double beta2,
                                                         double eps, double wd, double t,
                                                         int decoupled) {
  ortrain_adam_coeffs c;
  c.l2_on = !decoupled && wd != 0.0;
  c.l2 = (float)wd;
  c.decay = decoupled ? (float)(1.0 - lr * wd) : 1.0f;
  c.one_minus_b1 = (float)(1.0 - beta1);
  c.beta2 = (float)beta2;
  c.one_minus_b2 = (float)(1.0 - beta2);
  c.bc2_sqrt = (float)sqrt(1.0 - pow(beta2, t));
  c.eps = (float)eps;
  c.step_size = (float)(lr / (1.0 - pow(beta1, t)));
  return c;
}

/* ATen's lerp (native/Lerp.h): the formula switches at 0.5 so both ends are exact */
ORTRAIN_ELEMENT float ortrain_lerp(float a, float b, float w) {
  return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

/* g: the gradient, already multiplied by any grad_scale */
ORTRAIN_ELEMENT void ortrain_adam_element(float* p, float g, float* m, float* v,
                                          const ortrain_adam_coeffs* c) {
  const float pi = *p;
  if (c->l2_on) g = g + c->l2 * pi;           /* grad.add(param, alpha=wd) */
  const float mi = ortrain_lerp(*m, g, c->one_minus_b1);  /* exp_avg.lerp_(g, 1 - beta1) */
  const float vi = *v * c->beta2 + c->one_minus_b2 * g * g;  /* mul_(b2).addcmul_(g, g, 1 - b2) */
  *m = mi;
  *v = vi;
  /* param.mul_(1 - lr wd); denom = sqrt(v) / bc2_sqrt + eps; addcdiv_(m, denom, -step_size) */
  *p = pi * c->decay - c->step_size * mi / (sqrtf(vi) / c->bc2_sqrt + c->eps);
}

#endif /* ORTRAIN_ADAM_MATH_H */
