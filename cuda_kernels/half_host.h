// fp16/bf16 <-> fp32 on the host, bit-exact with torch's conversions (c10::Half,
// c10::BFloat16): round to nearest even, overflow to inf. Plain integer code, so the
// CPU reference needs neither _Float16 nor F16C.
#pragma once
#include <stdint.h>
#include <string.h>

namespace ortrain {

inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf, nan
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact in float
    const float f = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// F. Giesen's float_to_half_fast3_rtne.
inline uint16_t float_to_half(float f) {
  uint32_t u = float_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t h;
  if (u >= 0x47800000u) {  // >= 2^16: inf, or nan (quiet)
    h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 0x38800000u) {  // below 2^-14: subnormal or zero
    // Adding 0.5 aligns the 10 mantissa bits at the bottom; the FPU rounds to even.
    h = float_bits(bits_float(u) + 0.5f) - 0x3f000000u;
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += 0xc8000fffu + mant_odd;  // re-bias the exponent (-112 << 23), round to even
    h = u >> 13;                  // a carry into the exponent gives inf: correct
  }
  return static_cast<uint16_t>(h | (sign >> 16));
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// c10::round_to_nearest_even.
inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7fc0u;
  const uint32_t u = float_bits(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Reads element i of a gradient buffer of the given dtype as float.
inline float load_as_float(const void* data, int dtype, int64_t i) {
  switch (dtype) {
    case ORTRAIN_F16: return half_to_float(static_cast<const uint16_t*>(data)[i]);
    case ORTRAIN_BF16: return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
    default: return static_cast<const float*>(data)[i];
  }
}

inline void store_half(void* out, int dtype, int64_t i, float x) {
  static_cast<uint16_t*>(out)[i] = dtype == ORTRAIN_F16 ? float_to_half(x) : float_to_bf16(x);
}

}  // namespace ortrain
