// The per-element optimizer arithmetic, one definition for the CPU reference and the
// CUDA kernels: the reference is checked against torch, the kernels against the
// reference, so both see the same operation order (torch's, noted on each line).
//
// Scalars are prepared on the host in double and rounded to float once, the way torch
// turns the Python floats of its optimizers into fp32 kernel scalars; the bias
// corrections 1 - beta^t use the double `step` t given by the caller.
#pragma once
#include <math.h>

#include "../ortrain/runtime/adam_math.h"
#include "common.h"

namespace ortrain {

// torch.optim.Adam/AdamW: the element function the update in the backward's C kernel
// (ortrain/runtime/update_kernels.c) compiles too, one definition in plain C.
using AdamCoeffs = ortrain_adam_coeffs;

inline AdamCoeffs adam_coeffs(double lr, double beta1, double beta2, double eps, double wd,
                              double step, int decoupled) {
  return ortrain_adam_coeffs_of(lr, beta1, beta2, eps, wd, step, decoupled);
}

// g is the gradient already multiplied by grad_scale.
ORT_HD void adam_element(float& p, float g, float& m, float& v, const AdamCoeffs& c) {
  ortrain_adam_element(&p, g, &m, &v, &c);
}

// ortrain.optim.Lamb (ortrain/optim/lamb.py).
struct LambCoeffs {
  float beta1, one_minus_b1, beta2, one_minus_b2;
  float bc1, bc2;  // 1 - beta^t, or 1 without bias correction (x / 1 is exact)
  float eps, wd;
};

inline LambCoeffs lamb_coeffs(double beta1, double beta2, double eps, double wd, double step,
                              int bias_correction) {
  LambCoeffs c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_b1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_b2 = static_cast<float>(1.0 - beta2);
  c.bc1 = bias_correction ? static_cast<float>(1.0 - pow(beta1, step)) : 1.0f;
  c.bc2 = bias_correction ? static_cast<float>(1.0 - pow(beta2, step)) : 1.0f;
  c.eps = static_cast<float>(eps);
  c.wd = static_cast<float>(wd);
  return c;
}

// Updates m and v, returns the update direction u (p is read, not written).
ORT_HD float lamb_element(float p, float g, float& m, float& v, const LambCoeffs& c) {
  m = m * c.beta1 + g * c.one_minus_b1;      // m.mul_(beta1).add_(g * (1 - beta1))
  v = v * c.beta2 + g * g * c.one_minus_b2;  // v.mul_(beta2).add_(g * g * (1 - beta2))
  const float m_hat = m / c.bc1, v_hat = v / c.bc2;
  return m_hat / (sqrtf(v_hat) + c.eps) + c.wd * p;
}

// The p -= coef * u coefficient of one tensor: lr * trust, trust = ||p|| / ||u|| when
// both norms are > 0, else 1 (a NaN norm compares false: trust 1, as torch.where does).
ORT_HD float lamb_coef(float lr, float param_sq, float update_sq) {
  const float w = sqrtf(param_sq), u = sqrtf(update_sq);
  return lr * ((w > 0.0f && u > 0.0f) ? w / u : 1.0f);
}

}  // namespace ortrain
