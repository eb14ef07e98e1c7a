// Shared by qcompile's native kernels: bf16 <-> f32 over contiguous runs (vectorisable loops, no branches).
// f32 -> bf16 rounds to nearest even, as XLA and ml_dtypes do; a NaN stays a (quiet) NaN.

#ifndef QCOMPILE_NATIVE_BF16_H_
#define QCOMPILE_NATIVE_BF16_H_

#include <cstdint>
#include <cstring>

namespace qcompile_native {

inline void widen(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, 4);
  }
}

inline void narrow(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    dst[i] = static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

inline void widen(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }
inline void narrow(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_BF16_H_
