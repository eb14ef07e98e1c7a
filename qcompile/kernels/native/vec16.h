// Shared by qcompile's native kernels: 16-lane float vectors (GCC/Clang vector extensions; -march=native picks the
// instructions), unaligned loads and stores, e^x, and SiLU over a run of floats.

#ifndef QCOMPILE_NATIVE_VEC16_H_
#define QCOMPILE_NATIVE_VEC16_H_

#include <cmath>
#include <cstdint>
#include <cstring>

namespace qcompile_native {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
// x in every lane (one broadcast; `v16{} + x` costs a scalar add first: 0 + x is not x for x = -0).
inline v16 splat(float x) { return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// e^x for 16 lanes: x = n·ln2 + r with |r| ≤ ln2/2, e^r by Cephes' degree-6 polynomial, 2^n through the exponent
// bits; ≤ 2 ulp over the clamped range (silu only needs e^-g to f32 accuracy). A scalar std::exp per element made
// the epilogue cost as much as the matmul at 512 tokens.
inline v16 exp16(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447504f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const v16 fx = x * 1.44269504088896341f + 0.5f;
  const v16i t = __builtin_convertvector(fx, v16i);          // toward zero
  const v16i n = t + (__builtin_convertvector(t, v16) > fx);  // floor: a true lane compares as -1
  const v16 nf = __builtin_convertvector(n, v16);
  const v16 r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const v16i bits = (n + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// y = y·sigmoid(y) = y / (1 + e^-y), in place over n floats.
inline void silu_inplace(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16 v = load(y + i);
    store(y + i, v / (1.0f + exp16(-v)));
  }
  for (; i < n; ++i) y[i] = y[i] / (1.0f + std::exp(-y[i]));
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_VEC16_H_
