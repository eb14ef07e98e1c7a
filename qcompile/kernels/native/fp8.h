// Shared by qcompile's native CPU kernels that read FP8 weights (e4m3fn values with f32 block scales; the layout is
// described in qcompile/kernels/fp8.py): the FP8 → f32 table and a row of weights dequantized into a buffer.
//
// The kernels dequantize a slab of weight rows into a small buffer that stays in L1/L2 just before multiplying it,
// so memory moves one byte per weight and the multiply-adds run on f32 as in the f32 kernels. The value of an FP8
// byte is looked up in a 256-entry table (exact: every e4m3fn value is an f32), then multiplied by its block's scale
// in f32 — the same single rounding as the jnp reference's values.astype(f32) * scale.

#ifndef QCOMPILE_NATIVE_FP8_H_
#define QCOMPILE_NATIVE_FP8_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace qcompile_native {

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float v;
      if (exponent == 15 && mantissa == 7) {
        v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn has no infinities; S.1111.111 is NaN
      } else if (exponent == 0) {
        v = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: mantissa/8 · 2^-6
      } else {
        v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      }
      value[b] = (b & 128) ? -v : v;
    }
  }
};

inline const float* fp8_table() {
  static const Fp8Table table;
  return table.value;
}

// dst[0:n] = value(src[0:n]) · scale[c / block] for columns c = 0..n-1 (scale: this row's block scales).
inline void dequant_row(const uint8_t* src, const float* scale, int64_t block, int64_t n, float* dst) {
  const float* table = fp8_table();
  for (int64_t c0 = 0, b = 0; c0 < n; c0 += block, ++b) {
    const float s = scale[b];
    const int64_t c1 = std::min(n, c0 + block);
    for (int64_t c = c0; c < c1; ++c) dst[c] = table[src[c]] * s;
  }
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_FP8_H_
