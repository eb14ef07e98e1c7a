// Shared by qcompile's native kernels: bf16 <-> f32 over contiguous runs (vectorisable loops, no branches).
// f32 -> bf16 rounds to nearest even, as XLA and ml_dtypes do; a NaN stays a (quiet) NaN.

#ifndef QCOMPILE_NATIVE_BF16_H_
#define QCOMPILE_NATIVE_BF16_H_

#include <cstdint>
#include <cstring>

#include "vec16.h"

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

// The same conversions for 16 values at a time, in registers: no f32 copy of a bf16 row goes through memory.
typedef uint16_t u16x16 __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 widen16(const uint16_t* src) {
  const u32x16 bits = __builtin_convertvector(*reinterpret_cast<const u16x16*>(src), u32x16) << 16;
  v16 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void narrow16(v16 value, uint16_t* dst) {
  u32x16 bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const u32x16 rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 quiet_nan = (bits >> 16) | 0x40u;
  const u32x16 out = (bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
  *reinterpret_cast<u16x16*>(dst) = __builtin_convertvector(out, u16x16);
}

inline void widen(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }
inline void narrow(const float* __restrict src, float* __restrict dst, int64_t n) { std::memcpy(dst, src, 4 * n); }

// A row's values as f32 whether the row is f32 or bf16 (for kernels templated over the element type).
inline v16 load_as_f32(const float* p) { return load(p); }
inline v16 load_as_f32(const uint16_t* p) { return widen16(p); }
inline float value_as_f32(const float* p) { return *p; }
inline float value_as_f32(const uint16_t* p) {
  float out;
  widen(p, &out, 1);
  return out;
}

}  // namespace qcompile_native

#endif  // QCOMPILE_NATIVE_BF16_H_
