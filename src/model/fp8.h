// float8 e4m3fn ("F8_E4M3" in safetensors, torch.float8_e4m3fn): 1 sign bit, 4
// exponent bits (bias 7), 3 mantissa bits, no infinities, NaN only as S.1111.111.
// Largest finite magnitude 448 (code 0x7e), smallest normal 2^-6, subnormals
// m * 2^-9. Header-only so that both the model loader and the CPU kernels use
// the one conversion; the CUDA kernels' hardware conversion must agree with it
// (kernel tests compare against these functions).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace pd::model {

inline constexpr float kFp8E4m3Max = 448.0f;
// The block size of block-quantised FP8 checkpoints ("weight_block_size": [128, 128])
// and of their per-token activation groups.
inline constexpr int32_t kFp8BlockSize = 128;

// Exact: every code maps to the value it denotes (0x7f / 0xff to NaN).
inline float fp8_e4m3_to_f32(uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xf && mantissa == 0x7) {
    magnitude = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return negative ? -magnitude : magnitude;
}

// Round to nearest, ties to even mantissa; magnitudes above 448 (and infinities)
// saturate to +-448; NaN becomes 0x7f with the input's sign bit.
inline uint8_t f32_to_fp8_e4m3(float x) {
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7f);
  const float a = std::fabs(x);
  if (a >= kFp8E4m3Max) return static_cast<uint8_t>(sign | 0x7e);
  if (a < 0x1.0p-6f) {
    // Subnormal step 2^-9: the rounded multiple is the code itself (8 = the
    // smallest normal, 1.0 x 2^-6, when it rounds up). Scaling by 2^9 is exact.
    const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 9)));
    return static_cast<uint8_t>(sign | q);
  }
  int e2 = 0;
  (void)std::frexp(a, &e2);  // a = f * 2^e2 with f in [0.5, 1): unbiased exponent e2 - 1
  const int e = e2 - 1;
  // a * 2^(3 - e) lies in [8, 16); rounding to 16 carries into the exponent field.
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - e)));
  const int code = ((e + 7) << 3) + (q - 8);
  return static_cast<uint8_t>(sign | (code > 0x7e ? 0x7e : code));
}

}  // namespace pd::model
